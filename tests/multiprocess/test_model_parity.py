"""tripod's Megatron GPTModel reproduces `transformers` logits (fp32, 1e-5) at five TP/PP/DP layouts, and at PP3 with
uneven stages (7 layers as 2/3/2)."""
import re

import pytest
import torch

from tests.helpers.bounds import worst
from tests.helpers.common import make_tiny_hf_model, run_torchrun

# a number, even when another rank's output was glued to it on the shared pipe
FLOAT = r"(-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf)"

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}
MODELS = {
    "qwen2_gqa_qkvbias": ("qwen2", {}),
    "llama_llama3rope_untied": ("llama", {"rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 128}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    # Qwen3 dense: per-head q/k RMSNorm, no qkv bias, head_dim 32 != hidden / heads = 16, untied (as Qwen3-8B)
    "qwen3_qknorm_headdim": ("qwen3", {"head_dim": 32}),
}
LAYOUT_NAMES = ["TP1PP1DP1", "TP2PP1DP1", "TP1PP2DP1", "TP2PP2DP1", "TP2PP2DP2"]


@pytest.mark.dist
def test_logits_match_transformers_at_every_layout(tmp_path):
    from transformers import AutoModelForCausalLM

    cases = []
    for seed, (name, (family, overrides)) in enumerate(MODELS.items()):
        hf_dir = make_tiny_hf_model(tmp_path, family, seed=seed, subdir=name, **overrides)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        assert model.config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
        # 40 tokens > original_max_position_embeddings so llama3 scaling matters at long wavelengths
        input_ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            ref = model(input_ids).logits
        cases.append({"name": name, "hf_dir": hf_dir, "input_ids": input_ids, "ref_logits": ref})
    torch.save(cases, tmp_path / "cases.pt")

    out = run_torchrun("parity_model_worker.py", 8,
                       tmp_path / "cases.pt", timeout=400).stdout
    # ranks print concurrently: a line may hold two reports, so the number ends where a float does
    seen = {(m.group(1), m.group(2)) for m in re.finditer(rf"PARITY (\S+) (\S+) rank \d+ maxdiff {FLOAT}", out)}
    assert seen == {(m, lay) for m in MODELS for lay in LAYOUT_NAMES}, out[-3000:]
    diffs = [float(x) for x in re.findall(rf"maxdiff {FLOAT}", out)]
    assert worst(diffs) < 1e-5


@pytest.mark.dist
def test_uneven_pipeline_stages_match_transformers_and_round_trip(tmp_path):
    """PP3 with 7 layers split 2/3/2 (megatron's num_layers_in_first/last_pipeline_stage): logits == transformers
    (1e-5), HF -> megatron -> HF bit-identical, a checkpoint saved at 2/3/2 loads at PP1, and the hybrid engine,
    embedded decoder and a training step work on the layout (tests/multiprocess/workers/uneven_pp_worker.py)."""
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", seed=5, subdir="qwen2_7layers_tied", num_hidden_layers=7,
                                tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(input_ids).logits
    torch.save({"hf_dir": hf_dir, "input_ids": input_ids, "ref_logits": ref,
                "layers": [[0, 1], [2, 3, 4], [5, 6]]}, tmp_path / "case.pt")
    out = run_torchrun("uneven_pp_worker.py", 3, tmp_path / "case.pt", 2, 2, tmp_path, timeout=400).stdout
    parity = re.findall(rf"UNEVEN_PARITY stages 2/3/2 maxdiff {FLOAT}", out)
    ckpt = re.findall(rf"UNEVEN_CKPT rank \d PP3->PP1 maxdiff {FLOAT}", out)
    assert len(parity) == 1 and len(ckpt) == 3, out[-3000:]
    assert worst(parity + ckpt) < 1e-5
    assert "UNEVEN_HF_ROUNDTRIP" in out and "OK rollout_tp=1 layout=pp3-2/3/2" in out, out[-3000:]


CP_LAYOUT_NAMES = ["TP1CP2PP1DP1", "TP2CP2PP1DP1", "TP1CP2PP1DP2", "TP1CP2PP2DP1"]


@pytest.mark.dist
def test_context_parallel_logits_match_transformers_and_cp1(tmp_path):
    """Context parallelism (megatron's load-balanced 2*CP-chunk split, K / V all-gathered over the CP group:
    parallel/context_parallel.py) at CP2, TP2xCP2, CP2xDP2 and CP2xPP2: logits == transformers and == CP1 (fp32,
    1e-5, the bound of the other layouts: CP changes only which rank computes which query rows, and the order of
    nothing but the softmax's key sum when the gathered keys are laid out in global order)."""
    from transformers import AutoModelForCausalLM

    cases = []
    for seed, name in enumerate(["qwen2_gqa_qkvbias", "llama_llama3rope_untied"]):
        family, overrides = MODELS[name]
        hf_dir = make_tiny_hf_model(tmp_path, family, seed=seed, subdir=name, **overrides)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        input_ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            ref = model(input_ids).logits
        cases.append({"name": name, "hf_dir": hf_dir, "input_ids": input_ids, "ref_logits": ref})
    torch.save(cases, tmp_path / "cases.pt")
    out = run_torchrun("cp_parity_worker.py", 4, tmp_path / "cases.pt", timeout=400).stdout
    rows = re.findall(rf"CP_PARITY (\S+) (\S+) rank \d+ hf {FLOAT} cp1 {FLOAT}", out)
    assert {(m, lay) for m, lay, _, _ in rows} == {(m, lay) for m in ("qwen2_gqa_qkvbias", "llama_llama3rope_untied")
                                                   for lay in CP_LAYOUT_NAMES}, out[-3000:]
    largest = worst(x for _, _, a, b in rows for x in (a, b))
    print(f"context parallel logits: worst |diff| to transformers or CP1 over {len(rows)} rows: {largest:.3e}")
    assert largest < 1e-5
