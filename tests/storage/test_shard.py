"""Shard internals: the ready queue, the column gather, compaction, row-id routing."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from storage._columns import Source, gather, gather_with_nulls
from storage.node import StoreNode
from storage.queues import SeqQueue
from storage.schema import SEQ_BITS, TableSpec, TaskSpec, split_row_ids


def make_row_id(shard_id: int, seq: int) -> int:
    return (shard_id << SEQ_BITS) | seq


def test_seq_queue_fifo_across_pieces_and_push_front() -> None:
    q = SeqQueue()
    q.push(np.arange(0, 5))
    q.push(np.arange(5, 8))
    q.push(np.empty(0, dtype=np.int64))
    assert q.pop(3).tolist() == [0, 1, 2]
    assert q.pop(4).tolist() == [3, 4, 5, 6]
    q.push_front(np.array([40, 41]))
    assert q.size == 3
    assert q.pop(10).tolist() == [40, 41, 7]
    assert q.pop(1).tolist() == [] and q.size == 0


def _sources() -> dict[int, Source]:
    a = pa.array([[i] * 2 for i in range(10)], pa.list_(pa.int32()))
    b = pa.array([[100 + i] for i in range(10)], pa.list_(pa.int32()))
    return {0: Source({0: a}, a.nbytes, 10), 1: Source({0: b}, b.nbytes, 10)}


def test_gather_contiguous_run_is_a_zero_copy_slice() -> None:
    sources = _sources()
    out = gather(sources, 0, np.array([0, 0, 0], np.int32), np.array([4, 5, 6], np.int32))
    assert out.to_pylist() == [[4, 4], [5, 5], [6, 6]]
    assert out.offset == 4  # a slice of the stored chunk, not a copy
    assert out.values.buffers()[1].address == sources[0].arrays[0].values.buffers()[1].address


def test_gather_runs_and_interleaved_sources_keep_row_order() -> None:
    sources = _sources()
    src = np.array([0, 0, 1, 0, 1], np.int32)
    off = np.array([3, 1, 2, 9, 0], np.int32)
    expected = [[3, 3], [1, 1], [102], [9, 9], [100]]
    assert gather(sources, 0, src, off).to_pylist() == expected
    rng = np.random.default_rng(0)
    src = rng.integers(0, 2, 200).astype(np.int32)  # many runs: per-source take + permutation
    off = rng.integers(0, 10, 200).astype(np.int32)
    got = gather(sources, 0, src, off).to_pylist()
    assert got == [
        [o, o] if s == 0 else [100 + o] for s, o in zip(src.tolist(), off.tolist(), strict=True)
    ]


def test_gather_with_nulls_for_unwritten_cells() -> None:
    sources = _sources()
    typ = pa.list_(pa.int32())
    out = gather_with_nulls(
        sources, 0, typ, np.array([-1, 1, -1], np.int32), np.array([0, 5, 0], np.int32)
    )
    assert out.to_pylist() == [None, [105], None]
    assert (
        gather_with_nulls(
            sources, 0, typ, np.array([-1], np.int32), np.array([0], np.int32)
        ).null_count
        == 1
    )


def test_split_row_ids() -> None:
    ids = np.array([make_row_id(3, 7), make_row_id(0x102, (1 << 48) - 1)], dtype=np.uint64)
    shards, seqs = split_row_ids(ids)
    assert shards.tolist() == [3, 0x102] and seqs.tolist() == [7, (1 << 48) - 1]


def test_compaction_keeps_unconsumed_rows_and_cells() -> None:
    schema = pa.schema([("x", pa.int64())])
    node = StoreNode(0, 1)
    node.create_table(TableSpec("t", schema, (TaskSpec("a", ("x",)),), capacity_rows=10**6))
    shard = node._tables["t"].shards[0]
    kept, held = [], []
    for i in range(30):  # per put of 1000 rows: consume 999, hand the first one back
        node.put(
            "t", pa.RecordBatch.from_pydict({"x": pa.array(np.arange(i * 1000, (i + 1) * 1000))})
        )
        first = node.claim("t", "a", ["x"], 1)
        rest = node.claim("t", "a", ["x"], 999)
        node.ack("t", rest.lease_id)
        held.append(first.lease_id)
        kept += first.row_ids
    for lease_id in held:
        node.release("t", lease_id)
    assert shard.num_alive == 30 and shard.n < 30_000  # freed rows were compacted away
    lease = node.claim("t", "a", ["x"], 100_000)
    assert sorted(lease.row_ids) == sorted(kept)
    x = lease.batch.column("x").to_numpy()
    seq = (lease.batch.column("row_id").to_numpy() & np.uint64((1 << 48) - 1)).astype(np.int64)
    assert (seq == x).all()  # cells still attached to their rows after the moves
    node.ack("t", lease.lease_id)
    assert node.memory_bytes() == 0


def test_leases_held_across_compaction_ack_their_own_rows() -> None:
    schema = pa.schema([("x", pa.int64())])
    node = StoreNode(0, 1)
    node.create_table(TableSpec("t", schema, (TaskSpec("a", ("x",)),), capacity_rows=10**6))
    shard = node._tables["t"].shards[0]
    held = []
    for i in range(12):  # each round frees 999 rows; compaction moves the held rows down
        node.put("t", pa.RecordBatch.from_pydict({"x": pa.array(np.arange(1000) + i * 1000)}))
        held.append(node.claim("t", "a", ["x"], 1))
        node.ack("t", node.claim("t", "a", ["x"], 999).lease_id)
    assert shard.layout > 0  # compaction ran while the leases were held
    for lease in held:
        rec = shard.leases[lease.lease_id]
        assert shard.lease_idx(rec).tolist() == shard.locate(rec.seqs).tolist()
        node.ack("t", lease.lease_id)
    assert shard.num_alive == 0 and node.memory_bytes() == 0
    assert node.stats("t").shards[0].tasks["a"].consumed == 12_000
