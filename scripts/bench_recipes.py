"""The actor-update MFU of every recipe, each measured by `tripod bench` on this host.

A recipe whose model is a local directory runs as written. A recipe that names a hub model (Qwen2.5, Qwen3,
DeepSeek-V3) runs its own model's shapes scaled to one host (`tripod.engine.bench.scaled_model`: every per-layer
shape kept, the depth cut, the routed experts cut to E / DP so each expert gets the recipe's tokens, random weights,
SmolLM2's tokenizer) on one rank: the recipe's token-budget micro-batching (`use_dynamic_bsz`,
`ppo_max_token_len_per_gpu`), algorithm, packing and recomputation are kept; its parallel layout becomes TP1 PP1 EP1
(fp32 on CPU); responses are cut to `--response-length` and the batch to about `--tokens` tokens (one mini-batch),
so a step fits one lock slot. Dynamic sampling and the overlong penalty (DAPO) are switched off: a random model's
groups all score 0, and the penalty's buffer is longer than the cut responses.

    flock /tmp/tripod-heavy.lock python scripts/bench_recipes.py            # every recipe
    python scripts/bench_recipes.py recipes/qwen3/30b-a3b-gsm8k.yaml --steps 2

Writes OUT/<recipe>/bench.{json,md,png} (tripod bench's own) and OUT/RESULTS.md (one row per recipe).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "outputs" / "models" / "smollm2-135m-instruct"
GSM8K = ROOT / "outputs" / "data" / "gsm8k"
# recipes that are not a PPO / GRPO run of their own model: a reward model's training, and PPO on a learned reward
# model (the demo's model and shapes again, and it needs `make demo-rm`'s reward model)
SKIP = {"defaults.yaml", "smollm2-135m-arithmetic-reward-model.yaml", "smollm2-135m-arithmetic-ppo-rm.yaml"}
ONE_RANK = [f"{role}.megatron.{key}={value}" for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
            for key, value in (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
                               ("context_parallel_size", 1), ("expert_model_parallel_size", 1),
                               ("expert_tensor_parallel_size", 1), ("sequence_parallel", "false"),
                               ("param_dtype", "fp32"), ("num_layers_in_first_pipeline_stage", "null"),
                               ("num_layers_in_last_pipeline_stage", "null"),
                               ("virtual_pipeline_model_parallel_size", "null"))]
ONE_RANK += ["actor_rollout_ref.rollout.name=embedded", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
             "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.device=cpu"]


def all_recipes() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "recipes").glob("*/*.yaml")
                  if p.name not in SKIP and not p.name.endswith("-tools.yaml"))  # a multi-turn tool config


def prepare_inputs() -> None:
    """SmolLM2's tokenizer (scripts/prepare_smollm2.py) and GSM8K parquet (scripts/preprocess_gsm8k.py)."""
    if not (TOKENIZER / "tripod_prepared.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_smollm2.py"), "--out", str(TOKENIZER)], check=True)
    if not (GSM8K / "train.parquet").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "preprocess_gsm8k.py"), "--input_dir",
                        str(ROOT.parent / "shared" / "data" / "gsm8k"), "--output_dir", str(GSM8K)], check=True)


def scaled_run(recipe: str, cfg, args) -> tuple[list[str], list[str]]:
    """(overrides, what differs from the recipe) for a recipe whose model is a hub name."""
    from transformers import AutoTokenizer

    from tripod.engine.bench.scaled_model import fit_scaled_model, write_scaled_model
    from tripod.engine.cli.plan import plan_model_config

    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    dp = cfg.actor_rollout_ref.actor.megatron.data_parallel_size(world)
    with open(plan_model_config(cfg.actor_rollout_ref.model.path, recipe=recipe)) as f:
        hf = json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    scaled = fit_scaled_model(hf, layers=args.layers, data_parallel=dp, tokenizer=tokenizer, memory_gb=args.memory_gb,
                              critic=cfg.uses_critic, reference=cfg.uses_reference)
    model_dir = write_scaled_model(scaled, tokenizer, os.path.join(args.out, "models", Path(recipe).stem))
    n = cfg.actor_rollout_ref.rollout.n
    tokens = args.tokens or min(cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu, args.max_tokens)
    prompts = max(1, round(tokens / (n * args.response_length + args.prompt_tokens)))
    changes = [f"{cfg.actor_rollout_ref.model.path} shapes: " + ", ".join(scaled.changes),
               f"{scaled.params / 1e6:.0f}M parameters, random", f"layout TP1 PP1 EP1 fp32 on 1 rank (was DP{dp} of "
               f"{world})", f"{prompts} prompts x {n}, responses {args.response_length} tokens, one mini-batch"]
    budget = cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
    if not args.tokens and budget > tokens:
        changes.append(f"~{tokens} tokens a step of the recipe's {budget}-token micro-batch budget")
    over = [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{GSM8K / 'train.parquet'}]",
            f"data.train_batch_size={prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
            f"critic.ppo_mini_batch_size={prompts}", f"data.max_response_length={args.response_length}",
            f"data.gen_batch_size={prompts}", *ONE_RANK]
    if cfg.algorithm.filter_groups.enable:
        over.append("algorithm.filter_groups.enable=false")
        changes.append("dynamic sampling off")
    if cfg.reward_model.overlong_buffer.enable:
        over.append("reward_model.overlong_buffer.enable=false")
        changes.append("overlong penalty off")
    return over, changes


def row(recipe: str, out: str, changes: list[str], wall: float) -> str:
    with open(os.path.join(out, "bench.json")) as f:
        doc = json.load(f)
    s = doc["runs"][0]["summary"]
    mfu = s["mfu"]
    stages = s["stages"]
    fmt = lambda k: f"{100 * mfu[k]:.1f}%" if k in mfu else "-"  # noqa: E731
    return (f"| {recipe} | {fmt('update_actor')} | {stages['update_actor']['median_s']:.2f} | {fmt('gen')} | "
            f"{s['step_s']['median']:.2f} | {s['tokens_per_step']:.0f} | {s['peak_memory_gb_max']:.2f} | "
            f"{s['matmul_ceiling_gflops']:.0f} | {wall:.0f} | {'; '.join(changes) or 'as written'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipes", nargs="*", help="recipe YAMLs (default: every PPO / GRPO recipe in recipes/)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per recipe (default 2)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2, help="layers of a scaled model (default 2)")
    parser.add_argument("--memory-gb", type=float, default=14.0, help="host memory for a scaled run's models")
    parser.add_argument("--tokens", type=int, default=1024,
                        help="about this many model tokens per scaled step (a prompt shared by its n samples once); "
                             "0: the recipe's own micro-batch budget (actor.ppo_max_token_len_per_gpu), at most "
                             "--max-tokens")
    parser.add_argument("--max-tokens", type=int, default=8192, help="the cap of --tokens 0")
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=150, help="a GSM8K prompt's tokens, for --tokens")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "bench_recipes"))
    args = parser.parse_args(argv)
    from tripod.engine.config import load_config

    prepare_inputs()
    lines = ["| recipe | actor-update MFU | update s | generation MFU | step s | tokens/step | peak GB | "
             "ceiling GFLOP/s | wall s | run differs from the recipe in |", "|---" * 10 + "|"]
    for recipe in args.recipes or all_recipes():
        cfg = load_config(recipe)
        path = cfg.actor_rollout_ref.model.path
        if path is None:  # the demo recipe: scripts/demo.py fills in its model and data
            over, changes = [f"actor_rollout_ref.model.path={TOKENIZER}",
                             f"data.train_files=[{ROOT / 'outputs' / 'demo_data' / 'train.parquet'}]"], []
        else:
            over, changes = ([], []) if os.path.isdir(path) else scaled_run(recipe, cfg, args)
        out = os.path.join(args.out, Path(recipe).stem)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "tripod", "bench", recipe, *over, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--out", out]
        print(f"bench_recipes: {recipe}: {'; '.join(changes) or 'as written'}", flush=True)
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", flush=True)
            lines.append(f"| {recipe} | failed (exit {done.returncode}) | | | | | | | {wall:.0f} | {'; '.join(changes)} |")
        else:
            lines.append(row(recipe, out, changes, wall))
        print(lines[-1], flush=True)
        with open(os.path.join(args.out, "RESULTS.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
