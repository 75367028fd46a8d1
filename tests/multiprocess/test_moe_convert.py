"""MoE conversion: expert rows of the family tables (global expert names, EP ownership, expert-TP splits), both HF
expert layouts, DeepSeek MTP layers skipped, and `tripod convert/export --ep --etp` bit-identical end to end."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.moe_models import FAMILIES, hf_moe_model


@pytest.fixture(scope="module")
def hf_models():
    return {family: hf_moe_model(family, seed) for seed, family in enumerate([*FAMILIES, "deepseek_v2"])}


def _arch(model):
    from tripod.parallel.arch import arch_from_hf

    return arch_from_hf(model.config.to_dict())


@pytest.mark.parametrize("family", sorted([*FAMILIES, "deepseek_v2"]))
def test_fused_and_per_expert_layouts_convert_alike_and_round_trip(hf_models, family, tmp_path):
    """transformers-5's in-memory (fused) state dict and save_pretrained's per-expert file give the same canonical
    tensors; exporting them gives back save_pretrained's tensors bit for bit."""
    from tripod.parallel.convert import hf_to_megatron, megatron_to_hf

    model = hf_models[family]
    arch = _arch(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    on_disk = load_file(tmp_path / "model.safetensors")
    fused = {k: v for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    assert not any(k.endswith("mlp.experts.gate_up_proj") for k in on_disk)
    a, b = hf_to_megatron(arch, fused), hf_to_megatron(arch, on_disk)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    back = dict(kv for name, full in b.items() for kv in megatron_to_hf(arch, name, full))
    assert sorted(back) == sorted(on_disk)
    assert all(torch.equal(back[k], on_disk[k]) and back[k].dtype == on_disk[k].dtype for k in on_disk)
    if arch.moe.expert_bias:  # a buffer: converted like a parameter, and really random
        bias = [k for k in b if k.endswith("router.expert_bias")]
        assert bias and all(b[k].abs().min() > 0 for k in bias)


def test_expert_rows_ep_names_and_expert_tp_splits(hf_models):
    from tripod.parallel.families import Layers, get_family

    model = hf_models["deepseek_v3"]
    arch = _arch(model)
    family = get_family(arch.family)
    rows = family.rows(arch)
    # the dense first layer has a dense MLP and no experts; the MoE layers have every expert, the bias, shared MLP
    assert "decoder.layers.0.mlp.linear_fc1.weight" in rows and "decoder.layers.0.mlp.router.weight" not in rows
    for i in range(1, arch.num_layers):
        assert f"decoder.layers.{i}.mlp.linear_fc1.weight" not in rows
        assert {f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight" for e in range(4)} <= set(rows)
        assert rows[f"decoder.layers.{i}.mlp.router.expert_bias"].layers is Layers.MOE
    name = "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
    assert family.hf_names(arch, name) == ("model.layers.2.mlp.experts.3.gate_proj.weight",
                                           "model.layers.2.mlp.experts.3.up_proj.weight")
    assert family.ep_owner(arch, name, 2) == 1 and family.ep_owner(arch, name, 4) == 3
    assert family.ep_local_name(arch, name, 2) == name.replace("local_experts.3", "local_experts.1")
    assert family.ep_global_name(arch, family.ep_local_name(arch, name, 2), 2, 1) == name
    assert family.ep_owner(arch, "decoder.layers.2.mlp.router.weight", 2) is None
    # expert rows split over the expert-TP group (GATED_ROW halves), whatever the attention TP allows
    full = torch.randn(family.shape(arch, name), generator=torch.Generator().manual_seed(0))
    pieces = [family.shard(arch, name, full, 4, r) for r in range(4)]
    assert pieces[1].shape == (2 * 32 // 4, 64) and torch.equal(family.merge(arch, name, pieces), full)
    gate, up = full.chunk(2)
    assert torch.equal(pieces[1], torch.cat([gate[8:16], up[8:16]]))
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=3 must divide moe_intermediate_size=32"):
        family.shard(arch, name, full, 3, 0)
    shapes = family.local_shapes(arch, 2, 256, etp=1)
    assert shapes[name] == (64, 64) and shapes["decoder.layers.2.self_attention.linear_q_up_proj.weight"][0] == 48


def test_mtp_layers_are_skipped_with_a_logged_line(hf_models, tmp_path, caplog):
    from tripod.parallel.convert import SafetensorsReader, check_hf_names, family_of

    model = hf_models["deepseek_v3"]
    arch = _arch(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    state = load_file(tmp_path / "model.safetensors")
    last = arch.num_layers - 1
    mtp = {k.replace(f"layers.{last}.", f"layers.{arch.num_layers}."): v.clone() for k, v in state.items()
           if f"layers.{last}." in k}
    mtp[f"model.layers.{arch.num_layers}.enorm.weight"] = torch.ones(arch.hidden_size)
    save_file({**state, **mtp}, tmp_path / "model.safetensors")
    with caplog.at_level("WARNING"):
        check_hf_names(arch, family_of(arch), SafetensorsReader(tmp_path).names(), source="ckpt")
    assert f"skipping {len(mtp)} tensor(s) of layer(s) [{arch.num_layers}]" in caplog.text


@pytest.mark.dist
def test_cli_convert_export_with_expert_parallelism_is_bit_identical(hf_models, tmp_path):
    """DeepSeek-V3 (MLA, dense + MoE layers, expert bias buffer): HF -> TP1xEP2 checkpoint (2 ranks, DP 2) -> HF
    loaded at TP2xEP2 with expert TP 1 (2 ranks, DP 1: each expert on another rank than it was saved from):
    every tensor back bit for bit, per-expert names. (PP and expert-TP exports: test_moe_parity.py.) Both commands
    run in one 2-rank torchrun world (the CLI's in-process path; its spawning path: test_checkpoint_cli.py)."""
    from tests.helpers.trainer_runs import tripod_in_one_world

    hf_dir = tmp_path / "hf"
    hf_models["deepseek_v3"].save_pretrained(hf_dir, safe_serialization=True)
    ckpt, out = tmp_path / "ckpt", tmp_path / "back"
    stdout = tripod_in_one_world([["convert", hf_dir, ckpt, "--ep", "2"],
                                  ["export", ckpt, out, "--tp", "2", "--ep", "2", "--etp", "1"]], 2)
    meta = json.loads((ckpt / "tripod_checkpoint.json").read_text())
    assert meta["saved_layout"] == {"tp": 1, "pp": 1, "dp": 2, "ep": 2, "etp": 1}, meta
    assert "TP2 x PP1 x EP2, expert TP1" in stdout
    original, back = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[k], original[k]) and back[k].dtype == original[k].dtype for k in original)


def _with_mtp_layer(model, arch, hf_dir) -> dict[str, torch.Tensor]:
    """Save `model` with one multi-token-prediction layer after the last decoder layer, named as the published
    GLM-4.5 / DeepSeek-V3 checkpoints name it (a decoder layer plus eh_proj, enorm, hnorm, shared_head.norm); return
    the MTP tensors (random, fp32 and bf16 mixed so a cast would show)."""
    model.save_pretrained(hf_dir, safe_serialization=True)
    state = load_file(hf_dir / "model.safetensors")
    n, last, g = arch.num_layers, arch.num_layers - 1, torch.Generator().manual_seed(11)
    mtp = {k.replace(f"layers.{last}.", f"layers.{n}."): torch.randn(v.shape, generator=g)
           for k, v in state.items() if f"layers.{last}." in k}
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.randn(arch.hidden_size, 2 * arch.hidden_size, generator=g)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{n}.{norm}.weight"] = torch.randn(arch.hidden_size, generator=g).to(torch.bfloat16)
    save_file({**state, **mtp}, hf_dir / "model.safetensors")
    return mtp


@pytest.mark.dist
def test_glm_mtp_layers_survive_convert_and_export(hf_models, tmp_path):
    """GLM-4.5's MTP layer is neither trained nor run, but a converted checkpoint keeps it: HF (with an MTP layer) ->
    TP1xEP2 checkpoint -> HF at TP2xEP2 gives back every tensor bit for bit, the MTP layer included (copied from the
    checkpoint the model was converted from, which the checkpoint's metadata names), with one line saying so."""
    from tests.helpers.trainer_runs import tripod_in_one_world

    model = hf_models["glm4_moe"]
    arch = _arch(model)
    hf_dir = tmp_path / "hf"
    mtp = _with_mtp_layer(model, arch, hf_dir)
    ckpt, out = tmp_path / "ckpt", tmp_path / "back"
    stdout = tripod_in_one_world([["convert", hf_dir, ckpt, "--ep", "2"],
                                  ["export", ckpt, out, "--tp", "2", "--ep", "2", "--etp", "1"]], 2)
    assert f"{len(mtp)} tensor(s) of layers past num_hidden_layers=4 (GLM-4.5 multi-token-prediction (MTP) layer, " \
           f"not used for training or rollout) copied unchanged from {hf_dir}" in stdout, stdout[-2000:]
    original, back = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(mtp) <= set(original) and sorted(back) == sorted(original), set(back) ^ set(original)
    assert all(torch.equal(back[k], original[k]) and back[k].dtype == original[k].dtype for k in original)


def test_cli_refuses_bad_expert_sizes(hf_models, tmp_path, capsys):
    from tripod.engine.cli import main

    hf_dir = tmp_path / "hf"
    hf_models["qwen3_moe"].save_pretrained(hf_dir, safe_serialization=True)
    capsys.readouterr()
    for argv, expected in ((["--ep", "3"], "--ep 3 does not divide the 4 experts; use one of [1, 2, 4]"),
                           (["--etp", "5"], "--etp 5 does not divide moe_intermediate_size=32")):
        assert main(["convert", str(hf_dir), str(tmp_path / "o"), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and expected in err, err


@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_mla_softmax_scale_is_hf(rope):
    """deepseek.softmax_scale (what megatron's MLA computes from rotary_scaling_factor / mscale_all_dim, and what a
    rollout decoder needs) equals HF's attention scaling, with and without YaRN."""
    from tests.helpers.moe_models import YARN
    from tripod.parallel.families.deepseek import softmax_scale

    model = hf_moe_model("deepseek_v3", 0, **({"rope_parameters": YARN} if rope == "yarn" else {}))
    arch = _arch(model)
    assert softmax_scale(arch) == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-12)
    assert (rope == "yarn") == (abs(softmax_scale(arch) * 24 ** 0.5 - 1) > 0.1)


def test_fp8_checkpoints_are_refused_with_the_fix(hf_models):
    from tripod.parallel.convert import hf_to_megatron

    model = hf_models["deepseek_v3"]
    state = dict(model.state_dict())
    state["model.layers.1.self_attn.q_a_proj.weight_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(ValueError, match="FP8 block-scale tensor.*dequantize it to bf16 first"):
        hf_to_megatron(_arch(model), state)
