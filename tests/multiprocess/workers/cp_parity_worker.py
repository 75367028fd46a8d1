"""torchrun worker (4 ranks): context-parallel GPTModel logits == transformers logits and == the CP1 model's, for every
model in the case file, at (TP, CP, PP, DP) = (1,2,1,1) [ranks 0,1], (2,2,1,1), (1,2,1,2) and (1,2,2,1) [0..3].

argv: cases.pt — a list of {"name", "hf_dir", "input_ids", "ref_logits"} written by the pytest side.
Prints one `CP_PARITY <model> <layout> rank <r> hf <x> cp1 <y>` line per last-stage rank and fails above 1e-5.
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.bounds import worst
from tests.helpers.common import dist_worker

LAYOUTS = [((1, 2, 1, 1), [0, 1]), ((2, 2, 1, 1), [0, 1, 2, 3]), ((1, 2, 1, 2), [0, 1, 2, 3]),
           ((1, 2, 2, 1), [0, 1, 2, 3])]
TOLERANCE = 1e-5


def main() -> None:
    from tests.helpers.model_forward import forward_logits
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import load_hf_weights
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.model import build_gpt_model

    cases = torch.load(sys.argv[1])
    single = ParallelLayout(ranks=[0], name="TP1CP1PP1DP1")
    layouts = [ParallelLayout(tp=t, cp=c, pp=p, dp=d, ranks=ranks, name=f"TP{t}CP{c}PP{p}DP{d}")
               for (t, c, p, d), ranks in LAYOUTS]
    for case in cases:
        arch = arch_from_hf(case["hf_dir"])
        cp1 = [None, None]  # CP1 logits of the batch and of the flipped batch, on rank 0, sent to every rank
        if single.is_member:
            model = build_gpt_model(arch, single)
            assert not load_hf_weights(model, case["hf_dir"], arch, single)
            cp1 = [forward_logits(model, single, ids) for ids in (case["input_ids"], case["input_ids"].flip(0))]
        dist.broadcast_object_list(cp1, src=0)
        for layout in layouts:
            if not layout.is_member:
                continue
            model = build_gpt_model(arch, layout)
            assert not load_hf_weights(model, case["hf_dir"], arch, layout)
            # DP replicas see different batches: the odd DP ranks get a flipped batch
            input_ids, ref, base = case["input_ids"], case["ref_logits"], cp1[0]
            if layout.dp_rank % 2 == 1:
                input_ids, ref, base = input_ids.flip(0), ref.flip(0), cp1[1]
            logits = forward_logits(model, layout, input_ids)
            if layout.is_last_stage:
                assert logits.shape == ref.shape, (logits.shape, ref.shape)
                hf, one = (logits - ref).abs().max().item(), (logits - base).abs().max().item()
                print(f"CP_PARITY {case['name']} {layout.name} rank {layout.ranks.index(dist.get_rank())} "
                      f"hf {hf:.3e} cp1 {one:.3e}", flush=True)
                assert worst((hf, one)) < TOLERANCE, f"{case['name']} {layout.describe()}: |logits - HF| = {hf}, " \
                                                 f"|logits - CP1| = {one}"
            else:
                assert logits is None


if __name__ == "__main__":
    dist_worker(main)
