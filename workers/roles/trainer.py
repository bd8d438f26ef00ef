"""The trainer role: a GRPO-family objective over streamed micro-batches, one optimizer step per
iteration. The step's math is ``workers.rl.objectives`` / ``workers.rl.advantages`` (pure); this
role feeds it, applies its result and keeps the lease ledger.

Claims whole groups, trains the current iteration's rows as they come (parks later ones), steps
when all are in, then publishes -> reports -> checkpoints -> acks (acks only after the step, so a
dead trainer's rows come back). The ledger, the fault rules, loss normalisation, old policy,
staleness and the multi-rank protocol: docs/training.md "The trainer". Its trace: a claim per
lease, a consume (with the version trained into) per trained piece, an ack of rows held only to
be acked (``workers.runtime.trace``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.nn.utils.rnn import pad_sequence

from storage.errors import CellAlreadyWritten, LeaseExpired, Unavailable, UnknownTable
from storage.schema import ROW_ID, Lease
from workers.config import TrainerWorkerConfig
from workers.engines.torch_trainer import TrainerEngine
from workers.rl.advantages import advantages, centred_std, overlong_penalty
from workers.rl.dynamic import GroupFilter
from workers.rl.objectives import LossSums, Objective, loss_sums
from workers.rl.packing_layout import forward_slices, steps_within
from workers.rl.reference import rows_to_groups
from workers.rl.staleness import TokenStaleness
from workers.rl.tokens import apply_loss_masks
from workers.rl.trimodel import TriModel
from workers.runtime import cores
from workers.runtime.distributed import Op, RankGroup, first_group
from workers.runtime.events import Span, StepReport, WorkerStatus
from workers.runtime.faults import dead_iteration
from workers.runtime.leases import LeaseKeeper
from workers.runtime.trace import Tracer
from workers.schema import trainer_columns
from workers.weights.file_sync import WeightPublisher

log = logging.getLogger(__name__)
ADVANTAGE = "advantage"  # the column each piece's rows carry from their first pass (float32)


@dataclass
class Piece:
    """The rows of one lease that belong to one iteration."""

    lease: Lease | None  # None on follower ranks (they never hold leases)
    iteration: int
    rows: pa.RecordBatch
    old_logp: list[torch.Tensor] = field(default_factory=list)  # recorded on the first pass
    local: pa.RecordBatch | None = None  # this rank's groups of ``rows`` (None: one rank, all)


@dataclass
class _Held:
    lease: Lease
    untrained: int  # rows of this lease not yet trained (held by the keeper until acked)
    # (row ids, advantages) of its trained pieces: written with the ack (leader only)
    advantages: list[tuple[pa.Array, pa.Array]] = field(default_factory=list)


class Trainer:
    """One GRPO trainer over the store. ``poll`` is one claim turn (``workers.main`` loops it)."""

    def __init__(self, client: Any, table: str, engine: TrainerEngine, tri: TriModel,
                 settings: TrainerWorkerConfig, publisher: WeightPublisher, *,
                 worker: str = "trainer-0", send: Callable[[Any], None] = lambda r: None,
                 start_iteration: int = 0, on_step: Callable[[int], None] = lambda it: None,
                 keeper: LeaseKeeper, ranks: RankGroup | None = None) -> None:
        self.client, self.table, self.engine, self.tri = client, table, engine, tri
        self.s, self.publisher, self.worker = settings, publisher, worker
        self.send, self.on_step = send, on_step
        # Held leases outlive claim turns (a lease is acked after the step): the keeper renews
        # them from its own thread, so a long step or a slow poller never lets one expire.
        self.keeper = keeper
        self.ranks = ranks  # several trainer ranks (workers.runtime.distributed); None: this process alone
        self.tracer = Tracer(send, worker, enabled=settings.common.trace_rows
                             and (ranks is None or ranks.is_leader))
        self.step = start_iteration  # = policy version of the current weights
        self.columns = trainer_columns(settings.reference_in_store, settings.cuts.partial)
        self.sampling = GroupFilter.for_trainer(settings, send)  # dynamic sampling's filter
        loss = settings.grpo
        low, high = loss.clip_bounds()
        self.objective = Objective(loss.loss, low, high, loss.kl_coef, loss.correction,
                                   loss.is_cap, settings.max_response_tokens)
        # reinforce_pp scales by the std over the whole step's batch: train it whole
        self._whole = settings.whole_iterations or loss.advantage == "reinforce_pp"
        self._rows_of: dict[int, list[pa.RecordBatch]] = {}  # iteration -> rows accepted (whole)
        self._parked: dict[int, list[Piece]] = {}
        self._held: dict[int, _Held] = {}
        self._seen: dict[int, set[int]] = {}  # iteration (>= step) -> row ids accepted for training
        self._ack_only: list[Piece] = []  # duplicates and stale rows: acked after the next step
        self._reset_iteration()

    # ------------------------------------------------------------------ the loop
    def publish_current(self) -> None:
        """Publish the current weights as version ``step`` (start-up and resume)."""
        self.publisher.publish(self.engine.state_dict(), self.step)

    def poll(self, timeout_s: float) -> bool:
        """One claim turn; returns True when it completed an iteration (a step was taken)."""
        # Rows of this iteration claimed (and parked) before the last step are work in hand: a
        # server-side wait for more rows would hold them up to ``timeout_s``, so just look.
        wait = 0.0 if self._parked.get(self.step) and self._may_train() else timeout_s
        try:
            lease = self.client.claim(
                self.table, "trainer", list(self.columns), self.s.rows_per_claim,
                whole_groups=True, timeout=wait,
            )
        except (Unavailable, UnknownTable):  # store node down or recovering: its rows come back
            time.sleep(0.5)
            return False
        with cores.busy():  # this host's thread budget, shared by phase (workers.runtime.cores)
            if lease.num_rows:
                self._accept(lease)
            for piece in self._parked.pop(self.step, []) if self._may_train() else ():
                self._train_first_pass(piece)
            if not lease.num_rows and self._rows_in < self._expected():
                self._check_dead()
            if self._rows_in >= self._expected() and self._rows_in > 0:
                self._finish_iteration()
                return True
        return False

    def _expected(self) -> int:
        return self.s.rows_per_iteration - self.s.group_size * len(self._dead)

    def _may_train(self) -> bool:
        """Whether rows of the current iteration may be trained now: at once when streaming, and
        only once every expected row is in hand with ``whole_iterations`` (the separate-pools
        baseline that takes turns: training of k starts when all of k is ready) or with advantage
        reinforce_pp (its scale is the whole step's)."""
        return (not self._whole
                or len(self._seen.get(self.step, ())) >= self._expected())

    def _check_dead(self) -> None:
        """At most once a second while waiting: which groups of this iteration are DEAD."""
        if time.monotonic() - self._dead_checked < 1.0:
            return
        self._dead_checked = time.monotonic()
        try:
            stats = self.client.stats(self.table)
        except (Unavailable, UnknownTable):
            return
        tasks = sorted({t for shard in stats.shards for t in shard.tasks})
        groups = self.s.rows_per_iteration // self.s.group_size
        self._dead, cause = dead_iteration(stats, tasks, self.step, groups)
        if cause is not None:  # no restart can help: the controller fails the run with the cause
            self.send(WorkerStatus(self.worker, "trainer", "unrecoverable", cause))

    def _accept(self, lease: Lease) -> None:
        self.tracer.claim(lease)
        iterations = lease.batch.column("iteration").to_numpy()
        self._held[lease.lease_id] = _Held(lease, lease.num_rows)
        self.keeper.hold(lease)
        for it in sorted(set(iterations.tolist())):
            rows = lease.batch.filter(pa.array(iterations == it))
            if it < self.step:  # in the current weights already (docs/training.md)
                self._ack_only.append(Piece(lease, int(it), rows))
                continue
            seen = self._seen.setdefault(int(it), set())
            ids = rows.column(ROW_ID).to_numpy()
            again = pa.array([int(r) in seen for r in ids.tolist()], pa.bool_())
            if again.true_count:  # delivered again after a lost lease: hold, never retrain
                self._ack_only.append(Piece(lease, int(it), rows.filter(again)))
                rows = rows.filter(pc.invert(again))
            rows, dropped = self.sampling.split(int(it), rows)  # workers.rl.dynamic
            if dropped is not None:  # zero variance or surplus: acked after the step, untrained
                self._ack_only.append(Piece(lease, int(it), dropped))
            seen.update(int(r) for r in rows.column(ROW_ID).to_numpy().tolist())
            if self._whole and rows.num_rows:
                self._rows_of.setdefault(int(it), []).append(rows)
            for part in self._split(rows) if rows.num_rows else []:
                piece = Piece(lease, int(it), part)
                if it == self.step and not self._whole:
                    self._train_first_pass(piece)
                else:
                    self._parked.setdefault(int(it), []).append(piece)

    def _split(self, rows: pa.RecordBatch) -> list[pa.RecordBatch]:
        """The pieces of whole groups trained one forward/backward each: one per group in
        deterministic mode, else pieces of at most ``tokens_per_forward`` tokens (docs/training.md);
        several ranks split a piece among themselves instead."""
        if self.ranks is not None:
            return [rows]
        groups = rows.column("group_id").to_numpy()
        if self.s.deterministic:
            return [rows.filter(pa.array(groups == g)) for g in sorted(set(groups.tolist()))]
        tokens = (pc.list_value_length(rows.column("prompt_ids")).to_numpy()
                  + pc.list_value_length(rows.column("response_ids")).to_numpy())
        order = list(dict.fromkeys(groups.tolist()))  # groups in arrival order
        size = dict.fromkeys(order, 0)
        for g, n in zip(groups.tolist(), tokens.tolist(), strict=True):
            size[g] += n
        slices = forward_slices([size[g] for g in order], self.s.pack.tokens_per_forward)
        if len(slices) <= 1:
            return [rows]
        return [rows.filter(pa.array(np.isin(groups, [order[i] for i in part])))
                for part in slices]

    # ------------------------------------------------------------------ compute
    def _forward(self, piece: Piece, first_pass: bool) -> tuple[torch.Tensor, LossSums]:
        rows = piece.rows if piece.local is None else piece.local
        idle = rows.num_rows == 0  # a rank without groups here still runs one (zero) backward
        if idle:
            rows = first_group(piece.rows)
        groups, where = rows_to_groups(rows)
        pack = self.s.pack
        out = self.tri.forward(
            groups, temperature=self.s.sampling.temperature, token_budget=pack.token_budget,
            pack=pack.packing, min_saving=pack.packing_min_saving,
        )
        logp_rows = [out.policy[g][r] for g, r in where]
        logp = pad_sequence(logp_rows, batch_first=True)
        dev = logp.device  # the policy's (a GPU): every operand of the loss goes there
        lengths = torch.tensor([len(x) for x in logp_rows])
        positions = (torch.arange(logp.shape[1]) < lengths[:, None]).float()
        # Packed or not, every response token was scored (environment tokens are context); the
        # loss mask is laid on the same per-row grid either way, so packing stays exact.
        mask = apply_loss_masks(positions, _loss_masks(rows)).to(dev)
        if first_pass:
            piece.old_logp = [x.detach() for x in logp_rows]
        old = pad_sequence(piece.old_logp, batch_first=True)
        ref = None
        loss = self.s.grpo
        if loss.kl_coef > 0:
            if self.s.reference_in_store:
                ref = _padded(rows.column("ref_logprobs")).to(dev)
            else:
                ref = pad_sequence([out.ref[g][r] for g, r in where], batch_first=True)
        behaviour = (_padded(rows.column("response_logprobs")).to(dev)
                     if self.objective.correction != "off" else None)
        adv = torch.from_numpy(rows.column(ADVANTAGE).to_numpy(zero_copy_only=False).copy())
        loss_sum, sums = loss_sums(self.objective, logp, old, adv.to(dev), mask, ref_logp=ref,
                                   behaviour_logp=behaviour)
        if first_pass and (self.ranks is None or self.ranks.is_leader):
            assert piece.lease is not None  # the leader's pieces come with their lease
            # recorded for inspection: written with the ack after the step
            self._held[piece.lease.lease_id].advantages.append(
                (piece.rows.column(ROW_ID), piece.rows.column(ADVANTAGE)))
        if idle:  # same graph as the other ranks (ZeRO-2 reduces in backward), zero gradient
            return loss_sum * 0.0, LossSums()
        return loss_sum, sums

    def _with_advantages(self, rows: pa.RecordBatch) -> pa.RecordBatch:
        """``rows`` (whole groups) with their ``advantage`` column: computed once, by the leader,
        from the shaped rewards (follower ranks receive it with the rows)."""
        if ADVANTAGE in rows.schema.names:
            return rows
        s = self.s.grpo
        if s.advantage == "reinforce_pp" and self._batch_std is None:  # one scale for the step
            every = [self._shaped_rewards(r) for r in self._rows_of.get(self.step, [rows])]
            self._batch_std = centred_std(*(torch.cat(x) for x in zip(*every, strict=True)),
                                          group_size=self.s.group_size)
        adv = advantages(s.advantage, *self._shaped_rewards(rows), group_size=self.s.group_size,
                         std_normalize=s.group_std, batch_std=self._batch_std)
        return rows.append_column(ADVANTAGE, pa.array(adv.numpy(), pa.float32()))

    def _shaped_rewards(self, rows: pa.RecordBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(rewards plus any overlong penalty, group ids) of ``rows``."""
        budget, s = self.s.max_response_tokens, self.s.grpo
        lengths = pc.list_value_length(rows.column("response_ids")).to_numpy().astype(np.int64)
        penalty = overlong_penalty(torch.from_numpy(lengths), max_tokens=budget,
                                   buffer=s.overlong_tokens(budget), penalty=s.overlong_penalty)
        return (torch.tensor(rows.column("reward").to_pylist(), dtype=torch.float32) + penalty,
                torch.tensor(rows.column("group_id").to_pylist(), dtype=torch.int64))

    def _train_first_pass(self, piece: Piece) -> None:
        with cores.busy():  # re-taken per piece: a share freed by another process is used at once
            self._train_piece(piece)

    def _train_piece(self, piece: Piece) -> None:
        start = time.time()
        self._first_at = self._first_at or start
        piece.rows = self._with_advantages(piece.rows)
        if self.ranks is not None:
            if self.ranks.is_leader:
                self.ranks.send_micro_batch(piece.rows, piece.iteration)
            piece.local = self.ranks.share(piece.rows)
        loss_sum, sums = self._forward(piece, first_pass=True)
        self.engine.backward(loss_sum)
        self._sums = self._sums + sums
        rows = piece.rows
        self._rows_in += rows.num_rows
        versions = rows.column("policy_version").to_pylist()
        self._staleness += [self.step - v for v in versions]
        self._tokens.add(self.step, pc.list_value_length(rows.column("response_ids")).to_pylist(),
                         versions, rows.column("response_version_runs").to_pylist()
                         if "response_version_runs" in rows.schema.names else None)
        self._rewards += rows.column("reward").to_pylist()
        self._turns += turn_counts(_loss_masks(rows) or [None] * rows.num_rows)
        self._failures += sum(1 for ok in rows.column("reward_ok").to_pylist() if not ok)
        self._done.append(piece)
        end = time.time()
        self._busy += end - start
        self.send(Span("trainer", self.worker, start, end, piece.iteration, rows.num_rows,
                       sums.num_tokens))

    def _finish_iteration(self) -> None:
        start = time.time()
        if self.ranks is not None:  # every rank: the whole iteration's sums, hence its token count
            if self.ranks.is_leader:
                self.ranks.send_step(self.step)
            self._sums = self.ranks.all_reduce_sums(self._sums)
        # the objective's normaliser of the whole step (tokens, responses or a constant)
        grad_norm = self.engine.step(1.0 / (self._sums.norm or 1.0))
        passes = [_pass_metrics(self._sums, grad_norm)]
        for _ in range(self.s.grpo.updates_per_batch - 1):  # extra passes, old = iteration start
            total = LossSums()
            for piece in self._done:
                loss_sum, sums = self._forward(piece, first_pass=False)
                self.engine.backward(loss_sum)
                total = total + sums
            if self.ranks is not None:
                total = self.ranks.all_reduce_sums(total)
            passes.append(_pass_metrics(total, self.engine.step(1.0 / (total.norm or 1.0))))
        self.step += 1
        if self.ranks is not None and not self.ranks.is_leader:
            self._reset_iteration()
            self.on_step(self.step)
            return
        published = self.publisher.publish(self.engine.state_dict(), self.step)
        end = time.time()
        self._busy += end - start
        means = self._sums.means()  # the first pass: every run has one (per pass: ``passes``)
        rewards = torch.tensor(self._rewards) if self._rewards else torch.zeros(1)
        self.send(Span("trainer", self.worker, start, end, self.step - 1, 0, 0))
        for piece in self._done:  # before the report: the controller writes them with its record
            if piece.lease is not None:
                self.tracer.consume(piece.lease, piece.rows, self.step, columns=("advantage",))
        self.send(StepReport(
            iteration=self.step - 1, policy_version=self.step, samples=self._rows_in,
            response_tokens=self._sums.num_tokens, loss=means["loss"], kl=means["kl"],
            clip_fraction=means["clip_fraction"], grad_norm=grad_norm,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std()) if len(self._rewards) > 1 else 0.0,
            reward_failures=self._failures,
            staleness_mean=sum(self._staleness) / max(len(self._staleness), 1),
            staleness_max=max(self._staleness, default=0),
            importance_weight_mean=means["is_weight_mean"], ratio_mean=means["ratio_mean"],
            clip_low_fraction=means["clip_low_fraction"],
            clip_high_fraction=means["clip_high_fraction"],
            sequence_ratio_mean=means["sequence_ratio_mean"],
            importance_capped_fraction=means["is_capped_fraction"],
            passes=passes if len(passes) > 1 else [],
            ratio_max=means["ratio_max"], ratio_min=means["ratio_min"],
            step_seconds=end - (self._first_at or start), publish_seconds=published.seconds,
            publish_bytes=published.bytes, busy_seconds=self._busy,
            turns_mean=sum(t for t, _ in self._turns) / max(len(self._turns), 1),
            tool_calls_mean=sum(c for _, c in self._turns) / max(len(self._turns), 1),
            partial_resumes=self._tokens.rows_resumed,
            tokens_per_version_span=self._tokens.tokens_per_version_span,
            staleness_token_mean=self._tokens.staleness_token_mean,
            **self.sampling.step_fields(self.step - 1),
        ))
        self.on_step(self.step)  # the checkpoint, before any ack (docs/training.md)
        self._ack_done()
        self._reset_iteration()

    def _ack_done(self) -> None:
        """Ack every lease whose rows are all trained (or held only to be acked)."""
        for piece in self._done + self._ack_only:
            assert piece.lease is not None  # the leader's pieces always come with their lease
            held = self._held.get(piece.lease.lease_id)
            if held is None:
                continue
            held.untrained -= piece.rows.num_rows
            if held.untrained == 0:
                self.keeper.drop(held.lease.lease_id)
                try:
                    self._ack(held)
                except (LeaseExpired, Unavailable, UnknownTable) as exc:  # rows come back
                    log.warning("ack of lease %s refused (%s)", held.lease.lease_id, exc)
                del self._held[piece.lease.lease_id]
        for piece in self._ack_only:  # duplicates and rows of trained iterations: acked only
            if piece.lease is not None:
                self.tracer.lease_event("ack", piece.lease, piece.rows)
        self._ack_only = []

    def _ack(self, held: _Held) -> None:
        """Ack a trained lease, writing its rows' advantages in the same request."""
        if held.advantages:
            ids, adv = zip(*held.advantages, strict=True)
            arrays = [pa.concat_arrays(list(ids)), pa.concat_arrays(list(adv))]
            batch = pa.RecordBatch.from_arrays(arrays, names=[ROW_ID, "advantage"])
            try:
                self.client.write(self.table, held.lease, batch, ack=True)
                return
            except CellAlreadyWritten as exc:  # a predecessor recorded them: the ack still goes
                log.warning("advantages of lease %s not recorded: %s", held.lease.lease_id, exc)
        self.client.ack(held.lease)

    def _reset_iteration(self) -> None:
        """The state of the current iteration: its dead group ids, the pieces already on the
        first pass, their loss sums and the stats of its report."""
        self._seen = {it: ids for it, ids in self._seen.items() if it >= self.step}
        self._dead: set[int] = set()
        self._dead_checked = 0.0
        self._done: list[Piece] = []
        self._rows_in, self._sums = 0, LossSums()
        self._rows_of = {it: rows for it, rows in self._rows_of.items() if it >= self.step}
        self._batch_std: float | None = None  # reinforce_pp's scale of the current step
        self._staleness: list[int] = []
        self._tokens = TokenStaleness()  # per-token versions (workers.rl.staleness)
        self._rewards: list[float] = []
        self._turns: list[tuple[int, int]] = []  # per trained row: (model turns, tool answers)
        self._failures = 0
        self._first_at: float | None = None
        self._busy = 0.0

    # ------------------------------------------------------------------ follower ranks
    def follow(self) -> None:
        """A follower rank's loop: train what rank 0 sends, step when it says, return at STOP."""
        if self.ranks is None or self.ranks.is_leader:
            raise RuntimeError("follow() is for ranks > 0 of a multi-rank trainer")
        while True:
            command = self.ranks.receive()
            if command.op is Op.STOP:
                return
            if command.iteration != self.step:
                raise RuntimeError(
                    f"rank {self.ranks.rank} at step {self.step} got {command.op.name} for "
                    f"iteration {command.iteration}: ranks out of step"
                )
            if command.op is Op.MICRO_BATCH:
                assert command.rows is not None
                self._train_first_pass(Piece(None, command.iteration, command.rows))
            else:
                self._finish_iteration()

    def stop_followers(self) -> None:
        """Leader: tell follower ranks the run is over (they return from ``follow``)."""
        if self.ranks is not None and self.ranks.is_leader:
            self.ranks.send_stop()

    def release_held(self) -> None:
        """Clean stop: hand every held lease back at once (not counted as a failed delivery)."""
        for held in self._held.values():
            self.keeper.drop(held.lease.lease_id)
            self.client.release(held.lease)
        self._held.clear()


def _pass_metrics(sums: LossSums, grad_norm: float) -> dict[str, float]:
    """One optimizer pass of a step, as reported in ``StepReport.passes``."""
    means = sums.means()
    keys = ("loss", "kl", "clip_fraction", "clip_low_fraction", "clip_high_fraction",
            "ratio_mean", "ratio_min", "ratio_max", "sequence_ratio_mean", "is_weight_mean")
    return {**{k: means[k] for k in keys}, "grad_norm": grad_norm}


def _loss_masks(rows: pa.RecordBatch) -> list[list[int] | None] | None:
    """Each row's ``response_loss_mask`` (None: all ones), or None when no row has one (rows
    claimed without the column, or every writer single-turn)."""
    if "response_loss_mask" not in rows.schema.names:
        return None
    column = rows.column("response_loss_mask")
    return None if column.null_count == len(column) else column.to_pylist()


def turn_counts(masks: list[list[int] | None]) -> list[tuple[int, int]]:
    """(model turns, tool calls answered) of each response, read from its loss mask: a turn is
    a run of generated tokens (1s), an answered call a run of observation tokens (0s) between
    them. None (single-turn): one turn, no call."""
    out = []
    for mask in masks:
        if not mask:
            out.append((1, 0))
            continue
        starts = [i for i in range(len(mask)) if i == 0 or mask[i] != mask[i - 1]]
        turns = sum(1 for i in starts if mask[i])
        out.append((turns, len(starts) - turns))
    return out


def _padded(column: pa.Array) -> torch.Tensor:
    """A list<float32> column as a zero-padded ``[rows, longest]`` float32 tensor, read from the
    Arrow buffers (no Python object per value; ``flatten`` honours slices and null lists)."""
    lengths = pc.list_value_length(column).fill_null(0).to_numpy().astype(np.int64)
    flat = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    out = np.zeros((len(lengths), int(lengths.max(initial=0))), np.float32)
    out[np.repeat(np.arange(len(lengths)), lengths), steps_within(lengths)] = flat
    return torch.from_numpy(out)
