"""The sandbox launcher: a standalone script that isolates itself, then runs model-written code.

`workers.agent.sandbox` starts it as ``python -I -S sandbox_exec.py SPEC_JSON`` in a new session;
it imports only the standard library, because with ``-I -S`` nothing else is on its path. It never
runs in a worker's process, so ``fork`` here is safe (this process has one thread).

Process tree (one job each)::

    launcher L  (caller's uid, initial namespaces)  builds the root skeleton, writes C's id maps
      └─ C      new user/mount/net/pid/ipc/uts namespaces; waits for I
          └─ I  pid 1 of the new pid namespace: mounts, pivot_root; reaps; reports G's status
              └─ G  drops to uid 65534, sets rlimits and no_new_privs, execs Python on the code

Invariants:
- Where the call has a cgroup (``cgroup_procs``), L writes its own pid into it before anything
  else, so C, I, G and whatever the code starts are all inside before the code runs.
- The code runs as uid 65534 of a fresh user namespace; RLIMIT_NPROC counts per user namespace,
  so each sandbox has its own allowance. Under a root caller that uid maps to ``UID_BASE +
  pid(L)`` outside: never 0 (root is exempt from RLIMIT_NPROC and may signal anyone), unique
  among live sandboxes (pids are), so the code cannot signal or trace the caller, L, C or I (all
  uid 0). Under a non-root caller it maps to the caller's own uid (the only mapping allowed
  unprivileged): the pid namespace then hides the caller, but ``kill(0, ...)`` reaches L and C.
- G's execve drops every capability (its uid is not root in its namespace); no_new_privs is set.
- The network namespace is new and its loopback stays down: every connect fails.
- The root is a read-only bind of a skeleton holding read-only binds of /usr and the Python
  prefix, four device nodes, and a size-limited tmpfs at /sandbox (the cwd). No /proc, no /etc,
  no /tmp. The old root is detached.
- When I exits (right after G), the kernel kills every process of the pid namespace. C dies with
  L and I dies with C (PR_SET_PDEATHSIG); the caller kills L's process group when done.
- The status pipe (close-on-exec, so the code never holds it) carries one line per event:
  ``setup MESSAGE`` when isolation failed before the code ran, ``wait STATUS CPU_S`` from I.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import platform
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 4096
# Remounting a bind inside a user namespace must keep the flags the kernel locked on the source.
KEEP_FLAGS = MS_NOEXEC | MS_NOATIME | MS_NODIRATIME | MS_RELATIME
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SANDBOX_UID = 65534
UID_BASE = 2_000_000_000  # + launcher pid: above any real account, below 2**32 - 1
DEVICES = ("null", "zero", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (src, dst, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {dst}")


def _report(fd: int, line: str) -> None:
    try:
        os.write(fd, (line.replace("\n", " ")[:500] + "\n").encode())
    except OSError:
        pass


def _skeleton(root: str, binds: list[str]) -> None:
    """Empty mount points for the new root, made by L while it can still create files here."""
    for path in binds:
        dst = root + path
        os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
        if os.path.islink(path):
            os.symlink(os.readlink(path), dst)
        elif os.path.isdir(path):
            os.makedirs(dst, mode=0o755, exist_ok=True)
    os.makedirs(root + "/dev", mode=0o755)
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
    os.makedirs(root + "/sandbox", mode=0o755)
    for dirpath, _dirs, _files in os.walk(root):
        os.chmod(dirpath, 0o755)


def _bind_ro(src: str, dst: str, extra: int) -> None:
    try:
        _mount(src, dst, None, MS_BIND)
    except OSError:  # a source with locked submounts can only be bound recursively
        _mount(src, dst, None, MS_BIND | MS_REC)
    kept = os.statvfs(src).f_flag & KEEP_FLAGS
    _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | extra | kept)


def _build_root(root: str, binds: list[str], spec: dict) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount(root, root, None, MS_BIND)  # pivot_root needs the new root to be a mount point
    for path in binds:
        if not os.path.islink(path):
            _bind_ro(path, root + path, MS_NODEV)
    for name in DEVICES:
        _bind_ro(f"/dev/{name}", f"{root}/dev/{name}", MS_NOEXEC)
    size = f"size={spec['tmpfs_mb']}m,nr_inodes=4096,mode=700,uid={SANDBOX_UID},gid={SANDBOX_UID}"
    _mount("tmpfs", root + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, size)
    os.chdir(root)
    nr = SYS_PIVOT_ROOT[platform.machine()]
    _check(_libc.syscall(nr, b".", b"."), "pivot_root")  # old root now stacked under "."
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    kept = os.statvfs("/").f_flag & KEEP_FLAGS
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)
    os.chdir("/sandbox")


def _limit(spec: dict) -> None:
    mib = 1024 * 1024
    cpu = max(1, math.ceil(spec["cpu_s"]))
    # soft CPU limit -> SIGXCPU; the hard one (a second later) -> SIGKILL if SIGXCPU is caught
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (spec["process_mb"] * mib,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["tmpfs_mb"] * mib,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _exec_payload(spec: dict, code: str) -> None:
    """G: pid 2, drops to uid 65534 and execs the code. Never returns."""
    if spec["root_mode"]:
        os.setgroups([])  # drop root's supplementary groups: they would still open files
    os.setresgid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
    os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
    argv = [spec["python"], "-I", "-X", "utf8"]
    try:  # argv strings are capped at 128 KiB, and must encode
        inline = "\x00" not in code and len(code.encode()) <= 100_000
    except UnicodeEncodeError:  # a lone surrogate: its bytes make Python report it, as code
        inline = False
    if not inline:
        with open("/sandbox/main.py", "wb") as f:
            f.write(code.encode("utf-8", errors="surrogatepass"))
        argv.append("/sandbox/main.py")
    else:
        argv += ["-c", code]  # in argv, so /proc/PID/cmdline shows what a process runs
    env = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8"}
    _limit(spec)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    os.execve(spec["python"], argv, env)


def _init(spec: dict, code: str, root: str, binds: list[str], status_fd: int) -> None:
    """I: pid 1 of the new namespaces. Builds the root, runs G, reaps until G ends, exits.

    The code runs as pid 2, not as init, so default signal actions (SIGXCPU, SIGALRM, ...) apply
    to it as anywhere else. I keeps its outer uid, so the code cannot signal or trace it.
    """
    try:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _build_root(root, binds, spec)
        pid = os.fork()
        if pid == 0:
            try:
                _exec_payload(spec, code)
            except BaseException as exc:  # noqa: BLE001 - anything here means isolation failed
                _report(status_fd, f"setup {type(exc).__name__}: {exc}")
            os._exit(127)
        while True:  # orphans of the code are reparented here: reap them too
            child, status, usage = os.wait4(-1, 0)
            if child == pid:
                _report(status_fd, f"wait {status} {usage.ru_utime + usage.ru_stime:.3f}")
                os._exit(0)  # the kernel now kills what is left of the namespace
    except BaseException as exc:  # noqa: BLE001
        _report(status_fd, f"setup {type(exc).__name__}: {exc}")
    os._exit(127)


def _waiter(spec: dict, code: str, root: str, binds: list[str], status_fd: int,
            ready_w: int, go_r: int) -> None:
    """C: enters the new namespaces, waits for its id maps, forks I and waits for it."""
    try:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC
        _check(_libc.unshare(flags | CLONE_NEWUTS), "unshare")
        os.write(ready_w, b"r")
        if os.read(go_r, 1) != b"g":
            os._exit(127)  # L reported why
        pid = os.fork()
        if pid == 0:
            _init(spec, code, root, binds, status_fd)
        os.waitpid(pid, 0)
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001
        _report(status_fd, f"setup {type(exc).__name__}: {exc}")
        os._exit(127)


def _write_maps(pid: int, root_mode: bool) -> None:
    if root_mode:
        outer_uid = outer_gid = UID_BASE + os.getpid()
    else:
        outer_uid, outer_gid = os.getuid(), os.getgid()
        with open(f"/proc/{pid}/setgroups", "w") as f:  # required before an unprivileged gid_map
            f.write("deny")
    with open(f"/proc/{pid}/uid_map", "w") as f:
        f.write(f"{SANDBOX_UID} {outer_uid} 1\n")
    with open(f"/proc/{pid}/gid_map", "w") as f:
        f.write(f"{SANDBOX_UID} {outer_gid} 1\n")


def main() -> int:
    spec = json.loads(sys.argv[1])
    status_fd = spec["status_fd"]
    spec["root_mode"] = os.geteuid() == 0
    os.set_inheritable(status_fd, False)  # closed by the payload's execve
    try:
        for procs in spec["cgroup_procs"]:  # first: every process after this one starts inside
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        with open(os.path.join(spec["dir"], "code.py"), encoding="utf-8",
                  errors="surrogatepass") as f:
            code = f.read()
        root = os.path.join(spec["dir"], "root")
        binds = ["/usr", "/lib", "/lib64", "/bin", "/sbin"]
        binds = [p for p in binds if os.path.lexists(p)]
        if not spec["prefix"].startswith("/usr/"):
            binds.append(spec["prefix"])
        _skeleton(root, binds)
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _waiter(spec, code, root, binds, status_fd, ready_w, go_r)
        os.close(ready_w)
        os.close(go_r)
        if os.read(ready_r, 1) == b"r":
            try:
                _write_maps(pid, spec["root_mode"])
                os.write(go_w, b"g")
            except OSError as exc:
                _report(status_fd, f"setup id maps: {exc}")
        os.close(go_w)
        os.waitpid(pid, 0)
    except BaseException as exc:  # noqa: BLE001
        _report(status_fd, f"setup {type(exc).__name__}: {exc}")
        return 127
    return 0


if __name__ == "__main__":
    sys.exit(main())
