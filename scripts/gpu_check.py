"""The GPU check's driver (run by scripts/gpu_check.sh): every GPU claim of tripod in one run of a few minutes.

Steps, each timed and recorded (a failing step is recorded and the next one still runs):
  env        torch / Triton / CUDA versions, the device
  roofline   measured device copy (GB/s) and bf16 matmul (TFLOP/s): the ceilings the kernels are compared with
  kernels    each Triton kernel against its torch twin (correctness on fresh random inputs), then its GB/s or
             TFLOP/s (scripts/bench_kernels.py's GPU section) as a share of the ceilings
  ppo        three bf16 PPO steps (GAE critic, KL reference) of a small Qwen2-shaped model on one GPU with the embedded
             rollout engine, `tripod train ... trainer.device=cuda` under TRIPOD_CHECK_DEVICES=1 (every step fails on
             a tensor off the GPU)
  reshard    scripts/bench_reshard.py on CUDA tensors (4 local ranks over gloo on the one GPU: NCCL refuses two
             ranks per device)
  offload    engine/offload.py's movers on CUDA (tests/multiprocess/workers/offload_movers_worker.py, one rank on
             NCCL): two PPO steps of a tiny actor (bf16 / fp32, with and without the distributed optimizer) and the
             reference with every offload kind on; each kind on the host has freed its device storage, comes back
             bit for bit, and the weights and optimizer states after each update equal a twin's that never offloads
             (within twice the update's own run-to-run difference: 0 when it is deterministic)
Writes OUT/gpu_check.json and OUT/gpu_check.md. `--dry-run`: the same steps on CPU at tiny sizes (Triton through
its interpreter, fp32 roofline, one PPO step), so everything up to the first CUDA call is known to work.
`--steps offload,ppo` runs only those steps (a rerun of what failed).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]  # tests.helpers and the sibling scripts live in the checkout


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    return env


def step_env(dry: bool) -> dict:
    import torch
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    import megatron.core

    import tripod
    out["megatron_core"] = megatron.core.__version__
    out["tripod"] = os.path.dirname(os.path.abspath(tripod.__file__))  # the bundle's install, not the checkout
    if not dry and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible; run with --dry-run on a CPU machine")
    return out


def step_roofline(dry: bool) -> dict:
    import torch
    from bench_kernels import cuda_time
    if dry:  # the same two measurements on the host, tiny
        a, src = torch.randn(256, 256), torch.randn(1 << 20)
        dst = torch.empty_like(src)
        t0 = time.perf_counter(); a @ a; t_mm = time.perf_counter() - t0  # noqa: E702
        t0 = time.perf_counter(); dst.copy_(src); t_cp = time.perf_counter() - t0  # noqa: E702
        return {"matmul_TFLOPs(fp32,cpu)": 2 * 256 ** 3 / t_mm / 1e12, "copy_GBps(cpu)": 2 * src.numel() * 4 / t_cp / 1e9}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    return {"bf16_matmul_TFLOPs": 2 * 8192 ** 3 / cuda_time(lambda: a @ a) / 1e12,
            "copy_GBps": 2 * src.numel() * 4 / cuda_time(lambda: dst.copy_(src)) / 1e9}


def step_kernels(dry: bool) -> dict:
    import torch

    import tripod.kernels as kernels
    dev = "cpu" if dry else "cuda"
    g = torch.Generator(device=dev).manual_seed(7)
    n_rows, n_cols = (4, 64) if dry else (64, 4096)
    x = [torch.randn(n_rows, n_cols, device=dev, generator=g) * 0.1 for _ in range(3)]
    mask = (torch.rand(n_rows, n_cols, device=dev, generator=g) > 0.1).float()
    checks = {
        "gae": lambda be: kernels.gae(x[0], x[1], mask, 0.99, 0.95, backend=be),
        "kl(k3)": lambda be: kernels.kl(x[0], x[1], "k3", backend=be),
        "policy_loss": lambda be: kernels.policy_loss_per_token(x[0], x[1], x[2], backend=be),
        "value_loss": lambda be: kernels.value_loss_per_token(x[0], x[1], x[2], backend=be),
    }
    tokens, vocab, hid = (16, 96, 32) if dry else (1024, 32000, 896)
    h = torch.randn(tokens, hid, device=dev, generator=g)
    w = torch.randn(vocab, hid, device=dev, generator=g) / hid ** 0.5
    labels = torch.randint(0, vocab, (tokens,), device=dev, generator=g)
    checks["logprobs_from_hidden"] = lambda be: kernels.logprobs_from_hidden(h, w, labels, backend=be)
    rows = []
    for name, fn in checks.items():
        tri, ref = fn("triton"), fn("torch")
        tri, ref = (tri if isinstance(tri, tuple) else (tri,)), (ref if isinstance(ref, tuple) else (ref,))
        err = max(((a.float() - b.float()).abs().max().item() for a, b in zip(tri, ref) if a is not None), default=0.0)
        scale = max((b.float().abs().max().item() for b in ref if b is not None), default=1.0)
        ok = err <= 1e-4 * max(1.0, scale)  # fp32 on both sides: a few ulps of reduction-order difference
        rows.append({"kernel": name, "max_abs_err": err, "ok": ok})
    out = {"correctness": rows}
    if not all(r["ok"] for r in rows):
        raise RuntimeError(f"Triton kernels disagree with their torch twins: {rows}")
    if not dry:
        from bench_kernels import bench_gpu
        out["performance"] = bench_gpu(quick=False)
    return out


def step_ppo(dry: bool, workdir: str) -> dict:
    from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
    size = {} if dry else dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    setup = make_ppo_setup(workdir, data_suffix=".jsonl", **size)  # JSON lines: the bundle has no pyarrow
    run_dir = os.path.join(workdir, "run")
    steps = 1 if dry else 3
    args = tiny_overrides(setup, run_dir, steps=steps) + [
        f"trainer.device={'cpu' if dry else 'cuda'}", "trainer.val_before_train=false", "data.val_files=[]",
        "actor_rollout_ref.actor.megatron.param_dtype=bf16", "trainer.logger=[jsonl]"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tripod", "train", "recipes/defaults.yaml", *args], cwd=REPO,
                          env=_env({"TRIPOD_CHECK_DEVICES": "1", "OMP_NUM_THREADS": "1"}), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=420)
    if proc.returncode != 0:
        raise RuntimeError("tripod train failed:\n" + proc.stdout[-4000:])
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    checked = proc.stdout.count("DEVICE_CHECK")
    if checked != steps:
        raise RuntimeError(f"expected {steps} device-checked steps, saw {checked}")
    keys = ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "timing_s/step", "timing_s/gen")
    return {"steps": steps, "seconds": time.perf_counter() - t0, "device_checked_steps": checked,
            "per_step": [{k: m.get(k) for k in keys} for m in metrics if m.get("step", 0) > 0]}


def step_reshard(dry: bool) -> dict:
    sizes = ["--hidden", "64", "--layers", "2", "--ffn", "128", "--vocab", "256", "--repeats", "1"] if dry else []
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_reshard.py"), "--json",
                           "--device", "cpu" if dry else "cuda", *sizes], cwd=REPO, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError("bench_reshard failed:\n" + proc.stdout[-3000:])
    r = json.loads(lines[-1])
    return {k: r[k] for k in ("layout", "device", "traffic_ratio", "peak_memory_ratio", "time_ratio")}


def step_offload(dry: bool, workdir: str) -> dict:
    from tests.helpers.common import make_tiny_hf_model
    hf_dir = make_tiny_hf_model(os.path.join(workdir, "offload"), "qwen2", seed=3, num_hidden_layers=2)
    worker = os.path.join(REPO, "tests", "multiprocess", "workers", "offload_movers_worker.py")
    env = _env({"TRIPOD_DEVICE": "cpu" if dry else "cuda", "OMP_NUM_THREADS": "1",
                "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})  # cuBLAS's deterministic workspace, before CUDA starts
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                           worker, hf_dir], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    rows = [json.loads(line[len("OFFLOAD "):]) for line in proc.stdout.splitlines() if line.startswith("OFFLOAD ")]
    if proc.returncode != 0 or len(rows) != 5:
        raise RuntimeError("offload_movers_worker failed:\n" + proc.stdout[-4000:])
    if any(r["device"] != ("cpu" if dry else "cuda") for r in rows):
        raise RuntimeError(f"the movers ran on {[r['device'] for r in rows]}")
    return {r["case"]: {k: r[k] for k in ("released", "plan", "reload_checks", "twin_max_diff")} for r in rows}


def markdown(result: dict) -> str:
    lines = [f"# GPU check ({'dry run on CPU' if result['dry_run'] else 'CUDA'}), {result['date']}", "",
             "| step | ok | seconds | summary |", "|---|---|---|---|"]
    for name, s in result["steps"].items():
        summary = s.get("error", "").splitlines()[0][:120] if not s["ok"] else json.dumps(s["result"])[:300]
        lines.append(f"| {name} | {'yes' if s['ok'] else 'NO'} | {s['seconds']:.1f} | {summary.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: everything up to the first CUDA call")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "gpu_check"), help="folder for the JSON + markdown")
    p.add_argument("--steps", default=None, help="comma-separated steps to run (default: all)")
    args = p.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # Triton kernels through the interpreter on CPU tensors
    os.makedirs(args.out, exist_ok=True)
    result = {"dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "steps": {}}
    with tempfile.TemporaryDirectory(prefix="tripod-gpu-check-") as work:
        steps = [("env", lambda: step_env(args.dry_run)), ("roofline", lambda: step_roofline(args.dry_run)),
                 ("kernels", lambda: step_kernels(args.dry_run)), ("ppo", lambda: step_ppo(args.dry_run, work)),
                 ("reshard", lambda: step_reshard(args.dry_run)), ("offload", lambda: step_offload(args.dry_run, work))]
        wanted = args.steps.split(",") if args.steps else [name for name, _ in steps]
        unknown = set(wanted) - {name for name, _ in steps}
        if unknown:
            p.error(f"--steps: unknown {sorted(unknown)}; the steps are {[name for name, _ in steps]}")
        for name, fn in (step for step in steps if step[0] in wanted):
            t0 = time.perf_counter()
            try:
                result["steps"][name] = {"ok": True, "result": fn()}
            except Exception as e:  # recorded; the other steps still run
                result["steps"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                         "traceback": traceback.format_exc()}
            result["steps"][name]["seconds"] = time.perf_counter() - t0
            print(f"gpu_check: {name:<8} {'ok' if result['steps'][name]['ok'] else 'FAILED'} "
                  f"({result['steps'][name]['seconds']:.1f} s)", flush=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(markdown(result))
    print(markdown(result))
    return 0 if all(s["ok"] for s in result["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
