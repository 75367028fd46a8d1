#!/usr/bin/env python
"""The rollout on its own ranks against the colocated synchronous step, on this machine.

A GRPO workload whose responses vary in length (a random Qwen2 whose end-of-sequence row of the LM head is an average
token's plus a wide random part: lengths from 1 to the cap, the median about a quarter of it) and whose reward waits `--latency` seconds per sample outside the model (a remote judge:
`time.sleep` in the reward function, in the rank's reward pool). Three runs with the same total ranks (2), threads
per rank (1), samples, lengths and seed:

    sync      trainer.n_gpus_per_node=2, rollout colocated (DP2, two rollout replicas)
    async a1  1 trainer rank + 1 rollout rank, staleness_threshold=1 (a sample is at most 1 step old)
    async a2  1 trainer rank + 1 rollout rank, staleness_threshold=2 (at most 2 steps old)

Prints one table: samples/s over the steps, the trainer's and the rollout's idle seconds, response lengths (median,
max), the held-out (greedy) reward after the same samples, peak RSS per rank. Record results in bench/RESULTS.md.

    python scripts/bench_async.py [--steps 6] [--latency 0.5]

`--replicas 1,2,4` (issue 46) measures instead what moves where, with 2 trainer DP ranks and that many rollout
replicas (rollout TP 1, staleness 1, no judge latency): the bytes through the busiest trainer rank per step against
the batch's body / DP, and the weight-push bytes per sending trainer rank (flat in the replica count). Bytes do not
depend on timing, so a short run on a loaded machine measures them exactly.

    python scripts/bench_async.py --replicas 1,2,4 --steps 3   (>= 3: staleness 1 first pushes after step 1)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "src"))

from tripod.engine.rewards.arithmetic import arithmetic_reward  # noqa: E402
from tripod.engine.rewards.registry import register_reward  # noqa: E402

LATENCY = float(os.environ.get("TRIPOD_BENCH_LATENCY", "0.5"))


@register_reward("arithmetic_remote")  # registered in every spawned rank too: they import this file as __mp_main__
def remote_judge(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    time.sleep(LATENCY)
    return arithmetic_reward(solution_str, ground_truth, extra_info)


def make_workload(root: str) -> dict:
    import torch
    import transformers

    from tripod.engine.data import make_arithmetic_rows, write_prompt_parquet
    from tripod.engine.data.char_tokenizer import char_tokenizer

    tok = char_tokenizer()
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # EOS scores like an average token plus a wide random part: lengths from 1 to the cap,
        w = model.lm_head.weight  # median about a quarter of it (HF sampling over the full vocabulary: 37 of 96 at 16, 14 at 24)
        w[tok.eos_token_id] = w.mean(0) + 20.0 * w[tok.eos_token_id]
    path = os.path.join(root, "model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    out = {"model": path}
    for split, count, seed in (("train", 256, 0), ("val", 16, 1)):
        rows = make_arithmetic_rows(count, seed=seed, split=split)
        for r in rows:
            r["data_source"] = "arithmetic_remote"
        out[split] = os.path.join(root, f"{split}.parquet")
        write_prompt_parquet(rows, out[split])
    return out


def run(name: str, work: dict, root: str, steps: int, extra: list[str]) -> dict:
    from tripod.engine.cli import main as tripod_main

    run_dir = os.path.join(root, name)
    args = ["train", os.path.join(REPO, "recipes", "defaults.yaml"), f"data.train_files={work['train']}",
            f"data.val_files={work['val']}", "data.max_prompt_length=160", "data.train_batch_size=8",
            "data.shuffle=true", f"actor_rollout_ref.model.path={work['model']}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.response_length=96", "algorithm.adv_estimator=grpo",
            "reward_model.num_workers=4", "reward_model.timeout_s=60", f"trainer.total_training_steps={steps}",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.threads_per_rank=1",
            "trainer.logger=[jsonl]", "trainer.resume=disable", f"trainer.default_local_dir={run_dir}",
            f"trainer.rollout_data_dir={run_dir}/rollouts", *extra]
    start = time.perf_counter()
    assert tripod_main(args) == 0
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    lengths = [len(json.loads(line)["response_ids"]) for k in range(1, steps + 1)
               for line in open(os.path.join(run_dir, "rollouts", f"{k}.jsonl"))]
    step_s = sum(r["timing_s/step"] for r in rows)
    samples = 8 * 4 * steps
    return {"name": name, "samples_per_s": samples / step_s, "step_s": step_s, "wall_s": wall,
            "trainer_idle_s": sum(r.get("async/trainer_idle_s", 0.0) for r in rows),
            "rollout_idle_s": sum(r.get("async/rollout_idle_s", 0.0) for r in rows),
            "len_median": statistics.median(lengths), "len_max": max(lengths),
            "val_reward": rows[-1].get("val/reward_mean", float("nan")),
            "peak_rss_gb": max(r.get("perf/peak_memory_gb/max", float("nan")) for r in rows)}


def bytes_table(work: dict, root: str, steps: int, replicas: list[int]) -> None:
    """`--replicas`: one run per replica count; prints the bytes table (see the module docstring)."""
    print("| replicas | busiest trainer rank B/step | batch body B/step / DP | busiest / (body / DP) | "
          "head B | push B per sending rank (max) | push B per rollout rank |")
    print("|---|---|---|---|---|---|---|")
    for n in replicas:
        name = f"replicas_{n}"
        run(name, work, root, steps, ["trainer.n_gpus_per_node=2", "rollout.nnodes=1", f"rollout.n_gpus_per_node={n}",
                                      "async_training.staleness_threshold=1",
                                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
        rows = [json.loads(line) for line in open(os.path.join(root, name, "metrics.jsonl"))]
        busiest = max(max(r["async/batch_bytes/rank0"], r["async/batch_bytes/rank1"]) for r in rows)
        head = max(r["async/batch_head_bytes"] for r in rows)
        body = max((r["async/batch_bytes_total"] - 2 * r["async/batch_head_bytes"]) / 2 for r in rows)
        pushes = [r for r in rows if "async/weight_push_bytes/rank0" in r]
        push = max(max(r["async/weight_push_bytes/rank0"], r["async/weight_push_bytes/rank1"]) for r in pushes)
        print(f"| {n} | {busiest:,.0f} | {body:,.0f} | {busiest / body:.3f} | {head:,.0f} | {push:,.0f} | "
              f"{pushes[0]['async/weight_bytes_per_replica']:,.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--latency", type=float, default=LATENCY, help="the judge's seconds a sample (default 0.5)")
    p.add_argument("--replicas", default="", help="comma-separated replica counts: the bytes table instead")
    args = p.parse_args()
    if args.replicas:
        args.latency = 0.0
    os.environ["TRIPOD_BENCH_LATENCY"] = str(args.latency)  # the spawned ranks read it when they import this file
    root = tempfile.mkdtemp(prefix="tripod-bench-async-")
    work = make_workload(root)
    if args.replicas:
        print(f"load average {os.getloadavg()[0]:.2f}; {args.steps} steps x 8 prompts x 4 samples, 2 trainer ranks")
        bytes_table(work, root, args.steps, [int(x) for x in args.replicas.split(",")])
        return
    own = ["trainer.n_gpus_per_node=1", "rollout.nnodes=1", "rollout.n_gpus_per_node=1"]
    results = [run("sync", work, root, args.steps, ["trainer.n_gpus_per_node=2"]),
               run("async_a1", work, root, args.steps, own + ["async_training.staleness_threshold=1"]),
               run("async_a2", work, root, args.steps, own + ["async_training.staleness_threshold=2"])]
    base = results[0]["samples_per_s"]
    print(f"\nload average {os.getloadavg()[0]:.2f}; {args.steps} steps x 8 prompts x 4 samples, latency "
          f"{args.latency} s a sample, 2 ranks x 1 thread")
    print("| run | samples/s | vs sync | step s (sum) | trainer idle s | rollout idle s | length median / max | "
          "held-out reward | peak GB/rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r['samples_per_s']:.2f} | {r['samples_per_s'] / base:.2f}x | {r['step_s']:.1f} | "
              f"{r['trainer_idle_s']:.1f} | {r['rollout_idle_s']:.1f} | {r['len_median']:g} / {r['len_max']} | "
              f"{r['val_reward']:.3f} | {r['peak_rss_gb']:.2f} |")


if __name__ == "__main__":
    main()
