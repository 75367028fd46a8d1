"""The MoE router keys of a `{key}.megatron` config section, translated into megatron TransformerConfig fields
(`moe_config_overrides`), and megatron's tracker name of each load-balancing loss (read back by
`MegatronWorker.moe_aux_loss`)."""
from __future__ import annotations

from tripod.engine.config import MegatronConfig
from tripod.parallel.arch import ModelArch

# megatron's tracker name of each load-balancing loss (transformer/moe/router.py)
MOE_AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def moe_config_overrides(megatron_cfg: MegatronConfig, arch: ModelArch, key: str) -> dict:
    """TransformerConfig fields from `{key}.megatron.moe_*` for an MoE model; {} for a dense one (which must leave
    them at their defaults: one clear line naming the key otherwise)."""
    moe = arch.moe
    m = megatron_cfg
    lb, coeff, rate = m.moe_router_load_balancing_type, m.moe_aux_loss_coeff, m.moe_router_bias_update_rate
    if moe is None:
        if lb != "none" or coeff or rate:
            raise ValueError(f"{key}.megatron.moe_router_load_balancing_type={lb!r} / moe_aux_loss_coeff={coeff} / "
                             f"moe_router_bias_update_rate={rate}: the {arch.family} model has no experts; "
                             "leave them at none / 0 / 0")
        return {}
    if rate and not moe.expert_bias:
        raise ValueError(f"{key}.megatron.moe_router_bias_update_rate={rate}: this {arch.family} router has no expert "
                         "bias (only DeepSeek-V3's sigmoid router does); set it to 0")
    out = dict(moe_router_load_balancing_type=lb, moe_aux_loss_coeff=float(coeff))
    if moe.expert_bias:
        out["moe_router_bias_update_rate"] = float(rate)
    return out
