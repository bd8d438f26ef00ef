"""Weights across hosts: the trainer serves published policy versions, remote readers fetch them.

Hosts do not share ``/dev/shm``: a rollout worker (or the controller's evaluator) on another host
cannot read the trainer's weights directory. So the trainer's ``WeightPublisher`` also runs a
``WeightServer`` — a ZeroMQ ROUTER on a thread of its own, answering two requests about the
directory it publishes into — and a remote reader's ``WeightFetcher`` copies a version into its
*local* weights directory (temp name, then rename: a reader never sees a partial file). From there
everything is as on one host: the same file name, the same loader, vLLM's reload from a path.

Wire (every frame after the ROUTER identity):

    request   [msgpack {"op": "newest" | "fetch", "id": int, "version": int (fetch only)}]
    reply     [msgpack {"id", "ok", "newest", "version", "bytes", "error"}, (safetensors bytes)]

Only msgpack headers and raw safetensors bytes travel (nothing is unpickled; safetensors is a
plain tensor container). Requests are small and size-capped (``MAXMSGSIZE``); a malformed one gets
``ok: false`` with the reason and the server keeps serving. A version the trainer has already
pruned (it keeps the newest ``weights_keep``) is answered ``ok: false``; the reader then asks for
the newest one again.

Failure: a request with no reply within its timeout raises ``WeightFetchError`` and the socket is
replaced (a late reply can never be taken for another request's); callers retry within their own
deadline, so a network cut delays a weight sync but never loads a partial or wrong version.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from workers.weights_files import published_versions, weights_path

log = logging.getLogger("workers.weights")

MAX_REQUEST_BYTES = 4096


class WeightFetchError(RuntimeError):
    """A fetch or newest request failed (no reply in time, or the server refused it)."""


class WeightServer:
    """Answers ``newest`` and ``fetch(version)`` for the files in ``directory`` (its own thread)."""

    def __init__(self, directory: str | os.PathLike, bind: str) -> None:
        self.directory = Path(directory)
        self.served_bytes = 0
        self.served_versions = 0
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.bind(bind)
        self.endpoint: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock  # handed to the thread below, never touched here again
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                header, data = self._handle(frames[1:])
                try:
                    sock.send_multipart([frames[0], msgpack.packb(header), *data], copy=False)
                except zmq.ZMQError as exc:  # the reader went away: nothing to answer
                    log.warning("weight server: reply dropped: %s", exc)
        finally:
            sock.close()

    def _handle(self, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        header: dict[str, Any] = {
            "id": None,
            "ok": False,
            "newest": None,
            "version": None,
            "bytes": 0,
            "error": "",
        }
        try:
            if len(frames) != 1:
                raise ValueError(f"expected 1 frame, got {len(frames)}")
            req = msgpack.unpackb(frames[0], raw=False, max_str_len=256, max_map_len=8)
            if not isinstance(req, dict) or not isinstance(req.get("id"), int):
                raise ValueError("request must be a map with an integer 'id'")
            header["id"] = req["id"]
            op = req.get("op")
            versions = published_versions(self.directory)
            header["newest"] = versions[-1] if versions else None
            if op == "newest":
                header["ok"] = True
                return header, []
            if op != "fetch":
                raise ValueError(f"op must be 'newest' or 'fetch', got {op!r}")
            version = req.get("version")
            if not isinstance(version, int) or isinstance(version, bool) or version < 0:
                raise ValueError(f"fetch.version must be an integer >= 0, got {version!r}")
            try:
                data = weights_path(self.directory, version).read_bytes()
            except FileNotFoundError:
                raise ValueError(
                    f"version {version} is not available (published: {versions})"
                ) from None
            header.update(ok=True, version=version, bytes=len(data))
            self.served_bytes += len(data)
            self.served_versions += 1
            return header, [data]
        except Exception as exc:  # a bad request is answered, never fatal to the server
            header["error"] = f"{type(exc).__name__}: {exc}"
            return header, []

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class WeightFetcher:
    """Reader side: ask a ``WeightServer`` for the newest version, copy one into a directory."""

    def __init__(self, address: str, *, timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._open()

    def _open(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        self._sock = sock

    def _call(self, request: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], list]:
        assert self._sock is not None
        req_id = next(self._ids)
        self._sock.send(msgpack.packb({**request, "id": req_id}))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1):
                if time.monotonic() < deadline:
                    continue
                self._sock.close(linger=0)
                self._open()  # a late reply must land on a socket nobody reads any more
                raise WeightFetchError(
                    f"no reply from weight server {self.address} within {timeout_s:.3g} s"
                )
            frames = self._sock.recv_multipart(copy=False)
            header = msgpack.unpackb(frames[0].bytes, raw=False, max_str_len=1 << 16)
            if not isinstance(header, dict) or header.get("id") != req_id:
                continue  # a late reply to an earlier request
            if not header.get("ok"):
                raise WeightFetchError(f"weight server {self.address}: {header.get('error')}")
            return header, frames[1:]

    def newest(self, timeout_s: float | None = None) -> int | None:
        header, _ = self._call({"op": "newest"}, timeout_s or self.timeout_s)
        newest = header.get("newest")
        return newest if isinstance(newest, int) else None

    def fetch(self, version: int, directory: str | os.PathLike) -> int:
        """Copy ``version`` into ``directory`` (atomically); returns the bytes received."""
        header, frames = self._call({"op": "fetch", "version": int(version)}, self.timeout_s)
        if (
            len(frames) != 1
            or len(frames[0]) != header.get("bytes")
            or header.get("version") != version
        ):
            raise WeightFetchError(
                f"weight server {self.address}: malformed reply for version {version}"
            )
        path = weights_path(directory, version)
        tmp = path.with_suffix(".part")
        with open(tmp, "wb") as fh:
            fh.write(frames[0].buffer)
        os.replace(tmp, path)
        return len(frames[0])

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
