"""Weight sync: the trainer publishes policy version v, rollout engines load it when the mode says.

Path of the bytes: the trainer writes the HF-named tensors of version v to
``<dir>/policy-v000007.safetensors`` (written to a temp name, then renamed, so a reader never sees
a partial file) and announces ``(version, path, bytes)`` on a ZeroMQ PUB socket. A rollout worker
waiting for version >= v looks at the directory first (so an announcement missed by a late joiner
costs nothing), then waits on its SUB socket for the next announcement, re-checking the directory
every ``recheck_s``: a bounded wait, never a busy loop, and a timeout (``WeightSyncTimeout``) rather
than a hang.

Retention: the newest ``keep`` versions stay on disk; older files are unlinked (a reader that already
opened one keeps reading it safely on POSIX).

Versions: version 0 is the initial policy; the trainer publishes version k+1 after its k-th step.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch
import zmq
from safetensors.torch import load_file, save_file

_NAME = re.compile(r"^policy-v(\d{6,})\.safetensors$")


class WeightSyncTimeout(TimeoutError):
    """The wanted policy version did not appear in time."""


@dataclass(frozen=True)
class PublishedWeights:
    version: int
    path: str
    bytes: int
    seconds: float  # time to serialise and write


def weights_path(directory: str | os.PathLike, version: int) -> Path:
    return Path(directory) / f"policy-v{version:06d}.safetensors"


def latest_version(directory: str | os.PathLike) -> int | None:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return None
    versions = [int(m.group(1)) for n in names if (m := _NAME.match(n))]
    return max(versions) if versions else None


class WeightPublisher:
    """Trainer side. ``bind`` is a ZeroMQ address for announcements (None: files only)."""

    def __init__(self, directory: str | os.PathLike, bind: str | None = None, *, keep: int = 3) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._socket: zmq.Socket | None = None
        self.endpoint: str | None = None
        if bind:
            self._socket = zmq.Context.instance().socket(zmq.PUB)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.bind(bind)
            self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> PublishedWeights:
        start = time.perf_counter()
        path = weights_path(self.directory, version)
        tmp = path.with_suffix(".tmp")
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
        nbytes = path.stat().st_size
        self._prune(version)
        if self._socket is not None:
            self._socket.send(msgpack.packb({"version": version, "path": str(path), "bytes": nbytes}))
        return PublishedWeights(version, str(path), nbytes, time.perf_counter() - start)

    def _prune(self, newest: int) -> None:
        for name in os.listdir(self.directory):
            m = _NAME.match(name)
            if m and int(m.group(1)) <= newest - self.keep:
                try:
                    os.unlink(self.directory / name)
                except FileNotFoundError:
                    pass

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


class WeightSubscriber:
    """Rollout side: find or wait for a policy version and read its tensors."""

    def __init__(
        self, directory: str | os.PathLike, connect: str | None = None, *, recheck_s: float = 0.5
    ) -> None:
        self.directory = Path(directory)
        self.recheck_s = recheck_s
        self._socket: zmq.Socket | None = None
        if connect:
            self._socket = zmq.Context.instance().socket(zmq.SUB)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.setsockopt(zmq.SUBSCRIBE, b"")
            self._socket.connect(connect)

    def newest(self) -> int | None:
        return latest_version(self.directory)

    def wait_for(self, min_version: int, timeout_s: float) -> int:
        """Block until a version >= ``min_version`` is on disk; return the newest such version."""
        deadline = time.monotonic() + timeout_s
        while True:
            newest = latest_version(self.directory)
            if newest is not None and newest >= min_version:
                return newest
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WeightSyncTimeout(
                    f"policy version {min_version} not published within {timeout_s:.1f}s "
                    f"(newest on disk: {newest}) in {self.directory}"
                )
            wait = min(remaining, self.recheck_s)
            if self._socket is not None:
                if self._socket.poll(int(wait * 1000)):
                    while self._socket.poll(0):
                        self._socket.recv()  # the directory is the truth; the message is a wake-up
            else:
                time.sleep(wait)

    def load(self, version: int) -> tuple[dict[str, torch.Tensor], int]:
        """The tensors of ``version`` and the bytes read."""
        path = weights_path(self.directory, version)
        return load_file(str(path)), path.stat().st_size

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
