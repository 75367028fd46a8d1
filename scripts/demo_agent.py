#!/usr/bin/env python
"""`make demo-agent`: an SFT cold start, then multi-turn GRPO with a calculator tool, on CPU.

1. SmolLM2-135M-Instruct (scripts/prepare_smollm2.py) and synthetic calculator transcripts
   (scripts/make_calculator_sft.py: a question, the hermes `<tool_call>` to `calculator`, its answer, `#### N`; about
   a fifth of the questions are word problems, "Each box holds 36 pencils...", whose expression the model writes).
2. GRPO prompts: the transcripts' system prompt and a question, half templates naming the expression and half word
   problems, 2-3 digit operands; none of their problems occurs in the transcripts, and the 48 held-out ones not in
   the training prompts either. Reward: 1 for the right `#### N`.
3. Held-out evaluation of the base model (`tripod train ... trainer.val_only=true`: greedy, multi-turn, the tool live).
4. `tripod train-sft recipes/demo/smollm2-135m-calculator-sft.yaml` for SFT_STEPS steps (a short cold start: the
   call format is learnt, the word problems only partly, so RL has something to do), exported to HF.
5. `tripod train recipes/demo/smollm2-135m-calculator-grpo.yaml` from the SFT model: validation before the first step
   (after SFT) and at the end (after RL).
It prints held-out reward, tool-call rate (share of trajectories with a tool call) and the share of those whose
calls parse, at the three points, and the time per step split into generation and tool calls.

Extra `key=value` arguments go to the GRPO run, e.g. `python scripts/demo_agent.py trainer.total_training_steps=4`.
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time

from make_calculator_sft import SYSTEM_PROMPT, make_splits, problem, question

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(REPO, "outputs", "models", "smollm2-135m-instruct")
OUT = os.path.join(REPO, "outputs", "demo_agent")
DATA = os.path.join(OUT, "data")
SFT_RECIPE = os.path.join(REPO, "recipes", "demo", "smollm2-135m-calculator-sft.yaml")
GRPO_RECIPE = os.path.join(REPO, "recipes", "demo", "smollm2-135m-calculator-grpo.yaml")
SFT_WORD_FRACTION = 0.25  # a quarter of the transcripts are word problems; GRPO's prompts are half word problems
SFT_STEPS = 12  # the cold start: the call format is learnt, the word problems only partly
KEYS = (("val/reward_mean", "held-out reward"), ("val/tool/call_rate", "tool-call rate"),
        ("val/tool/parse_frac", "calls parse"))


def run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def prompt_row(expression: str, value: int, rng: random.Random, split: str, index: int) -> dict:
    """A GRPO prompt: the transcripts' system prompt and the question (odd rows: a word problem)."""
    text = question(expression, value, rng, word=bool(index % 2))
    return {"data_source": "arithmetic", "ability": "math",
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}],
            "reward_model": {"style": "rule", "ground_truth": str(value)},
            "extra_info": {"split": split, "index": index, "question": text, "expression": expression,
                           "word_problem": bool(index % 2)}}


def write_data(train_count: int = 256, val_count: int = 48) -> None:
    from tripod.engine.data import write_prompt_parquet

    run([sys.executable, "scripts/make_calculator_sft.py", "--output_dir", os.path.join(DATA, "sft"),
         "--word_fraction", str(SFT_WORD_FRACTION)])
    sft = sum(make_splits(512, 64, 0, "content", SFT_WORD_FRACTION), [])  # what the script above wrote
    sft_expressions = {re.search(r'"expression": "([^"]+)"', m["content"])[1] for c in sft for m in c
                       if m["role"] == "assistant" and "<tool_call>" in m["content"]}
    rng, rows, used = random.Random(1), {"test": [], "train": []}, set(sft_expressions)
    for split, count in (("test", val_count), ("train", train_count)):
        while len(rows[split]) < count:
            expression, value = problem(rng)
            if expression in used or value < 0:
                continue
            used.add(expression)
            rows[split].append(prompt_row(expression, value, rng, split, len(rows[split])))
        write_prompt_parquet(rows[split], os.path.join(DATA, f"{split}.parquet"))
    print(f"wrote {train_count} GRPO prompts and {val_count} held-out ones to {DATA} (half word problems; none of "
          f"their problems in the {len(sft_expressions)} SFT transcripts)", flush=True)


def grpo(model: str, run_dir: str, *extra: str) -> None:
    run([sys.executable, "-m", "tripod", "train", GRPO_RECIPE, f"actor_rollout_ref.model.path={model}",
         f"data.train_files={DATA}/train.parquet", f"data.val_files={DATA}/test.parquet",
         f"trainer.default_local_dir={run_dir}", *extra])


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main(overrides: list[str]) -> int:
    start = time.time()
    run([sys.executable, "scripts/prepare_smollm2.py", "--out", MODEL_DIR])
    write_data()
    grpo(MODEL_DIR, os.path.join(OUT, "base_eval"), "trainer.val_only=true")
    sft_dir = os.path.join(OUT, "sft")
    run([sys.executable, "-m", "tripod", "train-sft", SFT_RECIPE, f"model.path={MODEL_DIR}",
         f"data.train_files=[{DATA}/sft/train.parquet]", f"data.val_files=[{DATA}/sft/val.parquet]",
         f"trainer.default_local_dir={sft_dir}", f"trainer.total_training_steps={SFT_STEPS}", "trainer.resume=disable",
         "trainer.test_freq=-1"])  # validation loss before and after only (each pass over the 64 rows costs ~30 s)
    grpo(os.path.join(sft_dir, "hf"), os.path.join(OUT, "grpo"), *overrides)
    base, rl = metrics(os.path.join(OUT, "base_eval")), metrics(os.path.join(OUT, "grpo"))
    vals = [m for m in rl if "val/reward_mean" in m]
    points = (("before SFT", base[0]), ("after SFT", vals[0]), (f"after RL (step {vals[-1]['step']})", vals[-1]))
    print(f"\nheld-out calculator problems (greedy, {DATA}/test.parquet):")
    print(f"  {'':22s}" + "".join(f"{label:>18s}" for _, label in KEYS))
    for name, m in points:
        print(f"  {name:22s}" + "".join(f"{m[k]:18.3f}" if k in m else f"{'(no calls)':>18s}" for k, _ in KEYS))
    steps = [m for m in rl if "multi_turn/generate_s" in m]  # training steps (validation's metrics are val/...)
    if steps:
        mean = lambda k: sum(m.get(k, float("nan")) for m in steps) / len(steps)  # noqa: E731
        print(f"per GRPO step ({len(steps)} steps, 8 prompts x 4 samples): {mean('multi_turn/turns_mean'):.2f} turns "
              f"per trajectory, {mean('tool/calls_mean'):.2f} tool calls, generation "
              f"{mean('multi_turn/generate_s'):.1f} s, tool calls {mean('multi_turn/tool_s'):.2f} s, training reward "
              f"{mean('critic/score/mean'):.3f}")
    print(f"runs: {OUT}/{{base_eval,sft,grpo}}; total {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
