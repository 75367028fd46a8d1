"""torchrun worker (4 ranks): a tripod reward model's scores == transformers' *ForSequenceClassification scores,
at (TP,PP,DP) = (1,1,1) [rank 0], (2,1,1) [0,1] and (1,2,1) [2,3]; then TP2 and PP2 export it back to HF. Then the
PPO loop's `RewardModelWorker.score` at TP2xDP2 and PP2xDP2 (all 4 ranks, one-row micro-batches, 5 sequences so one
filler row pads the DP split) gives the same scores on every rank.

argv: cases.pt (a list of {"name", "hf_dir", "input_ids", "attention_mask", "ref_scores"}), out_dir.
Prints `RM_PARITY <model> <layout> maxdiff <x>` per layout on its last stage, `RM_EXPORT <model> <layout> <dir>`
after each export (the pytest side compares the exported tensors with the originals) and `RM_WORKER <model> <layout>
rank <r> maxdiff <x>` on every rank.
"""
import os
import sys

import torch

from tests.helpers.common import dist_worker

LAYOUTS = [((1, 1, 1), [0]), ((2, 1, 1), [0, 1]), ((1, 2, 1), [2, 3])]
TOLERANCE = 1e-5


def main() -> None:
    from tests.helpers.model_forward import forward_logits
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import load_hf_weights, save_hf_checkpoint
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.model import build_gpt_model

    cases, out_dir = torch.load(sys.argv[1]), sys.argv[2]
    layouts = [ParallelLayout(tp=t, pp=p, dp=d, ranks=ranks, name=f"TP{t}PP{p}DP{d}") for (t, p, d), ranks in LAYOUTS]
    for case in cases:
        arch = arch_from_hf(case["hf_dir"])
        assert arch.score_head
        for layout in layouts:
            if not layout.is_member:
                continue
            model = build_gpt_model(arch, layout)
            assert not load_hf_weights(model, case["hf_dir"], arch, layout)  # the score head is loaded too
            values = forward_logits(model, layout, case["input_ids"])
            if layout.is_last_stage:
                last = case["attention_mask"].sum(-1) - 1  # right padding: the last real token
                scores = values[torch.arange(values.shape[0]), last]
                diff = (scores - case["ref_scores"]).abs().max().item()
                print(f"RM_PARITY {case['name']} {layout.name} maxdiff {diff:.3e}", flush=True)
                assert diff < TOLERANCE, f"{case['name']} {layout.name}: max |score - HF| = {diff}"
            if layout.tp * layout.pp > 1:
                target = os.path.join(out_dir, f"{case['name']}_{layout.name}")
                save_hf_checkpoint(model, arch, layout, target)
                if layout.tp_rank == 0 and layout.pp_rank == 0:
                    print(f"RM_EXPORT {case['name']} {layout.name} {target}", flush=True)
        check_worker(case, arch)


def check_worker(case: dict, arch) -> None:
    from tripod.engine.workers.reward_model import RewardModelWorker
    from tripod.parallel.layout import ParallelLayout

    sequences = [row[:int(n)].tolist() for row, n in zip(case["input_ids"], case["attention_mask"].sum(-1))]
    sequences.append(sequences[1])
    ref = torch.cat([case["ref_scores"], case["ref_scores"][1:2]])
    for tp, pp in ((2, 1), (1, 2)):
        layout = ParallelLayout(tp=tp, pp=pp, dp=2, ranks=[0, 1, 2, 3], name=f"TP{tp}PP{pp}DP2")
        worker = RewardModelWorker(arch, layout, case["hf_dir"], pad_token_id=0, offload=True)
        scores = torch.tensor(worker.score(sequences, micro=1))
        diff = (scores - ref).abs().max().item()
        print(f"RM_WORKER {case['name']} {layout.name} rank {torch.distributed.get_rank()} maxdiff {diff:.3e}",
              flush=True)
        assert diff < TOLERANCE, f"{case['name']} {layout.name}: RewardModelWorker.score - HF = {diff}"


if __name__ == "__main__":
    dist_worker(main)
