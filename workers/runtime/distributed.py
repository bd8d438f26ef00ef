"""Rank coordination for a multi-rank trainer: rank 0 alone talks to the store and broadcasts
commands (micro-batch rows as Arrow IPC bytes, step, stop); every rank computes its round-robin
share of whole groups. Protocol and invariants: docs/engines.md, "Multi-rank trainer".
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, TypeVar

import pyarrow as pa
import torch
import torch.distributed as dist

_CONTROL_LEN = 3  # [op, iteration, payload bytes]
_PEAKS = ("_max", "_min")  # suffixes of the fields all_reduce_sums reduces by max / min
Sums = TypeVar("Sums")
log = logging.getLogger(__name__)


class Op(IntEnum):
    MICRO_BATCH = 1  # payload: the claimed rows of one micro-batch (Arrow IPC stream)
    STEP = 2  # the iteration is complete: all-reduce the loss sums, then optimizer step
    STOP = 3  # the leader is done: followers return


class RanksOutOfSync(RuntimeError):
    """Two ranks hold different parameters after a step (a bug, never an expected state)."""


@dataclass(frozen=True)
class RankEnv:
    """What torch's launcher tells a process about its place in the job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def rank_env(environ: dict[str, str] | None = None) -> RankEnv | None:
    """The launcher's rank variables, or None when this process was not started by a launcher;
    ``ValueError`` naming the variable when the set is partial or malformed."""
    env = os.environ if environ is None else environ
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    present = [n for n in names if n in env]
    if not present:
        return None
    missing = [n for n in names if n not in env]
    if missing:
        raise ValueError(f"partial launcher environment: {missing} unset (have {present})")
    values: dict[str, int] = {}
    for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        try:
            values[n] = int(env[n])
        except ValueError:
            raise ValueError(f"{n} must be an integer, got {env[n]!r}") from None
    if not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise ValueError(f"RANK={values['RANK']} outside WORLD_SIZE={values['WORLD_SIZE']}")
    return RankEnv(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], env["MASTER_ADDR"],
                   values["MASTER_PORT"])


def describe_rank(env: RankEnv, environ: dict[str, str] | None = None) -> str:
    """One log line (checked by multi-host tests): rank, launcher and rendezvous, network namespace
    and this rank's own address toward the master (a UDP ``connect`` route lookup sends nothing)."""
    e = os.environ if environ is None else environ
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in e else "other"
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "?"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((env.master_addr, env.master_port))
            via = sock.getsockname()[0]
    except OSError:
        via = "?"
    return (
        f"rank {env.rank} of {env.world_size} joined (local rank {env.local_rank}, "
        f"launcher={launcher}, MASTER_ADDR={env.master_addr} MASTER_PORT={env.master_port}, "
        f"netns={netns}, via {via}, GLOO_SOCKET_IFNAME={e.get('GLOO_SOCKET_IFNAME', '-')})"
    )


# --------------------------------------------------------------------------- payloads
def encode_rows(rows: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema) as writer:
        writer.write_batch(rows)
    return sink.getvalue().to_pybytes()


def decode_rows(data: bytes | memoryview) -> pa.RecordBatch:
    reader = pa.ipc.open_stream(pa.py_buffer(data))
    batches = list(reader)
    if len(batches) != 1:
        raise ValueError(f"micro-batch payload holds {len(batches)} record batches, expected 1")
    return batches[0]


def deal_groups(rows: pa.RecordBatch, rank: int, world_size: int) -> pa.RecordBatch:
    """The rows of the groups this rank owns: group i (in order of first appearance) goes to
    rank ``i % world_size``. Whole groups only, row order kept."""
    if world_size == 1:
        return rows
    owner: dict[int, int] = {}
    mask = []
    for gid in rows.column("group_id").to_pylist():
        if gid not in owner:
            owner[gid] = len(owner) % world_size
        mask.append(owner[gid] == rank)
    return rows.filter(pa.array(mask, pa.bool_()))


def first_group(rows: pa.RecordBatch) -> pa.RecordBatch:
    """The rows of the first group (what an idle rank backpropagates with weight 0)."""
    ids = rows.column("group_id").to_pylist()
    return rows.filter(pa.array([g == ids[0] for g in ids], pa.bool_()))


# --------------------------------------------------------------------------- the group
@dataclass(frozen=True)
class Command:
    op: Op
    iteration: int
    rows: pa.RecordBatch | None  # MICRO_BATCH only


class RankGroup:
    """This process's view of the trainer ranks over an initialised ``torch.distributed`` group:
    the leader calls ``send_*``, followers ``receive``; all call each collective at one point."""

    def __init__(self, rank: int, world_size: int, *, own_group: bool | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("RankGroup needs an initialised torch.distributed process group")
        self.rank = rank
        self.world_size = world_size
        # Commands, row payloads, loss sums and digests are host tensors: they travel over gloo
        # whatever the gradients use (NCCL takes CUDA tensors only). own_group=None: a gloo group
        # of our own unless the default group is gloo already; every rank creates it here, at the
        # same point, as new_group requires.
        if own_group is None:
            own_group = dist.get_backend() != "gloo"
        self._group = dist.new_group(backend="gloo") if own_group else None
        try:
            env = rank_env()
        except ValueError:  # not torchrun's: nothing to say about the launcher
            env = None
        if env is not None:
            log.info(describe_rank(env))

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def share(self, rows: pa.RecordBatch) -> pa.RecordBatch:
        return deal_groups(rows, self.rank, self.world_size)

    # ---------------------------------------------------------------- leader
    def send_micro_batch(self, rows: pa.RecordBatch, iteration: int) -> None:
        payload = encode_rows(rows)
        self._control(Op.MICRO_BATCH, iteration, len(payload))
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self._group)

    def send_step(self, iteration: int) -> None:
        self._control(Op.STEP, iteration, 0)

    def send_stop(self) -> None:
        self._control(Op.STOP, -1, 0)

    def _control(self, op: Op, iteration: int, nbytes: int) -> None:
        if not self.is_leader:
            raise RuntimeError(f"rank {self.rank} cannot send commands; only rank 0 leads")
        dist.broadcast(torch.tensor([int(op), iteration, nbytes], dtype=torch.int64), src=0,
                       group=self._group)

    # ---------------------------------------------------------------- follower
    def receive(self) -> Command:
        """Block until the leader's next command (and its payload) arrives."""
        control = torch.zeros(_CONTROL_LEN, dtype=torch.int64)
        dist.broadcast(control, src=0, group=self._group)
        op, iteration, nbytes = (int(x) for x in control.tolist())
        try:
            kind = Op(op)
        except ValueError:
            raise RuntimeError(f"rank {self.rank}: unknown command {op} from rank 0") from None
        rows = None
        if kind is Op.MICRO_BATCH:
            data = torch.empty(nbytes, dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self._group)
            rows = decode_rows(memoryview(data.numpy()))
        return Command(kind, iteration, rows)

    # ---------------------------------------------------------------- collectives
    def all_reduce_sums(self, sums: Sums) -> Sums:
        """Per-rank sums (a dataclass of numbers: the trainer's ``workers.rl.objectives.LossSums``)
        reduced over the ranks: a field named ``*_max`` by max, ``*_min`` by min (inf on a rank
        without tokens), every other one summed, ints kept ints; every rank gets the global ones."""
        out: dict[str, Any] = {}
        for suffix, op in (("", dist.ReduceOp.SUM), ("_max", dist.ReduceOp.MAX),
                           ("_min", dist.ReduceOp.MIN)):
            group = [f for f in fields(sums)  # type: ignore[arg-type]
                     if f.name[-4:] == suffix or (not suffix and f.name[-4:] not in _PEAKS)]
            values = torch.tensor([float(getattr(sums, f.name)) for f in group],
                                  dtype=torch.float64)
            dist.all_reduce(values, op=op, group=self._group)
            out.update({f.name: round(v) if f.type == "int" else v
                        for f, v in zip(group, values.tolist(), strict=True)})
        return dataclasses.replace(sums, **out)  # type: ignore[type-var]

    def broadcast_text(self, text: str) -> str:
        """Rank 0's ``text`` on every rank (e.g. the checkpoint directory every rank writes to)."""
        data = text.encode() if self.is_leader else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._group)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_leader
               else torch.empty(int(size[0]), dtype=torch.uint8))
        if int(size[0]):
            dist.broadcast(buf, src=0, group=self._group)
        return bytes(buf.numpy()).decode()

    def check_in_sync(self, model: torch.nn.Module) -> list[int]:
        """Every rank's parameter digest; raises ``RanksOutOfSync`` unless all are equal."""
        digest = torch.tensor([parameter_digest(model)], dtype=torch.int64)
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(gathered, digest, group=self._group)
        digests = [int(t[0]) for t in gathered]
        if len(set(digests)) != 1:
            raise RanksOutOfSync(f"parameter digests differ across ranks: {digests}")
        return digests


def parameter_digest(model: torch.nn.Module) -> int:
    """A 63-bit digest of every parameter's name and exact bytes (bitwise identity check)."""
    h = hashlib.blake2b(digest_size=8)
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)
