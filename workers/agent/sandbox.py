"""Runs untrusted, model-written Python (the ``python`` tool) in an isolated process.

Owns `run_python`, `check_sandbox` and their two records. The code never runs in the caller's
process: `run_python` starts ``sandbox_exec.py`` (see its docstring for the process tree) in a new
session, with Popen's own fork/exec and no ``preexec_fn``, so it is safe in threaded workers.

Isolation, all from Linux namespaces (no root needed where unprivileged user namespaces work):
- a fresh user namespace, uid 65534, no capabilities, no_new_privs;
- a fresh network namespace with loopback down: no network at all, 127.0.0.1 included;
- a fresh mount namespace whose root holds only read-only /usr and the Python prefix, four device
  nodes and a private tmpfs at /sandbox (the working directory; gone with the namespace);
- a fresh pid namespace whose init is the code itself: when it exits every descendant dies;
- a cgroup of its own per call where the host lets the caller write one (`workers.agent.cgroup`):
  the sum of its processes' memory and of its /sandbox tmpfs stays within ``memory_mb``, its
  processes within ``max_processes`` (plus the launcher's three); elsewhere a per-process
  fallback whose rlimits add up to ``memory_mb``. `memory_plan` says which holds here;
- rlimits: RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_NPROC (fork bombs), RLIMIT_FSIZE, RLIMIT_NOFILE,
  RLIMIT_CORE=0; here a wall-clock deadline and the output cap.

Error values in `SandboxResult.error`:
- None: the code ran to its end; ``exit_code`` is its exit status (a syntax error or an uncaught
  exception is exit 1 with the traceback on stderr, and still ``error=None``: the model reads it).
- "timeout": wall clock past ``wall_s``, or CPU time past ``cpu_s`` (SIGXCPU, or the SIGKILL of the
  hard limit a second later when SIGXCPU is caught).
- "memory": exit with a ``MemoryError`` traceback, i.e. an allocation refused by RLIMIT_AS; or
  killed while the call's cgroup's OOM killer ended one of its processes.
- "output_limit": stdout or stderr went past ``max_output_bytes``; killed at once.
- "crashed": ended by a signal other than the ones above (SIGSEGV, SIGABRT, ...).
- "killed": SIGKILL not from the CPU limit, or the launcher died before reporting a status.
- "unavailable": isolation cannot be set up here (`check_sandbox` says why); the code did not run.
``exit_code`` is the exit status, minus the signal number when a signal ended it, None when unknown.

Needs no root: unprivileged user namespaces suffice (a non-root caller's code then runs under the
caller's own uid outside, and ``os.killpg(0, 9)`` can end the launcher: error "killed").

Not protected against:
- kernel bugs: the code shares the host kernel and no seccomp filter narrows its system calls;
- total CPU: RLIMIT_CPU holds per process, so up to ``max_processes`` times ``cpu_s``, and the
  code competes with the worker for cores until ``wall_s`` (the cgroup has no cpu controller);
- reading what is world-readable under /usr and the Python prefix (its site-packages included),
  and what the kernel tells anyone (uname, CPU model, clocks, timing side channels).
The code sees the standard library and the base interpreter's own site-packages, never the
worker's virtualenv.
"""

from __future__ import annotations

import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from workers.agent import cgroup
from workers.settings import SandboxLimits  # (the limits a call runs under, declared there)

log = logging.getLogger(__name__)
_EXEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_exec.py")
_KILL_GRACE_S = 5.0  # after a kill: how long to wait for the tree to go and the pipes to close
DEFAULTS = SandboxLimits()  # env.sandbox.*'s defaults


@dataclass(frozen=True)
class SandboxResult:
    stdout: str  # UTF-8, undecodable bytes replaced; at most max_output_bytes bytes before decoding
    stderr: str
    exit_code: int | None
    error: str | None  # None or one of the values in the module docstring
    wall_s: float


_check_lock = threading.Lock()
_check_result: list[str | None] = []  # [None] once a probe succeeded in this process

_PROBE = """
import os, socket
assert os.getuid() == 65534, os.getuid()
assert os.getcwd() == "/sandbox", os.getcwd()
s = socket.socket()
try:
    s.connect(("127.0.0.1", 9))
except OSError:
    pass
else:
    raise SystemExit("network reachable")
print("sandbox-ok")
"""


def check_sandbox() -> str | None:
    """None when isolation works here, else a one-line reason. One successful probe per process."""
    with _check_lock:
        if _check_result:
            return _check_result[0]
        reason = _probe()
        if reason is None:  # a failure is probed again next time: it may have been transient
            _check_result.append(reason)
        return reason


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux namespaces; this is {sys.platform}"
    try:
        res = _run(_PROBE, SandboxLimits(wall_s=20.0, cpu_s=5.0), time.monotonic())
    except Exception as exc:  # noqa: BLE001 - a reason, never a raise
        return f"sandbox probe failed: {type(exc).__name__}: {exc}"
    if res.stdout.strip() == "sandbox-ok" and res.exit_code == 0:
        return None
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    detail = lines[-1] if lines else f"exit {res.exit_code}, error {res.error}"
    return f"sandbox probe failed: {detail}"


def memory_plan(limits: SandboxLimits = DEFAULTS) -> cgroup.MemoryPlan:
    """What caps the sum of a call's memory on this host, and the limits a call runs under."""
    return cgroup.plan(limits.memory_mb, limits.max_processes, cgroup.host())


def _call_cgroup(limits: SandboxLimits) -> tuple[cgroup.MemoryPlan, cgroup.CallCgroup | None]:
    host = cgroup.host()
    if host.mode != cgroup.FALLBACK:
        try:
            made = cgroup.CallCgroup.create(host, limits.memory_mb,
                                            limits.max_processes + cgroup.LAUNCHER_PROCESSES)
            return cgroup.plan(limits.memory_mb, limits.max_processes, host), made
        except OSError as exc:  # this call alone runs under the fallback's limits
            log.warning("sandbox: cannot make the call's cgroup, per-process limits: %s", exc)
            host = cgroup.Host(cgroup.FALLBACK, reason=f"cannot make the call's cgroup: {exc}")
    return cgroup.plan(limits.memory_mb, limits.max_processes, host), None


def run_python(code: str, limits: SandboxLimits = DEFAULTS) -> SandboxResult:
    """Runs ``code`` isolated under ``limits``. Never raises: every failure is an error result."""
    start = time.monotonic()
    try:
        reason = check_sandbox()
        if reason is not None:
            return SandboxResult("", reason, None, "unavailable", time.monotonic() - start)
        return _run(code, limits, start)
    except Exception as exc:  # noqa: BLE001 - the caller must never die of a tool call
        return SandboxResult("", f"sandbox: {type(exc).__name__}: {exc}", None, "unavailable",
                             time.monotonic() - start)


class _Outputs:
    """Drains stdout, stderr and the status pipe together until EOF, the deadline or overflow."""

    def __init__(self, proc: subprocess.Popen, status_r: int, cap: int) -> None:
        self.cap = cap
        self.data = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
        self.overflow = False
        self.sel = selectors.DefaultSelector()
        self.sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        self.sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        self.sel.register(status_r, selectors.EVENT_READ, "status")

    def pump(self, deadline: float, stop_on_overflow: bool = True) -> bool:
        """Reads until every pipe is at EOF (True) or the deadline or an overflow (False)."""
        while self.sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0 or (stop_on_overflow and self.overflow):
                return False
            for key, _ in self.sel.select(timeout=min(left, 0.5)):
                fd = key.fd if isinstance(key.fileobj, int) else key.fileobj.fileno()
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.sel.unregister(key.fileobj)
                    continue
                buf = self.data[key.data]
                keep = (self.cap + 1 if key.data != "status" else 65536) - len(buf)
                buf += chunk[:max(keep, 0)]  # one byte past the cap is enough to know
                if key.data != "status" and len(buf) > self.cap:
                    self.overflow = True
        return True

    def close(self) -> None:
        self.sel.close()


def _kill_tree(proc: subprocess.Popen) -> None:
    # the launcher leads its own session; the payload dies with it (death signals, pid namespace)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run(code: str, limits: SandboxLimits, start: float) -> SandboxResult:
    tmp = tempfile.mkdtemp(prefix="sandbox-")
    status_r, status_w = os.pipe()
    proc, cg = None, None
    try:
        plan, cg = _call_cgroup(limits)
        with open(os.path.join(tmp, "code.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        spec = {"dir": tmp, "status_fd": status_w, "python": os.path.realpath(sys.executable),
                "prefix": os.path.realpath(sys.base_prefix), "cpu_s": limits.cpu_s,
                "process_mb": plan.process_mb, "tmpfs_mb": plan.tmpfs_mb,
                "processes": plan.processes, "cgroup_procs": cg.procs_files if cg else []}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _EXEC, json.dumps(spec)], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,),
            start_new_session=True, cwd=tmp, env={})
        os.close(status_w)
        status_w = -1
        out = _Outputs(proc, status_r, limits.max_output_bytes)
        try:
            finished = out.pump(start + limits.wall_s)
            timed_out = not finished and not out.overflow
            _kill_tree(proc)  # always: nothing of the sandbox outlives this call
            out.pump(time.monotonic() + _KILL_GRACE_S, stop_on_overflow=False)
        finally:
            out.close()
        proc.wait(timeout=_KILL_GRACE_S)
        oom_kills = cg.oom_kills() if cg else 0
        return _result(out, limits, timed_out, oom_kills, time.monotonic() - start)
    finally:
        if proc is not None and proc.returncode is None:
            _kill_tree(proc)
            proc.wait()
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        if proc is not None:
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
        if cg is not None:
            cg.close(_KILL_GRACE_S)
        shutil.rmtree(tmp, ignore_errors=True)


def _result(out: _Outputs, limits: SandboxLimits, timed_out: bool, oom_kills: int,
            wall: float) -> SandboxResult:
    cap = limits.max_output_bytes
    stdout = bytes(out.data["stdout"][:cap]).decode("utf-8", errors="replace")
    stderr = bytes(out.data["stderr"][:cap]).decode("utf-8", errors="replace")
    setup, status, cpu = None, None, 0.0
    for line in out.data["status"].decode("utf-8", errors="replace").splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "setup" and setup is None:
            setup = rest
        elif kind == "wait":
            raw, _, cpu_s = rest.partition(" ")
            status, cpu = int(raw), float(cpu_s)
    exit_code = None if status is None else os.waitstatus_to_exitcode(status)
    if out.overflow:
        return SandboxResult(stdout, stderr, exit_code, "output_limit", wall)
    if timed_out:
        return SandboxResult(stdout, stderr, exit_code, "timeout", wall)
    if setup is not None:  # only the launcher writes "setup": the code never ran
        return SandboxResult(stdout, f"sandbox setup failed: {setup}", None, "unavailable", wall)
    error = _classify(exit_code, stderr, cpu, limits)
    if error == "killed" and oom_kills:  # SIGKILL from the cgroup's OOM killer
        error = "memory"
    return SandboxResult(stdout, stderr, exit_code, error, wall)


def _classify(exit_code: int | None, stderr: str, cpu: float, limits: SandboxLimits) -> str | None:
    if exit_code is None:
        return "killed"
    if exit_code == -signal.SIGXCPU:
        return "timeout"
    if exit_code == -signal.SIGKILL:
        return "timeout" if cpu >= max(1, math.ceil(limits.cpu_s)) - 0.05 else "killed"
    if exit_code < 0:
        return "crashed"
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if exit_code != 0 and lines and lines[-1].startswith("MemoryError"):
        return "memory"
    return None
