#!/usr/bin/env python
"""`make demo-rm`: a reward model learned from preferences, then PPO on it alone; the rule reward rises on held-out
problems, so what the reward model learned transfers.

1. `make demo`'s model (scripts/prepare_smollm2.py) and arithmetic problems (scripts/demo.py's `arithmetic_splits`:
   the same 91 training and 64 held-out validation problems, the same chat prompts with one worked example).
2. Preference pairs (engine/data/arithmetic_preferences.py): chosen = a correct answer in the `#### N` form the rule
   rewards, rejected = a wrong number (in the chosen's own form), a wrong number after the marker, the right number
   without the marker or after a malformed one. Training pairs: 4 per training problem (one of each kind); held-out
   pairs: 1 per validation problem (the kinds in turn), never trained on. Prompts are the PPO prompts, rendered with
   the tokenizer's chat template, so the reward model scores exactly what the PPO loop will show it.
3. `tripod train-rm recipes/demo/smollm2-135m-arithmetic-reward-model.yaml`: Bradley-Terry from SmolLM2-135M-Instruct
   (a new score head), exported to outputs/demo_rm/reward_model/hf.
4. `tripod train recipes/demo/smollm2-135m-arithmetic-ppo-rm.yaml`: `make demo`'s PPO with that reward model as the
   only training reward (the training prompts' data source `arithmetic_rm` has no rule function, and
   `reward_model.combine: fallback` scores such rows by the model), validated greedily by the exact `#### N` rule on
   the held-out problems (their data source `arithmetic` keeps its rule).
5. Printed: the reward model's held-out pairwise accuracy and margin, and the held-out rule reward before and after PPO.

Extra arguments: `rm.KEY=VALUE` goes to `tripod train-rm` (e.g. rm.trainer.total_training_steps=4), `ppo.KEY=VALUE`
to `tripod train` (e.g. ppo.trainer.total_training_steps=1); `--skip-rm` reuses the reward model already exported.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo import EXAMPLE, MODEL_DIR, REPO, arithmetic_splits, run  # noqa: E402  (make demo's model and problems)

DATA_DIR = os.path.join(REPO, "outputs", "demo_rm_data")
RUN_DIR = os.path.join(REPO, "outputs", "demo_rm")
RM_RECIPE = os.path.join(REPO, "recipes", "demo", "smollm2-135m-arithmetic-reward-model.yaml")
PPO_RECIPE = os.path.join(REPO, "recipes", "demo", "smollm2-135m-arithmetic-ppo-rm.yaml")
NO_RULE_SOURCE = "arithmetic_rm"  # a data source without a rule function: the reward model scores its rows


def write_data() -> None:
    """PPO prompts (training rows relabelled to NO_RULE_SOURCE, validation rows as `make demo`'s) and preference
    pairs from the same problems."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from tripod.engine.data import write_prompt_parquet
    from tripod.engine.data.arithmetic_preferences import preference_rows
    from tripod.engine.rewards import registered_data_sources

    assert NO_RULE_SOURCE not in registered_data_sources(), f"{NO_RULE_SOURCE} has a rule function"
    train, val = arithmetic_splits()
    for row in train:
        row["data_source"] = NO_RULE_SOURCE
    write_prompt_parquet(train, os.path.join(DATA_DIR, "train.parquet"))
    write_prompt_parquet(val, os.path.join(DATA_DIR, "test.parquet"))

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    render = lambda question: tokenizer.apply_chat_template(  # noqa: E731  the PPO prompt's text
        EXAMPLE + [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    prefs = {"prefs_train": preference_rows(train, 4, seed=0, prompt=render),
             "prefs_val": preference_rows(val, 1, seed=1, prompt=render)}
    for name, rows in prefs.items():
        pq.write_table(pa.Table.from_pylist(rows), os.path.join(DATA_DIR, f"{name}.parquet"))
    print(f"wrote {DATA_DIR}: PPO prompts ({len(train)} training rows of {len({r['expression'] for r in prefs['prefs_train']})}"
          f" problems, data source {NO_RULE_SOURCE}; {len(val)} held-out validation problems), "
          f"{len(prefs['prefs_train'])} training and {len(prefs['prefs_val'])} held-out preference pairs", flush=True)


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(args: list[str]) -> int:
    start, py = time.time(), sys.executable
    rm_over = [a[3:] for a in args if a.startswith("rm.")]
    ppo_over = [a[4:] for a in args if a.startswith("ppo.")]
    unknown = [a for a in args if not a.startswith(("rm.", "ppo.")) and a != "--skip-rm"]
    if unknown:
        print(f"unknown arguments {unknown}: give rm.KEY=VALUE (tripod train-rm), ppo.KEY=VALUE (tripod train) or "
              "--skip-rm", file=sys.stderr)
        return 2
    rm_dir, ppo_dir = os.path.join(RUN_DIR, "reward_model"), os.path.join(RUN_DIR, "ppo")
    run([py, "scripts/prepare_smollm2.py", "--out", MODEL_DIR])
    os.makedirs(DATA_DIR, exist_ok=True)
    write_data()
    if "--skip-rm" not in args:
        run([py, "-m", "tripod", "train-rm", RM_RECIPE, f"model.path={MODEL_DIR}",
             f"data.train_files=[{DATA_DIR}/prefs_train.parquet]", f"data.val_files=[{DATA_DIR}/prefs_val.parquet]",
             f"trainer.default_local_dir={rm_dir}", *rm_over])
    rm_done = time.time()
    run([py, "-m", "tripod", "train", PPO_RECIPE, f"actor_rollout_ref.model.path={MODEL_DIR}",
         f"reward_model.model.path={rm_dir}/hf", f"data.train_files={DATA_DIR}/train.parquet",
         f"data.val_files={DATA_DIR}/test.parquet", f"trainer.default_local_dir={ppo_dir}", *ppo_over])

    rm_val = [m for m in metrics(rm_dir) if "val/accuracy" in m][-1]
    ppo = metrics(ppo_dir)
    val = [(m["step"], m["val/reward_mean"]) for m in ppo if "val/reward_mean" in m]
    model_scores = [(m["step"], m["reward/model_mean"]) for m in ppo if "reward/model_mean" in m]
    (s0, before), (s1, after) = val[0], val[-1]
    print(f"\nreward model (step {rm_val['step']}, {rm_dir}/hf), held-out preference pairs "
          f"({DATA_DIR}/prefs_val.parquet): pairwise accuracy {rm_val['val/accuracy']:.3f}, "
          f"margin {rm_val['val/margin']:.2f}, loss {rm_val['val/loss']:.3f}")
    if model_scores:
        print("reward-model score of the training rollouts (the only training reward), by step: "
              + " ".join(f"{s}:{v:+.2f}" for s, v in model_scores))
    print(f"held-out rule reward (greedy, exact '#### N' match, {DATA_DIR}/test.parquet, never trained on):")
    print(f"  before PPO (step {s0}): {before:.3f}")
    print(f"  after PPO  (step {s1}): {after:.3f}   change {after - before:+.3f}")
    print(f"run directories: {rm_dir}, {ppo_dir}; reward model {rm_done - start:.0f} s, "
          f"total {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except subprocess.CalledProcessError as e:
        sys.exit(e.returncode)
