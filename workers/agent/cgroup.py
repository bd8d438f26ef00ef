"""Caps the sum of one sandbox call's memory and processes: a cgroup per call, or a fallback.

Owns finding which cgroup interface this host lets the caller write (`host`), the limits a call
runs under (`MemoryPlan`, from `plan`) and one call's cgroup (`CallCgroup`). Modes:

- "cgroup-v2": a unified hierarchy (``ROOT/cgroup.controllers``) where the caller's own cgroup,
  or else its parent, can hold children with the memory and pids controllers (enabled in its
  ``cgroup.subtree_control`` if they are not yet: this fails in a cgroup that holds processes,
  the root excepted). Each call gets ``memory.max`` = memory_mb (``memory.swap.max`` 0) and
  ``pids.max``.
- "cgroup-v1": memory and pids hierarchies (``ROOT/memory``, ``ROOT/pids``) with a writable
  cgroup of the caller's. Each call gets ``memory.limit_in_bytes`` = memory_mb (and
  ``memory.memsw.limit_in_bytes``, so swap cannot bypass it) and ``pids.max``.
- "per-process fallback": no writable cgroup (not root, a read-only /sys/fs/cgroup, no such
  controllers). The sum is bounded by rlimits alone: the /sandbox tmpfs gets a quarter of
  memory_mb, and the rest is split between at most ``max_processes`` processes of RLIMIT_AS each,
  fewer where each would get under ``FALLBACK_MIN_PROCESS_MB``:
  ``processes * process_mb + tmpfs_mb <= memory_mb``.

In a cgroup mode the per-process limits stay those of the settings (RLIMIT_AS = memory_mb, so one
large allocation is still a plain ``MemoryError``), and the cgroup caps the sum of the call's
processes' memory and of the pages its tmpfs holds (shmem is charged to the cgroup that writes
it). Whether a mode works is found by making and removing a probe cgroup, once per process.

Invariants of `CallCgroup`: it exists before the launcher starts; the launcher writes its own pid
into every ``procs_files`` before it forks anything, so every process of the call is inside before
any code runs; `CallCgroup.close` kills what is left in it, waits until it is empty and removes
it. A worker killed during a call leaves an empty cgroup named after its pid behind.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

ROOT = "/sys/fs/cgroup"  # where the hierarchies are mounted (tests point it elsewhere)
V2, V1, FALLBACK = "cgroup-v2", "cgroup-v1", "per-process fallback"
# The launcher's own processes (sandbox_exec's L, C and I) in the cgroup besides the code's.
LAUNCHER_PROCESSES = 3
# Fallback only: the share of memory_mb that the /sandbox tmpfs gets (1/N), and the least
# RLIMIT_AS a process gets, under which Python can hardly import its standard library
# (docs/training.md, "The python tool's sandbox").
FALLBACK_TMPFS_SHARE = 4
FALLBACK_MIN_PROCESS_MB = 32
_MIB = 1024 * 1024
_names = itertools.count()


@dataclass(frozen=True)
class Host:
    """What caps a call here: the mode, the directories a call's cgroup is made in (v2: one;
    v1: the memory one, then the pids one; none in the fallback) and why the fallback."""

    mode: str
    parents: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    """The limits one call runs under; ``memory_mb`` caps their sum."""

    mode: str
    memory_mb: int  # the cgroup's limit, or the bound the fallback's rlimits keep to
    process_mb: int  # RLIMIT_AS of each process
    tmpfs_mb: int  # the /sandbox tmpfs and RLIMIT_FSIZE
    processes: int  # RLIMIT_NPROC (the code's processes and threads)
    reason: str = ""  # why the fallback

    def describe(self) -> str:
        if self.mode != FALLBACK:
            return (f"{self.mode}: a cgroup per call holds its processes' memory and its "
                    f"/sandbox tmpfs to {self.memory_mb} MiB together, and its processes to "
                    f"{self.processes} (+{LAUNCHER_PROCESSES} of the launcher); RLIMIT_AS "
                    f"{self.process_mb} MiB each")
        return (f"{FALLBACK} ({self.reason}): {self.processes} processes x RLIMIT_AS "
                f"{self.process_mb} MiB + a {self.tmpfs_mb} MiB /sandbox tmpfs <= "
                f"{self.memory_mb} MiB")


def plan(memory_mb: int, max_processes: int, host_: Host) -> MemoryPlan:
    if host_.mode != FALLBACK:
        return MemoryPlan(host_.mode, memory_mb, memory_mb, memory_mb, max_processes)
    tmpfs_mb = max(1, memory_mb // FALLBACK_TMPFS_SHARE)
    budget = memory_mb - tmpfs_mb
    processes = max(1, min(max_processes, budget // FALLBACK_MIN_PROCESS_MB))
    return MemoryPlan(FALLBACK, memory_mb, budget // processes, tmpfs_mb, processes,
                      host_.reason)


_hosts: dict[str, Host] = {}
_hosts_lock = threading.Lock()


def host() -> Host:
    """The mode in force under ``ROOT``; probed once per process (and per ``ROOT``)."""
    with _hosts_lock:
        if ROOT not in _hosts:
            _hosts[ROOT] = _detect(ROOT)
        return _hosts[ROOT]


def _own_paths() -> dict[str, str]:
    """controller -> this process's cgroup path ("" for the v2 line)."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(","):
                paths[name] = path
    return paths


def _detect(root: str) -> Host:
    try:
        own = _own_paths()
    except OSError as exc:
        return Host(FALLBACK, reason=f"cannot read /proc/self/cgroup: {exc}")
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        path = own.get("", "/")
        mine = os.path.normpath(root + path)
        for parent in dict.fromkeys([mine, os.path.dirname(mine) if path != "/" else mine]):
            try:
                _enable_v2(parent)
                _probe((parent,), V2)
                return Host(V2, (parent,))
            except OSError as exc:
                reason = f"no writable cgroup v2 with memory and pids at {parent}: {exc}"
        return Host(FALLBACK, reason=reason)
    parents = []
    for name in ("memory", "pids"):
        top = os.path.join(root, name)
        if not os.path.isdir(top):
            return Host(FALLBACK, reason=f"no cgroup v2 and no v1 {name} hierarchy under {root}")
        mine = os.path.normpath(top + own.get(name, "/"))
        parents.append(mine if os.path.isdir(mine) else top)
    try:
        _probe(tuple(parents), V1)
    except OSError as exc:
        return Host(FALLBACK, reason=f"cgroup v1 not writable under {parents[0]}: {exc}")
    return Host(V1, tuple(parents))


def _enable_v2(parent: str) -> None:
    with open(os.path.join(parent, "cgroup.controllers")) as f:
        missing = {"memory", "pids"} - set(f.read().split())
    if missing:
        raise OSError(f"controllers {sorted(missing)} not available")
    with open(os.path.join(parent, "cgroup.subtree_control")) as f:
        if {"memory", "pids"} <= set(f.read().split()):
            return
    _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")


def _probe(parents: tuple[str, ...], mode: str) -> None:
    CallCgroup.create(Host(mode, parents), 64, 8).close(grace_s=1.0)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


class CallCgroup:
    """One call's cgroup: limits set at creation, joined by the launcher, removed by `close`."""

    def __init__(self, mode: str, dirs: tuple[str, ...]) -> None:
        self.mode, self.dirs = mode, dirs
        self.procs_files = [os.path.join(d, "cgroup.procs") for d in dirs]

    @classmethod
    def create(cls, host_: Host, memory_mb: int, max_pids: int) -> CallCgroup:
        """Made with its limits, or OSError with nothing left behind."""
        name = f"streamflow-sandbox-{os.getpid()}-{next(_names)}"
        dirs: list[str] = []
        try:
            for parent in host_.parents:
                os.mkdir(os.path.join(parent, name))
                dirs.append(os.path.join(parent, name))
            mem, pids = dirs[0], dirs[-1]
            limit = str(memory_mb * _MIB)
            if host_.mode == V2:
                _write(os.path.join(mem, "memory.max"), limit)
                if os.path.exists(os.path.join(mem, "memory.swap.max")):
                    _write(os.path.join(mem, "memory.swap.max"), "0")
            else:  # memsw only after memory: it may never be below it
                _write(os.path.join(mem, "memory.limit_in_bytes"), limit)
                if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), limit)
            _write(os.path.join(pids, "pids.max"), str(max_pids))
        except OSError:
            cls(host_.mode, tuple(dirs)).close(grace_s=1.0)
            raise
        return cls(host_.mode, tuple(dirs))

    def peak_bytes(self) -> int | None:
        """The most memory the call held at once (None where the kernel does not say)."""
        name = "memory.peak" if self.mode == V2 else "memory.max_usage_in_bytes"
        raw = _read(os.path.join(self.dirs[0], name))
        return int(raw) if raw and raw.strip().isdigit() else None

    def oom_kills(self) -> int:
        """How many of the call's processes the cgroup's OOM killer ended."""
        name = "memory.events" if self.mode == V2 else "memory.oom_control"
        for line in (_read(os.path.join(self.dirs[0], name)) or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def close(self, grace_s: float) -> None:
        """Kills what is left inside, waits up to ``grace_s`` until it is empty, removes it (a
        warning if not)."""
        deadline = time.monotonic() + grace_s
        kill = os.path.join(self.dirs[0], "cgroup.kill") if self.dirs else ""
        if self.mode == V2 and os.path.exists(kill):
            try:
                _write(kill, "1")
            except OSError:
                pass
        pause = 0.002
        for path in reversed(self.dirs):
            while os.path.isdir(path):
                members = self._members(path)
                for pid in members:
                    _kill(pid, path)
                if not members:
                    try:
                        os.rmdir(path)
                        break
                    except FileNotFoundError:
                        break
                    except OSError as exc:
                        if time.monotonic() > deadline:
                            log.warning("sandbox cgroup %s not removed: %s", path, exc)
                            break
                if time.monotonic() > deadline:
                    log.warning("sandbox cgroup %s not removed: still holds %s", path, members)
                    break
                time.sleep(pause)  # the kernel is still tearing the processes down
                pause = min(pause * 2, 0.05)

    @staticmethod
    def _members(path: str) -> list[int]:
        raw = _read(os.path.join(path, "cgroup.procs"))
        return [int(p) for p in raw.split()] if raw else []


def _kill(pid: int, path: str) -> None:
    """SIGKILL through a pidfd, taken while ``pid`` is still a member: a recycled pid is never
    signalled."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return  # gone
    try:
        if pid in CallCgroup._members(path):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)
