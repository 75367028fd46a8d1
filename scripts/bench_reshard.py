#!/usr/bin/env python
"""Benchmark: tripod's micro-DP resharding vs. the naive full all-gather on every rank, side by side in one run.

    python scripts/bench_reshard.py                       # train TP2xPP2 -> rollout TP2 on 4 local gloo ranks
    python scripts/bench_reshard.py --tp 2 --pp 2 --dp 2 --rollout-tp 1 --json

Re-launches itself under torchrun when not already inside one. For each method it reports bytes received per rank
(counted at the collectives), peak extra memory per rank (RSS high-water mark on CPU, the allocator's peak on CUDA)
and seconds (median of --repeats), and the ratios. The model is random (Qwen2-shaped, sizes from the flags): the
transport does not care what the numbers are.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--rollout-tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--bucket-mb", type=float, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the shards live; cuda: every rank on GPU LOCAL_RANK %% device_count, collectives over "
                        "gloo (NCCL refuses two ranks on one GPU), peak memory from the CUDA allocator")
    return p.parse_args()


def launch_self(args: argparse.Namespace) -> int:
    n = args.tp * args.pp * args.dp
    env = dict(os.environ, OMP_NUM_THREADS="1", THP_MEM_ALLOC_ENABLE="0")  # RSS against the plan: no 2 MB pages
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *sys.argv]
    return subprocess.call(cmd, env=env)


def training_groups(plan):
    """The training TP group and PP group (with its ranks in stage order) of this rank."""
    me, tp_group, pp_group, pp_ranks = dist.get_rank(), None, None, None
    t, p, d = plan.tp, plan.pp, plan.dp
    for pp_rank in range(p):
        for dp_rank in range(d):
            ranks = [r + t * (dp_rank + d * pp_rank) for r in range(t)]
            g = dist.new_group(ranks)
            if me in ranks:
                tp_group = g
    for dp_rank in range(d):
        for tp_rank in range(t):
            ranks = [tp_rank + t * (dp_rank + d * s) for s in range(p)]
            g = dist.new_group(ranks)
            if me in ranks:
                pp_group, pp_ranks = g, ranks
    return tp_group, pp_group, pp_ranks


def run(args: argparse.Namespace) -> None:
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.hybrid_engine import MicroDPGather, TransferStats, build_reshard_plan, naive_full_gather
    from tripod.parallel.hybrid_engine.plan import local_shape
    from tripod.runtime.memory import measure_peak_memory

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo")
    me, world = dist.get_rank(), dist.get_world_size()
    heads = max(8, args.hidden // 128)
    arch = arch_from_hf(dict(model_type="qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                             intermediate_size=args.ffn, num_hidden_layers=args.layers, num_attention_heads=heads,
                             num_key_value_heads=heads // 4 or 1, head_dim=args.hidden // heads))
    plan = build_reshard_plan(arch, args.tp, args.pp, args.dp, args.rollout_tp,
                              bucket_bytes=int(args.bucket_mb * (1 << 20)), world_size=world)
    g = torch.Generator().manual_seed(1000 + me)
    shard = {s.name: torch.randn(local_shape(s, plan.tp), generator=g).to(device) for s in plan.owned_specs(me)}
    gather = MicroDPGather(plan)
    tp_group, pp_group, pp_ranks = training_groups(plan)

    def tripod():
        gather.stats = TransferStats()
        return gather.gather(shard), gather.stats

    def naive():
        stats = TransferStats()
        return naive_full_gather(plan, shard, tp_group, pp_group, pp_ranks, stats), stats

    results = {}
    for name, fn in (("tripod", tripod), ("naive", naive)):
        seconds, peaks = [], []
        for _ in range(args.repeats):
            dist.barrier()
            with measure_peak_memory(device) as mem:
                t0 = time.perf_counter()
                gen, stats = fn()
                dist.barrier()
                seconds.append(time.perf_counter() - t0)
            peaks.append(mem.extra_bytes)
            del gen
        local = torch.tensor([stats.bytes_received, max(peaks), statistics.median(seconds)], dtype=torch.float64)
        everyone = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(everyone, local)
        results[name] = dict(
            bytes_received_per_rank=[int(x[0]) for x in everyone],
            peak_extra_bytes_per_rank=[int(x[1]) for x in everyone],
            seconds=max(float(x[2]) for x in everyone),
        )
    if me == 0:
        report(plan, results, args.json, f"{device.type}/gloo")
    dist.destroy_process_group()


def report(plan, results: dict, as_json: bool, device: str = "cpu/gloo") -> None:
    def worst(name, key):
        return max(results[name][key])
    summary = dict(
        layout=dict(tp=plan.tp, pp=plan.pp, dp=plan.dp, rollout_tp=plan.rollout_tp),
        model_bytes=plan.model_bytes(), generation_shard_bytes=plan.generation_shard_bytes(),
        bucket_bytes=plan.bucket_bytes, plan_bytes_received_per_rank=[plan.bytes_received(r)
                                                                      for r in range(plan.world_size)],
        paper_bytes_received=plan.bytes_received_ideal(), methods=results,
        traffic_ratio=worst("naive", "bytes_received_per_rank") / max(1, worst("tripod", "bytes_received_per_rank")),
        peak_memory_ratio=worst("naive", "peak_extra_bytes_per_rank") / max(1, worst("tripod",
                                                                                    "peak_extra_bytes_per_rank")),
        time_ratio=results["naive"]["seconds"] / max(1e-9, results["tripod"]["seconds"]),
        device=device,
    )
    if as_json:
        print(json.dumps(summary))
        return
    mb = 1 << 20
    print(plan.describe())
    print(f"\n{'method':<8} {'max recv MiB/rank':>18} {'max peak extra MiB/rank':>24} {'seconds':>9}")
    for name in ("tripod", "naive"):
        r = results[name]
        print(f"{name:<8} {max(r['bytes_received_per_rank']) / mb:>18.1f} "
              f"{max(r['peak_extra_bytes_per_rank']) / mb:>24.1f} {r['seconds']:>9.3f}")
    print(f"\nnaive/tripod: traffic {summary['traffic_ratio']:.2f}x, peak memory {summary['peak_memory_ratio']:.2f}x, "
          f"time {summary['time_ratio']:.2f}x")


if __name__ == "__main__":
    arguments = parse_args()
    if "RANK" not in os.environ:
        sys.exit(launch_self(arguments))
    run(arguments)
