"""Column data of a shard: Arrow chunks as they arrived, and the gather that builds a claimed batch.

Every put/write becomes one *source* kept as received; each cell points at ``(source, offset)``
and a source is freed once no live cell points at it. See docs/store-protocol.md ("Shards")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  # Array.take imports it lazily: pay that at start-up

# Beyond this many runs of sources, one take per source and a permutation beat a take per run.
_MAX_RUNS = 32


@dataclass(slots=True)
class Source:
    """The arrays of one put/write request, indexed by column id, and their accounting."""

    arrays: dict[int, pa.Array]
    nbytes: int
    refs: int  # live (row, column) cells pointing here; freed at 0


def _take(arr: pa.Array, off: np.ndarray) -> pa.Array:
    n = len(off)
    o0 = int(off[0])
    if n == 1:
        return arr.slice(o0, 1)
    if int(off[-1]) - o0 == n - 1 and bool((off[1:] - off[:-1] == 1).all()):
        return arr.slice(o0, n)
    return arr.take(pa.array(off, type=pa.int64()))


def gather(sources: dict[int, Source], col: int, src: np.ndarray, off: np.ndarray) -> pa.Array:
    """The cells (src[i], off[i]) of column ``col`` as one array, in row order. ``src`` >= 0."""
    n = len(src)
    bounds = np.flatnonzero(src[1:] != src[:-1]) + 1
    if len(bounds) == 0:
        return _take(sources[int(src[0])].arrays[col], off)
    if len(bounds) < _MAX_RUNS:
        starts = np.concatenate(([0], bounds))
        ends = np.concatenate((bounds, [n]))
        pieces = [
            _take(sources[int(src[s])].arrays[col], off[s:e])
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
        ]
        return pa.concat_arrays(pieces)
    # Many interleaved sources: one take per source, then one permutation back to row order.
    order = np.argsort(src, kind="stable")
    sorted_src = src[order]
    cuts = np.flatnonzero(sorted_src[1:] != sorted_src[:-1]) + 1
    starts = np.concatenate(([0], cuts)).tolist()
    ends = np.concatenate((cuts, [n])).tolist()
    pieces = [
        _take(sources[int(sorted_src[s])].arrays[col], off[order[s:e]])
        for s, e in zip(starts, ends, strict=True)
    ]
    merged = pa.concat_arrays(pieces)
    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = np.arange(n)
    return merged.take(pa.array(inverse))


def gather_with_nulls(
    sources: dict[int, Source], col: int, typ: pa.DataType, src: np.ndarray, off: np.ndarray
) -> pa.Array:
    """Like ``gather`` but cells with ``src < 0`` (never written) come back as nulls."""
    written = src >= 0
    n = len(src)
    if bool(written.all()) and n:
        return gather(sources, col, src, off)
    if not bool(written.any()):
        return pa.nulls(n, type=typ)
    values = gather(sources, col, src[written], off[written])
    # take() with null indices yields nulls: scatter the written values back into row order.
    idx = np.full(n, 0, dtype=np.int64)
    idx[written] = np.arange(int(written.sum()))
    return values.take(pa.array(idx, mask=~written))


def claimed_batch(
    sources: dict[int, Source], src_all: np.ndarray, off_all: np.ndarray, created: np.ndarray,
    idx: np.ndarray, names: Sequence[str], cols: Sequence[int], row_ids: np.ndarray,
    deliveries: np.ndarray,
) -> pa.RecordBatch:
    """A claimed batch of rows ``idx``: columns ``cols`` (-1: ``created_at``) named ``names``,
    then ``row_id`` and ``deliveries``; ``src_all``/``off_all``: the shard's cell pointers."""
    arrays: list[pa.Array] = []
    k = len(idx)
    data_cols = [c for c in cols if c >= 0]
    fast: dict[int, pa.Array] = {}
    if data_cols and k:
        # A column whose cells are a contiguous run of one source is a zero-copy slice.
        src = np.take(src_all, idx, axis=1)  # (rows first: never copy whole columns)
        off = np.take(off_all, idx, axis=1)
        if len(data_cols) != len(src):
            src, off = src[data_cols], off[data_cols]
        one_src = (src == src[:, :1]).all(axis=1)
        runs = (off[:, 1:] - off[:, :-1] == 1).all(axis=1) if k > 1 else one_src
        for j, (c, single, run, s0, o0) in enumerate(
            zip(data_cols, one_src.tolist(), runs.tolist(), src[:, 0].tolist(), off[:, 0].tolist(),
                strict=True)
        ):
            if single and run and s0 >= 0:
                fast[c] = sources[s0].arrays[c].slice(o0, k)
            else:
                fast[c] = gather(sources, c, src[j], off[j])
    # pa.array infers float64/uint64/uint16 from the numpy dtypes, faster than passing type=.
    for c in cols:
        if c < 0:
            arrays.append(pa.array(created[idx]))
        elif c in fast:
            arrays.append(fast[c])
        else:
            arrays.append(gather(sources, c, src_all[c, idx], off_all[c, idx]))
    arrays.append(pa.array(row_ids.astype(np.uint64, copy=False)))
    arrays.append(pa.array(deliveries))
    return pa.RecordBatch.from_arrays(arrays, names=[*names, "row_id", "deliveries"])
