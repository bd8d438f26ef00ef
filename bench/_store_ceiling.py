"""The ceiling of the W1 benchmark on this machine: W1's own client processes against a node that
does no store work.

Why it exists. W1 (``bench.store``) is compared with a raw ZeroMQ PUSH->PULL stream between two
processes. W1 itself runs five processes (a store node, a producer, three consumers) that talk in
request/reply round trips of 64 rows, each side encoding and decoding Arrow IPC in Python. How
much of the gap is the store's own work, and how much is the shape of the workload on this
machine? This module answers the second part by measurement: ``NullNode`` speaks the store's wire
protocol (the same frames, ``wire.decode_request`` header checks, ``wire.write_batch`` replies), so
the unchanged W1 client processes run against it, but it keeps no per-row state, reads no body,
validates no Arrow and builds each claim reply by slicing one pre-built batch. Whatever W1 reaches
against it is an upper bound for any store node written in Python here, and the clients' CPU time
bounds even a node that costs nothing.

What it models, just enough for W1's clients to run unchanged and check their data: rows exist
once put; a reward or reference claim hands out rows put and not yet claimed by that task; a
trainer claim hands out rows both upstream tasks have acked; claims wait (parked) while nothing is
ready; row ids count up per task, so the trainer's exactly-once check still holds; the pre-built
batch carries ``reward`` and ``ref_logprobs`` equal to each row's first response token, the values
the W1 consumers would have written. Never a store: no leases expire, nothing is fenced, nothing is
freed. Used only by the benchmark.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import zmq

from bench._w1 import MICRO, w1_full_batch
from storage import wire


def _full_batch() -> pa.RecordBatch:
    """64 W1 rows with every column, values as W1's consumers would have written them."""
    return w1_full_batch(0, MICRO, np.random.default_rng(0))  # row i's first token = i


@dataclass
class _Counts:
    """Rows per task: put, handed out, acked (the only state W1's dependencies need)."""

    put: int = 0
    claimed: dict[str, int] = field(
        default_factory=lambda: {"reward": 0, "reference": 0, "trainer": 0}
    )
    acked: dict[str, int] = field(default_factory=lambda: {"reward": 0, "reference": 0})

    def ready(self, task: str) -> int:
        if task == "trainer":
            return min(self.acked.values()) - self.claimed["trainer"]
        return self.put - self.claimed[task]


class NullNode:
    """A ROUTER loop answering W1's verbs without a store behind it (see the module docstring)."""

    def __init__(self, bind: str = "tcp://127.0.0.1:*") -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(bind)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.full = _full_batch()
        self.counts = _Counts()
        self.leases: dict[int, tuple[str, int]] = {}  # lease id -> (task, rows)
        self.parked: list[tuple[bytes, wire.Request]] = []
        self.next_lease = 1

    def serve_forever(self) -> None:
        while True:
            frames = self.sock.recv_multipart(copy=False)
            self._handle(frames[0].bytes, wire.decode_request(frames[1:]))
            if self.parked:  # retry waiting claims after every state change (FIFO)
                self.parked = [p for p in self.parked if not self._claim(*p)]

    def _reply(
        self,
        ident: bytes,
        req: wire.Request,
        result: dict[str, Any],
        bodies: list[Any] | None = None,
    ) -> None:
        frames = wire.encode_reply(req.req_id, result, bodies or [])
        self.sock.send_multipart([ident, *frames], copy=False)

    def _handle(self, ident: bytes, req: wire.Request) -> None:
        a = req.args
        if req.verb == "put":
            start, self.counts.put = self.counts.put, self.counts.put + MICRO
            row_ids = np.arange(start, start + MICRO, dtype="<u8").tobytes()
            self._reply(ident, req, {"row_ids": row_ids, "depth": 0})
        elif req.verb == "claim":
            self._ack(a["ack_lease_id"])
            if not self._claim(ident, req):
                self.parked.append((ident, req))
        elif req.verb == "write":
            if a["ack"]:
                self._ack(a["lease_id"])
            self._reply(ident, req, {})
        elif req.verb == "ack":
            self._ack(a["lease_id"])
            self._reply(ident, req, {})
        elif req.verb == "tables":
            self._reply(ident, req, {"tables": []})
        else:  # hello, create_table, drop_table, ...: nothing to keep
            self._reply(ident, req, {"node_index": 0, "shard_ids": [0], "protocol": 1})

    def _ack(self, lease_id: int | None) -> None:
        task, rows = self.leases.pop(lease_id, (None, 0)) if lease_id else (None, 0)
        if task in self.counts.acked:
            self.counts.acked[task] += rows

    def _claim(self, ident: bytes, req: wire.Request) -> bool:
        """Answer the claim if rows are ready (or it does not wait); False: park it."""
        a = req.args
        task, columns = a["task"], a["columns"]
        n = min(a["max_rows"], MICRO, self.counts.ready(task))
        if n <= 0 and a["timeout"] > 0:
            return False
        n = max(n, 0)
        start = self.counts.claimed[task]
        self.counts.claimed[task] += n
        lease_id = 0
        if n:
            lease_id, self.next_lease = self.next_lease, self.next_lease + 1
            self.leases[lease_id] = (task, n)
        arrays = [self.full.column(c).slice(0, n) for c in columns]
        arrays.append(pa.array(np.arange(start, start + n, dtype=np.uint64)))
        arrays.append(pa.array(np.ones(n, dtype=np.uint16)))
        batch = pa.RecordBatch.from_arrays(arrays, names=[*columns, "row_id", "deliveries"])
        result = {"lease_id": lease_id, "shard_id": 0, "deadline": 0.0}
        self._reply(ident, req, result, [wire.write_batch(batch)])
        return True


def _serve(out: Any) -> None:
    node = NullNode()
    out.put(node.address)
    node.serve_forever()


def start_null_node() -> tuple[mp.process.BaseProcess, str]:
    """A ``NullNode`` in its own process (spawned, daemon): (process, address)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(out,), daemon=True)
    proc.start()
    return proc, out.get(timeout=60)
