"""The coordinator's shard map over real sockets: claims routed to owned shards across nodes,
placement on the shallowest shard, a dead consumer's shards reassigned within the bound, the
depth-imbalance gauge as scraped, stealing, leases that outlive a move, metrics documented, and
(slow) a skewed workload against a store node process where the balancer evens the load."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from testkit import wait_until

import storage
from storage.balance import REASONS, BalancerConfig
from storage.coordinator import ConsumerSession, Coordinator, CoordinatorClient
from storage.metrics import CoordinatorMetrics, SessionMetrics
from storage.schema import TableSpec, TaskSpec

ROOT = Path(__file__).resolve().parents[2]

SCHEMA = pa.schema([("x", pa.int64())])


def spec(name: str = "t") -> TableSpec:
    return TableSpec(name, SCHEMA, (TaskSpec("work", ("x",)),), lease_seconds=30.0)


def rows(n: int, start: int = 0) -> pa.Table:
    return pa.table({"x": list(range(start, start + n))})


def test_claim_with_shards_routes_to_the_owning_nodes_only():
    with storage.embedded(2, tcp=True) as n0, storage.embedded(2, node_index=1, tcp=True) as n1:
        client = storage.connect([n0.address, n1.address])
        client.create_table(spec())
        client.put("t", rows(10), shard_id=0)
        client.put("t", rows(10, 10), shard_id=(1 << 8) | 1)
        lease = client.claim("t", "work", ["x"], 4, shards=[(1 << 8) | 1])
        assert lease.shard_id == (1 << 8) | 1 and lease.num_rows == 4
        # The previous lease lives on node 1; the next claim asks node 0 only: ack apart, no loss.
        nxt = client.claim("t", "work", ["x"], 4, shards=[0], ack=lease)
        assert nxt.shard_id == 0 and nxt.num_rows == 4
        assert client.stats("t").task_total("work").consumed == 4
        assert client.claim("t", "work", ["x"], 4, shards=[1], timeout=0.1).num_rows == 0
        with pytest.raises(ValueError, match="non-empty"):
            client.claim("t", "work", ["x"], 4, shards=[])
        with pytest.raises(ValueError, match="shard id"):
            client.claim("t", "work", ["x"], 4, shards=[-1])
        client.close()


def test_puts_go_to_the_shallowest_shard():
    with storage.embedded(4) as store:
        client = store.client()
        client.create_table(spec())
        client.put("t", rows(30), shard_id=0)
        client.put("t", rows(20), shard_id=1)
        client.put("t", rows(10), shard_id=2)
        for _ in range(3):  # each put goes to the shallowest shard then (ties: lowest id)
            client.put("t", rows(5))
        by_shard = {s.shard_id: s.rows for s in client.stats("t").shards}
        assert by_shard == {0: 30, 1: 20, 2: 15, 3: 10}  # 3: 0->5->10, then 2: 10->15


def test_dead_consumer_shards_go_to_the_live_one_within_the_bound():
    cfg = BalancerConfig(session_timeout_s=1.0, heartbeat_interval_s=0.2)
    with storage.embedded(4, tcp=True) as store:
        store.client().create_table(spec())
        with Coordinator(store_addresses=[store.address], balancer=cfg) as coord:
            live = ConsumerSession(coord.address, "t", "work", "live")
            ghost = CoordinatorClient(coord.address)
            ghost.join("t", "work", "ghost")
            with CoordinatorClient(coord.address) as cc:

                def ghost_owns_shards() -> bool:
                    if cc.assignment("t", "work")["members"].get("ghost", {}).get("shards"):
                        return True
                    ghost.heartbeat("t", "work", "ghost", generation=1 << 40)
                    return False

                wait_until(ghost_owns_shards, 10, what="the ghost to get shards")
                # the ghost stops heartbeating now
                wait_until(lambda: sorted(live.shards()) == [0, 1, 2, 3],
                           cfg.unowned_bound_s + 2.0, what="the live consumer to own all")
                assert "ghost" not in cc.assignment("t", "work")["members"]
            m = coord.metrics
            assert m.reassignments.labels("t", "work", "expired")._value.get() >= 1
            assert m.owned_shards.labels("t", "work", "live")._value.get() == 4
            assert m.consumers.labels("t", "work")._value.get() == 1
            # The dead consumer's process is restarted under the same id: it rejoins and the
            # balancer hands it its share again (by handoff: never owned by both at once).
            reborn = ConsumerSession(coord.address, "t", "work", "ghost")
            wait_until(lambda: len(reborn.shards()) == 2, cfg.unowned_bound_s + 5.0,
                       what="the reborn consumer's share")
            with CoordinatorClient(coord.address) as cc:
                members = cc.assignment("t", "work")["members"]
                owned = [s for m in members.values() for s in m.get("shards", [])]
                assert sorted(owned) == [0, 1, 2, 3]  # each shard exactly one owner
            assert sorted(live.shards()) == sorted({0, 1, 2, 3} - set(reborn.shards()))
            reborn.close()
            live.close()
            ghost.close()


@pytest.mark.slow
def test_skewed_workload_balancer_moves_the_flooded_shard_to_the_fast_consumer(h, tmp_path):
    """Store node process, coordinator, two consumer threads: c0-slow (5x slower) starts owning
    the flooded shard. Stealing is off so the move itself must do the evening."""
    node = h.StoreProcess(tmp_path, shards=4).start()
    try:
        admin = storage.connect(node.address)
        admin.create_table(spec())
        cfg = BalancerConfig(session_timeout_s=2.0, heartbeat_interval_s=0.2, patience=2)
        with Coordinator(store_addresses=[node.address], balancer=cfg) as coord:
            names = ("c0-slow", "c1-fast")
            cost = {"c0-slow": 0.005, "c1-fast": 0.001}
            sessions = {n: ConsumerSession(coord.address, "t", "work", n, steal=False)
                        for n in names}
            wait_until(lambda: sorted(sessions["c0-slow"].shards()) == [0, 2], 10,
                       what="the round-robin start")
            done = {n: 0 for n in names}
            stop = threading.Event()

            def consume(name: str) -> None:
                client, prev = storage.connect(node.address), None
                while not stop.is_set():
                    lease = sessions[name].claim(client, ["x"], 16, timeout=0.3, ack=prev)
                    prev = None
                    if lease.num_rows:
                        t0 = time.monotonic()
                        time.sleep(cost[name] * lease.num_rows)
                        sessions[name].record(lease.num_rows, time.monotonic() - t0)
                        done[name] += lease.num_rows
                        prev = lease
                if prev is not None:
                    client.ack(prev)
                client.close()

            threads = [threading.Thread(target=consume, args=(n,)) for n in names]
            for t in threads:
                t.start()
            total = 2000
            admin.put("t", rows(1800), shard_id=0)  # the flood, on c0-slow's shard
            admin.put("t", rows(total - 1800, 1800), shard_id=1)  # c1-fast's own work
            start = time.monotonic()
            wait_until(lambda: admin.stats("t").task_total("work").consumed >= total, 20,
                       what="every row consumed")
            wall = time.monotonic() - start
            stop.set()
            for t in threads:
                t.join(10)
            moved = coord.metrics.reassignments.labels("t", "work", "balance")._value.get()
            owners = dict(CoordinatorClient(coord.address).assignment("t", "work")["owners"])
            for s in sessions.values():
                s.close()
        # c0-slow alone would need 1800 * 5 ms = 9 s for the flood; the balancer gave the
        # flooded shard to c1-fast, which then did most of the work.
        assert moved >= 1 and owners[0] == "c1-fast"
        assert done["c1-fast"] >= 0.5 * total, done
        assert wall < 0.8 * 1800 * cost["c0-slow"], (wall, done)
        admin.close()
    finally:
        node.stop()


# -- helpers for the tests below ------------------------------------------------------------------

ALL_GENERATIONS = 1 << 40  # a heartbeat confirming this adopts every generation (clamped)


class Beater:
    """A consumer that only heartbeats (from its own thread and socket) with a rate the test sets:
    the coordinator sees a member with exactly this throughput and nothing in flight."""

    def __init__(self, address: str, name: str, rate: float = 0.0, interval: float = 0.05,
                 table: str = "t", task: str = "work") -> None:
        self.address, self.name, self.rate, self.interval = address, name, rate, interval
        self.table, self.task = table, task
        self.joined = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self.joined.wait(5), f"{name} could not join"

    def _run(self) -> None:
        with CoordinatorClient(self.address, request_timeout=2.0) as cc:
            cc.join(self.table, self.task, self.name)
            self.joined.set()
            while not self._stop.wait(self.interval):
                cc.heartbeat(self.table, self.task, self.name, generation=ALL_GENERATIONS,
                             rate=self.rate)
            cc.leave(self.table, self.task, self.name)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def wait_for(what: Callable[[], object], timeout: float, message: Callable[[], object]) -> object:
    """``wait_until`` whose failure shows ``message()`` (the state at the timeout)."""
    try:
        return wait_until(what, timeout)
    except AssertionError:
        raise AssertionError(message()) from None


def shard_stats(client: storage.Client, shard_id: int) -> dict:
    """One shard's per-task stats."""
    (shard,) = [s for s in client.stats("t").shards if s.shard_id == shard_id]
    return shard.tasks


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """The coordinator's /metrics over HTTP, parsed: {(sample name, labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def settled(cc: CoordinatorClient, sizes: dict[str, int]) -> dict[str, list[int]] | None:
    """The members' shards once every member owns ``sizes[member]`` shards and no handoff is in
    flight; else None."""
    view = cc.assignment("t", "work")
    got = {c: m["shards"] for c, m in view["members"].items()}
    if view["handoffs"] or {c: len(v) for c, v in got.items()} != sizes:
        return None
    return got


def test_depth_imbalance_gauge_reports_the_skew_and_falls_back_after_the_move():
    """Two members with known throughput, one shard flooded. The gauge (as scraped from /metrics
    and in the registry) is exactly max/mean of the drain times, above the threshold; it stays
    there while a move would not help (equal rates); once the other member is measured 10x
    faster the balancer moves the flooded shard to it and the gauge falls to near 1."""
    cfg = BalancerConfig(session_timeout_s=1.0, heartbeat_interval_s=0.05, patience=2)
    with storage.embedded(4, tcp=True) as store:
        admin = store.client()
        admin.create_table(spec())
        with Coordinator(store_addresses=[store.address], balancer=cfg, metrics_port=0) as coord:
            a = Beater(coord.address, "a", rate=100.0)
            b = Beater(coord.address, "b", rate=100.0)
            cc = CoordinatorClient(coord.address)
            shards = wait_for(lambda: settled(cc, {"a": 2, "b": 2}), 10,
                              lambda: cc.assignment("t", "work"))
            flood, a_other = shards["a"]
            admin.put("t", rows(1000), shard_id=flood)
            admin.put("t", rows(100, 1000), shard_id=a_other)
            admin.put("t", rows(200, 2000), shard_id=shards["b"][0])
            labels = frozenset({"table": "t", "task": "work"}.items())
            key = ("streamflow_coordinator_depth_imbalance_ratio", labels)

            # Drain times: a = (1000 + 100) / 100 = 11 s, b = 200 / 100 = 2 s; mean 6.5.
            skewed = 11.0 / 6.5
            assert skewed > cfg.threshold
            wait_for(lambda: scrape(coord.metrics_port).get(key) == pytest.approx(skewed), 10,
                     lambda: (scrape(coord.metrics_port).get(key), cc.assignment("t", "work")))
            rounds = coord.rounds
            wait_until(lambda: coord.rounds >= rounds + 10)  # > patience rounds: hysteresis holds
            scraped = scrape(coord.metrics_port)
            assert scraped[key] == pytest.approx(skewed)
            registered = coord.metrics.registry.get_sample_value(
                "streamflow_coordinator_depth_imbalance_ratio", {"table": "t", "task": "work"})
            assert registered == pytest.approx(skewed)
            balance = ("streamflow_coordinator_reassignments_total",
                       frozenset({"table": "t", "task": "work", "reason": "balance"}.items()))
            assert scraped.get(balance, 0.0) == 0.0  # moving 10 s of work to an equal peer: no
            assert dict(cc.assignment("t", "work")["owners"])[flood] == "a"

            b.rate = 1000.0  # b is measured 10x faster: moving the flood now halves the drain
            # After the move: a = 100 / 100 = 1 s, b = (200 + 1000) / 1000 = 1.2 s; mean 1.1.
            even = 1.2 / 1.1
            wait_for(lambda: scrape(coord.metrics_port).get(key) == pytest.approx(even), 10,
                     lambda: (scrape(coord.metrics_port).get(key), cc.assignment("t", "work")))
            scraped = scrape(coord.metrics_port)
            assert even < cfg.threshold
            assert scraped[balance] == 1.0
            owned = {c: scraped[("streamflow_coordinator_owned_shards",
                                 frozenset({"table": "t", "task": "work", "consumer": c}.items()))]
                     for c in "ab"}
            assert owned == {"a": 1.0, "b": 3.0}
            assert dict(cc.assignment("t", "work")["owners"])[flood] == "b"
            assert coord.metrics.registry.get_sample_value(
                "streamflow_coordinator_depth_imbalance_ratio",
                {"table": "t", "task": "work"}) == pytest.approx(even)
            cc.close()
            a.close()
            b.close()
        admin.close()


def test_an_idle_consumer_steals_from_the_deepest_shard_it_does_not_own():
    """The idle consumer's own shard is empty and the busy one's holds a backlog: its claims take
    the busy shard's rows (without owning it), counted as stolen; rows of its own shard count as
    owned. Depth moves are off (patience never reached), so only stealing can even the load."""
    cfg = BalancerConfig(session_timeout_s=1.0, heartbeat_interval_s=0.05, patience=10**9)
    with storage.embedded(2, tcp=True) as store:
        admin = store.client()
        admin.create_table(spec())
        with Coordinator(store_addresses=[store.address], balancer=cfg) as coord:
            busy = Beater(coord.address, "busy")
            idle = ConsumerSession(coord.address, "t", "work", "idle")
            cc = CoordinatorClient(coord.address)
            shards = wait_for(lambda: settled(cc, {"busy": 1, "idle": 1}), 10,
                              lambda: cc.assignment("t", "work"))
            (theirs,), (mine,) = shards["busy"], shards["idle"]
            wait_for(lambda: idle.shards() == [mine], 5, idle.shards)
            admin.put("t", rows(50), shard_id=theirs)

            def counted(source: str) -> float:
                return idle.metrics.registry.get_sample_value(
                    "streamflow_consumer_rows_claimed_total",
                    {"table": "t", "task": "work", "source": source}) or 0.0

            client = store.client()
            got: list[int] = []
            lease = idle.claim(client, ["x"], 10, timeout=1.0)
            while lease.num_rows:
                assert lease.shard_id == theirs and lease.shard_id not in idle.shards()
                got += lease.batch.column("x").to_pylist()
                lease = idle.claim(client, ["x"], 10, timeout=0.2, ack=lease)
            assert sorted(got) == list(range(50))
            assert idle.rows_stolen == 50 and idle.rows_owned == 0
            assert counted("stolen") == 50.0 and counted("owned") == 0.0
            # The busy shard stayed the busy consumer's all along: stolen, not reassigned.
            assert dict(cc.assignment("t", "work")["owners"])[theirs] == "busy"
            assert shard_stats(admin, theirs)["work"].consumed == 50
            # Rows on its own shard are claimed as owned (the counter tells the two apart).
            admin.put("t", rows(5, 100), shard_id=mine)
            lease = idle.claim(client, ["x"], 10, timeout=1.0)
            assert lease.shard_id == mine and lease.num_rows == 5
            client.ack(lease)
            assert counted("owned") == 5.0 and counted("stolen") == 50.0
            assert admin.stats("t").task_total("work").redelivered_total == 0
            client.close()
            idle.close()
            busy.close()
            cc.close()
        admin.close()


class _CountingClient:
    """A store client that counts the claims sent through it."""

    def __init__(self, client: storage.Client) -> None:
        self.client, self.claims = client, 0

    def claim(self, *args, **kwargs):
        self.claims += 1
        return self.client.claim(*args, **kwargs)


def test_a_consumer_owning_no_shard_waits_server_side_instead_of_spinning():
    """With more consumers than shards some own none. Such a consumer's claim used to end with a
    non-waiting steal probe, so its caller came straight back: a busy loop of empty claims that
    kept the store node saturated (the simulated 64-worker run spent 20 s of store CPU in 35 s).
    Its last probe now waits on every shard: an idle second costs a few claims, and rows put
    anywhere while it waits are taken by that same call."""
    cfg = BalancerConfig(session_timeout_s=2.0, heartbeat_interval_s=0.2, patience=10**9)
    with storage.embedded(1, tcp=True) as store:
        admin = store.client()
        admin.create_table(spec())
        with Coordinator(store_addresses=[store.address], balancer=cfg) as coord:
            owner = Beater(coord.address, "owner", interval=0.2)
            cc = CoordinatorClient(coord.address)
            wait_for(lambda: settled(cc, {"owner": 1}), 10, lambda: cc.assignment("t", "work"))
            idle = ConsumerSession(coord.address, "t", "work", "idle")
            wait_for(lambda: settled(cc, {"owner": 1, "idle": 0}), 10,
                     lambda: cc.assignment("t", "work"))
            assert idle.wait_assigned(5) and idle.shards() == []
            client = _CountingClient(store.client())
            t0 = time.monotonic()
            calls = 0
            while time.monotonic() - t0 < 1.0:
                assert idle.claim(client, ["x"], 10, timeout=5.0).num_rows == 0
                calls += 1
            # Each call waits claim_wait_s (0.2 s) server-side: ~5 calls, at most 2 claims each
            # (the deepest-shard probe, then the wait). Spinning made thousands.
            assert calls <= 8 and client.claims <= 2 * calls, (calls, client.claims)
            assert idle.claim_wait_s == pytest.approx(0.2)
            # Rows put while the call waits are its own: one call, no empty answer first.
            def put_while_it_waits() -> None:
                wait_until(lambda: store.parked()["claims"] == 1, what="the claim to park")
                admin.put("t", rows(5))

            putter = threading.Thread(target=put_while_it_waits)
            putter.start()
            lease = idle.claim(client, ["x"], 10, timeout=5.0)
            putter.join(30)
            assert lease.num_rows == 5 and idle.rows_stolen == 5
            client.client.ack(lease)
            client.client.close()
            idle.close()
            owner.close()
            cc.close()
        admin.close()


def _drain(session, client, shard: int) -> list[int]:
    """Claim (and ack) through ``session`` until nothing is left; every lease from ``shard``."""
    rows: list[int] = []
    lease = session.claim(client, ["x"], 50, timeout=1.0)
    while lease.num_rows:
        assert lease.shard_id == shard
        rows += lease.batch.column("x").to_pylist()
        lease = session.claim(client, ["x"], 50, timeout=0.1, ack=lease)
    return rows


def test_a_lease_taken_before_a_move_stays_valid_and_is_acked_exactly_once():
    """A owns both shards and holds a lease on rows of shard S; B joins and S moves to B (the
    handoff completes while A still holds the lease: a held lease is not a claim in progress).
    B claims only S's other rows; A's write+ack under its lease then succeeds; nothing is
    redelivered and every row is consumed exactly once."""
    schema = pa.schema([("x", pa.int64()), ("y", pa.int64())])
    two = TableSpec("t", schema, (TaskSpec("work", ("x",)), TaskSpec("after", ("x", "y"))),
                    lease_seconds=30.0)
    cfg = BalancerConfig(session_timeout_s=1.0, heartbeat_interval_s=0.05, patience=10**9)
    with storage.embedded(2, tcp=True) as store:
        admin = store.client()
        admin.create_table(two)
        with Coordinator(store_addresses=[store.address], balancer=cfg) as coord:
            cc = CoordinatorClient(coord.address)
            sa = ConsumerSession(coord.address, "t", "work", "A", steal=False)
            wait_for(lambda: sa.shards() == [0, 1], 10, sa.shards)
            S, other = 0, 1
            admin.put("t", pa.table({"x": list(range(20))}), shard_id=S)
            ca = store.client()
            held = sa.claim(ca, ["x"], 8, timeout=1.0)
            assert held.shard_id == S and held.num_rows == 8
            a_rows = held.batch.column("x").to_pylist()
            # Make S the shallower shard, so the join rebalance revokes S (not the other) from A.
            admin.put("t", pa.table({"x": list(range(100, 200))}), shard_id=other)
            wait_for(lambda: dict(cc.assignment("t", "work")["depth"]) == {S: 12, other: 100},
                     5, lambda: cc.assignment("t", "work"))
            sb = ConsumerSession(coord.address, "t", "work", "B", steal=False)
            wait_for(lambda: sb.shards() == [S] and sa.shards() == [other], 10,
                     lambda: (sa.shards(), sb.shards(), cc.assignment("t", "work")))
            view = cc.assignment("t", "work")
            assert dict(view["owners"]) == {S: "B", other: "A"} and not view["handoffs"]
            assert coord.metrics.registry.get_sample_value(
                "streamflow_coordinator_reassignments_total",
                {"table": "t", "task": "work", "reason": "join"}) == 1.0  # S, revoked for B
            cb = store.client()
            b_rows = _drain(sb, cb, S)
            assert sorted(b_rows) == sorted(set(range(20)) - set(a_rows))  # none of A's rows
            # A no longer owns S, yet its lease on S's rows is still good: write + ack succeed.
            assert S not in sa.shards()
            ca.write("t", held, pa.table({"y": [v * 10 for v in a_rows]}), ack=True)
            a_more = _drain(sa, ca, other)
            assert sb.claim(cb, ["x"], 50, timeout=0.1).num_rows == 0  # A's rows never reach B
            everything = a_rows + b_rows + a_more
            assert sorted(everything) == list(range(20)) + list(range(100, 200))  # exactly once
            stats = admin.stats("t")
            work = stats.task_total("work")
            assert work.consumed == 120 and work.in_flight == 0 and work.ready == 0
            assert work.redelivered_total == 0
            assert shard_stats(admin, S)["after"].ready == 8  # A's write landed (only A wrote y)
            for c in (cb, ca):
                c.close()
            sb.close()
            sa.close()
            cc.close()
        admin.close()


def test_coordinator_and_session_metrics_are_documented_and_follow_the_conventions():
    documented = set(re.findall(r"`(streamflow_[a-z_]+)`", (ROOT / "docs/metrics.md").read_text()))
    families = list(CoordinatorMetrics().registry.collect())
    families += list(SessionMetrics().registry.collect())
    names = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    assert {"streamflow_coordinator_reassignments_total", "streamflow_coordinator_owned_shards",
            "streamflow_coordinator_depth_imbalance_ratio",
            "streamflow_consumer_rows_claimed_total"} <= names
    assert names - documented == set()
    for f in families:
        name = f.name + ("_total" if f.type == "counter" else "")
        assert name.startswith("streamflow_") and f.type != "summary", name
        assert (f.type == "counter") == name.endswith("_total"), name
    text = (ROOT / "docs/metrics.md").read_text()
    assert all(reason in text for reason in REASONS)
    # One SessionMetrics per registry: two sessions of one worker share the counters.
    registry = CollectorRegistry()
    assert SessionMetrics.for_registry(registry) is SessionMetrics.for_registry(registry)
