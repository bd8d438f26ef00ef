"""Reports from workers to the controller: typed records over ZeroMQ PUSH/PULL.

Control-plane records only (spans, step reports, sampling counts, weight syncs, status, row
traces), one msgpack map ``{"kind": <record name>, **fields}`` each, decoded only into the
dataclasses below (never unpickled). A report is lost only when the controller is gone
(docs/training.md "Reports").
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import msgpack
import zmq


@dataclass
class Span:
    """One busy interval of one worker, for the stage timeline."""

    role: str  # rollout | reward | reference | trainer
    worker: str  # e.g. "rollout-0"
    start: float  # wall-clock seconds
    end: float
    iteration: int  # the iteration the rows belong to (-1 when mixed)
    rows: int
    tokens: int = 0  # tokens generated (rollout) or processed (trainer/reference)


@dataclass
class StepReport:
    """The trainer's report after one optimizer step (= one iteration)."""

    iteration: int
    policy_version: int  # version published after this step (= iteration + 1)
    samples: int
    response_tokens: int  # the tokens trained on: response tokens whose loss mask is 1
    # the step's first pass (each pass: ``passes``), token-weighted; grad_norm: pre-clip
    loss: float
    kl: float
    clip_fraction: float  # fraction of tokens (gspo: responses) whose clipped term was active
    grad_norm: float
    reward_mean: float
    reward_std: float
    reward_failures: int  # samples whose verifier failed (scored 0)
    staleness_mean: float  # trainer step minus sample policy version, over the step's samples
    staleness_max: int
    importance_weight_mean: float  # off-policy weight (trainer.importance_correction); 1 off
    ratio_mean: float  # policy/old ratio over the step's tokens (exactly 1 with one update/batch)
    ratio_max: float
    ratio_min: float
    step_seconds: float  # wall time from the first micro-batch to the published weights
    publish_seconds: float  # time to write the weights of the new version
    publish_bytes: int
    busy_seconds: float  # forward/backward/optimizer time in this step
    # per trained trajectory: model turns, and tool calls answered with an observation (read
    # from response_loss_mask: a single-turn run reports 1 and 0)
    turns_mean: float = 1.0
    tool_calls_mean: float = 0.0
    # per-token versions (workers.rl.staleness): trained trajectories continued with newer
    # weights after a cut, mean tokens per run of one version, token-weighted staleness
    partial_resumes: int = 0
    tokens_per_version_span: float = 0.0
    staleness_token_mean: float = 0.0
    # the objective's (workers.rl.objectives), of the step's first pass like loss and the
    # ratios: tokens (responses for gspo) clipped at the low / high bound, gspo's sequence
    # ratio, tokens whose importance weight the cap truncated or dropped
    clip_low_fraction: float = 0.0
    clip_high_fraction: float = 0.0
    sequence_ratio_mean: float = 1.0
    importance_capped_fraction: float = 0.0
    # trainer.updates_per_batch > 1: each pass's loss, ratios, clip fractions and grad_norm
    passes: list[dict[str, float]] = field(default_factory=list)
    # dynamic sampling (workers.rl.dynamic): zero-variance groups acked untrained, groups with
    # variance past the step's need acked untrained, and the zero-variance fraction of the
    # iteration's groups that reached the trainer (measured with dynamic sampling off too)
    filtered_groups: int = 0
    surplus_groups: int = 0
    zero_variance_rate: float = 0.0


@dataclass
class SamplingReport:
    """Dynamic sampling: the trainer's counts of one iteration's groups so far, sent whenever they
    change (cumulative per trainer process): the controller's cue for more prompts."""

    iteration: int
    informative: int  # groups with reward variance kept for the step
    filtered: int  # zero-variance groups acked untrained
    surplus: int  # groups with variance past the step's need, acked untrained


@dataclass
class WeightSyncReport:
    """A rollout engine loaded a new policy version."""

    worker: str
    policy_version: int
    seconds: float  # wait excluded: read + load into the engine
    bytes: int


@dataclass
class WorkerStatus:
    """ready -> stopped | failed (this process: it may be restarted) | unrecoverable (the work
    itself: the run fails with ``error``); docs/training.md "Reports"."""

    worker: str
    role: str
    state: str  # ready | stopped | failed | unrecoverable
    error: str = ""
    timestamp: float = field(default_factory=time.time)
    metrics_address: str = ""  # "host:port" of this worker's /metrics ("" when metrics are off)


@dataclass
class RowTrace:
    """What one worker did to one micro-batch of rows: a line of the run's trace (built by
    ``workers.runtime.trace.Tracer``, written by ``streamflow.tracefile``). One record per event
    and batch, never per row. Invariant (``check``): every per-row list is empty (not known for
    this event) or holds one entry per ``row_ids`` entry; -1 in an int list = not known."""

    # put | claim | write (cells sent: then ack, or fenced) | kept (a predecessor had written the
    # cells) | ack | release | fail | fenced (the write or ack was refused: the lease had expired)
    # | consume (trained)
    event: str
    task: str  # the store task ("put": the controller's put)
    worker: str  # e.g. "reward-0" ("controller" for put)
    t: float  # wall-clock seconds (a write or ack carried by the next claim: when it was sent)
    row_ids: list[int]
    lease_id: int = 0  # 0: no lease (put)
    deliveries: list[int] = field(default_factory=list)  # per row: this lease's delivery count
    groups: list[int] = field(default_factory=list)  # per row: group_id, when the batch has it
    iterations: list[int] = field(default_factory=list)  # per row: iteration, likewise
    seconds: float = 0.0  # write: claim to result (the stage's compute)
    columns: list[str] = field(default_factory=list)  # write / kept: the columns written
    # per row: write: the policy version of what it wrote; consume: the version trained into
    versions: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # per row: response (or piece) length
    runs: list[list[int]] = field(default_factory=list)  # per row: start, version, start, ...
    # per row: how the newest piece written ended (cut, tool, observation, stop, ...; "" none)
    ends: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)  # per row: the tool called ("" none)
    tool_seconds: list[float] = field(default_factory=list)  # per row: the call's latency
    tool_errors: list[str] = field(default_factory=list)  # per row: its error kind ("" none)
    error: str = ""  # fail: the reason; fenced: why

    def check(self) -> None:
        """Raise ValueError unless every field has its type and every list its length."""
        n = len(self.row_ids) if isinstance(self.row_ids, list) else -1
        typed = {"event": str, "task": str, "worker": str, "error": str, "lease_id": int}
        for name, tp in typed.items():
            if not isinstance(getattr(self, name), tp):
                raise ValueError(f"RowTrace.{name}: expected {tp.__name__}")
        if not isinstance(self.t, (int, float)) or not isinstance(self.seconds, (int, float)):
            raise ValueError("RowTrace.t / seconds: expected numbers")
        per_row = {"row_ids": int, "deliveries": int, "groups": int, "iterations": int,
                   "versions": int, "tokens": int, "runs": list, "ends": str, "tools": str,
                   "tool_seconds": (int, float), "tool_errors": str}
        for name, tp in per_row.items():
            value = getattr(self, name)
            if not isinstance(value, list) or len(value) not in (0, n) or not all(
                    isinstance(v, tp) for v in value):
                raise ValueError(f"RowTrace.{name}: expected [] or {n} entries of {tp}")
        if not all(isinstance(c, str) for c in self.columns) or not all(
                isinstance(x, int) for run in self.runs for x in run):
            raise ValueError("RowTrace.columns / runs: expected strings / ints")


Record = Span | StepReport | WeightSyncReport | WorkerStatus | RowTrace | SamplingReport
RECORDS: dict[str, type] = {c.__name__: c for c in Record.__args__}


def encode(record: Record) -> bytes:
    # fields read as they are (records hold no dataclasses): asdict's deep copy of a row trace's
    # lists would cost more than the packing
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    return msgpack.packb({"kind": type(record).__name__, **fields})


def decode(payload: bytes) -> Record:
    """Decode one report; raises ValueError naming what was wrong for anything unexpected."""
    try:
        obj = msgpack.unpackb(payload, raw=False, max_bin_len=1 << 20, max_str_len=1 << 20)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ValueError(f"undecodable report: {exc}") from exc
    if not isinstance(obj, dict) or obj.get("kind") not in RECORDS:
        kind = obj.get("kind") if isinstance(obj, dict) else repr(obj)
        raise ValueError(f"unknown report kind: {kind}")
    cls = RECORDS[obj.pop("kind")]
    unknown = set(obj) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    try:
        record = cls(**obj)
        if isinstance(record, RowTrace):  # lists a worker built: checked before they are written
            record.check()
    except TypeError as exc:  # a required field missing
        raise ValueError(f"{cls.__name__}: {exc}") from exc
    return record


class EventSender:
    """A worker's PUSH socket to the controller. Not thread-safe: one per thread. ``trace``:
    whether the worker's stages send ``RowTrace`` records (run.trace)."""

    def __init__(self, address: str | None, *, trace: bool, send_timeout_ms: int = 2000) -> None:
        self.trace = trace
        self._socket: zmq.Socket | None = None
        if address:
            self._socket = zmq.Context.instance().socket(zmq.PUSH)
            self._socket.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
            self._socket.setsockopt(zmq.LINGER, send_timeout_ms)
            self._socket.connect(address)
        self.sent: list[Record] = []  # kept only without a socket (in-process runs and tests)

    def send(self, record: Record) -> None:
        if self._socket is None:
            self.sent.append(record)
            return
        try:
            self._socket.send(encode(record))
        except zmq.Again:
            pass  # controller gone or stuck: nobody reads it (docs/training.md)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


class EventReceiver:
    """The controller's PULL socket, bound to ``bind``; workers connect to ``endpoint``."""

    def __init__(self, bind: str = "tcp://127.0.0.1:*") -> None:
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, 4 << 20)
        self._socket.bind(bind)
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(self, timeout_s: float) -> list[Record]:
        """Every report that arrives within ``timeout_s`` of the first poll (at least one poll)."""
        records: list[Record] = []
        if self._socket.poll(int(timeout_s * 1000)):
            while True:
                try:
                    payload = self._socket.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    records.append(decode(payload))
                except ValueError:
                    continue  # a malformed report is dropped, never fatal
        return records

    def close(self) -> None:
        self._socket.close()
