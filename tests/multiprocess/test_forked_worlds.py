"""The suite's gloo worlds are forks of one preloaded interpreter (tests/helpers/forked_worlds.py): a rank must see
what `torchrun --standalone` gives it, and a failing or hanging world must fail its test as under torchrun."""
from __future__ import annotations

import json
import re

import pytest

from tests.helpers.common import run_torchrun


def _reports(out: str) -> list[dict]:
    reports = [json.loads(m) for m in re.findall(r"WORLD_REPORT (\{.*?\})(?=WORLD_REPORT|\n|$)", out)]
    return sorted(reports, key=lambda r: int(r["RANK"]))


@pytest.mark.dist
def test_a_forked_rank_sees_what_torchrun_gives_it(monkeypatch):
    env = {"TRIPOD_WORLD_TEST": "yes"}
    monkeypatch.setenv("TRIPOD_TEST_FORKED_WORLDS", "0")
    real = _reports(run_torchrun("world_report.py", 2, -1, env=env).stdout)
    monkeypatch.setenv("TRIPOD_TEST_FORKED_WORLDS", "1")
    forked = _reports(run_torchrun("world_report.py", 2, -1, env=env).stdout)
    assert len(real) == len(forked) == 2
    # launch variables, argv, sys.path[0], cwd, one thread
    differ = {k: (r[k], f.get(k)) for r, f in zip(real, forked) for k in r if f.get(k) != r[k] and k != "rand"}
    assert not differ, f"a forked rank sees (torchrun's, forked): {differ}"
    # a fresh interpreter seeds torch's default generator from the OS: no two ranks (or worlds) share a stream
    draws = [tuple(r["rand"]) for r in real + forked]
    assert len(set(draws)) == len(draws), draws


@pytest.mark.dist
def test_a_failing_rank_fails_the_forked_world():
    with pytest.raises(AssertionError) as failed:
        run_torchrun("world_report.py", 3, 1)
    message = str(failed.value)
    assert "exited 1" in message and "[rank1] FAILED" in message and "planted failure on rank 1" in message


@pytest.mark.dist
def test_a_hanging_forked_world_times_out_and_is_killed(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(AssertionError, match="timed out after 2s"):
        run_torchrun(script, 2, timeout=2)
