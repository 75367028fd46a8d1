"""The GPU check's verdict (scripts/gpu_check_steps/schema.py): PASS only when every step is present, passed and
carries each required number finite; a missing step, a failed one, a NaN or an absent field each name themselves.
The whole driver runs in tests/multiprocess/test_gpu_check.py (make test-gpu-bundle)."""
import copy
import os
import sys

from tests.helpers.common import REPO_ROOT

sys.path.insert(0, os.path.join(str(REPO_ROOT), "scripts"))
from gpu_check_steps.schema import STEPS, problems  # noqa: E402


def _tree(path: list[str], value: float):
    if not path:
        return value
    if path[0] == "*":
        return {"a": _tree(path[1:], value), "b": _tree(path[1:], value)}
    return {path[0]: _tree(path[1:], value)}


def _merge(into: dict, other: dict) -> dict:
    for k, v in other.items():
        into[k] = _merge(into.get(k, {}), v) if isinstance(v, dict) else v
    return into


def _passing() -> dict:
    steps = {}
    for s in STEPS:
        result: dict = {}
        for path in s.numbers:
            _merge(result, _tree(path.split("."), 1.5))
        steps[s.name] = {"ok": True, "result": result}
    return {"steps": steps}


def test_a_complete_result_passes_and_each_fault_names_itself():
    doc = _passing()
    assert problems(doc) == []
    assert problems(doc, ["ppo"]) == []

    nan = copy.deepcopy(doc)
    nan["steps"]["ppo"]["result"]["mfu_actor_measured"] = float("nan")
    assert problems(nan) == ["ppo: mfu_actor_measured = nan, not a finite number"]

    missing_field = copy.deepcopy(doc)
    del missing_field["steps"]["kernels"]["result"]["elementwise"]["b"]["pct_of_copy"]
    assert problems(missing_field) == ["kernels: elementwise.*.pct_of_copy = None, not a finite number"]

    absent = copy.deepcopy(doc)
    del absent["steps"]["optim"]
    assert problems(absent) == ["optim: missing"]

    failed = copy.deepcopy(doc)
    failed["steps"]["env"] = {"ok": False, "error": "timed out after 25 s (its cap)\nmore"}
    assert problems(failed) == ["env: failed: timed out after 25 s (its cap)"]

    boolean = copy.deepcopy(doc)
    boolean["steps"]["roofline"]["result"]["copy_GBps"] = True
    assert problems(boolean) == ["roofline: copy_GBps = True, not a finite number"]


def test_the_caps_fit_the_device_call():
    """Eight minutes with the offline install (~20 s); the call's own limit is ten."""
    assert sum(s.cap_s for s in STEPS) <= 480 - 20
