"""The ``simulated`` engine: rollout, reward, reference and trainer stages that do no math but hold
their device for the time the cost model gives (``workers.engines.sim_cost``), scaled by ``time_scale``.

Everything around the hold is real: the stages plug into the real ``workers.roles.loop.StageLoop``
(claim -> process -> write+ack carried by the next claim) against a real store over real sockets,
and write real Arrow columns (placeholders of ``PAYLOAD_TOKENS`` tokens for the token lists, so
that the store moves real batches of every column but not the gigabytes a real 7B run would; the
true length travels in the extra column ``sim_response_tokens``).

Time: a device holds ``seconds / time_scale`` real seconds for ``seconds`` of simulated work.
Every hold is recorded as a ``Hold`` (device, role, kind, real start/end, iteration, rows) so the
bench can compute utilisation and draw timelines.

Weights (the mode's rule, modelled explicitly): a rollout device generates with the newest version
it knows (``VersionBoard``, fed by the controller's announcements) that is >= the batch's
``min_policy_version``, waiting for it if needed; switching to a newer version holds the device
for ``cost.sync_s()`` (the weight load). In ``sync``/``periodic`` every rollout device pays that at
the iteration boundary while nothing else can run; in ``async`` each device pays it between two of
its batches while the others keep generating with the version they hold (the overlap).

Trainer (``TrainerGroup``): ``devices`` data-parallel devices of one trainer job. Like the real
DeepSpeed trainer, one claimer (rank 0) claims whole groups from the store (one claim for all
free devices) and hands micro-batches of ``rows_per_trainer_batch`` rows to free devices; rows of
a later iteration are parked until the step of the current one. When all rows of iteration k are
trained: hold every device for ``cost.step_s(devices)`` (all-reduce +
optimizer), announce version k+1, hold for ``cost.sync_s()`` (sending the weights), then ack the
leases whose rows are all trained (acked after the step, as the real trainer does).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from storage.schema import ROW_ID, Lease
from workers.engines.sim_cost import CostModel, Workload, group_lengths
from workers.roles.loop import with_row_ids
from workers.schema import ROLLOUT_READS

PAYLOAD_TOKENS = 4  # tokens actually stored per response / log-prob list (placeholders)
SIM_COLUMN = "sim_response_tokens"


@dataclass
class Hold:
    device: str
    role: str  # rollout | reward | reference | trainer
    kind: str  # compute | sync | step
    start: float  # wall clock (time.time), comparable across the host processes
    end: float
    iteration: int
    rows: int


class DeviceClock:
    """Holds devices for simulated seconds and records every hold (thread-safe)."""

    def __init__(self, time_scale: float) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.time_scale = time_scale
        self.holds: list[Hold] = []  # list.append is atomic under the GIL

    def hold(
        self, devices: list[str], role: str, kind: str, seconds: float, iteration: int, rows: int
    ) -> None:
        start = time.time()
        if seconds > 0:
            time.sleep(seconds / self.time_scale)
        end = time.time()
        for d in devices:
            self.holds.append(Hold(d, role, kind, start, end, iteration, rows))


class VersionBoard:
    """The newest published policy version this host knows, and the controller's admissions."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.version = 0
        self.admitted = 0  # iterations put so far
        self.stopped = False

    def update(self, version: int, admitted: int, stop: bool) -> None:
        with self._cond:
            if version > self.version or admitted > self.admitted or stop != self.stopped:
                self.version = max(self.version, version)
                self.admitted = max(self.admitted, admitted)
                self.stopped = self.stopped or stop
                self._cond.notify_all()

    def wait(self, predicate: Callable[[VersionBoard], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self) or self.stopped, timeout)


def _iteration(batch: pa.RecordBatch) -> int:
    values = set(batch.column("iteration").to_pylist()) if "iteration" in batch.schema.names else ()
    return values.pop() if len(values) == 1 else -1


_CACHE: dict[tuple, pa.Array] = {}


def _placeholders(n: int, value: Any, typ: pa.DataType) -> pa.Array:
    key = (n, value, str(typ))
    if key not in _CACHE:  # immutable Arrow arrays, built once per size (keeps turns cheap)
        _CACHE[key] = pa.array([[value] * PAYLOAD_TOKENS] * n, pa.list_(typ))
    return _CACHE[key]


def _constant(n: int, value: Any, typ: pa.DataType) -> pa.Array:
    key = (n, value, str(typ), "scalar")
    if key not in _CACHE:
        _CACHE[key] = pa.array([value] * n, typ)
    return _CACHE[key]


class SimRolloutStage:
    """Rollout: G responses per prompt, lengths from the cost model, held for the batch's time."""

    task = "rollout"
    columns = ROLLOUT_READS
    whole_groups = True

    def __init__(
        self,
        device: str,
        cost: CostModel,
        w: Workload,
        clock: DeviceClock,
        board: VersionBoard,
        weight_wait_s: float = 120.0,
    ) -> None:
        self.device, self.cost, self.w, self.clock, self.board = device, cost, w, clock, board
        self.max_rows = w.groups_per_rollout_batch * w.group_size
        self.weight_wait_s = weight_wait_s
        self.loaded = 0  # the version this engine holds (built with version 0)
        self.last_tokens = 0
        self.lengths: dict[int, list[int]] = {}  # group id -> lengths (``precompute``)

    def precompute(self, group_ids: range) -> None:
        """Draw the lengths of these groups now (start-up), so a turn only looks them up."""
        self.lengths = {g: group_lengths(self.w, g) for g in group_ids}

    def ensure_version(self, required: int, iteration: int) -> None:
        if not self.board.wait(lambda b: b.version >= required, self.weight_wait_s):
            raise TimeoutError(f"{self.device}: version {required} not published in time")
        newest = self.board.version
        if newest > self.loaded:
            self.clock.hold([self.device], "rollout", "sync", self.cost.sync_s(), iteration, 0)
            self.loaded = newest

    def process(self, lease: Lease) -> pa.RecordBatch:
        batch = lease.batch
        k = _iteration(batch)
        self.ensure_version(max(batch.column("min_policy_version").to_pylist()), k)
        groups: dict[int, list[int]] = {}
        lengths = []
        for gid in batch.column("group_id").to_pylist():  # a group's j-th row: its j-th length
            if gid not in groups:
                drawn = self.lengths.get(gid) or group_lengths(self.w, gid)
                groups[gid] = drawn[::-1]
            lengths.append(groups[gid].pop())
        n = len(lengths)
        self.clock.hold(
            [self.device],
            "rollout",
            "compute",
            self.cost.generate_s(self.w.prompt_tokens, lengths),
            k,
            n,
        )
        self.last_tokens = sum(lengths)
        return with_row_ids(
            lease,
            {
                "response_ids": _placeholders(n, 1, pa.int32()),
                "response_logprobs": _placeholders(n, -1.0, pa.float32()),
                "policy_version": _constant(n, self.loaded, pa.int64()),
                "finish_reason": pa.array(
                    ["length" if x >= self.w.max_response_tokens else "stop" for x in lengths]
                ),
                SIM_COLUMN: pa.array(lengths, pa.int32()),
            },
        )


class SimRewardStage:
    task = "reward"
    columns = ("iteration", SIM_COLUMN)
    whole_groups = False

    def __init__(self, device: str, cost: CostModel, w: Workload, clock: DeviceClock) -> None:
        self.device, self.cost, self.clock = device, cost, clock
        self.max_rows = w.rows_per_reward_batch

    def process(self, lease: Lease) -> pa.RecordBatch:
        n = lease.num_rows
        self.clock.hold(
            [self.device], "reward", "compute", self.cost.reward_s(n), _iteration(lease.batch), n
        )
        return with_row_ids(
            lease,
            {
                "reward": _constant(n, 1.0, pa.float32()),
                "reward_ok": _constant(n, True, pa.bool_()),
                "reward_error": _constant(n, "", pa.string()),
            },
        )


class SimReferenceStage:
    task = "reference"
    columns = ("iteration", SIM_COLUMN)
    whole_groups = False

    def __init__(
        self, device: str, cost: CostModel, w: Workload, clock: DeviceClock, slowdown: float = 1.0
    ) -> None:
        self.device, self.cost, self.w, self.clock = device, cost, w, clock
        self.max_rows = w.rows_per_reference_batch
        self.slowdown = slowdown  # > 1: a slower device (the balancer's skew case)

    def process(self, lease: Lease) -> pa.RecordBatch:
        lengths = lease.batch.column(SIM_COLUMN).to_pylist()
        seconds = self.cost.reference_s(self.w.prompt_tokens, lengths) * self.slowdown
        self.clock.hold(
            [self.device], "reference", "compute", seconds, _iteration(lease.batch), len(lengths)
        )
        return with_row_ids(
            lease, {"ref_logprobs": _placeholders(len(lengths), -1.0, pa.float32())}
        )


@dataclass
class _Piece:
    lease_id: int
    iteration: int
    lengths: list[int]


class TrainerGroup:
    """``devices`` simulated data-parallel trainer devices fed by one claimer (see module doc)."""

    def __init__(
        self,
        client: Any,
        table: str,
        cost: CostModel,
        w: Workload,
        clock: DeviceClock,
        devices: list[str],
        announce: Callable[[int], None],
        *,
        gate: threading.Event | None = None,
        claim_timeout_s: float = 0.2,
        whole_iteration: bool = False,
    ) -> None:
        self.client, self.table, self.cost, self.w, self.clock = client, table, cost, w, clock
        self.devices, self.announce = devices, announce
        self.gate = gate  # sync (colocated): training only while the controller's turn says so
        self.claim_timeout_s = claim_timeout_s
        # True: no training before every row of the iteration is in hand (generation and
        # training take turns on separate pools: the baseline of the Periodic Asynchrony paper)
        self.whole_iteration = whole_iteration
        self._claimed: dict[int, int] = collections.defaultdict(int)
        self.step = 0  # the iteration being trained (its weights are version ``step``)
        self._cond = threading.Condition()  # device threads wait here for work
        self._claim_cv = threading.Condition(self._cond._lock)  # type: ignore[attr-defined]
        self._work: collections.deque[_Piece] = collections.deque()
        self._parked: dict[int, list[_Piece]] = collections.defaultdict(list)
        self._leases: dict[int, list] = {}  # lease_id -> [lease, untrained rows]
        self._trained: dict[int, int] = collections.defaultdict(int)
        self._to_ack: list[Lease] = []
        self._busy = 0
        self._stop = threading.Event()
        self.micro_batches = 0

    def run(self, stop: threading.Event) -> None:
        """The claimer (this thread) plus one thread per device, until every iteration stepped."""
        threads = [
            threading.Thread(target=self._device, args=(d,), daemon=True, name=d)
            for d in self.devices
        ]
        for t in threads:
            t.start()
        try:
            while not stop.is_set() and self.step < self.w.iterations:
                self._ack_ready()
                with self._cond:
                    if len(self._work) >= len(self.devices) and not self._waiting_whole():
                        self._claim_cv.wait(0.05)
                        continue
                if self.gate is not None and not self.gate.wait(0.05):
                    continue
                with self._cond:  # one claim for every free device (few requests at scale)
                    free = max(len(self.devices) - len(self._work) - self._busy, 1)
                lease = self.client.claim(
                    self.table,
                    "trainer",
                    ["iteration", SIM_COLUMN],
                    free * self.w.rows_per_trainer_batch,
                    whole_groups=True,
                    timeout=self.claim_timeout_s,
                )
                if lease.num_rows and self._turn_or_stop(stop):
                    self._accept(lease)
            self._ack_ready()
        finally:
            self._stop.set()
            with self._cond:
                self._cond.notify_all()
            for t in threads:
                t.join(timeout=5)

    def _turn_or_stop(self, stop: threading.Event) -> bool:
        """Sync: a claim issued during iteration k's turn may return rows of k+1 (they became
        ready while it long-polled, after the turn ended); they wait for k+1's turn, which comes
        once every stage before training is done, so stages never overlap. False on stop."""
        while self.gate is not None and not self.gate.wait(0.05):
            if stop.is_set():
                return False
        return True

    def _accept(self, lease: Lease) -> None:
        batch = lease.batch
        its = batch.column("iteration")
        with self._cond:
            self._leases[lease.lease_id] = [lease, lease.num_rows]
            size = self.w.rows_per_trainer_batch
            for k in sorted(set(its.to_pylist())):
                lengths = batch.filter(pc.equal(its, k)).column(SIM_COLUMN).to_pylist()
                self._claimed[k] += len(lengths)
                for i in range(0, len(lengths), size):  # micro-batches of the iteration's rows
                    piece = _Piece(lease.lease_id, k, lengths[i : i + size])
                    (self._work.append if k == self.step else self._parked[k].append)(piece)
            self._cond.notify(len(self._work))

    def _waiting_whole(self) -> bool:
        return self.whole_iteration and self._claimed[self.step] < self.w.rows_per_iteration

    def _ack_ready(self) -> None:
        with self._cond:
            acks, self._to_ack = self._to_ack, []
        for lease in acks:  # write+ack: the advantage column, then the rows are freed
            out = pa.RecordBatch.from_pydict(
                {
                    ROW_ID: lease.batch.column(ROW_ID),
                    "advantage": pa.array([0.0] * lease.num_rows, pa.float32()),
                }
            )
            self.client.write(self.table, lease, out, ack=True)

    def _device(self, name: str) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (self._work and not self._waiting_whole()) or self._stop.is_set()
                )
                if self._stop.is_set():
                    return
                piece = self._work.popleft()
                self._busy += 1
            self.micro_batches += 1
            self.clock.hold(
                [name],
                "trainer",
                "compute",
                self.cost.train_s(self.w.prompt_tokens, piece.lengths),
                piece.iteration,
                len(piece.lengths),
            )
            with self._cond:
                self._busy -= 1
                self._trained[piece.iteration] += len(piece.lengths)
                self._leases[piece.lease_id][1] -= len(piece.lengths)
                done = self._trained[self.step] >= self.w.rows_per_iteration
                self._claim_cv.notify()  # a device is free: the claimer may fetch more
            if done:
                self._step()

    def _step(self) -> None:
        k = self.step  # every row of k is trained: no piece of k is in flight
        self.clock.hold(self.devices, "trainer", "step", self.cost.step_s(len(self.devices)), k, 0)
        self.announce(k + 1)
        if k + 1 < self.w.iterations:  # sending the last version is not RL time
            self.clock.hold(self.devices, "trainer", "sync", self.cost.sync_s(), k, 0)
        with self._cond:
            self.step = k + 1
            for lease_id, entry in list(self._leases.items()):
                if entry[1] == 0:
                    self._to_ack.append(entry[0])
                    del self._leases[lease_id]
            self._work.extend(self._parked.pop(k + 1, []))
            self._cond.notify_all()
            self._claim_cv.notify()
