"""Validation of what callers hand the store: table specs and incoming Arrow batches.

Each raises a typed ``BadRequest``/``SchemaMismatch`` naming the field or column, and mutates
nothing: ``StoreNode`` validates a whole request before it changes any state."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pyarrow as pa

from storage.errors import BadRequest, SchemaMismatch
from storage.headers import WireSpec, field_error
from storage.persist_root import TABLE_NAME
from storage.schema import META_COLUMNS, ROW_ID, TableSpec
from storage.wire import spec_to_wire, to_batch


def validate_spec(spec: TableSpec) -> None:
    """BadRequest naming the first bad field of a table spec."""
    if not isinstance(spec, TableSpec):
        raise BadRequest("spec must be a TableSpec")
    if not isinstance(spec.name, str) or not TABLE_NAME.match(spec.name):
        raise BadRequest(f"name: {spec.name!r} is not 1-128 chars of [A-Za-z0-9_.-]")
    if not isinstance(spec.schema, pa.Schema):
        raise BadRequest("schema: must be a pyarrow.Schema")
    try:  # types and bounds of every field: the wire Struct's (storage/headers.py)
        msgspec.convert(spec_to_wire(spec), WireSpec)
    except msgspec.ValidationError as exc:
        raise field_error(exc, "", kind="spec") from None
    names = spec.schema.names
    if len(set(names)) != len(names):
        raise BadRequest(f"schema: duplicate column names in {names}")
    for name in names:
        if name in META_COLUMNS:
            raise BadRequest(f"schema: column {name!r} is reserved store metadata")
    if not spec.tasks:
        raise BadRequest("tasks: a table needs at least one task")
    task_names = [t.name for t in spec.tasks]
    if len(set(task_names)) != len(task_names) or not all(TABLE_NAME.match(n) for n in task_names):
        raise BadRequest(f"tasks: names must be unique and match [A-Za-z0-9_.-]: {task_names}")
    for t in spec.tasks:
        for c in t.needs:
            if c not in names:
                raise BadRequest(f"tasks[{t.name}].needs: unknown column {c!r}")
        if t.whole_groups and spec.group_column is None:
            raise BadRequest(f"tasks[{t.name}].whole_groups: the table has no group_column")
        if t.skip_null is not None and t.skip_null not in t.needs:
            raise BadRequest(f"tasks[{t.name}].skip_null: {t.skip_null!r} is not one of its needs")
        if t.skip_null is not None and t.whole_groups:
            raise BadRequest(f"tasks[{t.name}].skip_null: not with whole_groups")
    if (spec.group_column is None) != (spec.group_size is None):
        raise BadRequest("group_column and group_size: set both or neither")
    if spec.group_column is not None:
        if spec.group_column not in names:
            raise BadRequest(f"group_column: unknown column {spec.group_column!r}")
        if spec.schema.field(spec.group_column).type != pa.int64():
            raise BadRequest(f"group_column: {spec.group_column!r} must be int64")


def positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def as_batch(batch: pa.RecordBatch | pa.Table, what: str) -> pa.RecordBatch:
    try:
        return to_batch(batch)
    except TypeError:
        got = type(batch).__name__
        raise BadRequest(f"{what}: expected a pyarrow RecordBatch, got {got}") from None


def check_columns(spec: TableSpec, batch: pa.RecordBatch) -> dict[int, pa.Array]:
    """Schema + full Arrow validation; {column id: array} of user columns."""
    schema, arrays = spec.schema, {}
    names = batch.schema.names
    if len(set(names)) != len(names):
        raise SchemaMismatch(f"duplicate column names in batch: {names}")
    for i, f in enumerate(batch.schema):
        if f.name == ROW_ID:
            continue
        c = schema.get_field_index(f.name)
        if c < 0:
            raise SchemaMismatch(f"table {spec.name!r} has no column {f.name!r}")
        expected = schema.field(c)
        if f.type != expected.type:
            raise SchemaMismatch(f"column {f.name!r}: expected type {expected.type}, got {f.type}")
        col = batch.column(i)
        if not expected.nullable and col.null_count:
            raise SchemaMismatch(f"column {f.name!r} is not nullable but has nulls")
        arrays[c] = col
    try:
        batch.validate(full=True)
    except (pa.ArrowInvalid, pa.ArrowException) as e:
        raise BadRequest(f"invalid Arrow data: {e}") from None
    return arrays


def group_order(spec: TableSpec, batch: pa.RecordBatch) -> np.ndarray | None:
    """None if the batch's groups are already consecutive runs, else the stable sort order."""
    name, g = spec.group_column, spec.group_size or 1
    if name not in batch.schema.names:
        raise SchemaMismatch(f"column {name!r} (the group column) is required in a put")
    col = batch.column(name)
    if col.null_count:
        raise SchemaMismatch(f"column {name!r} (the group column) has nulls")
    ids = col.to_numpy()
    if len(ids) % g:
        raise BadRequest(f"put of {len(ids)} rows is not whole groups of {g} ({name!r})")
    runs = ids.reshape(-1, g)
    if bool((runs == runs[:, :1]).all()) and len(np.unique(runs[:, 0])) == len(runs):
        return None
    order = np.argsort(ids, kind="stable")
    runs = ids[order].reshape(-1, g)
    if not bool((runs == runs[:, :1]).all()) or not bool((np.diff(runs[:, 0]) > 0).all()):
        raise BadRequest(f"every {name!r} value must appear exactly {g} times in a put")
    return order
