"""tripod: a Megatron-based 3D-parallel (TP x PP x DP) engine for PPO-style RLHF.

The package lives in src/tripod (src layout): an editable install is then one plain `.pth` line naming src/, which
pyright, mypy, jedi and ruff read like any site-packages directory, and nothing but `tripod` becomes importable.
The product brief's rooms stay visible at the repository root as symlinks (engine/, parallel/, runtime/, kernels/).
"""
from setuptools import find_packages, setup

setup(
    name="tripod",
    version="0.1.0",
    description="Megatron-based 3D-parallel PPO/RLHF engine with a zero-redundancy hybrid engine",
    python_requires=">=3.11",
    package_dir={"": "src"},
    packages=find_packages("src", include=["tripod", "tripod.*"]),
    # torch is pinned by requirements.txt (CPU wheel) and must not be pulled here as a bare dependency.
    install_requires=[
        "megatron-core==0.16.1",
        "numpy",
        "psutil",
        "transformers>=5,<6",
        "safetensors",
        "omegaconf",
        "pydantic>=2",  # engine/agent: verl's OpenAI tool-schema models
        "pyarrow",
        "tensorboard",
        "rich",
        "matplotlib",
    ],
    extras_require={
        "ray": ["ray"],
        "gpu": ["triton"],  # sglang / transformer-engine are installed by hand on GPU machines
        "test": ["pytest", "pytest-timeout"],
        "wandb": ["wandb==0.31.0"],  # trainer.logger: [.., wandb]
        "mlflow": ["mlflow-skinny==3.17.2"],  # trainer.logger: [.., mlflow] (tracking client + local file store)
    },
    entry_points={"console_scripts": ["tripod=tripod.engine.cli:main"]},
)
