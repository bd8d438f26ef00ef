"""Weight sync by file: the trainer publishes policy version v, rollout engines load it.

``WeightPublisher`` writes ``<dir>/policy-v000007.safetensors`` atomically, keeps the newest
``keep`` and announces each on ZeroMQ PUB; ``WeightSubscriber`` finds or waits (bounded, never a
busy loop) for a version, fetched from the trainer's host when ``fetch`` is set
(``workers.weights.net``). Protocol: docs/engines.md, "Weight sync by file".
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch
import zmq
from safetensors.torch import load_file, save_file

from workers.weights.net import WeightFetcher, WeightFetchError, WeightServer
from workers.weights.versions import latest_version, prune, published_versions, weights_path

__all__ = [  # the file helpers are re-exported: callers import them from here
    "PublishedWeights", "WeightPublisher", "WeightSubscriber", "WeightSyncTimeout",
    "latest_version", "published_versions", "weights_path",
]

log = logging.getLogger("workers.weights.file_sync")


class WeightSyncTimeout(TimeoutError):
    """The wanted policy version did not appear in time."""


@dataclass(frozen=True)
class PublishedWeights:
    version: int
    path: str
    bytes: int
    seconds: float  # time to serialise and write


def _socket(kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(address)
    else:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
    return sock


class WeightPublisher:
    """Trainer side. ``bind`` is a ZeroMQ address for announcements (None: files only);
    ``serve`` one where readers on other hosts fetch the files (None: same host only)."""

    def __init__(
        self, directory: str | os.PathLike, bind: str | None = None, *, keep: int = 3,
        serve: str | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._server = WeightServer(self.directory, serve) if serve else None
        self.serve_endpoint = self._server.endpoint if self._server else None
        self._socket = _socket(zmq.PUB, bind, True) if bind else None
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT) if bind else None

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> PublishedWeights:
        start = time.perf_counter()
        path = weights_path(self.directory, version)
        tmp = path.with_suffix(".tmp")
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp))
        os.replace(tmp, path)
        nbytes = path.stat().st_size
        prune(self.directory, version, self.keep)
        if self._socket is not None:
            note = {"version": version, "path": str(path), "bytes": nbytes}
            self._socket.send(msgpack.packb(note))
        return PublishedWeights(version, str(path), nbytes, time.perf_counter() - start)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None


class WeightSubscriber:
    """Rollout side: find or wait for a policy version and read its tensors."""

    def __init__(
        self, directory: str | os.PathLike, connect: str | None = None, *, recheck_s: float = 0.5,
        fetch: str | None = None, keep: int = 4,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.recheck_s = recheck_s
        self.keep = keep
        # Remote trainer: versions are copied from its WeightServer into our own directory.
        self._fetcher = WeightFetcher(fetch) if fetch else None
        self._announced = -1  # newest version announced on SUB (a hint; the server is the truth)
        self.fetch_seconds: dict[int, float] = {}  # version -> network copy time, until reported
        self.fetched_bytes = 0
        self._socket = _socket(zmq.SUB, connect, False) if connect else None

    def newest(self) -> int | None:
        local = latest_version(self.directory)
        if self._fetcher is not None and self._socket is not None:
            self._drain()
            if self._announced > (-1 if local is None else local):
                try:
                    local = self._pull(self._announced, 5.0) or local
                except WeightFetchError as exc:  # retried at the next look; wait_for is bounded
                    log.warning("weight fetch failed: %s", exc)
        return local

    def _drain(self) -> None:
        """Take the announcements since the last look (never blocks); each is a wake-up only."""
        assert self._socket is not None
        while self._socket.poll(0):
            try:
                version = msgpack.unpackb(self._socket.recv(), raw=False, max_str_len=4096).get(
                    "version")
            except Exception:  # a malformed one is ignored
                continue
            if isinstance(version, int):
                self._announced = max(self._announced, version)

    def _pull(self, min_version: int, timeout_s: float) -> int | None:
        """Copy the server's newest version into our directory if it is >= ``min_version``."""
        assert self._fetcher is not None
        remote = self._fetcher.newest(timeout_s)
        local = latest_version(self.directory)
        if remote is None or remote < min_version or (local is not None and remote <= local):
            return None
        start = time.perf_counter()
        nbytes = self._fetcher.fetch(remote, self.directory)
        self.fetched_bytes += nbytes
        self.fetch_seconds[remote] = time.perf_counter() - start
        log.info("fetched policy version %d from %s (%d bytes, %.3f s)", remote,
                 self._fetcher.address, nbytes, self.fetch_seconds[remote])
        prune(self.directory, remote, self.keep)
        return remote

    def wait_for(self, min_version: int, timeout_s: float) -> int:
        """Block until a version >= ``min_version`` is on disk (fetched from the trainer's host
        when ``fetch`` is set); return the newest such version."""
        deadline = time.monotonic() + timeout_s
        while True:
            newest = latest_version(self.directory)
            if newest is not None and newest >= min_version:
                return newest
            if self._fetcher is not None:
                try:
                    wait_s = max(min(deadline - time.monotonic(), 5.0), 0.1)
                    pulled = self._pull(min_version, wait_s)
                except WeightFetchError as exc:  # e.g. a network cut: retry until the deadline
                    log.warning("weight fetch failed: %s", exc)
                    pulled = None
                if pulled is not None:
                    return pulled
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WeightSyncTimeout(
                    f"policy version {min_version} not published within {timeout_s:.1f}s "
                    f"(newest on disk: {newest}) in {self.directory}"
                )
            wait = min(remaining, self.recheck_s)
            if self._socket is None:
                time.sleep(wait)
            elif self._socket.poll(int(wait * 1000)):  # a wake-up: the directory is the truth
                self._drain()

    def load(self, version: int) -> tuple[dict[str, torch.Tensor], int]:
        """The tensors of ``version`` and the bytes read."""
        path = weights_path(self.directory, version)
        return load_file(str(path)), path.stat().st_size

    def close(self) -> None:
        if self._fetcher is not None:
            self._fetcher.close()
            self._fetcher = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
