"""MoE models (qwen3_moe, qwen2_moe, deepseek_v3 with MLA) equal `transformers` (fp32 logits within 1e-5) at
(tp, pp, ep[, etp]) = (1,1,1), (1,1,2), (2,1,2) with sequence parallel (etp 1 and 2), (1,2,2) and (2,2,2) with
etp=1, on gloo, in ONE 8-rank world (tests/multiprocess/workers/moe_parity_worker.py); HF -> tripod -> HF is bit-identical
(per-expert names, expert bias included), also from transformers-5's fused expert layout; and the check catches
two planted bugs (experts swapped under EP, the DeepSeek expert bias dropped). DeepSeek-V3 with YaRN RoPE and a
DeepSeek-V2-Lite-like model run at two layouts each."""
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.bounds import worst
from tests.helpers.moe_models import FAMILIES, YARN, hf_moe_model

FLOAT = r"(-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf)"
LAYOUTS = ["TP1PP1EP1", "TP1PP1EP2DP2", "TP2PP1EP2ETP1SP", "TP2PP1EP2ETP2DP2SP", "TP1PP2EP2DP2", "TP2PP2EP2ETP1SP"]
EXPORTS = ["TP2PP1EP2ETP2DP2SP", "TP2PP2EP2ETP1SP", "TP1PP2EP2DP2_fused"]
# DeepSeek-V3 with its published RoPE (YaRN): per-layer rotary frequencies and MLA's softmax mscale
YARN_CASE = ("deepseek_v3_yarn", "deepseek_v3", {"rope_parameters": YARN}, ["TP1PP1EP1", "TP2PP1EP2ETP1SP"])
# DeepSeek-V2-Lite-like (q_proj without q_lora, softmax routing without renormalisation)
V2_CASE = ("deepseek_v2", "deepseek_v2", {}, ["TP1PP1EP2DP2", "TP2PP1EP2ETP1SP"])
EXTRA = [YARN_CASE, V2_CASE]


def _fused_copy(model, hf_dir: str, out: str) -> None:
    """The model's in-memory state dict (transformers-5 fused experts) written as a checkpoint."""
    os.makedirs(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json")) as f, open(os.path.join(out, "config.json"), "w") as g:
        json.dump(json.load(f), g)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tests.helpers.common import run_torchrun

    tmp = tmp_path_factory.mktemp("moe_parity")
    cases = []
    variants = [(f, f, {}, LAYOUTS) for f in FAMILIES] + EXTRA
    for seed, (name, family, overrides, layouts) in enumerate(variants):
        model = hf_moe_model(family, seed + 7, **overrides)
        hf_dir = str(tmp / name)
        model.save_pretrained(hf_dir, safe_serialization=True)
        fused = str(tmp / f"{name}_fused")
        _fused_copy(model, hf_dir, fused)
        input_ids = torch.randint(3, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            ref = model(input_ids).logits
        cases.append({"name": name, "hf_dir": hf_dir, "fused_dir": fused, "input_ids": input_ids, "ref_logits": ref,
                      "layouts": layouts})
    torch.save(cases, tmp / "cases.pt")
    out = run_torchrun("moe_parity_worker.py", 8, tmp / "cases.pt", tmp / "exports", timeout=400).stdout
    return {"out": out, "root": tmp}


@pytest.mark.dist
def test_moe_logits_match_transformers_at_every_layout(world):
    out = world["out"]
    print("\n".join(line for line in out.splitlines() if line.startswith(("PARITY", "PLANTED"))))
    seen = {(m.group(1), m.group(2)) for m in re.finditer(rf"PARITY (\S+) (\S+) rank \d+ maxdiff {FLOAT}", out)}
    assert seen == {(f, lay) for f in FAMILIES for lay in LAYOUTS} | {(c[0], lay) for c in EXTRA for lay in c[3]}, \
        out[-3000:]
    diffs = [float(x) for x in re.findall(rf"PARITY \S+ \S+ rank \d+ maxdiff {FLOAT}", out)]
    assert worst(diffs) < 1e-5


@pytest.mark.dist
def test_moe_round_trip_is_bit_identical(world):
    for family in FAMILIES:
        original = load_file(os.path.join(world["root"], family, "model.safetensors"))
        assert any(".mlp.experts.0.gate_proj.weight" in k for k in original)
        for layout in EXPORTS:
            back = load_file(os.path.join(world["root"], "exports", family, layout, "model.safetensors"))
            assert sorted(back) == sorted(original), (family, layout, set(back) ^ set(original))
            for k, t in original.items():
                assert back[k].dtype == t.dtype and torch.equal(back[k], t), (family, layout, k)
        cast = load_file(os.path.join(world["root"], "exports", family, "TP2PP2EP2ETP1SP_bf16", "model.safetensors"))
        for k, t in original.items():  # --dtype casts the parameters; the fp32 expert bias stays as HF keeps it
            want = t if k.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
            assert cast[k].dtype == want.dtype and torch.equal(cast[k], want), (family, k)


@pytest.mark.dist
def test_planted_bugs_are_caught(world):
    found = {(m.group(1), m.group(2)): float(m.group(3))
             for m in re.finditer(rf"PLANTED (\S+) (\S+) maxdiff {FLOAT}", world["out"])}
    expected = {(f, "swapped_experts") for f in FAMILIES} | {("deepseek_v3", "zero_expert_bias")}
    assert expected <= set(found), world["out"][-3000:]
    assert min(found[k] for k in expected) > 1e-3, found
