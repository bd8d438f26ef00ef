"""The store benchmark: the RL-shaped W1 workload against a real multi-process store, the raw
ZeroMQ+Arrow limit measured in the same run, a claim-latency sweep and a small-rows figure.

W1 (issue 2): ``--rows`` rows (default 4,096), each ``prompt_ids`` int32[128], ``response_ids``
int32[512], ``response_logprobs`` float32[512], later ``reward`` float32 and ``ref_logprobs``
float32[512]; micro-batches of 64 rows. Processes: one store node (2 shards), a producer that
puts, a reward consumer (claims ``response_ids``, writes ``reward``), a reference consumer (claims
``prompt_ids, response_ids``, writes ``ref_logprobs``) and a trainer (claims all five, acks).
The trainer checks every row arrives exactly once with the values its upstream tasks wrote.

Figures (the JSON object on the last line):
- ``rows_per_second``: W1 rows / wall time from "go" to the trainer's last ack.
- ``bytes_per_second``: Arrow body bytes through the store node (puts + writes in, claim replies
  out) / the same wall time. ``trainer_bytes_per_second``: only what the trainer received.
- ``limit_bytes_per_second``: a raw ZeroMQ stream (PUSH/PULL, zero-copy) of the same Arrow IPC
  bytes (64-row batches of all five columns) between two processes, decoded by the receiver.
- ``ratio_to_limit`` = bytes_per_second / limit_bytes_per_second.
- ``claim_p50_ms`` / ``claim_p99_ms``: W1 claims that found rows ready (request to decoded lease;
  waits for rows not yet produced are long polls and are counted in ``claim_waits`` instead).
- ``claim_p50_ms_by_resident``: claim(64 rows) + release latency p50 with 1k/10k/100k rows
  resident (the store's scheduling cost must not grow with resident rows).
- ``small_rows_per_second``: put + claim + ack of 8-byte rows in batches of 10,000, one client.

Run: ``python -m storage.bench [--rows N] [--json]`` (or ``streamflow bench store``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

PROMPT_LEN, RESPONSE_LEN, MICRO = 128, 512, 64
W1_TASKS = {"reward": ("response_ids",), "reference": ("prompt_ids", "response_ids")}
ALL_COLUMNS = ["prompt_ids", "response_ids", "response_logprobs", "reward", "ref_logprobs"]


def w1_schema() -> pa.Schema:
    return pa.schema([
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("response_logprobs", pa.list_(pa.float32())),
        ("reward", pa.float32()),
        ("ref_logprobs", pa.list_(pa.float32())),
    ])


def w1_spec(name: str = "w1") -> Any:
    from storage.schema import TableSpec, TaskSpec

    tasks = (TaskSpec("reward", W1_TASKS["reward"]), TaskSpec("reference", W1_TASKS["reference"]),
             TaskSpec("trainer", tuple(ALL_COLUMNS)))
    return TableSpec(name, w1_schema(), tasks, lease_seconds=60.0)


def _lists(values: np.ndarray, width: int, typ: pa.DataType) -> pa.Array:
    n = len(values) // width
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * width)
    return pa.ListArray.from_arrays(offsets, pa.array(values, type=typ))


def w1_batch(start: int, n: int, rng: np.random.Generator) -> pa.RecordBatch:
    """n producer rows; response_ids[i][0] = start + i so the trainer can check values."""
    resp = rng.integers(0, 32000, size=(n, RESPONSE_LEN), dtype=np.int32)
    resp[:, 0] = np.arange(start, start + n, dtype=np.int32)
    return pa.RecordBatch.from_arrays([
        _lists(rng.integers(0, 32000, size=n * PROMPT_LEN, dtype=np.int32), PROMPT_LEN, pa.int32()),
        _lists(resp.ravel(), RESPONSE_LEN, pa.int32()),
        _lists(rng.standard_normal(n * RESPONSE_LEN, dtype=np.float32), RESPONSE_LEN, pa.float32()),
    ], names=["prompt_ids", "response_ids", "response_logprobs"])


def _first_token(batch: pa.RecordBatch) -> np.ndarray:
    col = batch.column("response_ids")
    return col.values.to_numpy()[col.offsets.to_numpy()[:-1]]


# -- W1 roles (each in its own process) -----------------------------------------------------------


def _role(role: str, address: str, rows: int, go: Any, out: Any) -> None:
    import storage
    from storage import wire

    c = storage.connect(address, request_timeout=120)
    c.tables()  # connected and warm before the clock starts
    out.put(("ready", role))
    go.wait()
    t0 = time.time()
    lat: list[float] = []
    waits, nbytes, seen = 0, 0, []
    if role == "producer":
        rng = np.random.default_rng(0)
        for start in range(0, rows, MICRO):
            batch = w1_batch(start, min(MICRO, rows - start), rng)
            nbytes += len(wire.write_batch(batch))
            seen += c.put("w1", batch, timeout=120).tolist()
        out.put((role, {"t0": t0, "t1": time.time(), "bytes": nbytes, "rows": seen}))
        return
    task = role
    columns = {"reward": ["response_ids"], "reference": ["prompt_ids", "response_ids"],
               "trainer": ALL_COLUMNS}[role]
    ok = True
    while len(seen) < rows:
        t = time.perf_counter()
        lease = c.claim("w1", task, columns, MICRO, timeout=0)
        if lease.num_rows:
            lat.append(time.perf_counter() - t)
        else:
            waits += 1
            lease = c.claim("w1", task, columns, MICRO, timeout=30)
            if not lease.num_rows:
                break
        nbytes += lease.batch.nbytes
        seen += lease.row_ids
        first = _first_token(lease.batch)
        if role == "reward":
            reward = pa.record_batch({"reward": pa.array(first.astype(np.float32))})
            nbytes += reward.nbytes
            c.write("w1", lease, reward, ack=True)
        elif role == "reference":
            ref = np.repeat(first.astype(np.float32), RESPONSE_LEN)
            batch = pa.record_batch({"ref_logprobs": _lists(ref, RESPONSE_LEN, pa.float32())})
            nbytes += batch.nbytes
            c.write("w1", lease, batch, ack=True)
        else:
            reward = lease.batch.column("reward").to_numpy()
            ref = lease.batch.column("ref_logprobs").values.to_numpy()[::RESPONSE_LEN]
            ok = ok and bool((reward == first).all() and (ref == first).all())
            c.ack(lease)
    out.put((role, {"t0": t0, "t1": time.time(), "bytes": nbytes, "rows": seen, "lat": lat,
                    "waits": waits, "values_ok": ok}))


def _limit_receiver(address: str, count: int, out: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    out.put(("bound", sock.getsockopt_string(zmq.LAST_ENDPOINT)))
    total, t0 = 0, None
    for _ in range(count):
        frame = sock.recv(copy=False)
        t0 = t0 or time.perf_counter()
        batch = pa.ipc.open_stream(pa.py_buffer(frame.buffer)).read_next_batch()
        total += len(frame.buffer)
        assert batch.num_rows == MICRO
    out.put(("limit", {"bytes": total, "seconds": time.perf_counter() - t0}))
    sock.close(0)
    ctx.term()


def measure_limit(min_bytes: int = 256 << 20) -> float:
    """Bytes/s of a raw PUSH->PULL stream of W1-shaped Arrow IPC batches between two processes."""
    import zmq

    from storage import wire

    batch = w1_batch(0, MICRO, np.random.default_rng(1))
    n = MICRO
    full = batch.append_column("reward", pa.array(np.zeros(n, np.float32))).append_column(
        "ref_logprobs", batch.column("response_logprobs"))
    payload = wire.write_batch(full)
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
    return (res["bytes"] - len(payload)) / res["seconds"] if res["seconds"] > 0 else 0.0


# -- the store node process -----------------------------------------------------------------------


class _Node:
    def __init__(self, shards: int = 2) -> None:
        self.dir = tempfile.mkdtemp(prefix="sf-bench-")
        ready = Path(self.dir) / "ready.json"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.proc = subprocess.Popen([sys.executable, "-m", "storage.server", "--bind",
                                      "tcp://127.0.0.1:0", "--shards", str(shards),
                                      "--ready-file", str(ready), "--log-level", "WARNING"], env=env)
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("store node did not start")
            time.sleep(0.02)
        self.address = json.loads(ready.read_text())["addresses"][0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)


def run_w1(address: str, rows: int) -> dict[str, Any]:
    import storage

    with storage.connect(address) as c:
        c.create_table(w1_spec())
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    roles = ["producer", "reward", "reference", "trainer"]
    procs = [ctx.Process(target=_role, args=(r, address, rows, go, out), daemon=True) for r in roles]
    for p in procs:
        p.start()
    for _ in roles:  # every role imported, connected and warm: "go" starts the clock
        tag, _role_name = out.get(timeout=120)
        assert tag == "ready"
    t_go = time.time()
    go.set()
    res = {}
    for _ in roles:
        role, data = out.get(timeout=600)
        res[role] = data
    for p in procs:
        p.join(30)
    produced, trained = res["producer"]["rows"], res["trainer"]["rows"]
    elapsed = res["trainer"]["t1"] - t_go
    lat = np.array([x for r in ("reward", "reference", "trainer") for x in res[r]["lat"]] or [0.0])
    store_bytes = sum(res[r]["bytes"] for r in roles)
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
                c.put(name, pa.record_batch({"x": np.arange(start, start + k),
                                             "y": np.zeros(k, np.float32)}))
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
    ap = argparse.ArgumentParser(prog="python -m storage.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096, help="W1 rows (default 4096)")
    ap.add_argument("--resident", default="1000,10000,100000", help="claim sweep sizes")
    ap.add_argument("--small-rows", type=int, default=200_000)
    ap.add_argument("--limit-mib", type=int, default=256, help="bytes streamed for the limit")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    node = _Node()
    try:
        limit = measure_limit(args.limit_mib << 20)
        w1 = run_w1(node.address, args.rows)
        sweep = claim_sweep(node.address, [int(x) for x in args.resident.split(",") if x])
        small = small_rows(node.address, args.small_rows)
    finally:
        node.stop()
    result = {**w1, "limit_bytes_per_second": limit,
              "ratio_to_limit": w1["bytes_per_second"] / limit if limit else 0.0,
              "claim_p50_ms_by_resident": sweep, "small_rows_per_second": small}
    print(f"{'metric':34s} value")
    for key, value in result.items():
        shown = f"{value:,.3f}" if isinstance(value, float) else str(value)
        print(f"{key:34s} {shown}")
    if args.json:
        print(json.dumps(result))
    ok = result["exactly_once"] and result["values_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
