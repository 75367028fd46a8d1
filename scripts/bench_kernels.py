"""Benchmark of tripod's fused RLHF kernels against the eager code they replace.

Sections (all ratios measured side by side in one run):
  gae       kernels.gae (vectorised torch twin) vs the per-token Python loop verl/OpenRLHF use.
  logprobs  kernels.logprobs_from_hidden vs log_softmax on full [tokens, vocab] logits,
            forward+backward: wall time and peak memory. Each method runs in a fresh
            subprocess; peak = kernel-level RSS high-water (VmHWM, reset via /proc/self/clear_refs)
            minus the RSS once the inputs exist, so torch allocations are all seen.
  gpu       (CUDA only) each Triton kernel vs eager torch, achieved GB/s or TFLOP/s against a
            bf16 matmul and a device copy measured in the same run.

Usage: python scripts/bench_kernels.py [--quick] [--json] [--dtype fp32|bf16] [--hidden 896]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tripod.runtime.memory import peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------- GAE
def gae_python_loop(rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return loop (multi-turn form: masked tokens pass through)."""
    next_values = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    reversed_advantages = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        new_gae = delta + gamma * lam * last_gae
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last_gae = new_gae * mask[:, t] + (1 - mask[:, t]) * last_gae
        reversed_advantages.append(last_gae)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    return advantages, advantages + values


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_gae(quick: bool) -> dict:
    try:
        from tripod.kernels.gae_scan import gae
    except ImportError as err:
        return {"skipped": f"tripod.kernels.gae not importable ({err}); the loop baseline alone is not a ratio"}
    batch, gamma, lam = 8, 0.99, 0.95
    rows = []
    for T in ([256, 1024] if quick else [1024, 4096, 16384]):
        gen = torch.Generator().manual_seed(T)
        rewards, values = torch.randn(batch, T, generator=gen), torch.randn(batch, T, generator=gen)
        mask = (torch.rand(batch, T, generator=gen) > 0.1).float()  # holes = tool tokens
        loop_adv, _ = gae_python_loop(rewards, values, mask, gamma, lam)
        fused_adv, _ = gae(rewards, values, mask, gamma, lam, backend="torch")
        counted = mask.bool()
        max_diff = (loop_adv - fused_adv)[counted].abs().max().item()
        t_loop = best_time(lambda: gae_python_loop(rewards, values, mask, gamma, lam), 1 if T > 4096 else 3)
        t_fused = best_time(lambda: gae(rewards, values, mask, gamma, lam, backend="torch"), 10)
        rows.append({"T": T, "batch": batch, "loop_ms": t_loop * 1e3, "gae_ms": t_fused * 1e3,
                     "speedup": t_loop / t_fused, "max_abs_diff": max_diff})
    return {"rows": rows, "dtype": "fp32", "device": "cpu"}


# ----------------------------------------------------------------------------- log-probs
def _full_logits_loss(h, w, labels, g_logp, g_ent):
    """The path being replaced: materialise [tokens, vocab] logits, log_softmax, gather, entropy."""
    log_p = torch.log_softmax((h @ w.T).float(), dim=-1)
    logp = log_p.gather(-1, labels[:, None])[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    return (logp * g_logp).sum() + (entropy * g_ent).sum()


def _fused_loss(h, w, labels, g_logp, g_ent):
    from tripod.kernels.logprobs import logprobs_from_hidden
    logp, entropy = logprobs_from_hidden(h, w, labels, backend="torch")
    return (logp * g_logp).sum() + (entropy * g_ent).sum()


def logprobs_child(method: str, tokens: int, vocab: int, hidden: int, dtype: str) -> dict:
    """One method, fwd+bwd, in this (fresh) process: time and RSS high-water above the inputs."""
    loss_fn = {"full": _full_logits_loss, "fused": _fused_loss}[method]
    gen = torch.Generator().manual_seed(0)
    small = [torch.randn(64, hidden, generator=gen), torch.randn(1000, hidden, generator=gen)]
    small = [t.to(DTYPES[dtype]).requires_grad_() for t in small]  # warm-up: load kernels, thread pool
    loss_fn(*small, torch.randint(0, 1000, (64,)), torch.ones(64), torch.ones(64)).backward()
    h = torch.randn(tokens, hidden, generator=gen).to(DTYPES[dtype]).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5).to(DTYPES[dtype]).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    g_logp, g_ent = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)
    reset_peak_rss()
    base_kib = rss_bytes() / 1024
    start = time.perf_counter()
    loss_fn(h, w, labels, g_logp, g_ent).backward()
    elapsed = time.perf_counter() - start
    peak_kib = peak_rss_bytes() / 1024
    return {"method": method, "seconds": elapsed, "peak_above_inputs_mib": (peak_kib - base_kib) / 1024,
            "peak_rss_mib": peak_kib / 1024, "input_and_param_mib": base_kib / 1024,
            "grad_norm_h": h.grad.float().norm().item()}


def bench_logprobs(quick: bool, dtype: str, hidden: int, repeats: int, tokens: int) -> dict:
    tokens, vocab = (512, 32000) if quick else (tokens, 151936)
    runs: dict[str, list[dict]] = {"fused": [], "full": []}
    for _ in range(repeats):  # interleaved so both see the same machine load
        for method in ("fused", "full"):
            cmd = [sys.executable, os.path.abspath(__file__), "--_logprobs-child", method, "--tokens",
                   str(tokens), "--vocab", str(vocab), "--hidden", str(hidden), "--dtype", dtype]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if out.returncode != 0:  # e.g. the full-logits path killed by the OOM killer
                return {"tokens": tokens, "vocab": vocab, "hidden": hidden, "dtype": dtype,
                        "failed": f"{method} child exited with {out.returncode} "
                                  f"({'SIGKILL, likely OOM' if out.returncode == -9 else out.stderr[-500:]})",
                        "completed_runs": runs}
            runs[method].append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = {m: min(r, key=lambda x: x["seconds"]) for m, r in runs.items()}
    peak = {m: max(x["peak_above_inputs_mib"] for x in r) for m, r in runs.items()}
    grad_rel = abs(best["fused"]["grad_norm_h"] - best["full"]["grad_norm_h"]) / best["full"]["grad_norm_h"]
    return {"tokens": tokens, "vocab": vocab, "hidden": hidden, "dtype": dtype, "device": "cpu",
            "threads": torch.get_num_threads(), "repeats": repeats,
            "fused_s": best["fused"]["seconds"], "full_s": best["full"]["seconds"],
            "time_ratio": best["fused"]["seconds"] / best["full"]["seconds"],
            "fused_peak_mib": peak["fused"], "full_peak_mib": peak["full"],
            "memory_ratio": peak["fused"] / peak["full"], "grad_h_norm_rel_diff": grad_rel,
            "all_runs": runs}


# ----------------------------------------------------------------------------- GPU
def cuda_time(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def bench_gpu(quick: bool) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: Triton-vs-eager GPU numbers not measured"}
    import tripod.kernels as kernels
    dev, n = "cuda", (1 << 20) if quick else (1 << 24)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ceil_tflops = 2 * 8192 ** 3 / cuda_time(lambda a=a: a @ a) / 1e12
    src = torch.randn(1 << 28, device=dev)
    dst = torch.empty_like(src)
    ceil_gbs = 2 * src.numel() * 4 / cuda_time(lambda src=src, dst=dst: dst.copy_(src)) / 1e9
    del a, src, dst
    rows = []
    x = [torch.randn(8, n // 8, device=dev) * 0.1 for _ in range(3)]
    mask = (torch.rand(8, n // 8, device=dev) > 0.1).float()
    elementwise = {
        "gae": (lambda be: kernels.gae(x[0], x[1], mask, 0.99, 0.95, backend=be), 4 * 4 + 2 * 4),
        "kl(k3)": (lambda be: kernels.kl(x[0], x[1], "k3", backend=be), 2 * 4 + 4),
        "policy_loss": (lambda be: kernels.policy_loss_per_token(x[0], x[1], x[2], backend=be), 3 * 4 + 3 * 4),
        "value_loss": (lambda be: kernels.value_loss_per_token(x[0], x[1], x[2], backend=be), 3 * 4 + 2 * 4),
    }
    for name, (fn, bytes_per_elem) in elementwise.items():
        t_tri, t_eager = cuda_time(lambda: fn("triton")), cuda_time(lambda: fn("torch"))
        rows.append({"kernel": name, "triton_ms": t_tri * 1e3, "eager_ms": t_eager * 1e3,
                     "speedup": t_eager / t_tri, "triton_GBps": bytes_per_elem * n / t_tri / 1e9,
                     "pct_of_copy": 100 * bytes_per_elem * n / t_tri / 1e9 / ceil_gbs})
    tokens, vocab, hid = (1024, 32000, 896) if quick else (4096, 151936, 896)
    h = torch.randn(tokens, hid, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hid, device=dev) / hid ** 0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=dev)
    g = torch.randn(tokens, device=dev)

    def fused(be):
        logp, ent = kernels.logprobs_from_hidden(h, w, labels, backend=be)
        ((logp + ent) * g).sum().backward()

    t_fused = cuda_time(lambda: fused("triton"), 5)
    t_full = cuda_time(lambda: _full_logits_loss(h, w, labels, g, g).backward(), 5)
    flops = 4 * 2 * tokens * vocab * hid  # fwd + recompute + two backward matmuls
    rows.append({"kernel": "logprobs_from_hidden fwd+bwd (bf16)", "triton_ms": t_fused * 1e3,
                 "eager_ms": t_full * 1e3, "speedup": t_full / t_fused,
                 "triton_TFLOPs": flops / t_fused / 1e12,
                 "pct_of_matmul": 100 * flops / t_fused / 1e12 / ceil_tflops})
    return {"device": torch.cuda.get_device_name(), "bf16_matmul_TFLOPs": ceil_tflops,
            "copy_GBps": ceil_gbs, "rows": rows}


# ----------------------------------------------------------------------------- report
def print_table(result: dict) -> None:
    print(f"# tripod kernel bench  ({result['machine']}, torch {result['torch']})")
    gae = result["gae"]
    print("\n## GAE: kernels.gae (torch twin) vs per-token Python loop")
    if "skipped" in gae:
        print("skipped:", gae["skipped"])
    else:
        print(f"{'T':>6} {'batch':>5} {'loop ms':>10} {'gae ms':>9} {'speedup':>8} {'max|diff|':>10}")
        for r in gae["rows"]:
            print(f"{r['T']:>6} {r['batch']:>5} {r['loop_ms']:>10.2f} {r['gae_ms']:>9.3f} "
                  f"{r['speedup']:>7.1f}x {r['max_abs_diff']:>10.2e}")
    lp = result["logprobs"]
    if "failed" in lp:
        print(f"\n## log-prob + entropy at {lp['tokens']} x {lp['vocab']}: FAILED: {lp['failed']}")
        print(json.dumps(lp["completed_runs"]))
        lp = None
    if lp:
        print(f"\n## log-prob + entropy, fwd+bwd: {lp['tokens']} tokens x {lp['vocab']} vocab, H={lp['hidden']}, "
          f"{lp['dtype']}, CPU {lp['threads']} threads, best of {lp['repeats']}")
        print(f"{'method':>28} {'time s':>8} {'peak MiB above inputs':>22}")
        print(f"{'full logits + log_softmax':>28} {lp['full_s']:>8.2f} {lp['full_peak_mib']:>22.0f}")
        print(f"{'logprobs_from_hidden':>28} {lp['fused_s']:>8.2f} {lp['fused_peak_mib']:>22.0f}")
        print(f"time ratio {lp['time_ratio']:.2f}x, memory ratio {lp['memory_ratio']:.3f} "
              f"(1/{1 / lp['memory_ratio']:.1f}), |grad h| rel diff {lp['grad_h_norm_rel_diff']:.1e}")
    gpu = result["gpu"]
    print("\n## GPU: Triton vs eager torch")
    if "skipped" in gpu:
        print("skipped:", gpu["skipped"])
    else:
        print(f"{gpu['device']}: bf16 matmul {gpu['bf16_matmul_TFLOPs']:.0f} TFLOP/s, copy {gpu['copy_GBps']:.0f} GB/s")
        for r in gpu["rows"]:
            extra = (f"{r['triton_GBps']:.0f} GB/s ({r['pct_of_copy']:.0f}% of copy)" if "triton_GBps" in r
                     else f"{r['triton_TFLOPs']:.0f} TFLOP/s ({r['pct_of_matmul']:.0f}% of matmul)")
            print(f"{r['kernel']:>40} triton {r['triton_ms']:.3f} ms  eager {r['eager_ms']:.3f} ms  "
                  f"{r['speedup']:.2f}x  {extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="log-prob bench dtype")
    parser.add_argument("--hidden", type=int, default=896, help="log-prob bench hidden size")
    parser.add_argument("--repeats", type=int, default=2, help="log-prob runs per method (best time)")
    parser.add_argument("--_logprobs-child", dest="child", choices=["full", "fused"], help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=4096, help="log-prob bench tokens (vocab 151936)")
    parser.add_argument("--vocab", type=int, default=151936, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(logprobs_child(args.child, args.tokens, args.vocab, args.hidden, args.dtype)))
        return
    result = {"machine": f"{platform.machine()} {os.cpu_count()}-core CPU", "torch": torch.__version__,
              "gae": bench_gae(args.quick),
              "logprobs": bench_logprobs(args.quick, args.dtype, args.hidden, args.repeats, args.tokens),
              "gpu": bench_gpu(args.quick)}
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
