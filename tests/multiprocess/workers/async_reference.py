"""torchrun worker (1 rank): the synchronous engine regenerates an asynchronous run's batches from saved weights.

argv: a JSON object {"overrides": [...], "run_dir": DIR, "dump_dir": DIR, "steps": [k, ...]}. For each step k
(1-based) of the run, every row's recorded weight versions ([[first token, version], ...], the run's
trainer.rollout_data_dir dump) are taken at their word: a colocated `PPOTrainer` with the run's config loads the
actor weights of each version (the run's checkpoint global_step_<v>, or the initial weights for 0) and generates, with
step k's sampling parameters, the rows' prompts plus the tokens before that segment, for the segment's length. Prints
`ASYNC_REFERENCE k equal=<bool> segments=<count>` per step: equal when every segment's tokens are the reference's and
its log-probs within 1e-5 (a batch of other rows than the run's may round differently).
"""
import dataclasses
import json
import os
import sys

from tests.helpers.common import dist_worker


def _segments(row: dict) -> list[tuple[int, int, int]]:
    """(version, first token, end token) of each segment of a dumped row."""
    segs, end = row["weight_versions"], len(row["response_ids"])
    return [(v, t0, segs[j + 1][0] if j + 1 < len(segs) else end) for j, (t0, v) in enumerate(segs)]


def main() -> None:
    import torch

    from tripod.engine.config import load_config
    from tripod.engine.data import PromptBatch
    from tripod.engine.trainer import PPOTrainer

    args = json.loads(sys.argv[1])
    overrides = [o for o in args["overrides"] if not o.startswith(("rollout.", "trainer.rollout_data_dir",
                                                                   "async_training."))]
    cfg = load_config("recipes/defaults.yaml", overrides + ["trainer.resume=disable"])
    n = cfg.actor_rollout_ref.rollout.n
    trainer = PPOTrainer(cfg)
    work: dict[int, list] = {}  # version -> (step, first token, prompt group rows, end token)
    dumps = {}
    for k in args["steps"]:
        with open(os.path.join(args["dump_dir"], f"{k}.jsonl")) as f:
            dumps[k] = [json.loads(line) for line in f]
        for g in range(0, len(dumps[k]), n):  # the n rows of a prompt were generated together
            for v, t0, t1 in _segments(dumps[k][g]):
                work.setdefault(v, []).append((k, t0, list(range(g, g + n)), t1))
    equal = {k: True for k in args["steps"]}
    for v in sorted(work):  # ascending: the initial weights first, then each checkpoint once
        if v > 0:
            trainer.resume(os.path.join(args["run_dir"], "checkpoints", f"global_step_{v}"))
        batches: dict[tuple[int, int, int], list[list[int]]] = {}
        for k, t0, rows, t1 in work[v]:
            batches.setdefault((k, t0, t1), []).append(rows)
        for (k, t0, t1), groups in batches.items():
            rows = dumps[k]
            prompts = [rows[g[0]]["prompt_ids"] + rows[g[0]]["response_ids"][:t0] for g in groups]
            params = dataclasses.replace(trainer.sampling_params(False, k - 1, 0), max_new_tokens=t1 - t0)
            got = trainer.generator.generate_rows(PromptBatch(prompts, [""] * len(prompts), [""] * len(prompts),
                                                              list(range(len(prompts)))), params)
            for r, lp, i in zip(got.responses, got.rollout_log_probs, [i for g in groups for i in g]):
                want = rows[i]["response_ids"][t0:t1]
                equal[k] = equal[k] and list(r) == want and torch.allclose(
                    lp, torch.tensor(rows[i]["rollout_log_probs"][t0:t1]), atol=1e-5, rtol=0)
    for k in args["steps"]:
        count = sum(len(r["weight_versions"]) for r in dumps[k])
        print(f"ASYNC_REFERENCE {k} equal={equal[k]} segments={count}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
