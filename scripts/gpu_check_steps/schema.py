"""The GPU check's steps in order, each with its time cap and the fields a passing result carries, and the check of
a whole result file (`problems`): every step present and ok, every required number finite, the verdict consistent.
The driver (scripts/gpu_check.py) decides PASS/FAIL with it; the CI dry run (tests/multiprocess/test_gpu_check.py)
checks its JSON with it."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    name: str
    run: str
    """module:function of gpu_check_steps run in the step's own process."""
    summary: str
    cap_s: int
    """Seconds on one H200: the caps add up to 455 s, 8 minutes with the offline install (~20 s)."""
    dry_cap_s: int
    """Seconds on a loaded 2-core CPU at the dry run's tiny sizes."""
    numbers: tuple[str, ...]
    """Dotted paths into the result that must hold finite numbers."""


STEPS = (
    Step("env", "system:run_env", "system:summary_env", 25, 240, ()),
    Step("roofline", "system:run_roofline", "system:summary_roofline", 15, 60, ("matmul_TFLOPs", "copy_GBps")),
    Step("kernels", "kernels:run", "kernels:summary", 70, 300,
         ("logprobs.max_abs_err", "logprobs.fused_TFLOPs", "logprobs.full_logits_TFLOPs", "logprobs.fused_peak_MiB",
          "logprobs.full_logits_peak_MiB", "elementwise.*.max_abs_err", "elementwise.*.triton_GBps",
          "elementwise.*.pct_of_copy")),
    Step("ppo_guarded", "ppo:run_guarded", "ppo:summary_guarded", 75, 400, ("device_checked_steps", "ops_off_device")),
    Step("ppo", "ppo:run_real", "ppo:summary_real", 180, 480,
         ("stages_s.gen", "stages_s.update_actor", "stages_s.step", "decode_tokens_per_s", "throughput_tokens_per_s",
          "mfu_actor_spec", "mfu_actor_measured", "max_allocated_gb", "max_reserved_gb", "plan_peak_gb",
          "checkpoint_s", "checkpoint_gb")),
    Step("reshard", "optim:run_reshard", "optim:summary_reshard", 30, 300,
         ("traffic_ratio", "peak_memory_ratio", "time_ratio")),
    Step("optim", "optim:run_optim", "optim:summary_optim", 60, 400,
         ("distopt_vs_plain.bf16", "distopt_vs_plain.fp32", "offload.*.twin_max_diff")),
)
BY_NAME = {s.name: s for s in STEPS}


def _values(tree, path: list[str]) -> list:
    if not path:
        return [tree]
    head, rest = path[0], path[1:]
    if head == "*":
        items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else []
        found = [v for item in items for v in _values(item, rest)]
        return found or [None]
    return _values(tree.get(head) if isinstance(tree, dict) else None, rest)


def problems(doc: dict, wanted: list[str] | None = None) -> list[str]:
    """Everything wrong with a gpu_check.json (empty: PASS). `wanted`: the steps that were asked for."""
    out = []
    for name in wanted or [s.name for s in STEPS]:
        s = doc.get("steps", {}).get(name)
        if s is None:
            out.append(f"{name}: missing")
            continue
        if not s.get("ok"):
            out.append(f"{name}: failed: {str(s.get('error', '?')).splitlines()[0][:200]}")
            continue
        for path in BY_NAME[name].numbers:
            for v in _values(s.get("result"), path.split(".")):
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                    out.append(f"{name}: {path} = {v!r}, not a finite number")
    return out
