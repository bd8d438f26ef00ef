"""Ports a parent picks for a child process to bind (``free_port``).

An address a child will bind (a store node, the trainer's weight announcements,
torch.distributed's master port) is often chosen by the parent before the child starts, because
other processes need it in their configs. It is taken below the kernel's ephemeral range: a port
from ``bind(0)`` comes from that range, which every outgoing connection on the machine draws from
too, so in the gap before the child binds, any ``connect()`` could take it (seen as "Address
already in use" in a test suite where hundreds of ZeroMQ connections churn). Below the range only
another explicit listener can collide. Tests take their ports here as well, for the same reason.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ports handed out by this process: two picks for one run (announce + master port) never
# return the same port although neither is bound yet.
_handed_out: set[tuple[str, int]] = set()


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The lowest port the kernel uses for outgoing connections (32768 when it cannot tell)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", *, ephemeral_low: int | None = None) -> int:
    """A TCP port on ``host`` that is free now, for a child process to bind (module docstring:
    why below the ephemeral range). Falls back to ``bind(0)`` when that range starts too low to
    leave room below it."""
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
