"""The worker process's entry point (``workers.main``): how it stops."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A process that installs the worker's stop handlers with a short bound, then never finishes its
# way out (as a worker whose store is gone may not): SIGTERM must still end it.
_STUCK = """
import sys, threading, time
from workers import main
main.EXIT_BOUND_S = 0.5
stop = threading.Event()
main.install_stop_handlers(stop)
print("ready", flush=True)
stop.wait()
print("stopping", flush=True)
time.sleep(60)
"""


def test_a_worker_stuck_on_its_way_out_leaves_within_the_bound_after_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", _STUCK], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "stopping"  # the signal set the stop event
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM  # as a signalled process reports
        assert time.monotonic() - started < 20
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# The stop event is set while a second signal arrives: this event's set() holds its lock and lets
# the handler run again right there (as a signal landing between two bytecodes of set() does).
_SIGNALLED_INSIDE_SET = """
import os, signal, threading
from workers import main
main.EXIT_BOUND_S = 0.5

class SignalledInsideSet(threading.Event):
    def set(self):
        with self._cond:
            os.kill(os.getpid(), signal.SIGINT)  # its handler runs before the next bytecode
            self._flag = True
            self._cond.notify_all()

stop = SignalledInsideSet()
main.install_stop_handlers(stop)
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
stop.wait()
print("stopping", flush=True)
threading.Event().wait(60)
"""


def test_a_second_signal_inside_the_first_handler_neither_deadlocks_nor_unbounds_the_exit():
    proc = subprocess.Popen([sys.executable, "-c", _SIGNALLED_INSIDE_SET], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM  # the first signal's bound
        assert proc.stdout.read().strip() == "stopping"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
