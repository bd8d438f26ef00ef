"""What a table is: its declared schema, its tasks, its limits, and the records the verbs return.

The row lifecycle per task and the row-id layout: docs/store-protocol.md ("Tables and tasks")."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

ROW_ID = "row_id"
"""Column present in every claimed batch: the stable 64-bit row id (uint64)."""

# Row ids: the top 16 bits name the shard, the low 48 a sequence number within it, so any client
# routes a row id to its shard without a lookup.
SHARD_BITS = 16
SEQ_BITS = 64 - SHARD_BITS
SEQ_MASK = (1 << SEQ_BITS) - 1


def shard_of(row_id: int) -> int:
    return row_id >> SEQ_BITS


# Store-kept metadata. These names are reserved: a user schema may not declare them.
META_COLUMNS: dict[str, pa.DataType] = {
    ROW_ID: pa.uint64(),  # stable id, see docs/store-protocol.md
    "created_at": pa.float64(),  # wall-clock seconds when the row was put
    # Per-task delivery count in a claimed batch, this delivery included (1 = first time).
    "deliveries": pa.uint16(),
}


class RowState(enum.IntEnum):
    """The per-(row, task) state (more: docs/store-protocol.md)::

        PENDING --(last needed column written)--> READY --claim--> LEASED --ack--> CONSUMED
           |                                        ^                 |                ^
           |                                        +--expire/release-+--(deliveries > max)--> DEAD
           +--(needs written, the task's ``skip_null`` cell NULL)-------------------------+

    A row is freed once every task has CONSUMED it; DEAD rows are kept until ``clear``."""

    PENDING = 0
    READY = 1
    LEASED = 2
    CONSUMED = 3
    DEAD = 4


@dataclass(frozen=True)
class TaskSpec:
    """A consumer task of a table: its name and the columns that make a row ready for it."""

    name: str
    needs: tuple[str, ...]
    # If True, claims hand out only complete groups, never split across leases.
    whole_groups: bool = False
    # A needed column whose cell, written NULL, says the row is no work for this task: such a row
    # goes from PENDING straight to CONSUMED (never claimed) when its needs are written. None: every
    # ready row is delivered. Not with whole_groups (a group would be split by its NULLs).
    skip_null: str | None = None


@dataclass(frozen=True)
class TableSpec:
    """Declared once at ``create_table``; immutable afterwards."""

    name: str
    schema: pa.Schema  # user columns only (no META_COLUMNS)
    tasks: tuple[TaskSpec, ...]
    # Optional grouping: rows sharing this int64 column's value, ``group_size`` per put.
    group_column: str | None = None
    group_size: int | None = None
    # Back-pressure: ``put`` waits (up to its timeout) while the table holds this many rows/bytes.
    # These limits are declared here only: a run's ``store.*`` keys take their defaults from them.
    capacity_rows: int = 100_000
    capacity_bytes: int = 8 << 30
    # Leases: default deadline, and the delivery count past which a row is quarantined (DEAD).
    lease_seconds: float = 30.0
    max_deliveries: int = 3
    # Durability with a persistence root: "always" (when acknowledged), "interval", "never".
    fsync: str = "always"
    fsync_interval_s: float = 0.05


@dataclass(frozen=True)
class Lease:
    """What ``claim`` returns: the rows (requested columns + ``row_id``, ``deliveries``) and the
    right to write/ack them until ``deadline``. An empty lease (``num_rows == 0``) needs no ack."""

    lease_id: int  # unique per node (includes the node epoch); 0 for an empty lease
    table: str
    task: str
    shard_id: int
    deadline: float  # wall-clock seconds
    batch: pa.RecordBatch

    @property
    def num_rows(self) -> int:
        return self.batch.num_rows

    @property
    def row_ids(self) -> list[int]:
        return self.batch.column(ROW_ID).to_pylist()


@dataclass
class TaskStats:
    """Counts of rows per state for one (table, shard, task)."""

    pending: int = 0
    ready: int = 0
    in_flight: int = 0  # LEASED
    consumed: int = 0
    dead: int = 0
    redelivered_total: int = 0  # rows handed out again after an expiry or failed release
    dead_reasons: dict[str, int] = field(default_factory=dict)


@dataclass
class ShardStats:
    shard_id: int
    rows: int  # live rows held (not yet freed)
    bytes: int  # memory held by this shard's column data
    tasks: dict[str, TaskStats]


@dataclass
class TableStats:
    table: str
    shards: list[ShardStats]

    def task_total(self, task: str) -> TaskStats:
        """Sum of one task's counts over all shards."""
        total = TaskStats()
        for shard in self.shards:
            s = shard.tasks[task]
            for f in ("pending", "ready", "in_flight", "consumed", "dead", "redelivered_total"):
                setattr(total, f, getattr(total, f) + getattr(s, f))
            for reason, n in s.dead_reasons.items():
                total.dead_reasons[reason] = total.dead_reasons.get(reason, 0) + n
        return total


def split_row_ids(row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(shard ids, int64 sequences) of uint64 row ids."""
    shards = (row_ids >> np.uint64(SEQ_BITS)).astype(np.int64)
    seqs = (row_ids & np.uint64(SEQ_MASK)).astype(np.int64)
    return shards, seqs
