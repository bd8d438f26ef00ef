"""The shared test helpers do what they say: a bounded wait, ports below the ephemeral range, a
check that a run left no child process."""

from __future__ import annotations

import time

import pytest
from testkit import free_port, no_children_left, wait_until


def test_wait_until_returns_the_value_once_true():
    start = time.monotonic()
    calls = iter([0, None, "", 7])
    assert wait_until(lambda: next(calls), timeout=5.0) == 7
    assert time.monotonic() - start < 2.0


def test_wait_until_names_what_it_waited_for():
    with pytest.raises(AssertionError, match="the moon"):
        wait_until(lambda: False, timeout=0.05, what="the moon")


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_no_children_left_counts_real_children_but_not_the_resource_tracker():
    import multiprocessing as mp
    import subprocess
    import sys

    child = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    child.start()  # the first spawn also starts Python's resource tracker, for good
    child.join(timeout=60)
    no_children_left(timeout=5.0)  # the tracker is not a leak of ours
    lingering = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(AssertionError, match=f"pid={lingering.pid}"):
            no_children_left(timeout=0.2)
    finally:
        lingering.kill()
        lingering.wait()
    no_children_left(timeout=5.0)
