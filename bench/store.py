"""The store benchmark: the RL-shaped W1 workload against a real multi-process store, the raw
ZeroMQ+Arrow limit measured in the same run, a claim-latency sweep and a small-rows figure.

W1 (``bench._w1``): ``--rows`` rows (default 4,096), each ``prompt_ids`` int32[128], ``response_ids``
int32[512], ``response_logprobs`` float32[512], later ``reward`` float32 and ``ref_logprobs``
float32[512]; micro-batches of 64 rows. Processes: one store node (2 shards), a producer that
puts, a reward consumer (claims ``response_ids``, writes ``reward``), a reference consumer (claims
``prompt_ids, response_ids``, writes ``ref_logprobs``) and a trainer (claims all five, acks).
The trainer checks every row arrives exactly once with the values its upstream tasks wrote.

The clock. Every process is started, has imported everything, connected, made one round trip
and (producer) built all its batches before "go"; the window runs from "go" to the trainer's
last ack. Building the producer's rows is the producer's work, not the store's, so it is done
before the clock starts, as the limit's sender also sends a pre-built payload.

Figures (the JSON object on the last line):
- ``rows_per_second``: W1 rows / window.
- ``bytes_per_second``: Arrow bytes that crossed the store node's socket / window. Every Arrow
  body counts once, with its IPC record-batch size (``pa.ipc.get_record_batch_size``: the
  message the wire carries, metadata and padding included; msgpack headers are not counted):
  put bodies and write bodies (``row_id`` column included) in, claim replies (requested columns
  + ``row_id`` + ``deliveries``) out. ``trainer_bytes_per_second``: only the trainer's claims.
- ``limit_bytes_per_second``: a raw ZeroMQ PUSH->PULL stream, zero-copy, between two processes,
  of 64-row Arrow IPC batches of all five W1 columns (decoded by the receiver), counted the same
  way (IPC record-batch size per message). It has no request/reply round trips and no small
  messages; the store's W1 has 4 round trips per 64 rows: a put, and per consumer one claim that
  also acks (reward/reference: writes and acks) the consumer's previous lease.
- ``ratio_to_limit`` = bytes_per_second / limit_bytes_per_second.
- ``claim_p50_ms`` / ``claim_p99_ms``: W1 claims that found rows ready (request to decoded lease,
  the piggybacked write/ack of the previous lease included; waits for rows not yet produced are
  long polls and are counted in ``claim_waits`` instead).
- ``cpu_seconds``: CPU time (user + sys, all threads) per process during the window, and
  ``cpu_busy_ratio`` = their sum / (window x cores): near 1.0 means the run is CPU-bound.
- ``claim_p50_ms_by_resident``: claim(64 rows) + release latency p50 with 1k/10k/100k rows
  resident (the store's scheduling cost must not grow with resident rows).
- ``small_rows_per_second``: put + claim + ack of 8-byte rows in batches of 10,000, one client.
- ``ceiling_bytes_per_second`` / ``ceiling_ratio_to_limit``: the same W1 client processes against
  ``bench._store_ceiling.NullNode``, a node that speaks the wire protocol but keeps no state,
  reads no body and answers claims from one pre-built batch: an upper bound for any store node
  in Python on this machine (``--no-ceiling`` skips it; it needs ``--rows`` a multiple of 64).
- ``clients_cpu_bound_ratio``: W1's bytes over the time the four client processes' CPU seconds
  take on this machine's cores, over the limit: the ratio a node costing nothing could not beat.

Run: ``streamflow bench store [--rows N] [--json]`` (or ``python -m bench.store``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bench._w1 import (
    ALL_COLUMNS,
    MICRO,
    RESPONSE_LEN,
    first_token,
    ref_logprobs_column,
    reward_column,
    w1_batch,
    w1_full_batch,
    w1_spec,
)

# -- W1 roles (each in its own process) -----------------------------------------------------------


def ipc_size(batch: pa.RecordBatch) -> int:
    """Bytes of ``batch`` as one Arrow IPC record-batch message (what the wire carries)."""
    return int(pa.ipc.get_record_batch_size(batch))


def _role(role: str, address: str, rows: int, go: Any, out: Any) -> None:
    import storage

    c = storage.connect(address, request_timeout=120)
    c.tables()  # connected and warm before the clock starts
    batches = []
    if role == "producer":  # the rows are the producer's work, not the store's: built up front
        rng = np.random.default_rng(0)
        batches = [w1_batch(s, min(MICRO, rows - s), rng) for s in range(0, rows, MICRO)]
    out.put(("ready", role))
    go.wait()
    t0, cpu0 = time.time(), time.process_time()
    lat: list[float] = []
    waits, nbytes, seen = 0, 0, []
    if role == "producer":
        for batch in batches:
            nbytes += ipc_size(batch)
            seen += c.put("w1", batch, timeout=120).tolist()
        cpu = time.process_time() - cpu0
        out.put((role, {"t0": t0, "t1": time.time(), "cpu": cpu, "bytes": nbytes, "rows": seen}))
        return
    task = role
    columns = {
        "reward": ["response_ids"],
        "reference": ["prompt_ids", "response_ids"],
        "trainer": ALL_COLUMNS,
    }[role]
    ok = True
    # Each turn acks (and writes) the previous lease in the same request as the next claim:
    # 1 round trip per 64 rows per consumer (the last lease is acked on its own).
    prev: Any = None  # the lease processed last turn, acked by this turn's claim
    prev_out: pa.RecordBatch | None = None  # the columns to write under it (None: ack only)
    while len(seen) < rows:
        t = time.perf_counter()
        lease = c.claim("w1", task, columns, MICRO, timeout=0, ack=prev, write=prev_out)
        prev = prev_out = None
        if lease.num_rows:
            lat.append(time.perf_counter() - t)
        else:
            waits += 1
            lease = c.claim("w1", task, columns, MICRO, timeout=30)
            if not lease.num_rows:
                break
        nbytes += ipc_size(lease.batch)
        seen += lease.batch.column("row_id").to_numpy().tolist()  # (to_pylist is ~10x slower)
        first = first_token(lease.batch)
        row_id = lease.batch.column("row_id")
        if role == "reward":
            prev_out = pa.record_batch({"row_id": row_id, "reward": reward_column(first)})
        elif role == "reference":
            prev_out = pa.record_batch(
                {"row_id": row_id, "ref_logprobs": ref_logprobs_column(first)}
            )
        else:
            reward = lease.batch.column("reward").to_numpy()
            ref = lease.batch.column("ref_logprobs").values.to_numpy()[::RESPONSE_LEN]
            ok = ok and bool((reward == first).all() and (ref == first).all())
        if prev_out is not None:
            nbytes += ipc_size(prev_out)
        prev = lease
    if prev is not None and prev_out is not None:
        c.write("w1", prev, prev_out, ack=True)
    elif prev is not None:
        c.ack(prev)
    out.put(
        (
            role,
            {
                "t0": t0,
                "t1": time.time(),
                "cpu": time.process_time() - cpu0,
                "bytes": nbytes,
                "rows": seen,
                "lat": lat,
                "waits": waits,
                "values_ok": ok,
            },
        )
    )


def _limit_receiver(address: str, count: int, out: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    out.put(("bound", sock.getsockopt_string(zmq.LAST_ENDPOINT)))
    total, t0 = 0, 0.0
    for i in range(count):
        frame = sock.recv(copy=False)
        if i == 0:  # the warm-up message starts the clock and is not counted
            t0 = time.perf_counter()
            continue
        batch = pa.ipc.open_stream(pa.py_buffer(frame.buffer)).read_next_batch()
        total += ipc_size(batch)
        assert batch.num_rows == MICRO
    out.put(("limit", {"bytes": total, "seconds": time.perf_counter() - t0}))
    sock.close(0)
    ctx.term()


def measure_limit(min_bytes: int = 256 << 20) -> float:
    """Bytes/s of a raw PUSH->PULL stream of W1-shaped Arrow IPC batches between two processes."""
    import zmq

    from storage import wire

    # Same columns, types and sizes as the trainer's claims (the values do not change the bytes).
    payload = wire.write_batch(w1_full_batch(0, MICRO, np.random.default_rng(1)))
    count = max(64, min_bytes // len(payload))
    ctx_mp = mp.get_context("spawn")
    out = ctx_mp.Queue()
    proc = ctx_mp.Process(target=_limit_receiver, args=("tcp://127.0.0.1:*", count + 1, out))
    proc.start()
    _, endpoint = out.get(timeout=60)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    sock.send(payload, copy=False)  # warm-up message: the receiver's clock starts on it
    for _ in range(count):
        sock.send(payload, copy=False)
    _, res = out.get(timeout=120)
    proc.join(30)
    sock.close(0)
    ctx.term()
    return res["bytes"] / res["seconds"] if res["seconds"] > 0 else 0.0


# -- the store node process -----------------------------------------------------------------------


class _Node:
    def __init__(self, shards: int = 2) -> None:
        self.dir = tempfile.mkdtemp(prefix="sf-bench-")
        from bench._store_node import spawn_store

        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.proc, addresses = spawn_store(shards, self.dir, env=env)
        self.address = addresses[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)


def _cpu_seconds(pid: int | None) -> float:
    if pid is None:
        return 0.0
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def run_w1(address: str, rows: int, node_pid: int | None = None) -> dict[str, Any]:
    """W1 against the node at ``address``; ``node_pid`` adds the node's CPU time to the figures."""
    import storage

    with storage.connect(address) as c:
        c.create_table(w1_spec())
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    roles = ["producer", "reward", "reference", "trainer"]
    procs = [
        ctx.Process(target=_role, args=(r, address, rows, go, out), daemon=True) for r in roles
    ]
    for p in procs:
        p.start()
    for _ in roles:  # every role imported, connected and warm: "go" starts the clock
        tag, _role_name = out.get(timeout=120)
        assert tag == "ready"
    node_cpu0 = _cpu_seconds(node_pid)
    t_go = time.time()
    go.set()
    res, node_cpu = {}, 0.0
    for _ in roles:
        role, data = out.get(timeout=600)
        res[role] = data
        if role == "trainer":  # the window ends with the trainer's last ack
            node_cpu = _cpu_seconds(node_pid) - node_cpu0
    for p in procs:
        p.join(30)
    produced, trained = res["producer"]["rows"], res["trainer"]["rows"]
    elapsed = res["trainer"]["t1"] - t_go
    lat = np.array([x for r in ("reward", "reference", "trainer") for x in res[r]["lat"]] or [0.0])
    store_bytes = sum(res[r]["bytes"] for r in roles)
    cpu = {"node": node_cpu, **{r: res[r]["cpu"] for r in roles}}
    return {
        "rows": rows,
        "seconds": elapsed,
        "exactly_once": len(trained) == len(set(trained)) == rows and set(trained) == set(produced),
        "values_ok": bool(res["trainer"]["values_ok"]),
        "rows_per_second": rows / elapsed,
        "bytes_per_second": store_bytes / elapsed,
        "trainer_bytes_per_second": res["trainer"]["bytes"] / elapsed,
        "claim_p50_ms": float(np.percentile(lat, 50) * 1e3),
        "claim_p99_ms": float(np.percentile(lat, 99) * 1e3),
        "claim_waits": sum(res[r]["waits"] for r in ("reward", "reference", "trainer")),
        "cpu_seconds": cpu,
        "cpu_busy_ratio": sum(cpu.values()) / (elapsed * (os.cpu_count() or 1)),
    }


def claim_sweep(address: str, resident: Sequence[int], iters: int = 200) -> dict[str, float]:
    """p50 of claim(64) with N rows resident (claim + release keeps N constant)."""
    import storage
    from storage.schema import TableSpec, TaskSpec

    out = {}
    schema = pa.schema([("x", pa.int64()), ("y", pa.float32())])
    with storage.connect(address) as c:
        for n in resident:
            name = f"sweep{n}"
            c.create_table(TableSpec(name, schema, (TaskSpec("a", ("x",)), TaskSpec("b", ("x",)))))
            for start in range(0, n, 10_000):
                k = min(10_000, n - start)
                c.put(
                    name,
                    pa.record_batch(
                        {"x": np.arange(start, start + k), "y": np.zeros(k, np.float32)}
                    ),
                )
            lat = []
            for _ in range(iters):
                t = time.perf_counter()
                lease = c.claim(name, "a", ["x"], 64)
                lat.append(time.perf_counter() - t)
                c.release(lease)
            out[str(n)] = float(np.percentile(lat, 50) * 1e3)
            c.drop_table(name)
    return out


def small_rows(address: str, total: int = 200_000, batch: int = 10_000) -> float:
    """Rows/s of put + claim + ack with tiny rows, in batches, from one client."""
    import storage
    from storage.schema import TableSpec, TaskSpec

    schema = pa.schema([("x", pa.int64())])
    data = pa.record_batch({"x": np.arange(batch, dtype=np.int64)})
    with storage.connect(address) as c:
        c.create_table(TableSpec("small", schema, (TaskSpec("a", ("x",)),)))
        t = time.perf_counter()
        done = 0
        while done < total:
            c.put("small", data)
            lease = c.claim("small", "a", ["x"], batch)
            c.ack(lease)
            done += lease.num_rows
        rate = done / (time.perf_counter() - t)
        c.drop_table("small")
    return rate


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.store", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096, help="W1 rows (default 4096)")
    ap.add_argument("--resident", default="1000,10000,100000", help="claim sweep sizes")
    ap.add_argument("--small-rows", type=int, default=200_000)
    ap.add_argument("--limit-mib", type=int, default=256, help="bytes streamed for the limit")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the null-node ceiling run")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    node = _Node()
    try:
        limit = measure_limit(args.limit_mib << 20)
        w1 = run_w1(node.address, args.rows, node.proc.pid)
        sweep = claim_sweep(node.address, [int(x) for x in args.resident.split(",") if x])
        small = small_rows(node.address, args.small_rows)
    finally:
        node.stop()
    clients_cpu = sum(v for k, v in w1["cpu_seconds"].items() if k != "node")
    clients_bound = w1["bytes_per_second"] * w1["seconds"] / (clients_cpu / (os.cpu_count() or 1))
    result = {
        **w1,
        "limit_bytes_per_second": limit,
        "ratio_to_limit": w1["bytes_per_second"] / limit if limit else 0.0,
        "claim_p50_ms_by_resident": sweep,
        "small_rows_per_second": small,
        "clients_cpu_bound_ratio": clients_bound / limit if limit else 0.0,
    }
    if not args.no_ceiling and args.rows % MICRO == 0:  # the null node counts whole batches
        from bench._store_ceiling import start_null_node

        proc, address = start_null_node()
        try:
            ceiling = run_w1(address, args.rows, proc.pid)
        finally:
            proc.terminate()
            proc.join(15)
        result["ceiling_bytes_per_second"] = ceiling["bytes_per_second"]
        result["ceiling_ratio_to_limit"] = ceiling["bytes_per_second"] / limit if limit else 0.0
        result["ceiling_exactly_once"] = ceiling["exactly_once"] and ceiling["values_ok"]
    print(f"{'metric':34s} value")
    for key, value in result.items():
        if isinstance(value, dict):
            shown = ", ".join(f"{k}={v:.3f}" for k, v in value.items())
        else:
            shown = f"{value:,.3f}" if isinstance(value, float) else str(value)
        print(f"{key:34s} {shown}")
    if args.json:
        print(json.dumps(result))
    ok = result["exactly_once"] and result["values_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
