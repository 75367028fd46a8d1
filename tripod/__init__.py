"""tripod: a Megatron-based 3D-parallel (TP x PP x DP) engine for PPO-style RLHF.

The rooms live at the repository root (`engine/`, `parallel/`, `kernels/`) and install under this namespace
(`tripod.engine`, `tripod.parallel`, `tripod.kernels`; see setup.py's package_dir), so nothing named `engine`,
`parallel` or `kernels` lands at the top of site-packages.
"""
__version__ = "0.1.0"
