"""Benchmark: the shard balancer on vs off under a skewed workload.

Workload: one store node process with ``--shards`` shards; ``--consumers`` consumer threads, each
with its own store client and ``ConsumerSession``; consumer ``c0-slow`` takes ``--slow-factor``
times longer per row than the others (work is a sleep, so the 2-core machine's load hardly
matters); a producer puts ``--rows`` rows at ``--put-rate`` rows/s, ``--flood`` of them onto shard
0 and the rest spread over the other shards. Both variants run the same workload one after the
other in one invocation (``--repeats`` alternates them), each on a fresh table and coordinator:

- ``on``: depth rebalancing with hysteresis + stealing from the deepest shard when idle;
- ``off``: static round-robin ownership by consumer id, no rebalancing, no stealing.

Round-robin gives shard 0 (the flooded one) to ``c0-slow`` in both variants at the start.
End-to-end throughput = rows / (last ack - first put). Utilisation = busy (working) time / wall.

Output: a table, then one JSON line (``--json``: only the JSON line on stdout, table on stderr)
with ``on_rows_per_second``, ``off_rows_per_second``, ``speedup`` and per-consumer utilisation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

import storage
from bench._store_node import spawn_store
from storage.balance import BalancerConfig
from storage.coordinator import Coordinator, CoordinatorClient
from storage.coordinator_session import ConsumerSession
from storage.schema import TableSpec, TaskSpec

SCHEMA = pa.schema([("x", pa.int64())])
TASK = "work"
ROWS_PER_CLAIM = 16
PUT_CHUNK = 50


def start_store(shards: int, tmp: Path) -> tuple[subprocess.Popen, str]:
    """A store node process on a free 127.0.0.1 port; returns (process, address)."""
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1"}
    proc, addresses = spawn_store(shards, tmp, env=env)
    return proc, addresses[0]


def run_variant(address: str, table: str, *, balance: bool, args: argparse.Namespace) -> dict:
    """One variant end to end; returns its measurements."""
    admin = storage.connect(address)
    admin.create_table(
        TableSpec(
            table,
            SCHEMA,
            (TaskSpec(TASK, ("x",)),),
            lease_seconds=30.0,
            capacity_rows=max(args.rows * 2, 1000),
        )
    )
    shard_ids = [s.shard_id for s in admin.stats(table).shards]
    cfg = BalancerConfig(
        session_timeout_s=2.0,
        heartbeat_interval_s=args.heartbeat,
        rebalance=balance,
        patience=2,
        cooldown_s=2.0,
    )
    coord = Coordinator(store_addresses=[address], balancer=cfg).start()
    names = ["c0-slow"] + [f"c{i}-fast" for i in range(1, args.consumers)]
    cost = {n: args.row_ms / 1000 * (args.slow_factor if "slow" in n else 1.0) for n in names}
    sessions = {n: ConsumerSession(coord.address, table, TASK, n, steal=balance) for n in names}
    busy = {n: 0.0 for n in names}
    done = {n: 0 for n in names}
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 30
        while any(not s.shards() for s in sessions.values()):  # everyone owns its shards
            if time.monotonic() > deadline:
                raise RuntimeError("consumers got no shards from the coordinator")
            time.sleep(0.05)

        def consume(name: str) -> None:
            session, client, prev = sessions[name], storage.connect(address), None
            try:
                while not stop.is_set():
                    lease = session.claim(client, ["x"], ROWS_PER_CLAIM, timeout=0.5, ack=prev)
                    prev = None
                    if lease.num_rows:
                        t0 = time.monotonic()
                        time.sleep(cost[name] * lease.num_rows)  # the work
                        spent = time.monotonic() - t0
                        session.record(lease.num_rows, spent)
                        busy[name] += spent
                        done[name] += lease.num_rows
                        prev = lease
                if prev is not None:
                    client.ack(prev)
            finally:
                client.close()

        threads = [threading.Thread(target=consume, args=(n,), daemon=True) for n in names]
        for t in threads:
            t.start()
        start = time.monotonic()
        flooded, others = shard_ids[0], shard_ids[1:] or shard_ids
        put, k = 0, 0
        while put < args.rows:  # the producer: a steady stream, most of it onto one shard
            n = min(PUT_CHUNK, args.rows - put)
            n_flood = round(n * args.flood)
            admin.put(table, pa.table({"x": list(range(put, put + n_flood))}), shard_id=flooded)
            if n - n_flood:
                target = others[k % len(others)]
                k += 1
                admin.put(
                    table, pa.table({"x": list(range(put + n_flood, put + n))}), shard_id=target
                )
            put += n
            time.sleep(max(0.0, start + put / args.put_rate - time.monotonic()))
        limit = time.monotonic() + args.max_seconds
        while admin.stats(table).task_total(TASK).consumed < args.rows:
            if time.monotonic() > limit:
                raise RuntimeError(f"{table}: not drained within {args.max_seconds} s")
            time.sleep(0.02)
        wall = time.monotonic() - start
        with CoordinatorClient(coord.address) as cc:
            state = cc.assignment(table, TASK)
        reassignments = sum(
            coord.metrics.reassignments.labels(table, TASK, r)._value.get()
            for r in ("join", "leave", "expired", "balance", "handoff_timeout")
        )
    finally:
        stop.set()
        for t in locals().get("threads", []):
            t.join(10)
        for s in sessions.values():
            s.close()
        coord.stop()
        admin.drop_table(table)
        admin.close()
    return {
        "balance": balance,
        "rows": args.rows,
        "seconds": round(wall, 3),
        "rows_per_second": round(args.rows / wall, 1),
        "reassignments": int(reassignments),
        "owners": {str(s): c for s, c in state["owners"]},
        "consumers": {
            n: {
                "rows": done[n],
                "busy_s": round(busy[n], 3),
                "utilisation": round(busy[n] / wall, 3),
                "rows_stolen": sessions[n].rows_stolen,
            }
            for n in names
        },
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="streamflow bench balance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--consumers", type=int, default=3)
    ap.add_argument("--row-ms", type=float, default=1.0, help="work per row of a fast consumer")
    ap.add_argument("--slow-factor", type=float, default=4.0)
    ap.add_argument("--flood", type=float, default=0.7, help="fraction of rows put on shard 0")
    ap.add_argument("--put-rate", type=float, default=3000.0, help="producer rows/s")
    ap.add_argument("--heartbeat", type=float, default=0.2, help="heartbeat interval s")
    ap.add_argument("--repeats", type=int, default=1, help="on/off pairs, alternated")
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument("--quick", action="store_true", help="a tiny run (tests)")
    ap.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.put_rate = 400, 4000.0
    if args.consumers < 2 or args.shards < 2 or not 0 <= args.flood <= 1 or args.rows < 1:
        ap.error("need --consumers >= 2, --shards >= 2, --flood in [0, 1], --rows >= 1")
    return args


def summarize(runs: dict[str, list[dict]]) -> dict[str, Any]:
    out: dict[str, Any] = {"bench": "balance"}
    for v in ("on", "off"):
        rs = runs[v]
        out[f"{v}_rows_per_second"] = round(sum(r["rows_per_second"] for r in rs) / len(rs), 1)
        out[f"{v}_utilisation"] = {
            n: round(sum(r["consumers"][n]["utilisation"] for r in rs) / len(rs), 3)
            for n in rs[0]["consumers"]
        }
        out[v] = rs
    out["speedup"] = round(out["on_rows_per_second"] / out["off_rows_per_second"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    table_out = sys.stderr if args.json else sys.stdout
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="bench-balance-") as tmp:
        proc, address = start_store(args.shards, Path(tmp))
        try:
            for i in range(args.repeats):
                order = ("on", "off") if i % 2 == 0 else ("off", "on")
                for v in order:
                    runs[v].append(
                        run_variant(address, f"bal_{v}_{i}", balance=v == "on", args=args)
                    )
        finally:
            proc.terminate()
            proc.wait(10)
    report = summarize(runs)
    print(
        f"balancer on vs off: {args.rows} rows, {args.shards} shards, {args.consumers} "
        f"consumers (c0 {args.slow_factor:g}x slower), {args.flood:.0%} of rows on shard 0",
        file=table_out,
    )
    names = list(report["on_utilisation"])
    print(
        f"{'variant':8} {'rows/s':>8} {'seconds':>8} "
        + " ".join(f"{n:>10}" for n in names)
        + "   (utilisation)",
        file=table_out,
    )
    for v in ("on", "off"):
        secs = sum(r["seconds"] for r in runs[v]) / len(runs[v])
        print(
            f"{v:8} {report[f'{v}_rows_per_second']:8.1f} {secs:8.2f} "
            + " ".join(f"{report[f'{v}_utilisation'][n]:10.2f}" for n in names),
            file=table_out,
        )
    print(f"speedup (on / off): {report['speedup']:.2f}x", file=table_out)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
