"""torchrun worker (8 ranks): MoE GPTModels (qwen3_moe, qwen2_moe, deepseek_v3) vs transformers logits at several
(tp, pp, ep, etp) layouts in ONE world, plus HF exports for the round-trip checks and two planted bugs.

argv: cases.pt (a list of {"name", "hf_dir", "fused_dir", "input_ids", "ref_logits"[, "layouts"]}; "layouts"
limits a case to some of LAYOUTS) and an output directory.
Prints `PARITY <model> <layout> rank <r> maxdiff <x>` per last-stage rank (fails above 1e-5),
`PLANTED <model> <bug> maxdiff <x>` for the planted bugs (the pytest side requires them to be large) and writes
`<out>/<model>/<layout>[_fused]` HF exports (compared bit for bit with the original by the pytest side).
"""
import os
import sys

import torch

from tests.helpers.common import dist_worker

# (tp, pp, ep, etp, dp), ranks
LAYOUTS = {
    "TP1PP1EP1": ((1, 1, 1, 1, 1), [0]),
    "TP1PP1EP2DP2": ((1, 1, 2, 1, 2), [1, 2]),
    "TP2PP1EP2ETP1SP": ((2, 1, 2, 1, 1), [3, 4]),
    "TP2PP1EP2ETP2DP2SP": ((2, 1, 2, 2, 2), [4, 5, 6, 7]),
    "TP1PP2EP2DP2": ((1, 2, 2, 1, 2), [0, 1, 2, 3]),
    "TP2PP2EP2ETP1SP": ((2, 2, 2, 1, 1), [4, 5, 6, 7]),
}
EXPORT = {"TP2PP1EP2ETP2DP2SP", "TP2PP2EP2ETP1SP"}  # layouts whose export is checked bit for bit
FUSED = "TP1PP2EP2DP2"  # loads the transformers-5 fused-expert copy, exports per-expert
PLANT = "TP1PP1EP2DP2"
BF16 = "TP2PP2EP2ETP1SP"  # also exported cast to bf16 (the fp32 expert bias stays fp32)
TOLERANCE = 1e-5


def _forward(model, layout, case):
    from tests.helpers.model_forward import forward_logits

    input_ids, ref = case["input_ids"], case["ref_logits"]
    if layout.dp_rank % 2 == 1:  # DP replicas see different batches (experts serve both through EP)
        input_ids, ref = input_ids.flip(0), ref.flip(0)
    logits = forward_logits(model, layout, input_ids)
    return (None if logits is None else (logits - ref).abs().max().item()), layout.is_last_stage


def _swap_local_experts(model) -> None:
    """Exchange megatron's local experts 0 and 1 on this rank (a loader that gets the expert order wrong)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in params.items():
            if ".local_experts.0." in name:
                other = params[name.replace(".local_experts.0.", ".local_experts.1.")]
                tmp = t.clone()
                t.copy_(other)
                other.copy_(tmp)


def _plant(model, layout, case):
    """Bugs the parity check must catch: experts in the wrong order on every EP rank; the expert bias dropped."""
    _swap_local_experts(model)
    diff, _ = _forward(model, layout, case)
    print(f"PLANTED {case['name']} swapped_experts maxdiff {diff:.3e}", flush=True)
    _swap_local_experts(model)
    biases = [b for n, b in model.named_buffers() if n.endswith("router.expert_bias")]
    if biases:
        with torch.no_grad():
            for b in biases:
                b.zero_()
        diff, _ = _forward(model, layout, case)
        print(f"PLANTED {case['name']} zero_expert_bias maxdiff {diff:.3e}", flush=True)


def main() -> None:
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import load_hf_weights, save_hf_checkpoint
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.model import build_gpt_model

    cases = torch.load(sys.argv[1])
    out_root = sys.argv[2]
    layouts = {name: ParallelLayout(tp=t, pp=p, ep=e, etp=x, dp=d, ranks=ranks, name=name)
               for name, ((t, p, e, x, d), ranks) in LAYOUTS.items()}
    me = torch.distributed.get_rank()
    for case in cases:
        arch = arch_from_hf(case["hf_dir"])
        for name, layout in layouts.items():
            if not layout.is_member or name not in case.get("layouts", LAYOUTS):
                continue
            model = build_gpt_model(arch, layout, sequence_parallel=layout.tp > 1).eval()
            if arch.mla is not None:  # the scale a rollout decoder takes from the family is megatron's
                from tripod.parallel.families.deepseek import softmax_scale
                assert all(abs(layer.self_attention.softmax_scale - softmax_scale(arch)) < 1e-12
                           for layer in model.decoder.layers)
            source = case["fused_dir"] if name == FUSED else case["hf_dir"]
            assert not load_hf_weights(model, source, arch, layout)
            diff, last = _forward(model, layout, case)
            if last:
                print(f"PARITY {case['name']} {name} rank {layout.ranks.index(me)} maxdiff {diff:.3e}", flush=True)
                assert diff < TOLERANCE, f"{case['name']} {layout.describe()}: max |logits - HF| = {diff}"
            if name in EXPORT or name == FUSED:
                suffix = "_fused" if name == FUSED else ""
                save_hf_checkpoint(model, arch, layout, os.path.join(out_root, case["name"], name + suffix))
            if name == BF16:
                save_hf_checkpoint(model, arch, layout, os.path.join(out_root, case["name"], name + "_bf16"),
                                   dtype=torch.bfloat16)
            if name == PLANT and last:
                _plant(model, layout, case)


if __name__ == "__main__":
    dist_worker(main)
