"""torchrun worker: tripod's scores of token sequences by a reward model directory (HF *ForSequenceClassification),
read by the PPO loop's `RewardModelWorker` (the scorer `tripod train-rm` validates with) on one TP x PP layout over
the whole world.

argv: hf_dir, sequences.json (a list of token-id lists), out.json, [tp, pp]. Rank 0 writes the scores (one float per
sequence, in order) to out.json.
"""
import json
import sys

from tests.helpers.common import dist_worker


def main() -> None:
    import torch.distributed as dist

    from tripod.engine.workers.reward_model import RewardModelWorker
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout

    hf_dir, seq_file, out = sys.argv[1:4]
    tp, pp = (int(x) for x in sys.argv[4:6]) if len(sys.argv) > 4 else (1, 1)
    with open(seq_file) as f:
        sequences = json.load(f)
    world = dist.get_world_size()
    layout = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp), ranks=list(range(world)), name="rm")
    worker = RewardModelWorker(arch_from_hf(hf_dir), layout, hf_dir, pad_token_id=0)
    scores = worker.score(sequences, micro=None)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(scores, f)


if __name__ == "__main__":
    dist_worker(main)
