"""Collective weight sync: the trainer broadcasts each policy version to the rollout workers.

Owns the weight-update group (``GroupMember``: its own process group, NCCL or gloo, bucketed
broadcast or shared-memory buckets), its rendezvous (``Rendezvous``) and the store announcements.
Protocol, epochs and membership: docs/engines.md, "Collective weight sync: the group and the wire".
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from workers.config import WeightGroupConfig

log = logging.getLogger("workers.weights.file_sync")

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
    torch.uint8, torch.int8, torch.bool)}
SEQ_KEY = "sf/seq"


class CollectiveSyncError(RuntimeError):
    """Joining the weight group or a broadcast failed or timed out."""




class Rendezvous:
    """The controller's TCP store (the group's rendezvous); it outlives trainer/rollout restarts."""

    def __init__(self, host: str, port: int) -> None:  # weights.host, weights.port (0: free)
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30))
        self.address = f"{host}:{self.store.port}"

    def close(self) -> None:  # the server stops with its last reference
        self.store = None  # type: ignore[assignment]


def connect_store(spec: WeightGroupConfig) -> dist.TCPStore:
    host, port = spec.host_port
    try:
        return dist.TCPStore(host, port, is_master=False,
                             timeout=datetime.timedelta(seconds=spec.timeout_s))
    except Exception as exc:  # noqa: BLE001 - torch raises several types for a refused connect
        raise CollectiveSyncError(
            f"weight group rendezvous {spec.address} unreachable: {exc}") from None


def tensor_meta(state: Mapping[str, torch.Tensor]) -> list[list[Any]]:
    return [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in state.items()]


def _nbytes(meta: Sequence[Any]) -> int:
    return _DTYPES[meta[1]].itemsize * math.prod(int(d) for d in meta[2])


def bucket_layout(meta: Sequence[Sequence[Any]], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``meta`` per bucket: in order, a bucket closes before exceeding bucket_bytes."""
    buckets: list[list[int]] = []
    size = 0
    for i, m in enumerate(meta):
        n = _nbytes(m)
        if not buckets or size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return [b for b in buckets if b]


def _layout(meta: Sequence[Sequence[Any]], bucket_bytes: int) -> tuple[list[list[int]], list[int]]:
    layout = bucket_layout(meta, bucket_bytes)
    return layout, [sum(_nbytes(meta[i]) for i in idx) for idx in layout]


def _pack(dst: torch.Tensor, tensors: Sequence[torch.Tensor], idx: list[int], **kw: Any) -> None:
    """Copy the bytes of ``tensors[idx]`` one after another into the flat uint8 ``dst``."""
    off = 0
    for i in idx:
        flat = tensors[i].detach().contiguous().reshape(-1).view(torch.uint8)
        dst[off : off + flat.numel()].copy_(flat, **kw)
        off += flat.numel()


def _unpack(buf: torch.Tensor, meta: Sequence[Sequence[Any]], idx: list[int],
            place: Callable[[int, torch.Tensor], None]) -> None:
    """``place(i, view)`` for each tensor i of ``idx``, viewed in the flat uint8 ``buf``."""
    off = 0
    for i in idx:
        n = _nbytes(meta[i])
        place(i, buf[off : off + n].view(_DTYPES[meta[i][1]]).view(meta[i][2]))
        off += n


def _wait(work: Any, timeout_s: float, what: str) -> None:
    try:
        ok = work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
        raise CollectiveSyncError(f"{what} failed: {' '.join(str(exc).split())[:300]}") from None
    if ok is False:
        raise CollectiveSyncError(f"{what} timed out after {timeout_s:.3g} s")


class GroupMember:
    """One process's membership of one epoch of the weight group."""

    def __init__(self, spec: WeightGroupConfig, store: dist.Store, epoch: int,
                 device: torch.device) -> None:
        self.spec, self.epoch, self.device = spec, epoch, device
        prefixed = dist.PrefixStore(f"sf/epoch{epoch}/", store)
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        try:
            if spec.backend == "nccl":
                torch.cuda.set_device(device.index or 0)
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self.pg = dist.ProcessGroupNCCL(prefixed, spec.rank, spec.world_size, opts)
            else:
                self.pg = dist.ProcessGroupGloo(prefixed, spec.rank, spec.world_size, timeout)
        except Exception as exc:  # noqa: BLE001
            raise CollectiveSyncError(
                f"joining weight group epoch {epoch} as rank {spec.rank}/{spec.world_size} at "
                f"{spec.address} failed: {' '.join(str(exc).split())[:300]}") from None

    def _broadcast(self, buf: torch.Tensor) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self.pg.broadcast([buf], opts)

    def send(self, tensors: Sequence[torch.Tensor], bucket_bytes: int) -> int:
        """Rank 0: broadcast ``tensors`` (in announcement order) bucket by bucket; bytes sent."""
        meta = [["", str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
        if self.spec.transport == "shm":
            return self._send_shm(tensors, meta, bucket_bytes)
        buffers: list[torch.Tensor | None] = [None, None]
        pending: list[Any] = [None, None]
        layout, sizes = _layout(meta, bucket_bytes)
        for b, idx in enumerate(layout):
            slot, size = b % 2, sizes[b]
            if pending[slot] is not None:
                _wait(pending[slot], self.spec.timeout_s, "weight broadcast")
            buf = buffers[slot]
            if buf is None or buf.numel() < size:
                buf = buffers[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
            _pack(buf[:size], tensors, idx, non_blocking=True)
            pending[slot] = self._broadcast(buf[:size])
        for work in pending:
            if work is not None:
                _wait(work, self.spec.timeout_s, "weight broadcast")
        return sum(sizes)

    def receive(
        self, meta: Sequence[Sequence[Any]], bucket_bytes: int,
        place: Callable[[int, torch.Tensor], None],
    ) -> int:
        """Rank > 0: receive every bucket; ``place(i, tensor)`` gets tensor i of ``meta`` (a view
        of the bucket buffer, valid during the call only). Bytes received."""
        if self.spec.transport == "shm":
            return self._receive_shm(meta, bucket_bytes, place)
        layout, sizes = _layout(meta, bucket_bytes)
        buffers = [torch.empty(max(sizes[0::2], default=0), dtype=torch.uint8, device=self.device),
                   torch.empty(max(sizes[1::2], default=0), dtype=torch.uint8, device=self.device)]
        works = [None, None]
        if layout:
            works[0] = self._broadcast(buffers[0][: sizes[0]])
        for b, idx in enumerate(layout):
            slot = b % 2
            _wait(works[slot], self.spec.timeout_s, "weight broadcast (receive)")
            if b + 1 < len(layout):  # the next bucket arrives while this one is unpacked
                works[1 - slot] = self._broadcast(buffers[1 - slot][: sizes[b + 1]])
            _unpack(buffers[slot], meta, idx, place)
        return sum(sizes)

    # -- shared-memory buckets (gloo on one host) ---------------------------------------------
    # Bucket b goes through slot b % 2: the sender fills it, then broadcasts "ready"; receivers
    # copy it out, then join an all-reduce "done". Every rank issues ready/done in the same order
    # (gloo matches by order); a slot is refilled only after its previous bucket's "done".
    def _slots(self, need: int, create: bool) -> list[torch.Tensor]:
        if getattr(self, "_shm_need", -1) == need:
            return self._shm
        port = self.spec.host_port[1]
        paths = [os.path.join(self.spec.shm_dir, f"sf-weights-{port}-e{self.epoch}-s{k}-{need}")
                 for k in (0, 1)]
        if create:
            self.close_shm()
            for path in paths:
                with open(path, "wb") as fh:
                    fh.truncate(need)
            self._shm_paths = paths
        self._shm = [torch.from_file(p, shared=True, size=need, dtype=torch.uint8) for p in paths]
        self._shm_need = need
        return self._shm

    def close_shm(self) -> None:
        for path in getattr(self, "_shm_paths", []):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._shm_paths, self._shm, self._shm_need = [], [], -1

    def _signal(self, b: int) -> tuple[Any, torch.Tensor]:
        flag = torch.full((1,), b, dtype=torch.int64)
        return self._broadcast(flag), flag

    def _done(self) -> Any:
        return self.pg.allreduce([torch.zeros(1)])

    def _send_shm(self, tensors: Sequence[torch.Tensor], meta: list, bucket_bytes: int) -> int:
        layout, sizes = _layout(meta, bucket_bytes)
        slots = self._slots(max(sizes, default=1), create=True)
        done: list[Any] = []
        keep: list[Any] = []
        for b, idx in enumerate(layout):
            if b >= 2:
                _wait(done[b - 2], self.spec.timeout_s, "weight sync (slot reuse)")
            _pack(slots[b % 2], tensors, idx)
            keep.append(self._signal(b))
            if b >= 1:
                done.append(self._done())
        if layout:
            done.append(self._done())
        for work in [*done, *(w for w, _ in keep)]:
            _wait(work, self.spec.timeout_s, "weight sync")
        return sum(sizes)

    def _receive_shm(self, meta: Sequence[Sequence[Any]], bucket_bytes: int,
                     place: Callable[[int, torch.Tensor], None]) -> int:
        layout, sizes = _layout(meta, bucket_bytes)
        ready = [self._signal(0)] if layout else []
        done = []
        slots: list[torch.Tensor] = []
        for b, idx in enumerate(layout):
            if b + 1 < len(layout):
                ready.append(self._signal(b + 1))
            _wait(ready[b][0], self.spec.timeout_s, "weight sync (receive)")
            if not slots:  # the sender created the files before its first "ready"
                slots = self._slots(max(sizes), create=False)
            _unpack(slots[b % 2], meta, idx, place)
            done.append(self._done())
        for work in done:
            _wait(work, self.spec.timeout_s, "weight sync")
        return sum(sizes)

    def barrier(self) -> None:
        _wait(self.pg.allreduce([torch.zeros(1, device=self.device)]), self.spec.timeout_s,
              "weight group barrier")


def announce(store: dist.Store, payload: dict[str, Any]) -> int:
    seq = int(store.add(SEQ_KEY, 1))
    store.set(f"sf/ann/{seq}", msgpack.packb(payload))
    return seq


def read_announcement(store: dist.Store, seq: int, wait_s: float) -> dict[str, Any] | None:
    """Announcement ``seq`` if it appears within ``wait_s``, else None (polled: a timed-out store
    ``wait`` logs a c10d warning every call)."""
    key = f"sf/ann/{seq}"
    deadline = time.monotonic() + wait_s
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)
    try:
        data = msgpack.unpackb(store.get(key), raw=False, max_str_len=1 << 16)
    except Exception:  # noqa: BLE001 - a malformed announcement is never acted on
        log.warning("ignoring a malformed weight announcement %d", seq)
        return None
    return data if isinstance(data, dict) else None


def current_seq(store: dist.Store) -> int:
    return int(store.add(SEQ_KEY, 0))


def copy_into(targets: Mapping[str, torch.Tensor], meta: Sequence[Sequence[Any]]) -> Callable:
    """``place`` for ``GroupMember.receive`` that copies tensor i into ``targets[name]`` (names
    and shapes checked against the announcement before anything is received)."""
    if unknown := [m[0] for m in meta if m[0] not in targets]:
        raise KeyError(f"weight announcement names {len(unknown)} unknown parameter(s): "
                       f"{unknown[:5]}")
    for name, _, shape in meta:
        if tuple(targets[name].shape) != tuple(shape):
            raise ValueError(f"weight announcement: {name} has shape {tuple(shape)}, "
                             f"expected {tuple(targets[name].shape)}")

    def place(i: int, tensor: torch.Tensor) -> None:
        targets[meta[i][0]].copy_(tensor)

    return place

