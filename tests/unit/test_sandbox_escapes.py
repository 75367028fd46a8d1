"""Escapes from the Python tool's sandbox (sandbox.py), each run as model-written code through PythonTool.execute:
read the environment of an ancestor or of the trainer, read or write a file outside the working directory, connect
to a listener of the host, kill the parent or the trainer, a fork bomb, an 8 GB allocation, an endless loop. Each is
contained, the caller lives, and no process is left (none below this one, none carrying the run's temporary path).

The first four are stopped by the namespaces alone. The `_without_namespaces_` controls run the same programs with
the namespaces forced off (`unsafe_local`) and see them succeed: a sandbox test that passes does so because the
sandbox stopped the program, not because the program is broken."""
import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile

import psutil
import pytest

from tripod.engine.agent import sandbox, sandbox_setup
from tripod.engine.agent.builtin_tools import PythonTool

SECRET_NAME = "TRIPOD_ESCAPE_TEST_SECRET"
ENVIRON = """
import os
def environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(e.split(b"=", 1) for e in f.read().split(b"\\0") if b"=" in e)
    except OSError:
        return {}
def parent(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0
pids, pid = set(PIDS), os.getpid()
while pid > 0:                                                    # every ancestor
    pids.add(pid)
    pid = parent(pid)
pids.update(int(p) for p in os.listdir("/proc") if p.isdigit())  # and every process in sight
found = {p: environ(p).get(NAME.encode(), b"").decode() for p in sorted(pids)}
print("looked at", len(found), "processes; found:", [v for v in found.values() if v])
"""
FILES = """
for path in READ:
    try:
        with open(path) as f:
            print("read", path, f.read(200))
    except OSError as e:
        print("cannot read", path, type(e).__name__)
for path in WRITE:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        print("wrote", path)
    except OSError as e:
        print("cannot write", path, type(e).__name__)
"""
CONNECT = """
import socket
for family, address in ADDRESSES:
    s = socket.socket(family)
    s.settimeout(2)
    try:
        s.connect(address)
        print("connected", address)
    except OSError as e:
        print("no connection", type(e).__name__)
"""
KILL = """
import os, signal
for pid in [os.getppid(), *PIDS]:
    try:
        os.kill(pid, signal.SIGKILL)
        print("signalled", pid)
    except OSError as e:
        print("cannot signal", pid, type(e).__name__)
print("still here")
"""
FORK_BOMB = """
import os, time
n = 0
while n < 300:              # bounded, so that a run without RLIMIT_NPROC cannot take the machine down
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        try:
            os.fork()           # the children fork too
        except OSError:
            pass
        time.sleep(60)
        os._exit(0)
    n += 1
print(n, flush=True)
"""


def require_namespaces() -> None:
    """Skip where the machine has no namespaces (a bare `unshare` fails too); fail where it has them and the sandbox's
    probe still fails, so that a broken sandbox cannot pass as a machine without namespaces."""
    problem = sandbox.namespace_problem()
    if problem is None:
        return
    try:
        bare = subprocess.run(["unshare", "--user", "--map-root-user", "--pid", "--fork", "--net", "--mount", "--ipc",
                               "--mount-proc", "true"], capture_output=True, timeout=30).returncode
    except OSError:
        bare = None
    if bare == 0:
        pytest.fail(f"`unshare` works here, but the sandbox's probe fails: {problem}")
    pytest.skip(f"no namespaces here: {problem}")


@pytest.fixture
def marker(tmp_path, monkeypatch) -> str:
    """Every run's temporary directory goes below this test's: each sandbox process carries it in its argv."""
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(runs))
    return str(runs)


@pytest.fixture
def stand_in():
    """A stand-in for a trainer process: the secret in its environment, a pid to kill."""
    secret = secrets.token_hex(16)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            env={**os.environ, SECRET_NAME: secret})
    yield proc, secret
    proc.kill()
    proc.wait()


def _tool(isolated: bool, monkeypatch, **config) -> PythonTool:
    if not isolated:
        monkeypatch.setattr(sandbox, "namespace_problem", lambda: "forced off by the test")
    else:
        require_namespaces()
    tool = PythonTool({"timeout": 5, "cpu_time_limit": 1, "memory_limit_mb": 512, "max_output_bytes": 8192,
                       "unsafe_local": not isolated, **config}, None)
    assert tool.isolated is isolated
    return tool


def _run(tool: PythonTool, code: str, **names) -> tuple[str, dict]:
    """Run `code` with `names` assigned before it; the text the model would see and the metrics."""
    prelude = "".join(f"{k} = {v!r}\n" for k, v in names.items())
    response, _, metrics = asyncio.run(tool.execute("escape", {"code": prelude + code}))
    return response.text, metrics


def _descendants() -> set[int]:
    def alive(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    return {p.pid for p in psutil.Process().children(recursive=True) if alive(p)}


def _assert_nothing_left(before: set[int], marker: str) -> None:
    assert _descendants() == before, _descendants() - before
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert left == [], left


def _environ(isolated, monkeypatch, stand_in) -> str:
    proc, secret = stand_in
    monkeypatch.setenv(SECRET_NAME, secret)  # in this process's os.environ too, should anything pass it on
    text, _ = _run(_tool(isolated, monkeypatch), ENVIRON, NAME=SECRET_NAME, PIDS=[os.getpid(), proc.pid])
    assert "looked at" in text, text
    return text


def test_the_environment_of_the_trainer_and_the_ancestors_is_out_of_reach(monkeypatch, stand_in, marker):
    before = _descendants()
    text = _environ(True, monkeypatch, stand_in)
    assert stand_in[1] not in text and "found: []" in text, text
    _assert_nothing_left(before, marker)


def test_without_namespaces_the_environ_program_finds_the_secret(monkeypatch, stand_in, marker):
    assert stand_in[1] in _environ(False, monkeypatch, stand_in)


def _files(isolated, monkeypatch, tmp_path, extra_writes=()) -> tuple[str, list]:
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret " + secrets.token_hex(8))
    targets = [tmp_path / "escaped.txt", *extra_writes]
    text, _ = _run(_tool(isolated, monkeypatch), FILES, READ=[str(secret), os.path.abspath(__file__)],
                   WRITE=[str(t) for t in targets])
    return text, targets


def test_files_outside_the_working_directory_cannot_be_read_or_written(monkeypatch, tmp_path, marker):
    before = _descendants()
    tool = _tool(True, monkeypatch)
    prefix = os.path.dirname(os.path.dirname(tool.python))  # visible, but read-only
    text, targets = _files(True, monkeypatch, tmp_path, extra_writes=[os.path.join(prefix, "escaped-by-sandbox")])
    try:
        lines = text.splitlines()
        assert len(lines) == 4 and all(line.startswith("cannot ") for line in lines), text
        assert [t for t in targets if os.path.exists(t)] == []
    finally:
        for t in targets:
            if os.path.exists(t):
                os.remove(t)
    _assert_nothing_left(before, marker)


def test_without_namespaces_the_files_program_reads_and_writes(monkeypatch, tmp_path, marker):
    text, targets = _files(False, monkeypatch, tmp_path)
    assert "read " + str(tmp_path / "secret.txt") + " the secret" in text and "wrote " in text, text
    assert os.path.exists(targets[0])


def _connect(isolated, monkeypatch) -> list[str]:
    """What reached a TCP listener on 127.0.0.1 and an abstract unix socket of this process."""
    tcp, unix = socket.socket(), socket.socket(socket.AF_UNIX)
    abstract = "\0tripod-escape-test-" + secrets.token_hex(8)
    with tcp, unix:
        tcp.bind(("127.0.0.1", 0))
        unix.bind(abstract)
        for s in (tcp, unix):
            s.listen(4)
            s.setblocking(False)
        text, _ = _run(_tool(isolated, monkeypatch), "import socket\nADDRESSES = [(socket.AF_INET, "
                       f"{tcp.getsockname()!r}), (socket.AF_UNIX, {abstract!r})]\n" + CONNECT)
        assert text.count("connect") == 2, text
        arrived = []
        for name, s in (("tcp", tcp), ("unix", unix)):
            try:
                s.accept()[0].close()
                arrived.append(name)
            except BlockingIOError:
                pass
    return arrived


def test_no_connection_reaches_the_host(monkeypatch, marker):
    before = _descendants()
    assert _connect(True, monkeypatch) == []
    _assert_nothing_left(before, marker)


def test_without_namespaces_the_connect_program_reaches_both_listeners(monkeypatch, marker):
    assert _connect(False, monkeypatch) == ["tcp", "unix"]


def test_the_code_cannot_kill_its_parent_or_the_trainer(monkeypatch, stand_in, marker):
    before = _descendants()
    proc, _ = stand_in
    text, metrics = _run(_tool(True, monkeypatch), KILL, PIDS=[os.getpid(), proc.pid])
    assert "still here" in text and "error" not in metrics, text
    assert proc.poll() is None  # and this process, the caller, is alive to check
    _assert_nothing_left(before, marker)


def test_without_namespaces_the_kill_program_kills_the_stand_in(monkeypatch, stand_in, marker):
    proc, _ = stand_in
    _run(_tool(False, monkeypatch), KILL, PIDS=[proc.pid])  # not this process's pid: it would end the test run
    assert proc.wait(10) == -signal.SIGKILL


def test_the_trainers_session_keyring_is_out_of_reach(monkeypatch, marker):
    import ctypes
    import platform

    keyctl = sandbox_setup.SYSCALLS.get(platform.machine(), {}).get("keyctl")
    if keyctl is None:
        pytest.skip(f"no keyctl number for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    # a session keyring of this process's own (as a login session has), which its children inherit
    ours = libc.syscall(keyctl, sandbox_setup.KEYCTL_JOIN_SESSION_KEYRING, b"tripod-escape-test")
    assert ours > 0, os.strerror(ctypes.get_errno())
    code = f"import ctypes\nprint(ctypes.CDLL(None).syscall({keyctl}, 0, -3, 0))"  # KEYCTL_GET_KEYRING_ID of @s
    theirs = int(_run(_tool(True, monkeypatch), code)[0])
    assert theirs > 0 and theirs != ours


@pytest.mark.parametrize("program, config, outcome", [
    (FORK_BOMB, {"max_processes": 16}, None),
    ("x = bytearray(8 << 30)\nprint(len(x))", {}, "memory limit exceeded"),
    ("while True:\n    pass", {}, "CPU time limit exceeded"),
], ids=["fork_bomb", "allocate_8gb", "endless_loop"])
def test_resource_escapes_are_contained(program, config, outcome, monkeypatch, marker):
    before = _descendants()
    text, metrics = _run(_tool(True, monkeypatch, **config), program)
    assert metrics.get("error") == outcome, text
    if program is FORK_BOMB:
        assert 0 < int(text) < 16, text  # RLIMIT_NPROC stopped it; every process was killed with the namespace
    assert metrics["seconds"] < 5  # ended by its own limit, not by the wall clock
    _assert_nothing_left(before, marker)


def test_the_code_sees_only_what_the_docstring_lists(monkeypatch, tmp_path, marker):
    tool = _tool(True, monkeypatch)
    code = """
import json, os, socket
status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
mounts = [line.split() for line in open("/proc/self/mountinfo")]
print(json.dumps({"root": os.listdir("/"), "etc": os.listdir("/etc"), "dev": os.listdir("/dev"),
                  "pids": sorted(p for p in os.listdir("/proc") if p.isdigit()), "ids": [os.getuid(), os.getgid()],
                  "uid_map": open("/proc/self/uid_map").read().split(), "host": socket.gethostname(),
                  "caps": [status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapAmb")],
                  "no_new_privs": status["NoNewPrivs"].strip(), "cwd": os.getcwd(),
                  "userns": open("/proc/sys/user/max_user_namespaces").read().strip(),
                  "rw": sorted(m[4] for m in mounts if m[5].split(",")[0] == "rw")}))
"""
    seen = json.loads(_run(tool, code)[0])
    prefix = os.path.dirname(os.path.dirname(tool.python))
    expected = {d for d in sandbox_setup.SYSTEM_DIRS if os.path.lexists("/" + d)} | {"dev", "proc", "etc"}
    expected |= {marker.split("/")[1]} | ({prefix.split("/")[1]} if not prefix.startswith("/usr/") else set())
    assert set(seen["root"]) == expected
    assert seen["etc"] == ["ld.so.cache"]
    assert set(seen["dev"]) == set(sandbox_setup.DEVICES) | {"fd", "stdin", "stdout", "stderr"}
    assert seen["pids"] == ["1", "2"]  # the setup and the code: nothing of the host
    with open("/proc/self/uid_map") as f:
        outer = sandbox.outer_id_when_root(f.read()) if os.geteuid() == 0 else os.geteuid()
    assert seen["ids"] == [sandbox.SANDBOX_ID] * 2 and seen["uid_map"] == [str(sandbox.SANDBOX_ID), str(outer), "1"]
    assert seen["caps"] == ["0000000000000000"] * 4 and seen["no_new_privs"] == "1"
    assert seen["host"] == "sandbox" and seen["userns"] == "0"
    assert seen["rw"] == sorted([seen["cwd"], "/proc", *(f"/dev/{d}" for d in sandbox_setup.DEVICES)])


@pytest.mark.skipif(os.geteuid() != 0, reason="run as root: switching to an unprivileged user needs root")
def test_an_unprivileged_trainer_gets_the_same_sandbox(tmp_path):
    """The non-root branch (tripod's own uid mapped, setgroups denied), run as `nobody` with the system's Python: the
    trainer can read its own file, the code in the sandbox cannot."""
    import shutil

    require_namespaces()
    python = shutil.which("python3", path=os.defpath)
    if python is None:
        pytest.skip("needs a system python3")
    home = tempfile.mkdtemp(prefix="tripod-escape-test-")  # below the shared temporary directory: nobody can reach it
    try:
        secret = os.path.join(home, "secret.txt")
        with open(secret, "w") as f:
            f.write("nobody's secret")
        for path in (home, secret):
            os.chown(path, 65534, 65534)
        os.chmod(home, 0o700)
        driver = f"""
import asyncio, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox", {sandbox.__file__!r})
sb = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sb
spec.loader.exec_module(sb)
code = "import os\\nprint(open('/proc/self/uid_map').read().split())\\ntry:\\n    print(open({secret!r}).read())\\n" \\
       "except OSError as e:\\n    print(type(e).__name__)"
r = asyncio.run(sb.run_python(code, wall_s=10, cpu_s=5, memory_mb=256, max_output_bytes=4096, python={python!r}))
print(json.dumps([sb.namespace_problem(), open({secret!r}).read(), r.stdout, r.stderr, r.exit_code]))
"""
        done = subprocess.run([python, "-I", "-c", driver], user=65534, group=65534, extra_groups=[],
                              env={"PATH": os.defpath}, capture_output=True, text=True, timeout=60)
        problem, outside, stdout, stderr, exit_code = json.loads(done.stdout or "null") or (None,) * 5
        assert done.returncode == 0 and problem is None and exit_code == 0, (done.stderr, stderr)
        assert outside == "nobody's secret"
        assert stdout == f"['{sandbox.SANDBOX_ID}', '65534', '1']\nFileNotFoundError\n"
    finally:
        shutil.rmtree(home, ignore_errors=True)
