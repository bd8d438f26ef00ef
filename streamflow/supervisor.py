"""Child processes of a run on one host: start them, watch them, restart them, stop them.

Orphans: every child asks the kernel (``PR_SET_PDEATHSIG``) to receive SIGTERM when the
supervising process dies, even by SIGKILL — a killed controller never leaves workers running.

Terminal signals: every child starts in its own session (``start_new_session``), so a Ctrl-C, which
the terminal sends to the whole foreground process group, reaches the supervising process only.
The stop is then the supervisor's to order (``stop_all``: workers first, the store last); before
this, Ctrl-C stopped the store node together with the workers, whose final lease releases then
timed out against a store that was gone.

Lifecycle of a child: started (stdout+stderr appended to ``<log_dir>/<name>.log``) -> running ->
exited. Exit 0 is a normal end. A non-zero exit is handled by ``check()``, the restart policy:

    exited non-zero ──never ready, no restart left, or before_restart refused──► terminal failure
          │                                                                    (the run fails with
          └─ otherwise: restart after backoff_s × 2^restarts (≤ backoff_max_s)   the log tail)
                        same argv (``before_restart`` may rewrite it), ``on_restarted`` runs after

Why "ready" gates restarts: a child that dies before it ever reported ready (bad config, missing
module, a model that cannot load) fails the same way every time — restarting it would only delay
the error, so the run fails at once. A child that was serving and then died (SIGKILL, OOM, a
crash) is restarted up to ``RestartPolicy.max_restarts`` times; its store leases expire and the
rows are redelivered, so the successor simply picks up work. Every restart is bounded, so a
systematic failure ends the run within (start-up + backoff) × (max_restarts + 1).

``stop_all`` sends SIGTERM, waits up to a grace period, then SIGKILLs whatever is left, so a run
never leaves processes behind. Once it began, ``check`` restarts nothing (a worker that exits
non-zero while being stopped is not a fault to repair), and ``kill_all`` (a second Ctrl-C) cuts the
grace period short: every child is SIGKILLed at once and the waits return. Whether the run
succeeded, failed or was interrupted, every process the supervisor ever started (a restarted
child's earlier ones included) is waited for before it returns, even when the graceful path is
cut short (an exception raised in ``between`` or in a wait): no child is left running or as an unreaped zombie of the caller's
process — which matters when the run is in-process (tests, notebooks).

Ports for children: ``free_port`` (``storage/ports.py``) picks them below the
kernel's ephemeral range, before the child starts, because the other children need them in their
configs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
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

    max_restarts: int = 0  # per child; 0 = any abnormal exit fails the run
    backoff_s: float = 0.5  # delay before the first restart; doubled for each further one
    backoff_max_s: float = 10.0  # cap of that delay


@dataclass
class Child:
    name: str  # e.g. "rollout-0", "store-0"
    role: str
    popen: subprocess.Popen
    log_path: Path
    argv: list[str] = field(default_factory=list)
    threads: int = 1
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
        return (
            f"{self.failure or f'{self.name} exited with status {self.exit_code()}'}:\n"
            f"{self.log_tail()}"
        )


class Supervisor:
    def __init__(
        self,
        log_dir: str | os.PathLike,
        env: dict[str, str] | None = None,
        policy: RestartPolicy | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        self.policy = policy or RestartPolicy()
        self.children: dict[str, Child] = {}
        self._spawned: list[subprocess.Popen] = []  # every process started, for stop_all to reap
        self.stopping = False  # stop_all began: no restart from now on
        self.forced = False  # kill_all was called: no grace period, no ``between``

    def start(self, name: str, role: str, argv: list[str], *, threads: int = 1) -> Child:
        if name in self.children:
            raise ValueError(f"a child named {name!r} already runs")
        log_path = self.log_dir / f"{name}.log"
        child = Child(
            name, role, self._spawn(argv, threads, log_path), log_path, list(argv), threads
        )
        self.children[name] = child
        return child

    def _spawn(self, argv: list[str], threads: int, log_path: Path) -> subprocess.Popen:
        env = {
            **self.env,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
        }
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=_die_with_parent,
                start_new_session=True,  # the terminal's Ctrl-C is the parent's to handle
            )
        self._spawned.append(popen)
        return popen

    def start_python(
        self, name: str, role: str, module: str, args: list[str], *, threads: int = 1
    ) -> Child:
        return self.start(name, role, [sys.executable, "-m", module, *args], threads=threads)

    def check(self) -> Child | None:
        """Apply the restart policy; returns the first child that failed terminally, if any.

        Call it often (the controller does, every loop turn): scheduled restarts happen here.
        After ``stop_all`` began it does nothing: children exiting then are being stopped."""
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
                why_not = self._why_not_restart(child, code)
                if why_not is not None:
                    child.failure = why_not
                    return child
                delay = min(self.policy.backoff_s * 2**child.restarts, self.policy.backoff_max_s)
                child.restart_at = now + delay
                log.warning(
                    "%s exited with status %s; restart %d/%d in %.1fs",
                    child.name,
                    code,
                    child.restarts + 1,
                    self.policy.max_restarts,
                    delay,
                )
            elif now >= child.restart_at:
                self._restart(child)
                if child.failure is not None:
                    return child
        return None

    def _why_not_restart(self, child: Child, code: int) -> str | None:
        if not child.ever_ready:
            return f"{child.name} exited with status {code} before it was ready (not restarted)"
        if child.restarts >= self.policy.max_restarts:
            return (
                f"{child.name} exited with status {code} after {child.restarts} restart(s) "
                f"(run.max_restarts={self.policy.max_restarts})"
            )
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

    def stop(self, name: str, grace_s: float = 10.0) -> int | None:
        child = self.children[name]
        if child.exit_code() is None:
            child.popen.send_signal(signal.SIGTERM)
            try:
                child.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                child.popen.kill()
                child.popen.wait()
        return child.exit_code()

    def stop_all(
        self,
        grace_s: float = 10.0,
        *,
        roles_last: tuple[str, ...] = ("store",),
        between: Callable[[], None] | None = None,
    ) -> None:
        """SIGTERM every child (workers first, then ``roles_last``), wait, SIGKILL the rest.

        ``between`` runs once the first group has exited and before the last one is stopped (the
        controller reads the store's final counts there, after every worker released its leases).
        Whatever happens meanwhile, every process this supervisor started is reaped on return.
        """
        self.stopping = True
        try:
            self._stop_groups(grace_s, roles_last, between)
        finally:
            self._reap_all()

    def kill_all(self) -> None:
        """Force the stop (a second Ctrl-C): SIGKILL every live child now. Signal-safe: it only
        sends signals; ``stop_all``'s waits then return at once and it skips ``between``."""
        self.stopping = self.forced = True
        for popen in self._spawned:
            if popen.poll() is None:
                try:
                    popen.kill()
                except OSError:  # exited meanwhile
                    pass

    def _stop_groups(
        self, grace_s: float, roles_last: tuple[str, ...], between: Callable[[], None] | None
    ) -> None:
        for group_last in (False, True):
            if group_last and between is not None and not self.forced:
                try:
                    between()
                except Exception:  # bookkeeping only: never block the shutdown
                    pass
            group = [c for c in self.children.values() if (c.role in roles_last) == group_last]
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
