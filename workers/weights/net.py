"""Weights across hosts: ``WeightServer`` (a ZeroMQ ROUTER on its own thread) serves published
versions; a remote reader's ``WeightFetcher`` copies one into its local weights directory.
Wire format and failure rules: docs/engines.md, "Weights across hosts".
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import msgpack
import msgspec
import zmq

from storage import rpc
from workers.weights.versions import published_versions, weights_path

log = logging.getLogger("workers.weights.file_sync")

MAX_REQUEST_BYTES = 4096


class WeightFetchError(RuntimeError):
    """A fetch or newest request failed (no reply in time, or the server refused it)."""


class WeightRequest(msgspec.Struct):
    """A reader's request: ``newest``, or ``fetch`` of one version."""

    id: int
    op: Literal["newest", "fetch"]
    version: Annotated[int, msgspec.Meta(ge=0)] | None = None


_DECODER = msgspec.msgpack.Decoder(WeightRequest)


class WeightServer(rpc.RouterService):
    """Answers ``newest`` and ``fetch(version)`` for the files in ``directory`` (its own thread)."""

    thread_name = "weight-server"

    def __init__(self, directory: str | os.PathLike, bind: str) -> None:
        super().__init__()
        self.directory = Path(directory)
        self.served_bytes = 0
        self.served_versions = 0
        self._bind = bind
        self.endpoint = ""
        self.start()

    def _open(self) -> None:
        self._sock, bound = rpc.bind_router(zmq.Context.instance(), [self._bind],
                                            max_message_bytes=MAX_REQUEST_BYTES, linger_ms=0)
        self.endpoint = bound[0]

    def _handle(self, frames: list) -> None:
        if len(frames) < 2:
            return
        header, data = self._answer([f.bytes for f in frames[1:]])
        self._out.append((frames[0].bytes, [msgpack.packb(header), *data], "weights", 0.0, None))

    def _answer(self, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        header: dict[str, Any] = dict(id=None, ok=False, newest=None, version=None, bytes=0,
                                      error="")
        try:
            if len(frames) != 1:
                raise ValueError(f"expected 1 frame, got {len(frames)}")
            try:
                req = _DECODER.decode(frames[0])
            except msgspec.ValidationError as exc:
                loose = msgspec.msgpack.decode(frames[0])  # only to answer with its id
                if isinstance(loose, dict) and isinstance(loose.get("id"), int):
                    header["id"] = loose["id"]
                raise ValueError(f"bad request: {exc}") from None
            header["id"] = req.id
            versions = published_versions(self.directory)
            header["newest"] = versions[-1] if versions else None
            if req.op == "newest":
                header["ok"] = True
                return header, []
            if req.version is None:
                raise ValueError("fetch.version is required")
            try:
                data = weights_path(self.directory, req.version).read_bytes()
            except FileNotFoundError:
                raise ValueError(f"version {req.version} is not available (published: {versions})"
                                 ) from None
            header.update(ok=True, version=req.version, bytes=len(data))
            self.served_bytes += len(data)
            self.served_versions += 1
            return header, [data]
        except Exception as exc:  # a bad request is answered, never fatal to the server
            header["error"] = f"{type(exc).__name__}: {exc}"
            return header, []

    def close(self) -> None:
        self.stop(timeout=5)


class WeightFetcher:
    """Reader side: ask a ``WeightServer`` for the newest version, copy one into a directory."""

    def __init__(self, address: str, *, timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._channel: rpc.Channel | None = rpc.Channel(
            zmq.Context.instance(), address, name=f"weight server {address}",
            timeout_error=WeightFetchError)

    def _call(self, request: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], list]:
        assert self._channel is not None
        req_id = next(self._ids)

        def ours(frames: list) -> tuple[dict[str, Any], list] | None:
            header = msgpack.unpackb(frames[0].bytes, raw=False, max_str_len=1 << 16)
            if not isinstance(header, dict) or header.get("id") != req_id:
                return None  # a late reply to an earlier request
            return header, frames[1:]

        header, frames = self._channel.call([msgpack.packb({**request, "id": req_id})], ours,
                                            timeout_s)
        if not header.get("ok"):
            raise WeightFetchError(f"weight server {self.address}: {header.get('error')}")
        return header, frames

    def newest(self, timeout_s: float | None = None) -> int | None:
        header, _ = self._call({"op": "newest"}, timeout_s or self.timeout_s)
        newest = header.get("newest")
        return newest if isinstance(newest, int) else None

    def fetch(self, version: int, directory: str | os.PathLike) -> int:
        """Copy ``version`` into ``directory`` (atomically); returns the bytes received."""
        header, frames = self._call({"op": "fetch", "version": int(version)}, self.timeout_s)
        if (len(frames) != 1 or len(frames[0]) != header.get("bytes")
                or header.get("version") != version):
            raise WeightFetchError(
                f"weight server {self.address}: malformed reply for version {version}")
        path = weights_path(directory, version)
        tmp = path.with_suffix(".part")
        with open(tmp, "wb") as fh:
            fh.write(frames[0].buffer)
        os.replace(tmp, path)
        return len(frames[0])

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
