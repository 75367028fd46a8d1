"""The env and roofline steps: what the machine is (versions, device, driver, Transformer Engine, the layer spec and
the SDPA kernel that really ran in the actor's forward) and the ceilings the later numbers are read against
(bf16 matmul TFLOP/s and device copy GB/s, measured)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import time

from gpu_check_steps import Context

SDPA_PREFIX = "aten::_scaled_dot_product_"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def probe_attention(hf_dir: str, out_path: str) -> None:
    """On rank 0 of a one-rank world: build the actor's model as the trainer does (PolicyWorker), run one log-prob
    forward under torch.profiler and record the layer spec and the SDPA kernels (aten ops) that ran."""
    import json

    import torch

    from tripod.engine.data.tiny_ppo import random_ppo_batch
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.precision import PrecisionSettings
    from tripod.runtime.device import current_device

    arch = arch_from_hf(hf_dir)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    worker = PolicyWorker("probe", arch, ParallelLayout(tp=1, pp=1, name="probe", arch=arch), hf_dir,
                          trainable=False, precision=PrecisionSettings(param_dtype=dtype))
    batch = random_ppo_batch(arch.vocab_size, 4)[0].to(current_device())
    worker.compute_log_probs(batch, 2, 1.0)  # warm-up: first-call compilation stays out of the trace
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=activities) as prof:
        worker.compute_log_probs(batch, 2, 1.0)
    names = {e.name for e in prof.events()}
    sdpa = sorted(n[len(SDPA_PREFIX):] for n in names if n.startswith(SDPA_PREFIX))
    kernels = sorted(n for n in names if any(k in n.lower() for k in ("flash", "fmha", "cudnn_attn", "mem_eff")))[:6]
    attn = [(n, type(m)) for n, m in worker.model[0].named_modules() if n.endswith("core_attention")]
    qkv = [type(m) for n, m in worker.model[0].named_modules() if n.endswith("linear_qkv")]
    spec = {"core_attention": f"{attn[0][1].__module__}.{attn[0][1].__name__}" if attn else None,
            "linear_qkv": f"{qkv[0].__module__}.{qkv[0].__name__}" if qkv else None}
    spec["transformer_engine_layers"] = any("transformer_engine" in (v or "") for v in spec.values())
    with open(out_path, "w") as f:
        json.dump({"layer_spec": spec, "sdpa_ops": sdpa, "attention_kernels": kernels,
                   "sdpa_kernel": sdpa[0] if len(sdpa) == 1 else (", ".join(sdpa) or "none (not SDPA)")}, f)


def run_env(ctx: Context) -> dict:
    import json

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "triton": _version("triton"), "megatron_core": _version("megatron-core"),
           "transformers": _version("transformers"), "transformer_engine": _version("transformer-engine")
           or (_version("transformer_engine") if importlib.util.find_spec("transformer_engine") else None),
           "device": "cpu (dry run)", "memory_gb": None, "driver": None}
    import tripod
    out["tripod_from"] = os.path.dirname(os.path.abspath(tripod.__file__))  # the bundle's install, not the checkout
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, memory_gb=props.total_memory / 2 ** 30, driver=_driver(),
                   multiprocessors=props.multi_processor_count)
    elif not ctx.dry:
        raise RuntimeError("no CUDA device visible; run with --dry-run on a CPU machine")
    from tripod.engine.data.tiny_models import make_tiny_hf_model
    from tripod.engine.launch import run_distributed

    hf_dir = make_tiny_hf_model(os.path.join(ctx.work, "probe"), "qwen2", num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2)
    probe = os.path.join(ctx.work, "attention_probe.json")
    run_distributed(1, probe_attention, hf_dir, probe)
    with open(probe) as f:
        out.update(json.load(f))
    return out


def summary_env(r: dict) -> str:
    mem = f" {r['memory_gb']:.0f} GiB, driver {r['driver']}" if r.get("memory_gb") else ""
    return (f"{r['device']}{mem}; torch {r['torch']} CUDA {r['cuda']} Triton {r['triton']} megatron-core "
            f"{r['megatron_core']} transformers {r['transformers']} TE {r['transformer_engine'] or 'absent'}; "
            f"attention {(r['layer_spec']['core_attention'] or '?').rsplit('.', 1)[-1]}, SDPA {r['sdpa_kernel']}")


def _timed(fn, sync, min_s: float, reps: int = 3) -> float:
    """Seconds per call of `fn`: best of `reps` rounds, each at least `min_s` long (after one warm-up)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < min_s:
            fn()
            n += 1
        sync()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def run_roofline(ctx: Context) -> dict:
    import torch

    cuda = not ctx.dry
    dev, dtype = ctx.device, torch.bfloat16 if cuda else torch.float32
    n, elems = (8192, 1 << 28) if cuda else (256, 1 << 20)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    src = torch.randn(elems, device=dev)
    dst = torch.empty_like(src)
    t_mm = _timed(lambda: a @ a, sync, 0.2 if cuda else 0.02)
    t_cp = _timed(lambda: dst.copy_(src), sync, 0.2 if cuda else 0.02)
    return {"matmul_dtype": str(dtype).removeprefix("torch."), "matmul_n": n, "matmul_TFLOPs": 2 * n ** 3 / t_mm / 1e12,
            "copy_GBps": 2 * elems * 4 / t_cp / 1e9}


def summary_roofline(r: dict) -> str:
    return f"{r['matmul_dtype']} matmul {r['matmul_TFLOPs']:.3g} TFLOP/s, copy {r['copy_GBps']:.3g} GB/s"
