"""Test worlds forked from one preloaded interpreter instead of started by `torchrun`.

Every gloo world of the suite used to start `torchrun`'s agent (an interpreter importing torch, ~3 CPU-seconds) and
one fresh interpreter per rank, each importing torch, megatron-core, transformers and tripod before its first line of
test work (~7 CPU-seconds a rank on the slow 2-core box, where a tiny model's step takes ~1). Here a server process
imports all of that once per pytest session; each world is one `fork()` of it (a leader) that forks its ranks. A
rank gets exactly what `torchrun --standalone` gives a worker script: RANK / LOCAL_RANK / WORLD_SIZE /
LOCAL_WORLD_SIZE / GROUP_RANK / MASTER_ADDR / MASTER_PORT and the TORCHELASTIC_* variables in a fresh environment
(the caller's), the script run as `__main__` with its argv, its directory first on sys.path, stdout and stderr
merged into the world's output, torch's and Python's default RNGs seeded from the OS as in a fresh interpreter. As under torchrun, the
first rank that fails takes the others down and the world exits 1.

What a test checks is unchanged: the same worker scripts, the same gloo collectives, a process per rank. Tests of
launching itself (torchrun/elastic/SLURM, the `tripod` CLI's own spawn) do not come here; they start real launchers.
`TRIPOD_TEST_FORKED_WORLDS=0` turns this off (every world through real `torchrun`).

Protocol, over a Unix socket: the client sends one JSON request {script, args, nproc, env, cwd, log}; the leader
answers its pid (a line), then the world's exit code (a line) when every rank has ended.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

PRELOAD = ("torch", "torch.distributed", "numpy", "safetensors.torch", "transformers",
           "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.pipeline_parallel",
           "megatron.core.distributed", "megatron.core.dist_checkpointing",
           "tripod.engine.trainer", "tripod.engine.cli", "tests.helpers.common")


def enabled() -> bool:
    return os.environ.get("TRIPOD_TEST_FORKED_WORLDS", "1") != "0"


# ---- server side -----------------------------------------------------------------------------------------------
def _run_rank(req: dict[str, Any], rank: int, port: int, out_fd: int) -> None:
    """In a forked rank: become the worker script's `__main__`, as torchrun would start it; never returns."""
    code = 1
    try:
        os.setpgid(0, os.getpgid(0))  # stay in the leader's group: a kill of the world reaches every rank
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.chdir(req["cwd"])
        nproc = req["nproc"]
        env = dict(req["env"], RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank),
                   ROLE_NAME="default", ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="localhost", MASTER_PORT=str(port),
                   TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                   TORCHELASTIC_RUN_ID=f"forked-{os.getppid()}", TORCHELASTIC_USE_AGENT_STORE="False")
        env.setdefault("OMP_NUM_THREADS", "1")
        os.environ.clear()
        os.environ.update(env)
        script = str(Path(req["script"]).resolve())
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[:] = [os.path.dirname(script), *extra, *sys.path[1:]]
        sys.argv = [script, *req["args"]]
        import random

        import torch

        _only_own_exit_handlers()
        random.seed()  # a fresh interpreter seeds both from the OS; the forks must not share one stream
        torch.seed()
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _only_own_exit_handlers() -> None:
    """At its exit a rank runs the exit handlers its own run registered, not the server's: those remove what the
    server made at import for every fork (wandb deletes its import-time media directory at exit), which would break
    every later world. Kept: the interpreter's own exit work (logging's flush, weakref finalizers made by the rank,
    multiprocessing's child cleanup), as a fresh interpreter would do it."""
    import logging
    import weakref

    atexit._clear()  # type: ignore[attr-defined]
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        finalizer.atexit = False
    atexit.register(logging.shutdown)
    if "multiprocessing.util" in sys.modules:
        atexit.register(sys.modules["multiprocessing.util"]._exit_function)
    atexit.register(weakref.finalize._exitfunc)  # type: ignore[attr-defined]


def _lead_world(conn: socket.socket) -> None:
    """In a forked leader: start the ranks, report pid and exit code, take the world down when a rank fails."""
    code = 1
    try:
        os.setpgid(0, 0)
        req = json.loads(conn.makefile("r").readline())
        out_fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        conn.sendall(f"{os.getpid()}\n".encode())
        from tests.helpers.common import free_port

        port = free_port()
        ranks = {}
        for rank in range(req["nproc"]):
            pid = os.fork()
            if pid == 0:
                conn.close()
                _run_rank(req, rank, port, out_fd)
            ranks[pid] = rank
        code = 0
        while ranks:
            pid, status = os.wait()
            rank = ranks.pop(pid, None)
            if rank is None:
                continue
            rc = os.waitstatus_to_exitcode(status)
            if rc != 0 and code == 0:
                code = 1
                os.write(out_fd, f"[forked world] rank {rank} (pid {pid}) exited with {rc}; stopping the other "
                                 f"ranks\n".encode())
                for other in ranks:
                    _signal(other, signal.SIGTERM)
                deadline = time.time() + 10
                while ranks and time.time() < deadline:
                    done, _ = os.waitpid(-1, os.WNOHANG)
                    if done:
                        ranks.pop(done, None)
                    else:
                        time.sleep(0.05)
                for other in ranks:
                    _signal(other, signal.SIGKILL)
        conn.sendall(f"{code}\n".encode())
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def serve(path: str) -> None:
    """The server: preload, then fork a leader per connection until stdin (the pytest process) closes."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import gc

    gc.collect()
    gc.freeze()  # the preloaded objects: no copy-on-write from the collector walking them in every fork
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 1.0)
        while True:  # reap finished leaders
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if sys.stdin in readable and not sys.stdin.buffer.read1(1):
            os._exit(0)  # no interpreter teardown: the frozen preloaded objects are the OS's to free
        if listener in readable:
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                _lead_world(conn)
            conn.close()


# ---- client side -----------------------------------------------------------------------------------------------
class _Server:
    proc: subprocess.Popen | None = None
    path: str = ""


def _server(env: dict[str, str]) -> str:
    if _Server.proc is None or _Server.proc.poll() is not None:
        from tests.helpers.common import REPO_ROOT

        _Server.path = os.path.join(tempfile.mkdtemp(prefix="tripod-worlds-"), "server.sock")
        _Server.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.forked_worlds", _Server.path],
                                        cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        line = _Server.proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"the forked-worlds server did not start (exit {_Server.proc.poll()}); "
                               "TRIPOD_TEST_FORKED_WORLDS=0 runs worlds through torchrun instead")
    return _Server.path


def _read_line(sock: socket.socket) -> str:
    """One line, unbuffered (a buffered reader could swallow the exit code that follows the pid)."""
    data = b""
    while not data.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte:
            break
        data += byte
    return data.decode()


class ForkedWorld:
    """A running world, shaped like the `subprocess.Popen` of a torchrun: `wait(timeout)`, `kill()`, `returncode`."""

    def __init__(self, script: str, nproc: int, args: list[str], env: dict[str, str], cwd: str, log: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(_server(env))
        self.sock.sendall((json.dumps(dict(script=script, nproc=nproc, args=args, env=env, cwd=str(cwd),
                                           log=log)) + "\n").encode())
        self.pid = int(_read_line(self.sock))
        self.returncode: int | None = None
        self.killed = False

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and self.killed:
            self.returncode = -signal.SIGKILL
        if self.returncode is None:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(f"forked world {self.pid}", timeout or 0)
            line = _read_line(self.sock)  # the exit code, or EOF when the leader was killed
            self.returncode = int(line) if line.strip() else -signal.SIGKILL
            self.sock.close()
        return self.returncode

    def poll(self) -> int | None:
        """The exit code, or None while the world runs (as `Popen.poll`)."""
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self.killed = True
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    serve(sys.argv[1])
