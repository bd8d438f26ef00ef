"""The shard map of one (table, task) consumer group and how it changes: a pure state machine.

Owners, handoffs in flight, sessions and depth rebalancing; no sockets, threads or clocks.
Invariants: docs/store-protocol.md ("Shard map")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# Why a shard changes owner (the reassignments metric's label).
REASONS = ("join", "leave", "expired", "balance", "handoff_timeout")


@dataclass(frozen=True)
class BalancerConfig:
    """How a group is balanced. ``rebalance=False`` is the static baseline: round-robin by
    consumer id (recomputed on membership changes), never by depth."""

    session_timeout_s: float = 3.0  # a member not heard from this long is dead
    heartbeat_interval_s: float = 0.5  # consumers' heartbeat period = coordinator round period
    rebalance: bool = True
    threshold: float = 1.25  # imbalance ratio (max/mean drain time) that counts as imbalanced
    patience: int = 3  # consecutive imbalanced rounds before a depth move
    margin: float = 0.2  # a move must cut the pair's larger drain time by this fraction
    min_gap_s: float = 0.5  # drain-time gap (seconds of work) below which nothing moves
    cooldown_s: float = 3.0  # a moved shard is not moved again within this

    def __post_init__(self) -> None:
        if not self.heartbeat_interval_s > 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if not self.session_timeout_s > 2 * self.heartbeat_interval_s:
            raise ValueError(f"session_timeout_s ({self.session_timeout_s}) must exceed twice "
                             f"heartbeat_interval_s ({self.heartbeat_interval_s})")
        if not self.threshold >= 1.0:
            raise ValueError(f"threshold must be >= 1, got {self.threshold}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if not 0.0 < self.margin < 1.0:
            raise ValueError(f"margin must be in (0, 1), got {self.margin}")
        if self.min_gap_s < 0 or self.cooldown_s < 0:
            raise ValueError("min_gap_s and cooldown_s must be >= 0")

    @property
    def unowned_bound_s(self) -> float:
        """The longest a shard stays without a live owner while the group has a member."""
        return self.session_timeout_s + self.heartbeat_interval_s


@dataclass
class Member:
    consumer: str
    last_seen: float
    confirmed: int = 0  # the generation whose assignment the consumer runs on
    rate: float = 0.0  # rows/s while busy, as reported (0: unknown yet)
    in_flight: int = 0  # rows it holds leases on


@dataclass
class Handoff:
    shard: int
    source: str  # the old owner, which must confirm revoke_gen
    target: str | None  # None: decided when the shard is released
    revoke_gen: int
    started: float
    reason: str


@dataclass(frozen=True)
class Change:
    """One ownership change, for metrics and logs."""

    shard: int
    source: str | None
    target: str | None
    reason: str


@dataclass
class Balancer:
    """One (table, task) group. Call ``join``/``heartbeat``/``leave`` as requests arrive and
    ``tick`` once per round; read ``assigned(consumer)``; drain ``changes``."""

    config: BalancerConfig = field(default_factory=BalancerConfig)
    generation: int = 0
    members: dict[str, Member] = field(default_factory=dict)
    owner: dict[int, str | None] = field(default_factory=dict)  # every known shard
    handoffs: dict[int, Handoff] = field(default_factory=dict)
    depth: dict[int, int] = field(default_factory=dict)  # ready rows per shard (last round)
    imbalance: float = 1.0
    changes: list[Change] = field(default_factory=list)
    _moved_at: dict[int, float] = field(default_factory=dict)
    _streak: int = 0
    _membership_changed: bool = False

    # -- requests --------------------------------------------------------------------------------
    def join(self, consumer: str, now: float) -> tuple[int, list[int]]:
        """Add (or refresh) a member; returns (generation, its shards)."""
        if consumer not in self.members:
            self.members[consumer] = Member(consumer, now)
            self._membership_changed = True
            self._assign(now)
        else:
            self.members[consumer].last_seen = now
        return self.generation, self.assigned(consumer)

    def heartbeat(
        self, consumer: str, now: float, *, confirmed: int, rate: float = 0.0, in_flight: int = 0
    ) -> tuple[int, list[int]]:
        """A member's heartbeat (an unknown consumer joins). Returns (generation, its shards)."""
        m = self.members.get(consumer)
        if m is None:
            return self.join(consumer, now)
        m.last_seen = now
        m.confirmed = max(m.confirmed, min(int(confirmed), self.generation))
        m.rate, m.in_flight = float(rate), int(in_flight)
        self._complete(now)
        self._assign(now)
        return self.generation, self.assigned(consumer)

    def leave(self, consumer: str, now: float) -> None:
        """A clean leave: the consumer promises it no longer claims from its shards."""
        if self.members.pop(consumer, None) is not None:
            self._release(consumer, "leave", now)
            self._membership_changed = True
            self._assign(now)

    # -- rounds ----------------------------------------------------------------------------------
    def set_shards(self, shards: Iterable[int]) -> None:
        """The table's shard ids (from the store's stats); new ones start unowned."""
        ids = set(int(s) for s in shards)
        for s in ids - self.owner.keys():
            self.owner[s] = None
        for s in self.owner.keys() - ids:  # a shard that disappeared (table dropped, node gone)
            del self.owner[s]
            self.handoffs.pop(s, None)
            self.depth.pop(s, None)

    def tick(self, now: float, depth: Mapping[int, int] | None = None) -> None:
        """One round: expire dead sessions, finish/cancel handoffs, assign unowned shards,
        rebalance (membership first, then depth with hysteresis)."""
        if depth is not None:
            self.set_shards(depth.keys())
            self.depth = {int(s): int(d) for s, d in depth.items()}
        for c, m in list(self.members.items()):
            if now - m.last_seen > self.config.session_timeout_s:
                del self.members[c]
                self._release(c, "expired", now)
                self._membership_changed = True
        self._complete(now)
        self._assign(now)
        self._measure()
        if self.config.rebalance and not self.handoffs:
            self._rebalance_depth(now)

    # -- views -----------------------------------------------------------------------------------
    def assigned(self, consumer: str) -> list[int]:
        return sorted(s for s, c in self.owner.items() if c == consumer)

    def owned_counts(self) -> dict[str, int]:
        counts = {c: 0 for c in self.members}
        for c in self.owner.values():
            if c in counts:
                counts[c] += 1
        return counts

    def drain_times(self) -> dict[str, float]:
        """Each member's expected drain time: (ready rows of its shards + rows in flight) over
        its recent throughput (members without a measurement get the group's mean rate)."""
        known = [m.rate for m in self.members.values() if m.rate > 0]
        prior = sum(known) / len(known) if known else 1.0
        load = {c: float(m.in_flight) for c, m in self.members.items()}
        for s, c in self.owner.items():
            if c in load:
                load[c] += self.depth.get(s, 0)
        return {c: load[c] / (m.rate if m.rate > 0 else prior) for c, m in self.members.items()}

    # -- internals -------------------------------------------------------------------------------
    def _bump(self) -> int:
        self.generation += 1
        return self.generation

    def _release(self, consumer: str, reason: str, now: float) -> None:
        """A member is gone (left or expired): its shards are free at once (it stopped using
        them), handoffs it had to confirm complete, handoffs to it get their target re-picked."""
        for s, c in self.owner.items():
            if c == consumer:
                self.owner[s] = None
                self.changes.append(Change(s, consumer, None, reason))
        for h in self.handoffs.values():
            if h.target == consumer:
                h.target = None
        self._bump()
        self._complete(now)

    def _complete(self, now: float) -> None:
        for s, h in list(self.handoffs.items()):
            src = self.members.get(h.source)
            if src is None or src.confirmed >= h.revoke_gen:
                del self.handoffs[s]
                target = h.target if h.target in self.members else None
                self.owner[s] = target  # None: _assign picks one now that the source let go
                if target is not None:
                    self._bump()
            elif now - h.started > self.config.session_timeout_s:
                del self.handoffs[s]  # never confirmed: the old owner may still use it; give back
                self.owner[s] = h.source
                self._bump()
                self.changes.append(Change(s, h.target, h.source, "handoff_timeout"))

    def _revoke(self, shard: int, target: str | None, reason: str, now: float) -> None:
        source = self.owner[shard]
        assert source is not None and shard not in self.handoffs
        self.owner[shard] = None
        self.handoffs[shard] = Handoff(shard, source, target, self._bump(), now, reason)
        self._moved_at[shard] = now
        self.changes.append(Change(shard, source, target, reason))

    def _load(self, consumer: str) -> int:
        """Shards a member owns or is about to receive."""
        n = sum(1 for c in self.owner.values() if c == consumer)
        return n + sum(1 for h in self.handoffs.values() if h.target == consumer)

    def _assign(self, now: float) -> None:
        """Membership rebalance (when members changed), then grant every free shard."""
        if not self.members:
            return
        ids = sorted(self.members)
        shards = sorted(self.owner)
        if self._membership_changed:
            self._membership_changed = False
            if not self.config.rebalance:  # static: shard i -> i-th consumer (round-robin)
                for i, s in enumerate(shards):
                    want = ids[i % len(ids)]
                    if self.owner[s] not in (None, want) and s not in self.handoffs:
                        self._revoke(s, want, "join", now)
            else:  # sticky: only the excess over the fair count moves
                quota = -(-len(shards) // len(ids))
                for c in ids:
                    extra = self._load(c) - quota
                    mine = sorted((s for s in shards if self.owner[s] == c),
                                  key=lambda s: self.depth.get(s, 0))
                    for s in mine[: max(extra, 0)]:
                        self._revoke(s, None, "join", now)
        for i, s in enumerate(shards):
            if self.owner[s] is not None or s in self.handoffs:
                continue
            if not self.config.rebalance:
                target = ids[i % len(ids)]
            else:  # fewest shards first, then the shortest drain time, then the id
                drain = self.drain_times()
                target = min(ids, key=lambda c: (self._load(c), drain[c], c))
            self.owner[s] = target
            self._bump()
        # Handoffs without a target get one now: granted as soon as the source confirms.
        for h in self.handoffs.values():
            if h.target is None:
                h.target = min(ids, key=lambda c: (self._load(c), c))

    def _measure(self) -> None:
        drain = self.drain_times()
        mean = sum(drain.values()) / len(drain) if drain else 0.0
        self.imbalance = max(drain.values()) / mean if mean > 0 else 1.0

    def _rebalance_depth(self, now: float) -> None:
        drain = self.drain_times()
        if len(drain) < 2:
            self._streak = 0
            return
        src = max(drain, key=lambda c: (drain[c], c))
        dst = min(drain, key=lambda c: (drain[c], c))
        gap = drain[src] - drain[dst]
        if self.imbalance > self.config.threshold and gap > self.config.min_gap_s:
            self._streak += 1
        else:
            self._streak = 0
        if self._streak < self.config.patience:
            return
        rates = {c: m.rate for c, m in self.members.items()}
        known = [r for r in rates.values() if r > 0]
        prior = sum(known) / len(known) if known else 1.0
        r_src, r_dst = rates[src] or prior, rates[dst] or prior
        best: tuple[float, int] | None = None
        for s, c in self.owner.items():
            if c != src or now - self._moved_at.get(s, -1e18) < self.config.cooldown_s:
                continue
            d = self.depth.get(s, 0)
            after = max(drain[src] - d / r_src, drain[dst] + d / r_dst)
            if best is None or (after, s) < best:
                best = (after, s)
        if best is not None and best[0] <= (1.0 - self.config.margin) * drain[src]:
            self._revoke(best[1], dst, "balance", now)
            self._streak = 0
