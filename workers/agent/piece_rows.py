"""A trajectory's pieces as cells of its row: the one reader (row -> pieces) and the one writer
(the write batches of "continue this row with a piece" and "end this row").

Piece k of a row lives in ``piece{k}_*`` (``workers.schema.piece_columns``), written by the task
that continues the row after piece k-1: ``rollout`` (k = 0), ``rollout.{k}`` (a model piece) or
``env.{k}`` (an observation; in a gateway run, the gateway). No store and no model here.

Invariants:

* The written piece cells of a row are a prefix of piece0, piece1, ...: whoever ends a trajectory
  writes, in the SAME write as its own cells, the assembled response columns
  (``workers.agent.pieces.assemble``), ``response_version_runs``, ``env_reward`` and NULL in
  every later piece cell, the gates (``to_model``, ``to_env``) of its own piece included. Every
  later task needs a gate, skips a NULL one (``TaskSpec.skip_null``), and so never sees the row:
  the row is freed once the trainer acks, like a single-turn one.
* A row that goes on writes both gates of its piece: True for the side that continues it, NULL
  for the other (whose task at k+1 the store then consumes without a claim).
* A NULL ``piece{k}_ids`` means "ended before piece k", except where ``piece{k}_end`` is set: an
  observation that ended the trajectory unappended (its error kept, for the reward).
* A table of one piece (single-turn, uncut: ``bound`` 1) has no piece cells: its only piece is
  written as the assembled columns alone, exactly the single-turn table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from storage.schema import ROW_ID
from workers.agent.pieces import TO_ENV, TO_MODEL, History, Piece, assemble
from workers.schema import (
    ENV_REWARD_FIELD,
    PIECE_FIELDS,
    SAMPLES_SCHEMA,
    VERSION_RUNS_FIELD,
    piece_columns,
)

# the cells a reader needs (the gates only say who goes next)
READ_FIELDS = ("ids", "logprobs", "version", "seed", "end", "error")
ASSEMBLED = ("response_ids", "response_logprobs", "response_loss_mask", "policy_version",
             "finish_reason")


def piece_reads(k: int, fields: Sequence[str] = READ_FIELDS) -> tuple[str, ...]:
    """The columns of pieces 0..k-1 (what a task continuing a row after them claims)."""
    return tuple(f"piece{i}_{name}" for i in range(k) for name in fields)


def _piece(row: Mapping[str, Any], k: int) -> Piece:
    version, seed = row.get(f"piece{k}_version"), row.get(f"piece{k}_seed")
    return Piece(tuple(row[f"piece{k}_ids"] or ()), row[f"piece{k}_end"],
                 tuple(row.get(f"piece{k}_logprobs") or ()),
                 None if version is None else int(version), None if seed is None else int(seed),
                 row.get(f"piece{k}_error"))


def read_history(row: Mapping[str, Any], k: int) -> History | None:
    """Pieces 0..k-1 of a claimed row (a ``to_pylist`` dict with ``piece_reads(k)``); None when
    one is NULL: the trajectory ended before piece k."""
    if any(row[f"piece{i}_ids"] is None for i in range(k)):
        return None
    return History(tuple(_piece(row, i) for i in range(k)))


def read_trajectory(row: Mapping[str, Any], bound: int) -> tuple[History, Piece | None]:
    """An ended row's pieces (``piece_reads(bound, ...)``), and the observation that ended it
    unappended (None: none did)."""
    pieces = []
    for k in range(bound):
        if row[f"piece{k}_ids"] is None:
            tail = _piece(row, k) if row.get(f"piece{k}_end") is not None else None
            return History(tuple(pieces)), tail
        pieces.append(_piece(row, k))
    return History(tuple(pieces)), None


@dataclass(frozen=True)
class Step:
    """What a task did to one row at piece k: ``piece`` (None: it wrote none, as when an agent
    ends its episode) after ``hist`` (pieces 0..k-1), and ``then``: ``TO_MODEL``, ``TO_ENV``, or
    the trajectory's finish_reason (it ends here: an observation piece is then not appended)."""

    row_id: int
    hist: History
    piece: Piece | None
    then: str
    env_reward: float | None = None  # written when the row ends here

    @property
    def ends(self) -> bool:
        return self.then not in (TO_MODEL, TO_ENV)


_TYPES = {f.name: f.type for f in (*SAMPLES_SCHEMA, VERSION_RUNS_FIELD, ENV_REWARD_FIELD)}


def _cells(k: int, pieces: Sequence[Piece | None], thens: Sequence[str]) -> dict[str, list]:
    """Piece k's cells of each row (all NULL for a None piece; the ids of an observation that
    ends the row NULL)."""
    out: dict[str, list] = {f"piece{k}_{name}": [] for name, _ in PIECE_FIELDS}
    for p, then in zip(pieces, thens, strict=True):
        unappended = p is not None and not p.model and then not in (TO_MODEL, TO_ENV)
        values = {
            "ids": None if p is None or unappended else list(p.ids),
            "logprobs": list(p.logprobs) if p is not None and p.model else None,
            "version": p.version if p is not None else None,
            "seed": p.seed if p is not None else None,
            "end": p.end if p is not None else None,
            "error": p.error if p is not None else None,
            "to_model": True if then == TO_MODEL else None,
            "to_env": True if then == TO_ENV else None,
        }
        for name, value in values.items():
            out[f"piece{k}_{name}"].append(value)
    return out


def _batch(row_ids: Sequence[int], values: dict[str, list], types: dict[str, pa.DataType]
           ) -> pa.RecordBatch:
    arrays = {ROW_ID: pa.array(row_ids, pa.uint64())}
    arrays.update({name: pa.array(v, types[name]) for name, v in values.items()})
    return pa.RecordBatch.from_pydict(arrays)


def piece_writes(k: int, bound: int, steps: Sequence[Step]) -> list[pa.RecordBatch]:
    """The writes of piece ``k`` of a table of ``bound`` pieces, one batch per column set (a
    batch holds one set for all its rows): rows that go on write piece k's cells and gates;
    rows that end write them (k < ``bound``) with the assembled columns, their runs,
    ``env_reward`` and NULL in every later piece cell (``bound`` 1: the assembled columns only)."""
    types = {**_TYPES, **{f.name: f.type for f in piece_columns(bound)}}
    going = [s for s in steps if not s.ends]
    ending = [s for s in steps if s.ends]
    out = []
    if going:
        if k >= bound or any(s.piece is None for s in going):
            raise ValueError(f"piece {k} goes on: it needs a piece, and k < {bound}")
        out.append(_batch([s.row_id for s in going],
                          _cells(k, [s.piece for s in going], [s.then for s in going]), types))
    if ending:
        done = []
        for s in ending:
            hist = s.hist if s.piece is None or not s.piece.model else s.hist.then(s.piece)
            done.append(assemble(hist, s.then))
        values: dict[str, list] = {name: [getattr(a, name) for a in done] for name in ASSEMBLED}
        if bound > 1:
            values[VERSION_RUNS_FIELD.name] = [
                [{"start": int(st), "version": int(v)} for st, v in a.runs] for a in done]
            values[ENV_REWARD_FIELD.name] = [s.env_reward for s in ending]
            if k < bound:
                values.update(_cells(k, [s.piece for s in ending], [s.then for s in ending]))
            nulls = [None] * len(ending)
            values.update({f"piece{i}_{name}": nulls for i in range(k + 1, bound)
                           for name, _ in PIECE_FIELDS})
        out.append(_batch([s.row_id for s in ending], values, types))
    return out
