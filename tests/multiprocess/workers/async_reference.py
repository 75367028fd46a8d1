"""torchrun worker (1 rank): the synchronous engine regenerates an asynchronous run's batches from saved weights.

argv: a JSON object {"overrides": [...], "run_dir": DIR, "steps": [k, ...], "age": a}. For each step k (1-based) of
the run, a colocated `PPOTrainer` with the run's config loads the actor weights after step k - 1 - a (its
checkpoint, or the initial weights for 0) and generates step k's prompts (the run's trainer.rollout_data_dir dump)
with step k's sampling parameters; prints `ASYNC_REFERENCE k equal=<bool> version=<dumped weight version>` per step.
"""
import json
import os
import sys

from tests.helpers.common import dist_worker


def main() -> None:
    import torch

    from tripod.engine.config import load_config
    from tripod.engine.trainer import PPOTrainer

    args = json.loads(sys.argv[1])
    overrides = [o for o in args["overrides"] if not o.startswith(("rollout.", "trainer.rollout_data_dir"))]
    cfg = load_config("recipes/defaults.yaml", overrides + ["trainer.resume=disable"])
    trainer = PPOTrainer(cfg)
    for k in sorted(args["steps"]):
        version = k - 1 - args["age"]
        if version > 0:
            trainer.resume(os.path.join(args["run_dir"], "checkpoints", f"global_step_{version}"))
        with open(os.path.join(cfg.trainer.rollout_data_dir or args["dump_dir"], f"{k}.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        n = cfg.actor_rollout_ref.rollout.n
        prompts = [rows[i]["prompt_ids"] for i in range(0, len(rows), n)]
        got = trainer.weight_sync.generate_rows(prompts, trainer.sampling_params(False, k - 1, 0))
        equal = all(list(r) == row["response_ids"] and torch.equal(lp, torch.tensor(row["rollout_log_probs"]))
                    for r, lp, row in zip(got.responses, got.log_probs, rows))
        print(f"ASYNC_REFERENCE {k} equal={equal} version={rows[0]['weight_version']}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
