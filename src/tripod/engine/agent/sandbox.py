"""Run a piece of model-written Python in a fresh set of Linux namespaces: the engine of the built-in Python tool.

    tripod (asyncio) --start_new_session--> supervisor (this file as a script; child subreaper; wall-clock limit)
      `-- unshare --user --pid --net --mount --ipc --uts --fork --kill-child --keep-caps --propagation private --
            python -I -S sandbox_setup.py SPEC     (pid 1 of the new pid namespace: builds the new root, then waits)
              `-- fork: setrlimit(CPU, AS, FSIZE, NOFILE, NPROC, CORE), capset(none), no_new_privs
                  -> exec python -I main.py          (uid/gid SANDBOX_ID, cwd: the work tmpfs)

The namespaces come from util-linux's `unshare`, found with `shutil.which("unshare")` on tripod's PATH. bubblewrap and
nsjail are not used even when installed: one backend, the one the tests run, rather than three (bubblewrap would also
map a root trainer's code to the host's root), and sandbox_setup.py does what they would do. The supervisor writes the new user namespace's id maps (`unshare` maps
ids only through newuidmap, which is rarely installed): the code runs as uid/gid 1000 inside, which is
`OUTER_ID_WHEN_ROOT` outside when tripod runs as root (so RLIMIT_NPROC applies and root-owned files are not the
code's; in a container's user namespace, the highest id it maps), and tripod's own uid/gid otherwise (an
unprivileged user namespace can map only that one id).

What the code sees, after the setup (pid 1) has built a new root on a tmpfs and `pivot_root`ed into it:
- read-only, nosuid, nodev: /usr, /bin, /sbin, /lib, /lib32, /lib64, /libx32 (those that exist; top-level symlinks
  such as /bin -> usr/bin are recreated as symlinks), /etc/ld.so.cache (no other file of /etc), the installation
  prefix of the interpreter (two levels above its real path, e.g. sys.base_prefix; nothing more when it is under
  /usr), and the code file at its own path;
- /proc of its own pid namespace (it sees only its own processes), /dev/null, /dev/zero, /dev/random, /dev/urandom
  and the /dev/fd, /dev/stdin, /dev/stdout, /dev/stderr symlinks: no GPU, no /sys, no /dev/shm;
- read-write: only its working directory (HOME and TMPDIR too), a fresh tmpfs of `memory_mb` MiB that is gone when
  the run ends; the rest of the new root is a read-only tmpfs of empty directories;
- a network namespace whose loopback interface is down (no connection anywhere, abstract unix sockets included), a
  fresh IPC namespace, the host name "sandbox", an empty environment (PATH, HOME, TMPDIR, LANG, single-thread BLAS
  settings and an empty CUDA_VISIBLE_DEVICES are set), a fresh session keyring, no capabilities, and no further
  user namespaces (user.max_user_namespaces is 0 inside).
The supervisor enforces the wall-clock limit and then kills everything below it; killing pid 1 kills the whole pid
namespace (and pid 1 exits as soon as the code does), so nothing the code started survives. stdout / stderr go to
files capped by RLIMIT_FSIZE.

`namespace_problem()` probes all this once per process with a real run. Where it fails (no `unshare`, user namespaces
disabled, a container without the capability, an architecture without known system call numbers), the PythonTool
refuses to start unless its config says `unsafe_local: true`; `run_python(..., isolated=False)` then runs the code
as tripod's user (supervisor -> sandbox_setup.py -> exec) with the rlimits (but RLIMIT_NPROC, which would count all
of that user's processes) and the process-tree kill only.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import select
import signal
import sys
import time
from dataclasses import dataclass

PR_SET_CHILD_SUBREAPER = 36
SANDBOX_ID = 1000                 # the code's uid and gid inside the user namespace
OUTER_ID_WHEN_ROOT = 0x7FFF0000   # what SANDBOX_ID is outside when tripod runs as root: no user or group of the host
_STATUS = "status.json"
_SETUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_setup.py")
# --keep-caps: the capabilities unshare gets in the new user namespace would go at the exec of the setup, which runs
# as an id that is not mapped yet; they go at the exec of the code instead (sandbox_setup.exec_code)
UNSHARE_FLAGS = ("--user", "--pid", "--net", "--mount", "--ipc", "--uts", "--fork", "--kill-child", "--keep-caps",
                 "--propagation", "private")


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
                     python: str | None = None, max_open_files: int = 256, max_processes: int = 64,
                     isolated: bool = True) -> SandboxResult:
    """Run `code` under the limits above (in the namespaces unless `isolated` is False) and return what it printed.
    Never leaves a process behind."""
    import asyncio  # here, not at the top: the supervisor (this file as a script) runs per call and imports little
    import shutil

    root, spec = _prepare(code, wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes,
                          python=python, max_open_files=max_open_files, max_processes=max_processes,
                          isolated=isolated)
    start = time.monotonic()
    proc = None
    try:
        with open(os.path.join(spec["out"], "stdout"), "wb") as so, open(os.path.join(spec["out"], "stderr"), "wb") as se:
            proc = await asyncio.create_subprocess_exec(
                *_supervisor_argv(spec), stdin=asyncio.subprocess.DEVNULL, stdout=so, stderr=se, cwd=spec["work"],
                env=spec["env"], start_new_session=True)
        try:
            await asyncio.wait_for(proc.wait(), wall_s + 5.0)  # the supervisor's own limit comes first
        except TimeoutError:
            pass
    finally:
        try:  # a second cancellation may land in `proc.wait()`: the directory still goes
            if proc is not None:
                if proc.returncode is None:
                    kill_tree(proc.pid)
                    await proc.wait()
                _kill_group(proc.pid)
            result = _collect(spec["out"], max_output_bytes, time.monotonic() - start)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return result


@functools.lru_cache(maxsize=None)
def namespace_problem() -> str | None:
    """Why the namespaced sandbox cannot run here, or None when it can: one real run of `print('ok')` through it,
    once per process (the answer does not change while the process lives)."""
    import shutil
    import subprocess

    if sys.platform != "linux":
        return f"namespaces are Linux-only (this is {sys.platform})"
    if shutil.which("unshare") is None:
        return "util-linux `unshare` is not on PATH"
    root, spec = _prepare("print('ok')", wall_s=30, cpu_s=10, memory_mb=256, max_output_bytes=4096, python=None,
                          max_open_files=64, max_processes=16, isolated=True)
    try:
        with open(os.path.join(spec["out"], "stdout"), "wb") as so, open(os.path.join(spec["out"], "stderr"), "wb") as se:
            proc = subprocess.Popen(_supervisor_argv(spec), stdin=subprocess.DEVNULL, stdout=so, stderr=se,
                                    cwd=spec["work"], env=spec["env"], start_new_session=True)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
        result = _collect(spec["out"], 4096, 0.0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if result.exit_code == 0 and result.stdout == "ok\n":
        return None
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else f"the probe run failed ({result.failure()})"


def _prepare(code: str, *, wall_s: float, cpu_s: float, memory_mb: int, max_output_bytes: int, python: str | None,
             max_open_files: int, max_processes: int, isolated: bool) -> tuple[str, dict]:
    """A fresh temporary directory (work/ for the code, out/ for the code file and what the run writes) and the spec
    the supervisor and the setup read."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="tripod-sandbox-")
    work, out = os.path.join(root, "work"), os.path.join(root, "out")
    for d in (work, out, os.path.join(root, "newroot")):
        os.mkdir(d)
    code_path = os.path.join(out, "main.py")
    with open(code_path, "w", encoding="utf-8") as f:
        f.write(code)
    os.chmod(code_path, 0o644)  # the code's uid may be another one than tripod's
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    spec = {"python": os.path.realpath(python or sys.executable), "code": code_path, "wall_s": wall_s,
            "cpu_s": max(1, int(cpu_s)), "memory_mb": int(memory_mb), "output_bytes": int(max_output_bytes),
            "nofile": max_open_files, "nproc": max_processes, "root": root, "work": work, "out": out, "env": env,
            "isolated": isolated, "id": SANDBOX_ID, "unshare": shutil.which("unshare") or "unshare"}
    return root, spec


def _supervisor_argv(spec: dict) -> list[str]:
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(spec)]


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


def _kill_group(pgid: int) -> None:
    """Kill what is left of the supervisor's process group: without namespaces, code that killed its supervisor is
    no longer below anything tripod watches. The group id cannot be reused while a member lives."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
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
    """The supervisor process: start the code (through `unshare` and the setup when isolated), wait for it up to the
    wall limit, kill what is left, write the status."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    deadline = time.monotonic() + spec["wall_s"]
    isolated = spec["isolated"]
    if isolated:  # setup -> supervisor "in the namespaces", supervisor -> setup "id maps written", setup's report
        (ready_r, ready_w), (go_r, go_w), (report_r, report_w) = os.pipe(), os.pipe(), os.pipe()
        spec = {**spec, "ready_fd": ready_w, "go_fd": go_r, "report_fd": report_w}
    argv = [sys.executable, "-I", "-S", _SETUP, json.dumps(spec)]
    if isolated:
        argv = [spec["unshare"], *UNSHARE_FLAGS, "--", *argv]
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if isolated:
                for fd in (ready_w, go_r, report_w):
                    os.set_inheritable(fd, True)
            os.execv(argv[0], argv)
        except OSError as e:
            print(f"tripod sandbox: cannot start the code: {e}", file=sys.stderr, flush=True)
        finally:
            os._exit(127)
    if isolated:
        for fd in (ready_w, go_r, report_w):
            os.close(fd)
        if select.select([ready_r], [], [], max(0.0, deadline - time.monotonic()))[0] and os.read(ready_r, 1):
            try:
                _write_id_maps(pid)
                os.write(go_w, b".")
            except OSError as e:
                print(f"tripod sandbox: cannot write the user namespace's id maps: {e}", file=sys.stderr, flush=True)
        os.close(go_w)  # without the byte the setup stops
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
    if isolated and not timed_out:  # pid 1 reports the code's status; without a report, unshare's (a failed setup)
        os.set_blocking(report_r, False)
        try:
            report = os.read(report_r, 64)
        except BlockingIOError:
            report = b""
        exit_code = int(report) if report.strip().lstrip(b"-").isdigit() else exit_code
    with open(os.path.join(spec["out"], _STATUS), "w") as f:
        json.dump({"exit_code": exit_code, "timed_out": timed_out}, f)


def outer_id_when_root(id_map: str) -> int:
    """The unprivileged id a root tripod maps SANDBOX_ID to, given its own namespace's uid_map / gid_map text:
    OUTER_ID_WHEN_ROOT where that is mapped (the host), else the highest id mapped (the root of a container's user
    namespace, which maps a range such as 0-65535, can hand out only those)."""
    ranges = [tuple(int(n) for n in line.split()) for line in id_map.splitlines() if line.strip()]
    if any(inside <= OUTER_ID_WHEN_ROOT < inside + count for inside, _, count in ranges):
        return OUTER_ID_WHEN_ROOT
    return max(inside + count - 1 for inside, _, count in ranges)


def _write_id_maps(pid: int) -> None:
    """Map SANDBOX_ID inside `pid`'s new user namespace: to an unprivileged id when tripod is root, else to tripod's
    own ids (the one mapping an unprivileged process may write, after denying setgroups)."""
    if os.geteuid() == 0:
        with open("/proc/self/uid_map") as u, open("/proc/self/gid_map") as g:
            uid, gid = outer_id_when_root(u.read()), outer_id_when_root(g.read())
    else:
        uid, gid = os.geteuid(), os.getegid()
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
    for name, outer in (("uid_map", uid), ("gid_map", gid)):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(f"{SANDBOX_ID} {outer} 1\n")


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
