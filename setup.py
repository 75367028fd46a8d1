"""tripod: a Megatron-based 3D-parallel (TP x PP x DP) engine for PPO-style RLHF."""
from setuptools import find_packages, setup

ROOMS = ("engine", "parallel", "kernels")

setup(
    name="tripod",
    version="0.1.0",
    description="Megatron-based 3D-parallel PPO/RLHF engine with a zero-redundancy hybrid engine",
    python_requires=">=3.11",
    # The rooms sit at the repository root and install as tripod.engine / tripod.parallel / tripod.kernels.
    packages=["tripod"] + [f"tripod.{p}" for p in find_packages(include=[r + s for r in ROOMS for s in ("", ".*")])],
    package_dir={"tripod": "tripod", **{f"tripod.{room}": room for room in ROOMS}},
    # torch is pinned by requirements.txt (CPU wheel) and must not be pulled here as a bare dependency.
    install_requires=[
        "megatron-core==0.16.1",
        "numpy",
        "psutil",
        "transformers>=5,<6",
        "safetensors",
        "omegaconf",
        "pyarrow",
        "tensorboard",
        "rich",
        "matplotlib",
    ],
    extras_require={
        "ray": ["ray"],
        "gpu": ["triton"],  # sglang / transformer-engine are installed by hand on GPU machines
        "test": ["pytest", "pytest-timeout"],
    },
    entry_points={"console_scripts": ["tripod=tripod.engine.cli:main"]},
)
