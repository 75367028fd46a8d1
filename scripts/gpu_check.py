"""The GPU check's driver (run by scripts/gpu_check.sh; docs/gpu_check.md says what each printed line means).

Runs the steps of gpu_check_steps/schema.py in order, each in a process of its own under its time cap (a hang or a
crash costs that step only: it is recorded with the end of its output and the next one runs), prints one line per
step and writes OUT/gpu_check.json after every step (OUT: --out, else $OUT when set, else bench/gpu_check/), then
OUT/gpu_check.md and the verdict: PASS when every step passed and carries its numbers (schema.problems).
`--dry-run`: the same steps on CPU at tiny sizes (Triton through its interpreter). `--steps ppo,optim` reruns those.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from gpu_check_steps import Context, child_env  # noqa: E402
from gpu_check_steps.schema import BY_NAME, STEPS, problems  # noqa: E402


def _resolve(spec: str):
    module, fn = spec.split(":")
    return getattr(importlib.import_module(f"gpu_check_steps.{module}"), fn)


def run_one(name: str, ctx: Context, out_path: str) -> int:
    """The child side: run one step, write {"ok", "result"|"error"} to `out_path`."""
    try:
        doc = {"ok": True, "result": _resolve(BY_NAME[name].run)(ctx)}
    except Exception as e:  # recorded; the driver goes on with the next step
        doc = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(out_path, "w") as f:
        json.dump(doc, f, default=str)
    return 0 if doc["ok"] else 1


def launch(name: str, ctx: Context, cap: int, log_path: str) -> dict:
    """The driver side: the step in its own process group, killed whole at its cap."""
    out_path = log_path + ".json"
    cmd = [sys.executable, os.path.abspath(__file__), "--one-step", name, "--work", ctx.work,
           "--results", ctx.results_path, "--step-out", out_path] + (["--dry-run"] if ctx.dry else [])
    env = child_env({"TRIPOD_DEVICE": ctx.device, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
                    | ({"TRITON_INTERPRET": "1"} if ctx.dry else {}))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(log_path, errors="replace") as f:
        tail = f.read()[-3000:]
    try:
        with open(out_path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        reason = f"timed out after {cap} s (its cap)" if proc.returncode == -signal.SIGKILL else \
            f"exited {proc.returncode} without a result"
        doc = {"ok": False, "error": reason}
    if not doc["ok"]:
        doc["log_tail"] = tail
    return doc


def _write(doc: dict, out: str) -> None:
    tmp = os.path.join(out, ".gpu_check.json.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, os.path.join(out, "gpu_check.json"))


def markdown(doc: dict) -> str:
    lines = [f"# GPU check ({'dry run on CPU' if doc['dry_run'] else 'CUDA'}), {doc['date']}: {doc.get('verdict')}",
             "", "| step | ok | seconds (cap) | line |", "|---|---|---|---|"]
    for name, s in doc["steps"].items():
        lines.append(f"| {name} | {'yes' if s['ok'] else 'NO'} | {s['seconds']:.1f} ({s['cap_s']}) | "
                     f"{s.get('line', '').replace('|', '/')} |")
    return "\n".join(lines + ["", f"total {doc.get('total_s', 0):.1f} s"]) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, every step")
    p.add_argument("--out", default=None, help="folder for gpu_check.json/.md (default $OUT, else bench/gpu_check)")
    p.add_argument("--steps", default=None, help=f"comma-separated steps (default all: {[s.name for s in STEPS]})")
    p.add_argument("--one-step", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    p.add_argument("--step-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one_step:
        return run_one(args.one_step, Context(args.dry_run, args.work, args.results), args.step_out)
    wanted = args.steps.split(",") if args.steps else [s.name for s in STEPS]
    unknown = [w for w in wanted if w not in BY_NAME]
    if unknown:
        p.error(f"--steps: unknown {unknown}; the steps are {[s.name for s in STEPS]}")
    out = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "bench", "gpu_check")
    os.makedirs(out, exist_ok=True)
    start = time.perf_counter()
    doc = {"dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "steps": {},
           "caps_s": {s.name: (s.dry_cap_s if args.dry_run else s.cap_s) for s in STEPS if s.name in wanted}}
    results = os.path.join(out, "gpu_check.json")
    _write(doc, out)
    with tempfile.TemporaryDirectory(prefix="tripod-gpu-check-") as work:
        ctx = Context(args.dry_run, work, results)
        for step in (s for s in STEPS if s.name in wanted):
            cap, t0 = doc["caps_s"][step.name], time.perf_counter()
            s = launch(step.name, ctx, cap, os.path.join(work, f"{step.name}.log"))
            s.update(seconds=time.perf_counter() - t0, cap_s=cap)
            try:
                s["line"] = _resolve(step.summary)(s["result"]) if s["ok"] else s["error"].splitlines()[0][:300]
            except Exception as e:  # a result without a field the line needs: the schema check names it
                s["line"] = f"(no summary: {type(e).__name__}: {e})"
            doc["steps"][step.name] = s
            doc["total_s"] = time.perf_counter() - start
            _write(doc, out)
            print(f"gpu_check: {step.name:<11} {'ok' if s['ok'] else 'FAILED':<6} {s['seconds']:5.1f}/{cap} s  "
                  f"{s['line']}", flush=True)
    doc["problems"] = problems(doc, wanted)
    doc["verdict"] = "FAIL" if doc["problems"] else "PASS"
    doc["total_s"] = time.perf_counter() - start
    _write(doc, out)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(markdown(doc))
    for line in doc["problems"]:
        print(f"gpu_check: problem: {line}", flush=True)
    passed = [n for n in wanted if not any(x.startswith(n + ":") for x in doc["problems"])]
    print(f"gpu_check: total {doc['total_s']:.1f} s  {doc['verdict']} ({len(passed)}/{len(wanted)} steps) -> "
          f"{results}", flush=True)
    return 0 if doc["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
