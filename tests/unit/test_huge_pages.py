"""torch's CPU tensors on transparent huge pages (engine/launch.py: default_huge_page_allocations).

The variable tripod sets must be the one torch's allocator reads: a process started with it holds a large fresh tensor
in huge pages (/proc/self/smaps_rollup: AnonHugePages), where the kernel allows them at all. `tripod` sets it for the
processes it starts unless the user chose.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tripod.engine.launch import HUGE_PAGES_ENV, default_huge_page_allocations

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SMAPS = Path("/proc/self/smaps_rollup")

PROBE = """
import re, torch
x = torch.empty(64 * 2**20 // 4)  # 64 MB, fresh
x.fill_(1.0)                       # first touch: the pages are made now
kb = int(re.search(r"AnonHugePages:\\s+(\\d+) kB", open("/proc/self/smaps_rollup").read()).group(1))
print(kb // 1024)
"""


def thp_mode() -> str | None:
    try:
        return re.search(r"\[(\w+)\]", THP_MODE.read_text()).group(1)
    except (OSError, AttributeError):
        return None


def huge_mb(value: str) -> int:
    env = dict(os.environ, **{HUGE_PAGES_ENV: value}, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_default_is_on_and_the_users_choice_stays():
    env: dict[str, str] = {}
    assert default_huge_page_allocations(env) is True and env[HUGE_PAGES_ENV] == "1"
    env = {HUGE_PAGES_ENV: "0"}
    assert default_huge_page_allocations(env) is False and env[HUGE_PAGES_ENV] == "0"


def test_the_cli_sets_it_for_what_it_spawns(monkeypatch, tmp_path):
    from tripod.engine.cli import main

    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    assert main(["report", str(tmp_path / "no-such-run")]) == 2  # fails on its input, after the default is set
    assert os.environ[HUGE_PAGES_ENV] == "1"


@pytest.mark.skipif(thp_mode() in (None, "never") or not SMAPS.exists(),
                    reason="the kernel offers no transparent huge pages here")
def test_torch_puts_large_tensors_on_huge_pages():
    on = huge_mb("1")
    assert on >= 32, f"{HUGE_PAGES_ENV}=1: only {on} MB of a fresh 64 MB tensor on huge pages"
    if thp_mode() == "madvise":  # without the variable torch does not ask for them
        off = huge_mb("0")
        assert off < on, (off, on)
