"""The built-in Python tool through the ToolRunner: code that forks, allocates 8 GB, loops, sleeps or prints 10 MB
gives an error result with its metric, the runner goes on, and no process is left, in the namespaced sandbox and in
the `unsafe_local` fallback alike; the environment is not inherited and the working directory is fresh and removed.
The tool refuses to start where there are no namespaces unless `unsafe_local: true` (which warns). The escapes the
namespaces stop are in test_sandbox_escapes.py."""
import asyncio
import json
import logging
import os

import psutil
import pytest

from tests.helpers.common import REPO_ROOT
from tests.unit.test_sandbox_escapes import require_namespaces
from tripod.engine.agent import ToolCall, ToolRunner, load_tools, sandbox
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
MODES = ["namespaces", "unsafe_local"]


@pytest.fixture(params=MODES)
def mode(request, monkeypatch):
    """`namespaces`: the real sandbox (skipped where this machine has none); `unsafe_local`: the probe reports no
    namespaces and the config allows the fallback."""
    if request.param == "unsafe_local":
        monkeypatch.setattr(sandbox, "namespace_problem", lambda: "forced off by the test")
    else:
        require_namespaces()
    return request.param


def _tool(mode: str = "namespaces", **config) -> PythonTool:
    config = {"timeout": 3, "cpu_time_limit": 1, "memory_limit_mb": 512, "max_output_bytes": 4096, **config}
    tool = PythonTool({**config, "unsafe_local": mode == "unsafe_local"}, None)
    assert tool.isolated is (mode == "namespaces")
    return tool


def _run(calls: list[str], mode: str, runner_timeout: float = 30.0, **config):
    runner = ToolRunner({"code_interpreter": _tool(mode, **config)}, max_parallel_calls=8,
                        max_tool_response_length=2000, tool_response_truncate_side="left", timeout_s=runner_timeout)

    async def episode():
        await runner.start("r", {})
        results = await runner.call("r", [ToolCall("code_interpreter", {"code": c}) for c in calls])
        after = await runner.call("r", [ToolCall("code_interpreter", {"code": "print(6 * 7)"})])
        await runner.finish_scores("r")
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
def test_bad_code_gives_errors_and_leaves_no_process(mode):
    before = _descendants()
    code = {"forks": FORKS, "allocates_8gb": "x = bytearray(8 << 30)\nprint(len(x))",
            "loops": "while True:\n    pass", "sleeps": "import time\ntime.sleep(600)",
            "prints_10mb": "import sys\nfor _ in range(160):\n    sys.stdout.write('y' * 65536)"}
    results, after = _run(list(code.values()), mode)
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
    if mode == "unsafe_local":  # host pids; in the namespaces they are the pid namespace's own numbers
        assert [pid for pid in forked if _alive(pid)] == []
    assert _descendants() == before, _descendants() - before


@pytest.mark.timeout(120)
def test_a_runner_time_out_shorter_than_the_tools_kills_the_tree(mode):
    before = _descendants()
    results, after = _run([FORKS + "import time\ntime.sleep(600)"], mode, runner_timeout=3.0, timeout=30,
                          cpu_time_limit=30)
    assert results[0].timed_out and "timed out after 3 s" in results[0].error
    assert after.text == "42\n"
    assert _descendants() == before


def test_the_code_gets_no_inherited_environment_and_a_fresh_directory(mode, monkeypatch):
    monkeypatch.setenv("TRIPOD_SECRET_FOR_TEST", "leaked")
    code = "import os, json\nprint(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd(), 'files': os.listdir()}))"
    results, _ = _run([code], mode)
    seen = json.loads(results[0].text)
    assert "TRIPOD_SECRET_FOR_TEST" not in seen["env"] and "VIRTUAL_ENV" not in seen["env"]
    assert set(seen["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                "MKL_NUM_THREADS", "LC_CTYPE", "CUDA_VISIBLE_DEVICES"}, seen["env"]
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert seen["files"] == [] and seen["cwd"] != os.getcwd() and not os.path.exists(seen["cwd"])


def test_without_namespaces_the_tool_refuses_to_start_unless_unsafe_local(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "namespace_problem", lambda: "user namespaces are disabled")
    with pytest.raises(ValueError) as refused:
        PythonTool({}, None)
    message = str(refused.value)
    assert "\n" not in message and "user namespaces are disabled" in message and "`unsafe_local: true`" in message
    with caplog.at_level(logging.WARNING, logger="tripod.engine.agent.builtin_tools"):
        tool = PythonTool({"unsafe_local": True}, None)
    assert not tool.isolated
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "UNSAFE" in warnings[0] and "user namespaces are disabled" in warnings[0]


def test_the_config_keys_are_checked_and_the_interpreter_is_the_real_one(monkeypatch):
    monkeypatch.setattr(sandbox, "namespace_problem", lambda: None)
    for bad, reason in [({"max_processes": 0}, "must be positive"), ({"unsafe_local": "yes"}, "true or false")]:
        with pytest.raises(ValueError, match=reason):
            PythonTool(bad, None)
    tool = PythonTool({}, None)
    assert tool.isolated and tool.max_processes == 64
    assert tool.python == os.path.realpath(tool.python) and os.access(tool.python, os.X_OK)


def test_the_shipped_python_tool_configs_run_in_the_sandbox():
    require_namespaces()
    for path in ("recipes/qwen3/gsm8k-tools.yaml", "src/tripod/engine/agent/configs/calculator_and_python_tools.yaml"):
        tool = load_tools(str(REPO_ROOT / path))["code_interpreter"]
        assert tool.isolated, path
        response, _, metrics = asyncio.run(tool.execute("i", {"code": "import os\nprint(os.getuid(), 6 * 7)"}))
        assert response.text == f"{sandbox.SANDBOX_ID} 42\n" and "error" not in metrics, (path, response.text)


def test_a_root_tripod_maps_the_code_to_an_unprivileged_id_its_namespace_has():
    host, container = "0 0 4294967295\n", "         0     100000      65536\n"
    assert sandbox.outer_id_when_root(host) == sandbox.OUTER_ID_WHEN_ROOT  # no user of the host
    assert sandbox.outer_id_when_root(container) == 65535  # the highest id a container's root can hand out


def test_orphans_are_reaped_so_they_do_not_use_up_max_processes():
    require_namespaces()
    orphans = """
import os
for _ in range(40):          # each child leaves a grandchild that pid 1 inherits and must reap
    if os.fork() == 0:
        if os.fork() == 0:
            os._exit(0)
        os._exit(0)
    os.wait()
print("done")
"""
    response, _, metrics = asyncio.run(_tool(max_processes=8).execute("i", {"code": orphans}))
    assert response.text == "done\n" and "error" not in metrics, response.text
