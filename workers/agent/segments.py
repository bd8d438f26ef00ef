"""Partial rollout as rows of the samples table: the pure functions the rollout and resume tasks
share (no store, no model; docs/partial.md).

A trajectory cut by a newer policy version lives in its row as segments
(``workers.schema.part_columns``): ``part{j}_*`` is segment j, written by ``rollout`` (j = 0,
with ``part_seed``) or ``resume.{j}`` when that segment was cut again. This module owns what those
tasks compute from a row: the segments read back from a claimed row, the context a resume
generates from, the per-token versions (run-length) of the assembled response, and the write
batches of one segment's rows, mirroring ``workers.agent.trajectory.turn_writes``.

Invariants:

* The written part cells of a row are a prefix of part_seed+part0, part1, ...: whoever ends a
  trajectory writes the assembled response columns, ``response_version_runs`` and NULL in every
  later part cell in the SAME write, so each later ``resume.{j}`` finds the row ready, reads a
  NULL and acks it untouched. A NULL ``part{j}_ids`` therefore means "ended before this".
* ``response_ids`` = segment 0 + segment 1 + ... + the last one; each token's log-prob is the one
  its own segment's version recorded (the per-token importance correction needs no more).
* Versions never decrease along a trajectory (a resume loads at least the previous segment's),
  so ``policy_version`` = the first run's version = the oldest token's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from storage.schema import ROW_ID
from workers.engines.base import FINISH_CUT
from workers.schema import VERSION_RUNS_FIELD, partial_schema


@dataclass(frozen=True)
class Segment:
    """The tokens one generate call added to a trajectory, under one policy version."""

    ids: list[int]  # [L_j] sampled tokens (the stop token included in the last segment)
    logprobs: list[float]  # [L_j] behaviour log-probs under ``version``
    version: int  # policy version that sampled them


@dataclass(frozen=True)
class Assembled:
    """The response columns of an ended trajectory."""

    response_ids: list[int]  # [L]
    response_logprobs: list[float]  # [L]
    policy_version: int  # the oldest token's
    finish_reason: str  # "stop" | "length"
    runs: list[tuple[int, int]]  # (start, version) per run of equal versions


def part_reads(j: int) -> tuple[str, ...]:
    """The columns segments 0..j-1 (and the row's seed) live in: what ``resume.{j}`` claims."""
    names = ["part_seed"]
    for i in range(j):
        names += [f"part{i}_ids", f"part{i}_logprobs", f"part{i}_version"]
    return tuple(names)


def segments(row: Mapping[str, Any], j: int) -> tuple[Segment, ...] | None:
    """Segments 0..j-1 of a claimed row (a ``to_pylist`` dict with ``part_reads(j)``); None when
    one is NULL: the trajectory ended before segment j-1 was cut."""
    got = []
    for i in range(j):
        ids = row[f"part{i}_ids"]
        if ids is None:
            return None
        got.append(Segment(list(ids), list(row[f"part{i}_logprobs"]), int(row[f"part{i}_version"])))
    return tuple(got)


def done_tokens(segs: Sequence[Segment]) -> int:
    return sum(len(s.ids) for s in segs)


def continuation_ids(prompt: Sequence[int], segs: Sequence[Segment]) -> list[int]:
    """prompt + segment 0 + segment 1 + ...: what the next segment is generated from."""
    out = list(prompt)
    for s in segs:
        out += s.ids
    return out


def version_runs(segs: Sequence[Segment]) -> list[tuple[int, int]]:
    """(start token, version) of each run of equal versions over the concatenated segments:
    adjacent segments of one version (a cut with no newer weights loaded after all) merge, and an
    empty segment adds nothing."""
    runs: list[tuple[int, int]] = []
    start = 0
    for s in segs:
        if s.ids and (not runs or runs[-1][1] != s.version):
            runs.append((start, s.version))
        start += len(s.ids)
    return runs or [(0, segs[0].version)]


def assemble_segments(segs: Sequence[Segment], finish_reason: str) -> Assembled:
    ids: list[int] = []
    logprobs: list[float] = []
    for s in segs:
        ids += s.ids
        logprobs += s.logprobs
    return Assembled(ids, logprobs, segs[0].version, finish_reason, version_runs(segs))


def run_dicts(runs: Sequence[tuple[int, int]]) -> list[dict[str, int]]:
    """``runs`` as ``response_version_runs`` cells take them."""
    return [{"start": int(s), "version": int(v)} for s, v in runs]


# ----------------------------------------------------------------------------- write batches
def later_parts(j: int, max_cuts: int) -> tuple[str, ...]:
    """The part columns from segment j on (plus ``part_seed`` when j == 0): NULL once the
    trajectory ends in segment j."""
    names = ["part_seed"] if j == 0 else []
    for i in range(j, max_cuts):
        names += [f"part{i}_ids", f"part{i}_logprobs", f"part{i}_version"]
    return tuple(names)


def _batch(row_ids: Sequence[int], values: dict[str, list[Any]], max_cuts: int) -> pa.RecordBatch:
    types = {f.name: f.type for f in partial_schema(max_cuts)}
    arrays = {ROW_ID: pa.array(row_ids, pa.uint64())}
    arrays.update({name: pa.array(v, types[name]) for name, v in values.items()})
    return pa.RecordBatch.from_pydict(arrays)


def part_writes(row_ids: Sequence[int], j: int, max_cuts: int,
                items: Sequence[tuple[Sequence[Segment], Segment, str]],
                seeds: Sequence[int] | None = None) -> list[pa.RecordBatch]:
    """The writes of segment ``j`` for rows ``row_ids``. Each item: (the row's segments before
    j, the new segment, its finish reason). Cut rows write ``part{j}_*`` (and, j == 0, their
    ``seeds`` as ``part_seed``); the others end: the assembled response columns, its runs and
    NULL in every later part cell. One batch per column set, cut rows first."""
    if j == 0 and seeds is None:
        raise ValueError("segment 0 writes part_seed: pass the rows' seeds")
    going, ending = [], []
    for n, (rid, (before, seg, finish)) in enumerate(zip(row_ids, items, strict=True)):
        if finish == FINISH_CUT:
            if j >= max_cuts:
                raise ValueError(f"segment {j} was cut, but a trajectory has at most {max_cuts} "
                                 "cuts (resume.{R} runs uncut)")
            going.append((rid, seg, n))
        else:
            ending.append((rid, assemble_segments([*before, seg], finish)))
    out = []
    if going:
        values: dict[str, list[Any]] = {
            f"part{j}_ids": [g[1].ids for g in going],
            f"part{j}_logprobs": [g[1].logprobs for g in going],
            f"part{j}_version": [g[1].version for g in going]}
        if j == 0:
            assert seeds is not None
            values["part_seed"] = [seeds[g[2]] for g in going]
        out.append(_batch([g[0] for g in going], values, max_cuts))
    if ending:
        done = [e[1] for e in ending]
        values = {
            "response_ids": [a.response_ids for a in done],
            "response_logprobs": [a.response_logprobs for a in done],
            # single-turn: every token is the model's (NULL = all ones), written all the same
            # since the trainer claims it
            "response_loss_mask": [None] * len(done),
            "policy_version": [a.policy_version for a in done],
            "finish_reason": [a.finish_reason for a in done],
            VERSION_RUNS_FIELD.name: [run_dicts(a.runs) for a in done],
        }
        values.update({name: [None] * len(done) for name in later_parts(j, max_cuts)})
        out.append(_batch([e[0] for e in ending], values, max_cuts))
    return out
