"""Several "hosts" on one machine for tests: Linux network namespaces joined by a bridge.

``Hosts(n)`` creates a hub namespace holding a bridge and ``n`` host namespaces, each joined to
the bridge by a veth pair and given ``10.A.B.(i+1)/24`` (A.B from the test's pid, so parallel
sessions do not clash), ``lo`` and links up. Names carry the pid too. Everything lives in
namespaces this helper creates; processes are started *inside* them (``exec_argv``), and a test
never connects from the root namespace to a namespace address. ``cut(i)`` / ``heal(i)`` take host
i's cable down and up (its bridge-side veth), like pulling a network cable. ``kill_all()`` SIGKILLs
every process still inside these namespaces (by pid, from ``ip netns pids``: only processes a test
started there, e.g. torchrun's ranks, which run in sessions of their own). ``close()`` (also on
``with`` exit) does that, then deletes every namespace, which removes the veths with them.

Needs root (``ip netns``); ``available()`` says whether this process can create namespaces.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def available() -> bool:
    return (
        os.geteuid() == 0
        and subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=10).returncode == 0
    )


class Hosts:
    def __init__(self, n: int, tag: str = "") -> None:
        pid = os.getpid()
        self.prefix = f"sf{pid}{tag}"
        self.subnet = f"10.{(pid >> 8) & 255}.{pid & 255}"
        self.hub = f"{self.prefix}-hub"
        self.names = [f"{self.prefix}-h{i}" for i in range(n)]
        self.addresses = [f"{self.subnet}.{i + 1}" for i in range(n)]
        short = f"{pid % 100000}{tag}"[:10]
        self._veths = [(f"v{short}{i}", f"b{short}{i}") for i in range(n)]  # (host, hub) ends
        self._created: list[str] = []
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        _ip("netns", "add", self.hub)
        self._created.append(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for name, addr, (host_end, hub_end) in zip(
            self.names, self.addresses, self._veths, strict=True
        ):
            _ip("netns", "add", name)
            self._created.append(name)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", hub_end)
            _ip("link", "set", host_end, "netns", name)
            _ip("link", "set", hub_end, "netns", self.hub)
            _ip("-n", self.hub, "link", "set", hub_end, "master", "br0")
            _ip("-n", self.hub, "link", "set", hub_end, "up")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", host_end)
            _ip("-n", name, "link", "set", host_end, "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def exec_argv(self, i: int) -> list[str]:
        """Prefix that runs a command inside host i's namespace."""
        return ["ip", "netns", "exec", self.names[i]]

    def cut(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", self._veths[i][1], "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", self._veths[i][1], "up")

    def pids(self) -> list[int]:
        """Every process inside one of these namespaces (not the hub: nothing runs there)."""
        out = []
        for name in self._created:
            res = subprocess.run(
                ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30
            )
            out += [int(x) for x in res.stdout.split()]
        return out

    def kill_all(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process left inside these namespaces and wait until they are gone."""
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def close(self) -> None:
        self.kill_all()
        for name in reversed(self._created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._created.clear()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
