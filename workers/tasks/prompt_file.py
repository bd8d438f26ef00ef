"""Prompts from a user's file: ``load_problem_file`` reads JSONL or Parquet (pyarrow is imported only
there, so the ``--dry-run`` checks stay light). Its held-out split: ``workers.tasks.heldout``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from workers.tasks.problem import Problem

if TYPE_CHECKING:
    import pyarrow as pa


class ProblemFileError(ValueError):
    """A problem file is missing, unreadable, or lacks a required column."""


def _as_text(value: object) -> str | None:
    # Prompts and answers are text; JSON numbers (answer 46 vs "46") become their JSON text.
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)


def _read_table(path: Path) -> pa.Table:
    import pyarrow as pa
    import pyarrow.parquet as pq

    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return pq.read_table(path)
    if suffix in (".jsonl", ".json", ".ndjson"):
        # pyarrow.json fails on a column mixing "46" and 46 (common for answers): parse lines
        rows = []
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ProblemFileError(f"{path}:{lineno}: invalid JSON: {exc}") from exc
        if not rows:
            raise ProblemFileError(f"{path}: no rows")
        keys = sorted({k for r in rows for k in r})
        return pa.table({k: pa.array([_as_text(r.get(k)) for r in rows], pa.string())
                         for k in keys})
    raise ProblemFileError(f"{path}: unsupported file type {suffix!r}; use .jsonl or .parquet")


def load_problem_file(
    path: str | os.PathLike[str], prompt_column: str, answer_column: str
) -> list[Problem]:
    """Read problems from a JSONL or Parquet file with a prompt and an answer column (the run's
    data.prompt_column and data.answer_column)."""
    import pyarrow as pa

    p = Path(path)
    if not p.is_file():
        raise ProblemFileError(f"problem file {str(p)!r} does not exist")
    try:
        table = _read_table(p)
    except ProblemFileError:
        raise
    except (pa.ArrowException, OSError) as exc:
        raise ProblemFileError(f"{p}: cannot read: {exc}") from exc
    for col in (prompt_column, answer_column):
        if col not in table.column_names:
            raise ProblemFileError(f"{p}: missing column {col!r}; columns are {table.column_names}")
    prompts = table.column(prompt_column).to_pylist()
    answers = table.column(answer_column).to_pylist()
    out = []
    for i, (q, a) in enumerate(zip(prompts, answers, strict=True)):
        if q is None or a is None:
            raise ProblemFileError(
                f"{p}: row {i} has a null {prompt_column!r} or {answer_column!r}")
        out.append(Problem(prompt=str(q), answer=str(a)))
    return out
