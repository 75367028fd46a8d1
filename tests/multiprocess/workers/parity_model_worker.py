"""torchrun worker (8 ranks): tripod GPTModel logits == transformers logits, for every model in the
case file, at (TP,PP,DP) = (1,1,1) [rank 0], (2,1,1) [0,1], (1,2,1) [2,3], (2,2,1) [4..7], (2,2,2) [0..7].

argv: cases.pt — a list of {"name", "hf_dir", "input_ids", "ref_logits"} written by the pytest side.
Prints one `PARITY <model> TP..PP..DP.. rank <r> maxdiff <x>` line per last-stage rank and fails above 1e-5.
"""
import sys

import torch

from tests.helpers.common import dist_worker

LAYOUTS = [((1, 1, 1), [0]), ((2, 1, 1), [0, 1]), ((1, 2, 1), [2, 3]), ((2, 2, 1), [4, 5, 6, 7]),
           ((2, 2, 2), list(range(8)))]
TOLERANCE = 1e-5


def main() -> None:
    from tests.helpers.model_forward import forward_logits
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import load_hf_weights
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.model import build_gpt_model, padded_vocab_size

    cases = torch.load(sys.argv[1])
    layouts = [ParallelLayout(tp=t, pp=p, dp=d, ranks=ranks, name=f"TP{t}PP{p}DP{d}")
               for (t, p, d), ranks in LAYOUTS]
    for case in cases:
        arch = arch_from_hf(case["hf_dir"])
        for layout in layouts:
            if not layout.is_member:
                continue
            model = build_gpt_model(arch, layout)
            embedding = getattr(model, "embedding", None)
            if embedding is not None:
                rows = embedding.word_embeddings.weight.shape[0] * layout.tp
                assert rows == padded_vocab_size(arch.vocab_size, layout.tp) and rows % (128 * layout.tp) == 0
            assert not load_hf_weights(model, case["hf_dir"], arch, layout)
            # DP replicas see different batches: the second half of the DP ranks get a flipped batch
            input_ids, ref = case["input_ids"], case["ref_logits"]
            if layout.dp_rank % 2 == 1:
                input_ids, ref = input_ids.flip(0), ref.flip(0)
            logits = forward_logits(model, layout, input_ids)
            if layout.is_last_stage:
                assert logits.shape == ref.shape, (logits.shape, ref.shape)
                diff = (logits - ref).abs().max().item()
                print(f"PARITY {case['name']} {layout.name} rank {layout.ranks.index(torch.distributed.get_rank())} "
                      f"maxdiff {diff:.3e}", flush=True)
                assert diff < TOLERANCE, f"{case['name']} {layout.describe()}: max |logits - HF| = {diff}"
            else:
                assert logits is None


if __name__ == "__main__":
    dist_worker(main)
