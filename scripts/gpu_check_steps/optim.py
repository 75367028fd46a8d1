"""The optimizer/offload and reshard steps.

optim    tests/multiprocess/workers/offload_movers_worker.py on one rank (NCCL on CUDA): a tiny Qwen2 actor (bf16 /
         fp32, with and without the distributed optimizer) and the frozen reference through two PPO updates with
         param, grad and optimizer offload on, each next to a twin that never offloads (the worker asserts the same
         weights and optimizer states, the storages freed and the bytes the memory plan predicts); then the
         parameters with the distributed optimizer against the same updates with megatron's plain optimizer.
reshard  scripts/bench_reshard.py (TP2xPP2 -> rollout TP2, 4 local ranks over gloo on the device's tensors).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from gpu_check_steps import REPO, Context, child_env

# With and without the distributed optimizer on one rank the two updates are the same arithmetic element by element
# (the same gradients: one rank's reduce-scatter and all-reduce are copies; Adam elementwise; no clipping at
# grad_clip=1e9), and the worker runs CUDA in deterministic mode: any difference is a finding, not noise.
DISTOPT_BOUND = 0.0


def run_optim(ctx: Context) -> dict:
    from tripod.engine.data.tiny_models import make_tiny_hf_model
    hf_dir = make_tiny_hf_model(os.path.join(ctx.work, "offload"), "qwen2", seed=3, num_hidden_layers=2)
    worker = os.path.join(REPO, "tests", "multiprocess", "workers", "offload_movers_worker.py")
    env = child_env({"TRIPOD_DEVICE": ctx.device, "OMP_NUM_THREADS": "1",
                     "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})  # cuBLAS's deterministic workspace, before CUDA starts
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                           worker, hf_dir], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)

    def lines(tag: str) -> list[dict]:
        return [json.loads(ln[len(tag) + 1:]) for ln in proc.stdout.splitlines() if ln.startswith(tag + " ")]
    rows, distopt = lines("OFFLOAD"), lines("DISTOPT")
    if proc.returncode != 0 or len(rows) != 5 or len(distopt) != 2:
        raise RuntimeError("offload_movers_worker failed:\n" + proc.stdout[-4000:])
    if any(r["device"] != ctx.device for r in rows):
        raise RuntimeError(f"the movers ran on {[r['device'] for r in rows]}")
    far = [d for d in distopt if not d["max_abs_diff"] <= DISTOPT_BOUND]
    if far:
        raise RuntimeError(f"distributed optimizer vs plain: parameters differ (bound {DISTOPT_BOUND}): {far}")
    return {"offload": {r["case"]: {k: r[k] for k in ("released", "plan", "reload_checks", "twin_max_diff")}
                        for r in rows},
            "distopt_vs_plain": {d["dtype"]: d["max_abs_diff"] for d in distopt}, "distopt_bound": DISTOPT_BOUND}


def summary_optim(r: dict) -> str:
    off = r["offload"]
    freed = sum(sum(c["released"].values()) for c in off.values()) / 2 ** 20
    return (f"offload {len(off)} cases: {freed:.1f} MiB freed = plan, {sum(c['reload_checks'] for c in off.values())} "
            f"reloads bit for bit, max |offloaded - twin| {max(c['twin_max_diff'] for c in off.values()):.1e}; "
            "distopt vs plain max diff " + ", ".join(f"{k} {v:.1e}" for k, v in r["distopt_vs_plain"].items()))


def run_reshard(ctx: Context) -> dict:
    sizes = ["--hidden", "64", "--layers", "2", "--ffn", "128", "--vocab", "256", "--repeats", "1"] if ctx.dry else []
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_reshard.py"), "--json",
                           "--device", ctx.device, *sizes], cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not found:
        raise RuntimeError("bench_reshard failed:\n" + proc.stdout[-3000:])
    r = json.loads(found[-1])
    return {k: r[k] for k in ("layout", "device", "traffic_ratio", "peak_memory_ratio", "time_ratio")}


def summary_reshard(r: dict) -> str:
    lay = r["layout"]
    layout = f"TP{lay['tp']}xPP{lay['pp']}xDP{lay['dp']} -> rollout TP{lay['rollout_tp']}" if isinstance(lay, dict) else lay
    return (f"{layout} on {r['device']}: micro-DP gather vs naive traffic x{r['traffic_ratio']:.1f}, "
            f"peak x{r['peak_memory_ratio']:.1f}, time x{r['time_ratio']:.1f}")
