"""The node's persistence root: which directories and files the store owns under it.

Rules: docs/store-protocol.md ("Persistence"); logs and snapshots are ``persist.TableStore``'s."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import uuid

import pyarrow as pa

from storage.errors import BadRequest
from storage.schema import TableSpec, TaskSpec

log = logging.getLogger(__name__)

MARKER = ".streamflow-table"
TABLE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")  # one component, no leading dot
MAX_EPOCH = (1 << 31) - 1  # lease ids are (epoch << 32) | counter: positive int64 everywhere
# Files the store writes in a table directory (drop_table removes these and nothing else).
_OWNED = re.compile(r"^(table\.json|shard-\d+\.snap|shard-\d+\.\d+\.log)(\.tmp)?$")
# Spec fields of table.json that say what the stored data means (must match to reopen it).
DATA_KEYS = ("schema", "tasks", "group_column", "group_size")
_LIMIT_KEYS = ("capacity_rows", "capacity_bytes", "lease_seconds", "max_deliveries", "fsync",
               "fsync_interval_s")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """tmp + fsync + rename + directory fsync: the file is the old one or the new one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def table_dir(root: str, name: str) -> str:
    """``<root>/<name>``, refusing anything that is not one plain component inside the root."""
    if not isinstance(name, str) or not TABLE_NAME.match(name):
        raise BadRequest(f"table name {name!r} is not 1-128 chars of [A-Za-z0-9_.-]")
    path = os.path.join(root, name)
    if os.path.islink(path):
        raise BadRequest(f"table directory {path!r} is a symlink; the store does not follow it")
    return path


def claim_dir(path: str, table: str) -> None:
    """Create the table's directory with its marker inside (made under a temporary name, then
    renamed: never seen half made), or check that an existing one is ours."""
    if not os.path.lexists(path):
        root = os.path.dirname(path)
        tmp = os.path.join(root, f".tmp-{table}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.mkdir(tmp, 0o755)
        write_atomic(os.path.join(tmp, MARKER), json.dumps({"table": table}) + "\n")
        try:
            os.rename(tmp, path)
        except OSError:  # another node made it first (or something else is there): check below
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(tmp, MARKER))
                os.rmdir(tmp)
        else:
            fsync_dir(root)
            return
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, MARKER)):
        raise BadRequest(f"{path!r} exists but was not created by the store (no {MARKER} marker); "
                         f"remove it or use another table name than {table!r}")


def remove_owned(path: str) -> None:
    """Delete what the store wrote in a table directory; keep (and log) anything else."""
    if not os.path.isfile(os.path.join(path, MARKER)) or os.path.islink(path):
        log.warning("%s has no %s marker: nothing deleted", path, MARKER)
        return
    foreign = []
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if _OWNED.match(name) and os.path.isfile(full) and not os.path.islink(full):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(full)
        elif name != MARKER:
            foreign.append(name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, MARKER))  # the store no longer owns the directory
    if foreign:
        log.warning("%s: kept files the store did not write: %s", path, sorted(foreign)[:10])
        return
    with contextlib.suppress(OSError):
        os.rmdir(path)


def spec_doc(spec: TableSpec) -> dict:
    doc = {
        "schema": base64.b64encode(spec.schema.serialize().to_pybytes()).decode(),
        "tasks": [[t.name, list(t.needs), t.whole_groups, t.skip_null] for t in spec.tasks],
        "group_column": spec.group_column, "group_size": spec.group_size,
    }
    doc.update({key: getattr(spec, key) for key in _LIMIT_KEYS})
    return doc


def spec_from_doc(name: str, doc: dict) -> TableSpec:
    """The TableSpec a ``table.json`` describes (limits missing from older files: defaults)."""
    schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(doc["schema"])))
    # [name, needs, whole_groups, skip_null]; files written before skip_null have three entries
    tasks = tuple(TaskSpec(str(t[0]), tuple(t[1]), bool(t[2]), t[3] if len(t) > 3 else None)
                  for t in doc["tasks"])
    limits = {key: doc[key] for key in _LIMIT_KEYS if key in doc}
    return TableSpec(name, schema, tasks, group_column=doc.get("group_column"),
                     group_size=doc.get("group_size"), **limits)


def discover(root: str) -> list[TableSpec]:
    """Specs of the tables to recover: directories with the marker and a table.json (one that
    cannot be read is an error: a node must not come up without one of its tables)."""
    specs = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not TABLE_NAME.match(name) or os.path.islink(path) or not os.path.isdir(path):
            continue
        meta = os.path.join(path, "table.json")
        if not os.path.isfile(os.path.join(path, MARKER)) or not os.path.isfile(meta):
            continue
        try:
            with open(meta) as f:
                specs.append(spec_from_doc(name, json.load(f)))
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
            raise BadRequest(f"cannot recover table {name!r}: {meta}: {exc}") from None
    return specs


def next_epoch(root: str, node_index: int) -> int:
    """The lease epoch of a new incarnation of node ``node_index``: the persisted one + 1 (1 on a
    fresh root), persisted before it is used. Wraps after 2**31 - 1 incarnations."""
    path = os.path.join(root, f".node-{node_index}.epoch")
    last = 0
    try:
        with open(path) as f:
            last = int(f.read().strip() or 0)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        raise BadRequest(f"cannot read the lease epoch file {path}: {exc}") from None
    epoch = last % MAX_EPOCH + 1
    write_atomic(path, f"{epoch}\n")
    return epoch
