"""The code's side of a sandboxed run (sandbox.py), run as a script with `python -I -S`, so standard library only.

    python -I -S sandbox_setup.py SPEC

Without namespaces (`unsafe_local`) it only applies the code's limits and execs the code (`exec_code`). In the
namespaces, as pid 1 of the new pid namespace (`setup`), it waits for the supervisor to write the id maps, builds the
new root on a tmpfs (read-only binds of what sandbox.py's docstring lists, its own /proc, the device nodes, the work
tmpfs), sets user.max_user_namespaces to 0 and the host name, joins a fresh session keyring (tripod's may hold keys),
`pivot_root`s into the new root and detaches the old one, then forks the code as uid/gid `spec["id"]` without
capabilities, reaps every child, and reports the code's exit status on `report_fd`. When it exits, the kernel kills
whatever is left in the pid namespace.
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import resource
import sys

PR_SET_NO_NEW_PRIVS = 38
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_REC, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 16384, 1 << 21, 1 << 24
MNT_DETACH = 2
SYSCALLS = {"x86_64": {"pivot_root": 155, "keyctl": 250},   # the numbers of the calls libc has no wrapper for
            "aarch64": {"pivot_root": 41, "keyctl": 219}, "riscv64": {"pivot_root": 41, "keyctl": 219}}
KEYCTL_JOIN_SESSION_KEYRING = 1
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
DEVICES = ("null", "zero", "random", "urandom")
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def exec_code(spec: dict) -> None:
    """In the code's process: the rlimits, no capabilities (in the namespaces), no new privileges, no inherited
    descriptor but 0-2, then the code. Never returns."""
    try:
        _limit_and_exec(spec)
    except OSError as e:
        print(f"tripod sandbox: cannot run {spec['python']}: {e}", file=sys.stderr, flush=True)
    finally:
        os._exit(127)


def _limit_and_exec(spec: dict) -> None:
    cpu, mem, cap = spec["cpu_s"], spec["memory_mb"] << 20, spec["output_bytes"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec["nofile"], spec["nofile"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = ctypes.CDLL(None, use_errno=True)
    if spec["isolated"]:
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
        # the setup's capabilities (in the new user namespace, kept across exec as ambient ones by --keep-caps): none
        header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
        if libc.capset(ctypes.byref(header), data) != 0:
            _raise("capset")
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.closerange(3, 1 << 20)
    os.execve(spec["python"], [spec["python"], "-I", spec["code"]], spec["env"])


def setup(spec: dict) -> None:
    """pid 1 of the new namespaces: build the new root, pivot into it, run the code as spec["id"], report its status.
    Exiting kills everything left in the pid namespace."""
    code_id = spec["id"]  # the code's uid and gid inside
    os.write(spec["ready_fd"], b".")
    if os.read(spec["go_fd"], 1) != b".":
        os._exit(125)
    os.umask(0o022)
    new_root, work = os.path.join(spec["root"], "newroot"), spec["work"]
    plan = _visible_paths(spec)  # opened before the uid changes: a root tripod's paths may pass through 0700 dirs
    _mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,uid={code_id},gid={code_id},size=1m")
    os.chdir(new_root)
    try:
        os.setgroups([])  # a root tripod's supplementary groups; denied (and not needed) in the unprivileged case
    except PermissionError:
        pass
    os.setresgid(code_id, code_id, code_id)
    os.setresuid(code_id, code_id, code_id)  # inside-root is unmapped, so the capabilities stay until exec
    for inside, kind, source in plan:
        rel = inside.lstrip("/")
        os.makedirs(os.path.dirname(rel) or ".", exist_ok=True)
        if kind == "link":
            os.symlink(source, rel)
            continue
        if kind == "dir":
            os.makedirs(rel, exist_ok=True)
        else:
            open(rel, "x").close()
        _mount(f"/proc/self/fd/{source}", rel, None, MS_BIND | MS_REC)
        os.close(source)
    os.mkdir("proc")
    _mount("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    work_rel = work.lstrip("/")
    os.makedirs(work_rel)
    _mount("tmpfs", work_rel, "tmpfs", MS_NOSUID | MS_NODEV,
           f"mode=0700,uid={code_id},gid={code_id},size={spec['memory_mb']}m")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, os.path.join("dev", name))
    _remount_read_only(new_root, keep={"proc", work_rel})
    with open("proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.sethostname(b"sandbox", 7) != 0:
        _raise("sethostname")
    if platform.machine() not in SYSCALLS:
        raise OSError(f"no known pivot_root and keyctl system call numbers for {platform.machine()}")
    number = SYSCALLS[platform.machine()]
    if libc.syscall(number["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None) < 0:  # a fresh one, not tripod's
        _raise("keyctl(JOIN_SESSION_KEYRING)")
    if libc.syscall(number["pivot_root"], b".", b".") != 0:
        _raise("pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:  # the old root, now stacked on the new one
        _raise("umount of the old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.close(spec["ready_fd"])
    os.close(spec["go_fd"])
    pid = os.fork()
    if pid == 0:
        os.close(spec["report_fd"])
        os.chdir(work)
        exec_code(spec)
    while True:  # reap orphans too: left as zombies they would count against RLIMIT_NPROC
        done, status = os.wait()
        if done == pid:
            break
    os.write(spec["report_fd"], str(os.waitstatus_to_exitcode(status)).encode())


def _visible_paths(spec: dict) -> list[tuple[str, str, str | int]]:
    """(path inside, "link" / "dir" / "file", link target or an O_PATH descriptor of the source) for everything the
    code sees from the host, the interpreter's installation prefix included."""
    plan: list[tuple[str, str, str | int]] = []
    for name in SYSTEM_DIRS:
        path = "/" + name
        if os.path.islink(path):
            plan.append((path, "link", os.readlink(path)))
        elif os.path.isdir(path):
            plan.append((path, "dir", os.open(path, os.O_PATH)))
    covered = tuple(p + "/" for p, kind, _ in plan if kind == "dir")
    prefix = os.path.dirname(os.path.dirname(spec["python"]))
    if not (prefix + "/").startswith(covered):
        plan.append((prefix, "dir", os.open(prefix, os.O_PATH)))
    files = (["/etc/ld.so.cache"] if os.path.isfile("/etc/ld.so.cache") else []) + [spec["code"]]
    files += [f"/dev/{d}" for d in DEVICES]
    return plan + [(path, "file", os.open(path, os.O_PATH)) for path in files]


def _remount_read_only(new_root: str, keep: set[str]) -> None:
    """Make every mount below the new root read-only (the submounts of recursive binds too), keeping the flags the
    kernel locked on them (atime, nodev, noexec), but the work tmpfs, /proc and the device nodes."""
    with open("/proc/self/mountinfo") as f:
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in f]
    for point in points:
        rel = point[len(new_root) + 1:]
        if not point.startswith(new_root + "/") or rel in keep or rel.startswith("dev/"):
            continue
        have = os.statvfs(rel).f_flag
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | (MS_NOEXEC if have & os.ST_NOEXEC else 0)
        flags |= (MS_NOATIME if have & os.ST_NOATIME else MS_RELATIME if have & os.ST_RELATIME else MS_STRICTATIME)
        flags |= MS_NODIRATIME if have & os.ST_NODIRATIME else 0
        _mount(None, rel, None, flags)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    if ctypes.CDLL(None, use_errno=True).mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags),
                                               enc(data)) != 0:
        _raise(f"mount {source or ''} on {target}")


def _raise(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    if not spec["isolated"]:
        exec_code(spec)
    try:
        setup(spec)
    except Exception as e:  # noqa: BLE001  (any failure is the setup's: say it once, on the code's stderr)
        print(f"tripod sandbox: setup failed: {e}", file=sys.stderr, flush=True)
        os._exit(125)
