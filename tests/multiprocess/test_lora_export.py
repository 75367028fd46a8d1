"""`tripod export --lora` / `--merge` of a LoRA checkpoint (parallel/lora/checkpoint.py): a tiny Qwen2 with peft's
random non-zero adapters, checkpointed by tripod at TP1 x PP2 and exported at TP2
(tests/multiprocess/workers/lora_export_worker.py). The peft directory loaded by `peft.PeftModel.from_pretrained` onto
the HF base, and the merged HF model loaded by transformers, give tripod's logits; mismatched flags are refused in one
line before any model is built. Planted by hand: TRIPOD_TEST_PLANT=lora_export_alpha (the adapters rebuilt with twice
the saved alpha: tests/multiprocess/workers/train_with_hooks.py, which the worker imports) makes both logit checks
fail."""
import argparse
import json

import pytest
import torch

from tests.helpers.common import run_torchrun
from tests.multiprocess.test_lora import peft_case

LOGITS_BOUND = 1e-5  # the LoRA parity tests' bound on fp32 logits (tests/multiprocess/test_lora.py)


@pytest.mark.dist
def test_export_lora_and_merge_give_tripods_logits(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    case = peft_case(tmp_path, "qwen2")
    torch.save(case, tmp_path / "case.pt")
    root = tmp_path / "out"
    root.mkdir()
    run_torchrun("lora_export_worker.py", 2, tmp_path / "case.pt", root, timeout=300)
    tripod = torch.load(root / "tripod_logits.pt")
    meta = json.loads((root / "ckpt" / "tripod_checkpoint.json").read_text())
    assert meta["lora"]["rank"] == case["rank"] and meta["lora"]["base_model_path"] == case["hf_dir"]
    config = json.loads((root / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == case["hf_dir"]
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, root / "peft").eval()(case["input_ids"]).logits
        merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32).eval()
        merged_logits = merged(case["input_ids"]).logits
    diffs = {"tripod vs peft's own model": (tripod - case["ref_logits"]).abs().max().item(),
             "export --lora on peft": (peft_logits - tripod).abs().max().item(),
             "export --merge on transformers": (merged_logits - tripod).abs().max().item()}
    print("LoRA export |logits diff|: " + ", ".join(f"{k} {v:.3e}" for k, v in diffs.items()))
    assert all(d <= LOGITS_BOUND for d in diffs.values()), diffs
    _check_refusals(root)


def _check_refusals(root) -> None:
    """One line each, from the metadata alone: a LoRA checkpoint without --merge / --lora, --lora or --merge on a
    checkpoint without adapters."""
    from tripod.engine.cli.export import check_lora_flags

    def args(ckpt, lora=False, merge=False):
        return argparse.Namespace(ckpt_dir=str(ckpt), lora=lora, merge=merge, dtype=None)

    with pytest.raises(ValueError, match=r"holds LoRA adapters \(rank 4\); pass --merge .* or --lora"):
        check_lora_flags(args(root / "ckpt"))
    for flag in ("lora", "merge"):
        with pytest.raises(ValueError, match=f"holds no LoRA adapters .*without --{flag}$"):
            check_lora_flags(args(root / "plain_ckpt", **{flag: True}))
    assert check_lora_flags(args(root / "ckpt", lora=True)) and not check_lora_flags(args(root / "ckpt", merge=True))
