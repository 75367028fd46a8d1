"""Run a piece of Python in a separate, limited process: the engine of the built-in Python code tool.

No well-kept PyPI package does this on Linux without root or Docker (nsjail / bubblewrap need user namespaces,
epicbox / llm-sandbox need Docker), so it is `resource.setrlimit` plus a process tree:

    tripod (asyncio)  --start_new_session-->  supervisor (this file as a script, child subreaper)
                                                  `-- fork: setrlimit(CPU, AS, FSIZE, NOFILE, CORE) -> exec python -I code.py

The code runs with an empty environment (a few fixed variables are set, none inherited), in a fresh temporary
directory that is removed afterwards; stdout / stderr go to files capped by RLIMIT_FSIZE (a write past the cap
fails). The supervisor enforces the wall-clock limit and, being the child subreaper, then kills and reaps every
descendant, including ones that forked and called setsid(). tripod kills the whole tree itself if the supervisor
does not report in time or the awaiting task is cancelled. This is resource hygiene for model-written code, not a
security boundary: the code runs as tripod's user and can read what that user can read.
"""
from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

PR_SET_CHILD_SUBREAPER = 36
_STATUS = "status.json"


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None      # the code's exit status; -N when killed by signal N; None when it never finished
    timed_out: bool            # the wall-clock limit ended it
    output_truncated: bool     # stdout or stderr reached max_output_bytes
    seconds: float

    def failure(self) -> str | None:
        """A short description of what went wrong, or None when the code exited 0 within its limits."""
        if self.timed_out:
            return "wall-clock time limit exceeded"
        if self.output_truncated:
            return "output size limit exceeded"
        if self.exit_code == -signal.SIGXCPU:
            return "CPU time limit exceeded"
        if self.exit_code is not None and self.exit_code < 0:
            return f"killed by {signal.Signals(-self.exit_code).name}"
        if "MemoryError" in self.stderr[-2000:]:
            return "memory limit exceeded"
        if self.exit_code != 0:
            return f"exit code {self.exit_code}"
        return None


async def run_python(code: str, *, wall_s: float, cpu_s: float, memory_mb: int, max_output_bytes: int,
                     python: str | None = None, max_open_files: int = 256) -> SandboxResult:
    """Run `code` under the limits above and return what it printed. Never leaves a process behind."""
    root = tempfile.mkdtemp(prefix="tripod-sandbox-")
    work, out = os.path.join(root, "work"), os.path.join(root, "out")
    os.mkdir(work)
    os.mkdir(out)
    code_path = os.path.join(out, "main.py")
    with open(code_path, "w", encoding="utf-8") as f:
        f.write(code)
    spec = {"python": python or sys.executable, "code": code_path, "wall_s": wall_s, "cpu_s": max(1, int(cpu_s)),
            "memory_bytes": int(memory_mb) << 20, "output_bytes": int(max_output_bytes), "nofile": max_open_files,
            "out": out}
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = None
    try:
        with open(os.path.join(out, "stdout"), "wb") as so, open(os.path.join(out, "stderr"), "wb") as se:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", os.path.abspath(__file__), json.dumps(spec), stdin=asyncio.subprocess.DEVNULL,
                stdout=so, stderr=se, cwd=work, env=env, start_new_session=True)
        try:
            await asyncio.wait_for(proc.wait(), wall_s + 5.0)  # the supervisor's own limit comes first
        except TimeoutError:
            pass
    finally:
        try:  # a second cancellation may land in `proc.wait()`: the directory still goes
            if proc is not None and proc.returncode is None:
                kill_tree(proc.pid)
                await proc.wait()
            result = _collect(out, max_output_bytes, time.monotonic() - start)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return result


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its live descendants; the top one is stopped first, so that the orphans of killed
    processes stay below it (it is their subreaper) until it goes too."""
    import psutil

    try:
        top = psutil.Process(pid)
        top.suspend()
    except psutil.Error:
        return
    def alive(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    for _ in range(1000):
        try:
            live = [p for p in top.children(recursive=True) if alive(p)]
        except psutil.Error:
            live = []
        if not live:
            break
        for p in live:
            try:
                p.kill()
            except psutil.Error:
                pass
        time.sleep(0.002)
    try:
        top.kill()
    except psutil.Error:
        pass


def _collect(out: str, cap: int, seconds: float) -> SandboxResult:
    def read(name: str) -> bytes:
        try:
            with open(os.path.join(out, name), "rb") as f:
                return f.read(cap + 1)
        except OSError:
            return b""

    stdout, stderr = read("stdout"), read("stderr")
    try:
        status = json.loads(read(_STATUS) or b"{}")
    except ValueError:
        status = {}
    return SandboxResult(stdout=stdout[:cap].decode("utf-8", "replace"), stderr=stderr[:cap].decode("utf-8", "replace"),
                         exit_code=status.get("exit_code"), timed_out=bool(status.get("timed_out", "exit_code" not in status)),
                         output_truncated=len(stdout) >= cap or len(stderr) >= cap, seconds=seconds)


def _supervise(spec: dict) -> None:
    """The supervisor process: fork the limited child, wait for it up to the wall limit, kill what is left."""
    import ctypes

    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    pid = os.fork()
    if pid == 0:
        try:
            cpu, mem, cap = spec["cpu_s"], spec["memory_bytes"], spec["output_bytes"]
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))
            resource.setrlimit(resource.RLIMIT_NOFILE, (spec["nofile"], spec["nofile"]))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.execv(spec["python"], [spec["python"], "-I", spec["code"]])
        finally:
            os._exit(127)
    deadline = time.monotonic() + spec["wall_s"]
    exit_code, timed_out = None, False
    while exit_code is None:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            exit_code = os.waitstatus_to_exitcode(status)
        elif stop or time.monotonic() > deadline:
            timed_out = True
            break
        else:
            time.sleep(0.01)
    _kill_descendants()
    with open(os.path.join(spec["out"], _STATUS), "w") as f:
        json.dump({"exit_code": exit_code, "timed_out": timed_out}, f)


def _kill_descendants() -> None:
    """As the child subreaper every leftover process is below this one: kill the tree, reap, until none is left."""
    me, deadline = os.getpid(), time.monotonic() + 10.0
    while time.monotonic() < deadline:
        parents: dict[int, list[int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat", "rb") as f:
                        ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                parents.setdefault(ppid, []).append(int(name))
        stack, below = list(parents.get(me, [])), []
        while stack:
            p = stack.pop()
            below.append(p)
            stack.extend(parents.get(p, []))
        for p in below:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return  # no child left, so no descendant either
        time.sleep(0.001)


if __name__ == "__main__":
    _supervise(json.loads(sys.argv[1]))
