"""The built-in Python tool through the ToolRunner: code that forks, allocates 8 GB, loops, sleeps or prints 10 MB
gives an error result with its metric, the runner goes on, and no process is left; the environment is not
inherited and the working directory is fresh and removed."""
import asyncio
import os

import psutil
import pytest

from tripod.engine.agent import ToolCall, ToolRunner
from tripod.engine.agent.builtin_tools import PythonTool

FORKS = """
import os, time
r, w = os.pipe()
kids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        os.setsid()                  # leaves the process group: only the subreaper still sees it
        grandchild = os.fork()
        if grandchild == 0:
            time.sleep(600)
            os._exit(0)
        os.write(w, b"%d\\n" % grandchild)
        time.sleep(600)
        os._exit(0)
    kids.append(pid)
got = b""
while got.count(b"\\n") < 2:
    got += os.read(r, 100)
print(*kids, *map(int, got.split()), flush=True)
"""


def _tool(**config) -> PythonTool:
    return PythonTool({"timeout": 3, "cpu_time_limit": 1, "memory_limit_mb": 512, "max_output_bytes": 4096, **config},
                      None)


def _run(calls: list[str], runner_timeout: float = 30.0, **config):
    runner = ToolRunner({"code_interpreter": _tool(**config)}, max_parallel_calls=8, max_tool_response_length=2000,
                        tool_response_truncate_side="right", timeout_s=runner_timeout)

    async def episode():
        await runner.start("r", {})
        results = await runner.call("r", [ToolCall("code_interpreter", {"code": c}) for c in calls])
        after = await runner.call("r", [ToolCall("code_interpreter", {"code": "print(6 * 7)"})])
        await runner.finish("r")
        return results, after[0]

    return asyncio.run(episode())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if _alive(p.pid)}


@pytest.mark.timeout(120)
def test_bad_code_gives_errors_and_leaves_no_process(tmp_path):
    before = _descendants()
    code = {"forks": FORKS, "allocates_8gb": "x = bytearray(8 << 30)\nprint(len(x))",
            "loops": "while True:\n    pass", "sleeps": "import time\ntime.sleep(600)",
            "prints_10mb": "import sys\nfor _ in range(160):\n    sys.stdout.write('y' * 65536)"}
    results, after = _run(list(code.values()))
    by = dict(zip(code, results))
    assert by["forks"].error is None, by["forks"]
    forked = [int(pid) for pid in by["forks"].text.split()]
    assert len(forked) == 4  # two children in sessions of their own, and a grandchild of each
    assert by["allocates_8gb"].error == "memory limit exceeded" and "MemoryError" in by["allocates_8gb"].text
    assert by["loops"].error == "CPU time limit exceeded" and not by["loops"].timed_out
    assert by["sleeps"].error == "wall-clock time limit exceeded" and by["sleeps"].timed_out
    assert by["sleeps"].metrics["seconds"] < 3 + 2.5  # the supervisor's limit, not tripod's backstop at 3 + 5 s
    assert by["prints_10mb"].error == "output size limit exceeded"
    assert "[Errno 27] File too large" in by["prints_10mb"].text  # RLIMIT_FSIZE stopped the writes
    assert len(by["prints_10mb"].text) <= 2000 + len("(truncated)...")
    for name in ("allocates_8gb", "loops", "sleeps", "prints_10mb"):
        assert by[name].text.endswith(f"Error: {by[name].error}"), by[name].text
    assert after.text == "42\n" and after.error is None  # the runner goes on
    alive = [pid for pid in forked if _alive(pid)]
    assert alive == [] and _descendants() == before, (alive, _descendants() - before)


@pytest.mark.timeout(120)
def test_a_runner_time_out_shorter_than_the_tools_kills_the_tree():
    before = _descendants()
    results, after = _run([FORKS + "import time\ntime.sleep(600)"], runner_timeout=3.0, timeout=30, cpu_time_limit=30)
    assert results[0].timed_out and "timed out after 3 s" in results[0].error
    assert after.text == "42\n"
    assert _descendants() == before


def test_the_code_gets_no_inherited_environment_and_a_fresh_directory(monkeypatch):
    monkeypatch.setenv("TRIPOD_SECRET_FOR_TEST", "leaked")
    code = "import os, json\nprint(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd(), 'files': os.listdir()}))"
    results, _ = _run([code])
    import json

    seen = json.loads(results[0].text)
    assert "TRIPOD_SECRET_FOR_TEST" not in seen["env"] and "VIRTUAL_ENV" not in seen["env"]
    assert set(seen["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                "MKL_NUM_THREADS", "LC_CTYPE"}, seen["env"]
    assert seen["files"] == [] and seen["cwd"] != os.getcwd() and not os.path.exists(seen["cwd"])
