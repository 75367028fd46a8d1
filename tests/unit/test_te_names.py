"""Transformer Engine's layer names map onto the family tables (issue 18 item 2), checked on CPU.

megatron's own TE spec builders (`get_gpt_decoder_layer_specs(config, use_transformer_engine=True)`) run here with
stand-ins for TE's module classes (TE does not import without CUDA); the spec they return says which module sits
where: a norm folded into the next linear (TELayerNormColumnParallelLinear with IdentityOp in the norm's place), a
separate TENorm (before routed experts, qk norms), ... Each TE module's parameter names are the recorded ones of
transformer_engine 2.x (`TE_PARAMS`). Every name so built must map (FamilySpec.canonical_suffix) to a row of the
family table for that layer, and together they must cover the table: what load_hf_weights needs at layer 0.
"""
from __future__ import annotations

import types

import pytest

# parameter names of TE's modules (transformer_engine/pytorch/module/*.py, TE 2.x; RMSNorm: no layer_norm_bias)
TE_PARAMS = {"TELayerNormColumnParallelLinear": ("layer_norm_weight", "weight"), "TEColumnParallelLinear": ("weight",),
             "TERowParallelLinear": ("weight",), "TELinear": ("weight",), "TENorm": ("weight",),
             "TEDotProductAttention": (), "IdentityOp": ()}


def _stand_in(name: str) -> type:
    return type(name, (), {})


@pytest.fixture
def te_spec_builders(monkeypatch):
    from megatron.core.models.backends import BackendSpecProvider
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    te = {n: _stand_in(n) for n in TE_PARAMS if n != "IdentityOp"}

    class StandInTESpecProvider(BackendSpecProvider):  # what TESpecProvider returns, class for class
        def linear(self): return te["TELinear"]  # noqa: E704
        def column_parallel_linear(self): return te["TEColumnParallelLinear"]  # noqa: E704
        def row_parallel_linear(self): return te["TERowParallelLinear"]  # noqa: E704
        def fuse_layernorm_and_linear(self): return True  # noqa: E704
        def column_parallel_layer_norm_linear(self): return te["TELayerNormColumnParallelLinear"]  # noqa: E704
        def layer_norm(self, rms_norm=False, for_qk=False): return te["TENorm"]  # noqa: E704
        def core_attention(self): return te["TEDotProductAttention"]  # noqa: E704
        def activation_func(self): return None  # noqa: E704

        def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm):
            assert not moe_use_grouped_gemm  # tripod's MoE config: SequentialMLP
            return SequentialMLP, MLPSubmodules(linear_fc1=te["TEColumnParallelLinear"],
                                                linear_fc2=te["TERowParallelLinear"])

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", StandInTESpecProvider, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TENorm", te["TENorm"], raising=False)
    return gpt_layer_specs


def _module_names(prefix: str, cls) -> list[str]:
    return [prefix + p for p in TE_PARAMS[cls.__name__]] if isinstance(cls, type) else []


def te_layer_names(layer_spec, arch) -> set[str]:
    """Parameter suffixes of one TE-spec layer (after `decoder.layers.<i>.`)."""
    sub = layer_spec.submodules
    names = _module_names("input_layernorm.", sub.input_layernorm) + _module_names("pre_mlp_layernorm.",
                                                                                   sub.pre_mlp_layernorm)
    attention = sub.self_attention.submodules
    for field in vars(attention):
        names += _module_names(f"self_attention.{field}.", getattr(attention, field))
    if arch.qkv_bias:
        names.append("self_attention.linear_qkv.bias")
    mlp = sub.mlp
    if mlp.module.__name__ == "MLP":
        names += _module_names("mlp.linear_fc1.", mlp.submodules.linear_fc1)
        names += _module_names("mlp.linear_fc2.", mlp.submodules.linear_fc2)
    else:  # MoELayer: the router is built by MoELayer itself (the same module in both specs)
        moe = arch.moe
        names.append("mlp.router.weight")
        if moe.expert_bias:
            names.append("mlp.router.expert_bias")
        experts = mlp.submodules.experts.submodules
        for e in range(moe.num_experts):
            names += _module_names(f"mlp.experts.local_experts.{e}.linear_fc1.", experts.linear_fc1)
            names += _module_names(f"mlp.experts.local_experts.{e}.linear_fc2.", experts.linear_fc2)
        shared = mlp.submodules.shared_experts
        if shared is not None and moe.shared_expert_ffn_hidden_size:
            names += _module_names("mlp.shared_experts.linear_fc1.", shared.submodules.linear_fc1)
            names += _module_names("mlp.shared_experts.linear_fc2.", shared.submodules.linear_fc2)
            if moe.shared_expert_gate:
                names.append("mlp.shared_experts.gate_weight")
    return set(names)


def _arch(tmp_path, family: str):
    from tests.helpers.common import make_tiny_hf_model
    from tripod.parallel.arch import arch_from_hf

    if family in ("llama", "qwen2", "qwen3"):
        return arch_from_hf(make_tiny_hf_model(tmp_path, family))
    from tests.helpers.moe_models import make_tiny_moe_model
    return arch_from_hf(make_tiny_moe_model(tmp_path, family))


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_te_spec_names_map_onto_the_family_table(tmp_path, te_spec_builders, family):
    from tripod.parallel.families import get_family
    from tripod.parallel.families.spec import LAYER_PREFIX
    from tripod.parallel.model import transformer_config_from_arch
    from tripod.parallel.stages import StageSplit

    arch = _arch(tmp_path, family)
    layout = types.SimpleNamespace(tp=1, pp=1, ep=1, etp=1, name="actor", validate_for=lambda a: None,
                                   stage_split=lambda n, vpp=None: StageSplit(n))
    config = transformer_config_from_arch(arch, layout)
    specs = te_spec_builders.get_gpt_decoder_layer_specs(config, use_transformer_engine=True, normalization="RMSNorm")
    table = get_family(arch.family)
    rows = table.rows(arch)
    folded = 0
    for layer, spec in enumerate(specs):
        te_names = te_layer_names(spec, arch)
        folded += sum(n.endswith("layer_norm_weight") for n in te_names)
        mapped = {f"{LAYER_PREFIX}{layer}.{table.canonical_suffix(arch, n)}" for n in te_names}
        want = {n for n in rows if n.startswith(f"{LAYER_PREFIX}{layer}.")}
        assert mapped == want, (layer, sorted(mapped ^ want))
    assert folded  # TE folded at least one norm into a linear: the case the local names alone miss


def test_use_te_true_without_te_names_the_key():
    from tripod.parallel.model import resolve_use_te

    arch = types.SimpleNamespace(mla=None, family="qwen2")
    with pytest.raises(ValueError, match=r"megatron\.use_te=true but Transformer Engine"):
        resolve_use_te("true", arch)
    with pytest.raises(ValueError, match=r"megatron\.use_te='maybe' must be one of auto, true, false"):
        resolve_use_te("maybe", arch)
    assert resolve_use_te("auto", arch) is False and resolve_use_te(False, arch) is False  # no TE on this machine
