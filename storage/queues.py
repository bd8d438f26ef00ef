"""What a shard hands out and who holds it: FIFO ready queues of row sequences, lease records.

Rules: docs/store-protocol.md ("Shards")."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


class SeqQueue:
    """FIFO of int64 sequences, stored as a deque of numpy pieces (push/pop cost per piece)."""

    __slots__ = ("_parts", "_head", "size")

    def __init__(self) -> None:
        self._parts: deque[np.ndarray] = deque()
        self._head = 0
        self.size = 0  # entries held, stale ones included

    def push(self, seqs: np.ndarray) -> None:
        if len(seqs):
            self._parts.append(seqs)
            self.size += len(seqs)

    def push_front(self, seqs: np.ndarray) -> None:
        if len(seqs):
            if self._head:
                self._parts[0] = self._parts[0][self._head :]
                self._head = 0
            self._parts.appendleft(seqs)
            self.size += len(seqs)

    def pop(self, n: int) -> np.ndarray:
        out: list[np.ndarray] = []
        need = n
        while need and self._parts:
            first = self._parts[0]
            avail = len(first) - self._head
            if avail <= need:
                out.append(first[self._head :])
                self._parts.popleft()
                self._head = 0
                need -= avail
            else:
                out.append(first[self._head : self._head + need])
                self._head += need
                need = 0
        self.size -= n - need
        if len(out) == 1:
            return out[0]
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


@dataclass(slots=True)
class LeaseRec:
    """A live lease: which task holds which rows (by sequence) until when."""

    lease_id: int
    task: int
    seqs: np.ndarray  # int64 sequences of the leased rows, in batch order
    deadline: float
    lease_seconds: float
    row_ids: np.ndarray | None = None  # uint64 row ids, in batch order (write's fast path)
    idx: np.ndarray | None = None  # dense indices of seqs, valid while the shard's layout is
    layout: int = -1  # ... this one (``Shard.layout`` changes only at compaction)
