"""Ports a parent picks for a child process to bind (``free_port``), below the ephemeral range.

Why: docs/store-protocol.md ("Ports")."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ports handed out by this process: two picks never return the same (not yet bound) port.
_handed_out: set[tuple[str, int]] = set()


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The lowest port the kernel uses for outgoing connections (32768 when it cannot tell)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", *, ephemeral_low: int | None = None) -> int:
    """A TCP port on ``host`` that is free now, below the ephemeral range, for a child process to
    bind. Falls back to ``bind(0)`` when that range starts too low to leave room below it."""
    low = _ephemeral_low() if ephemeral_low is None else ephemeral_low
    first = 10_000
    if low - first >= 1_000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(first, low)
            if (host, port) in _handed_out:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            _handed_out.add((host, port))
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
