"""Tiny random HF Mixture-of-Experts checkpoints (Qwen3-MoE, Qwen2-MoE, DeepSeek-V3 with MLA, DeepSeek-V2-Lite-like):
defined in tripod/engine/data/tiny_models.py, which scripts/ use too, under the names the tests use (COMMON: the
shapes shared with the dense models; FAMILIES: each MoE family's config)."""
from tripod.engine.data.tiny_models import DEEPSEEK_V2, YARN, hf_moe_model, make_tiny_moe_model  # noqa: F401
from tripod.engine.data.tiny_models import MOE_FAMILIES as FAMILIES  # noqa: F401
from tripod.engine.data.tiny_models import TINY_CONFIG as COMMON  # noqa: F401
