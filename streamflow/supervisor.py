"""Child processes of a run on one host: start them, watch them, stop them.

Orphans: every child asks the kernel (``PR_SET_PDEATHSIG``) to receive SIGTERM when the
supervising process dies, even by SIGKILL — a killed controller never leaves workers running.

Lifecycle of a child: started (stdout+stderr to ``<log_dir>/<name>.log``) -> running -> exited.
``failed()`` names the first child that exited non-zero (the run then fails with that child's log
tail); ``stop_all`` sends SIGTERM, waits up to a grace period, then SIGKILLs whatever is left, so a
run never leaves processes behind, whether it succeeded, failed or was interrupted.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: children are still stopped by stop_all on every normal exit path


@dataclass
class Child:
    name: str  # e.g. "rollout-0", "store-0"
    role: str
    popen: subprocess.Popen
    log_path: Path

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Supervisor:
    def __init__(self, log_dir: str | os.PathLike, env: dict[str, str] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        self.children: dict[str, Child] = {}

    def start(self, name: str, role: str, argv: list[str], *, threads: int = 1) -> Child:
        if name in self.children:
            raise ValueError(f"a child named {name!r} already runs")
        log_path = self.log_dir / f"{name}.log"
        env = {
            **self.env,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
        }
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=_die_with_parent,
            )
        child = Child(name, role, popen, log_path)
        self.children[name] = child
        return child

    def start_python(
        self, name: str, role: str, module: str, args: list[str], *, threads: int = 1
    ) -> Child:
        return self.start(name, role, [sys.executable, "-m", module, *args], threads=threads)

    def failed(self) -> Child | None:
        """The first child that exited with a non-zero status, if any."""
        for child in self.children.values():
            code = child.exit_code()
            if code not in (None, 0):
                return child
        return None

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
        """
        for group_last in (False, True):
            if group_last and between is not None:
                try:
                    between()
                except Exception:  # bookkeeping only: never block the shutdown
                    pass
            group = [c for c in self.children.values() if (c.role in roles_last) == group_last]
            for child in group:
                if child.exit_code() is None:
                    child.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for child in group:
                try:
                    child.popen.wait(max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    child.popen.kill()
                    child.popen.wait()
