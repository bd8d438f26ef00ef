"""The shared test helpers do what they say: a bounded wait, ports below the ephemeral range."""

from __future__ import annotations

import time

import pytest
from testkit import free_port, wait_until


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
