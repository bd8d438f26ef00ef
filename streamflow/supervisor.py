"""Child processes of a run on one host: start them, watch them, restart them, stop them.

Children die with the supervising process (``PR_SET_PDEATHSIG``) and run in their own session (a
terminal Ctrl-C reaches the supervisor only); ``stop_all`` stops workers before stores and reaps
every process ever started. Restart policy and its reasons: docs/controller.md "The supervisor".
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1
log = logging.getLogger("streamflow.supervisor")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: children are still stopped by stop_all on every normal exit path


@dataclass(frozen=True)
class RestartPolicy:
    """How often a child that exits abnormally after becoming ready is started again."""

    max_restarts: int  # per child (run.max_restarts); 0 = any abnormal exit fails the run
    backoff_s: float = 0.5  # delay before the first restart; doubled for each further one
    backoff_max_s: float = 10.0  # cap of that delay


@dataclass
class Child:
    name: str  # e.g. "rollout-0", "store-0"
    role: str
    popen: subprocess.Popen
    log_path: Path
    argv: list[str]
    threads: int  # OMP/MKL threads of its process (<role>.threads; 1 for a store node)
    restarts: int = 0  # times this child was started again
    ready: bool = False  # the current process reported ready (set by the owner)
    ever_ready: bool = False  # some process of this child reported ready: restarts allowed
    # Called before a restart; may rewrite ``argv`` (e.g. a config to resume from). Raising
    # refuses the restart: the exception's text becomes the failure's cause.
    before_restart: Callable[[Child], None] | None = None
    on_restarted: Callable[[Child], None] | None = None  # called once the new process runs
    failure: str | None = None  # why the child failed terminally (set by ``check``)
    restart_at: float | None = None  # monotonic time of a scheduled restart
    exit_codes: list[int] = field(default_factory=list)  # abnormal exits so far

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def mark_ready(self) -> None:
        self.ready = self.ever_ready = True

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def describe_failure(self) -> str:
        """The cause of a terminal failure and the log tail: what a failed run reports."""
        cause = self.failure or f"{self.name} exited with status {self.exit_code()}"
        return f"{cause}:\n{self.log_tail()}"


class Supervisor:
    def __init__(self, log_dir: str | os.PathLike, policy: RestartPolicy) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        self.policy = policy
        self.children: dict[str, Child] = {}
        self._spawned: list[subprocess.Popen] = []  # every process started, for stop_all to reap
        self.stopping = False  # stop_all began: no restart from now on
        self.forced = False  # kill_all was called: no grace period, no ``between``

    def start(self, name: str, role: str, argv: list[str], *, threads: int) -> Child:
        if name in self.children:
            raise ValueError(f"a child named {name!r} already runs")
        log_path = self.log_dir / f"{name}.log"
        proc = self._spawn(argv, threads, log_path)
        child = Child(name, role, proc, log_path, list(argv), threads)
        self.children[name] = child
        return child

    def _spawn(self, argv: list[str], threads: int, log_path: Path) -> subprocess.Popen:
        env = {**self.env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads),
               "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_OFFLINE": "1"}
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(
                argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                preexec_fn=_die_with_parent,
                start_new_session=True)  # the terminal's Ctrl-C is the parent's to handle
        self._spawned.append(popen)
        return popen

    def check(self) -> Child | None:
        """Apply the restart policy (scheduled restarts happen here: call it often); the first
        child that failed terminally, if any. Does nothing once ``stop_all`` began."""
        if self.stopping:
            return None
        now = time.monotonic()
        for child in self.children.values():
            code = child.exit_code()
            if code in (None, 0):
                continue
            if child.failure is not None:
                return child
            if child.restart_at is None:
                child.ready = False
                child.exit_codes.append(code)
                if not child.ever_ready:
                    child.failure = (f"{child.name} exited with status {code} before it was ready "
                                     "(not restarted)")
                    return child
                if child.restarts >= self.policy.max_restarts:
                    child.failure = (f"{child.name} exited with status {code} after "
                                     f"{child.restarts} restart(s) "
                                     f"(run.max_restarts={self.policy.max_restarts})")
                    return child
                delay = min(self.policy.backoff_s * 2**child.restarts, self.policy.backoff_max_s)
                child.restart_at = now + delay
                log.warning("%s exited with status %s; restart %d/%d in %.1fs", child.name, code,
                            child.restarts + 1, self.policy.max_restarts, delay)
            elif now >= child.restart_at:
                self._restart(child)
                if child.failure is not None:
                    return child
        return None

    def _restart(self, child: Child) -> None:
        child.restart_at = None
        if self.stopping:
            return
        try:
            if child.before_restart is not None:
                child.before_restart(child)
        except Exception as exc:
            child.failure = f"{child.name} exited with status {child.exit_code()}; {exc}"
            return
        child.restarts += 1
        child.ready = False
        with open(child.log_path, "a") as fh:  # the log keeps the dead process's lines above
            fh.write(f"\n--- supervisor: restart {child.restarts} of {child.name} ---\n")
        child.popen = self._spawn(child.argv, child.threads, child.log_path)
        log.warning("%s restarted (pid %d)", child.name, child.popen.pid)
        if child.on_restarted is not None:
            try:
                child.on_restarted(child)
            except Exception as exc:
                child.failure = f"{child.name} restarted but could not rejoin: {exc}"

    def stop_all(self, grace_s: float = 10.0, *, between: Callable[[], None] | None = None) -> None:
        """SIGTERM every child (workers first, then the stores), wait, SIGKILL the rest;
        ``between`` runs between the two groups. Every process started is reaped on return."""
        self.stopping = True
        try:
            self._stop_groups(grace_s, between)
        finally:
            self._reap_all()

    def kill_all(self) -> None:
        """Force the stop (a second Ctrl-C): SIGKILL every live child now. Signal-safe: it only
        sends signals; ``stop_all``'s waits then return at once and it skips ``between``."""
        self.stopping = self.forced = True
        for popen in self._spawned:
            if popen.poll() is None:
                with contextlib.suppress(OSError):  # exited meanwhile
                    popen.kill()

    def _stop_groups(self, grace_s: float, between: Callable[[], None] | None) -> None:
        for group_last in (False, True):
            if group_last and between is not None and not self.forced:
                try:
                    between()
                except Exception:  # bookkeeping only: never block the shutdown
                    pass
            group = [c for c in self.children.values() if (c.role == "store") == group_last]
            for child in group:
                if child.exit_code() is None and not self.forced:
                    child.popen.send_signal(signal.SIGCONT)  # a frozen child must see SIGTERM
                    child.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for child in group:
                try:
                    child.popen.wait(max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    child.popen.kill()
                    child.popen.wait()

    def _reap_all(self) -> None:
        """SIGKILL and wait for every process started that has not been waited for yet (a
        graceful stop that was cut short; exited ones are only reaped)."""
        for popen in self._spawned:
            if popen.poll() is None:  # poll() reaps one that has exited
                popen.kill()  # also ends a stopped (SIGSTOP) one
                popen.wait()
