"""torchrun worker (2 ranks): a tripod model with LoRA adapters (peft's random non-zero A and B) saved as a tripod
checkpoint at TP1 x PP2 with the adapters' settings in its metadata, then `tripod export --lora` and `tripod export
--merge` run in-process on this world at TP2.

argv: case.pt (tests/multiprocess/test_lora_export.py: hf_dir, input_ids, lora rank / alpha / targets, peft's adapter
tensors) and the output root. Writes `<root>/ckpt`, `<root>/peft`, `<root>/merged`, `<root>/tripod_logits.pt` (the
checkpointed model's logits, from the last stage) and `<root>/plain_ckpt` (the base model without adapters).
"""
import os
import sys

import torch


def main() -> None:
    import tests.multiprocess.workers.train_with_hooks  # noqa: F401  (plants $TRIPOD_TEST_PLANT, if set, in this rank)
    from tests.helpers.model_forward import forward_logits
    from tripod.engine.cli import main as tripod_main
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.checkpoint import save_model_checkpoint
    from tripod.parallel.convert import load_hf_weights
    from tripod.parallel.families import get_family
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.lora import LoraSettings, apply_lora
    from tripod.parallel.lora.checkpoint import lora_metadata
    from tripod.parallel.lora.state import load_peft_state
    from tripod.parallel.model import build_gpt_model

    case, root = torch.load(sys.argv[1]), sys.argv[2]
    arch = arch_from_hf(case["hf_dir"])
    layout = ParallelLayout(tp=1, pp=2, dp=1, name="saved")
    model = build_gpt_model(arch, layout)
    assert not load_hf_weights(model, case["hf_dir"], arch, layout)
    plain = os.path.join(root, "plain_ckpt")
    save_model_checkpoint(model, plain, arch, layout, tokenizer_dir=case["hf_dir"])  # no adapters
    settings = LoraSettings(rank=case["rank"], alpha=case["alpha"], target_modules=case["targets"])
    adapters = apply_lora([model], arch, settings)
    load_peft_state(adapters, case["adapters"], get_family(arch.family).hf_layer_prefix, "peft")
    with torch.no_grad():
        logits = forward_logits(model, layout, case["input_ids"])
    if layout.is_last_stage:
        torch.save(logits, os.path.join(root, "tripod_logits.pt"))
    ckpt = os.path.join(root, "ckpt")
    save_model_checkpoint(model, ckpt, arch, layout, tokenizer_dir=case["hf_dir"],
                          extra_metadata=lora_metadata(settings, case["hf_dir"]))
    assert tripod_main(["export", "--lora", ckpt, os.path.join(root, "peft"), "--tp", "2"]) == 0
    assert tripod_main(["export", "--merge", ckpt, os.path.join(root, "merged"), "--tp", "2"]) == 0


if __name__ == "__main__":
    from tests.helpers.common import dist_worker

    dist_worker(main)
