"""Benchmark: the first iterations of a fresh process, phase by phase, each one profiled.

Why: on a GPU StreamFlow's first two ``sync`` iterations of G1 took several seconds of generation
and the later ones half a second (docs/performance.md). This runs what ``streamflow run``
runs in ``sync`` (the controller's ``ColocatedLoop``, every role in this one fresh process, as in
``bench phases``) for ``--iterations`` iterations from a cold start and reports, per iteration:

- the phases' seconds (generation with the weight load taken out, reference, train step, the
  weight movement, the whole iteration);
- with ``--profile``, a ``torch.profiler`` summary of that iteration: the operators with the most
  self time on the host and (on a GPU) on the device, and the profiled iteration's seconds;
- on a GPU, the caching allocator's counters after the iteration (device ``cudaMalloc`` calls,
  segments, reserved bytes, retries): growth in the first iterations only points at allocation.

Its verdict, ``first_over_steady``: each of the first two iterations' generation seconds over the
median of the later ones (> 1: a warm-up cost). Output: a table, then one JSON line ``{"device",
"shape", "iterations": [{"k", "generation_s", "reference_s", "train_step_s", "weight_sync_s",
"total_s", "allocator", "profile"}], "first_over_steady"}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench._g1 import G1, QUICK, build_model_dir, run_config


def _allocator(torch: Any, device: str) -> dict[str, int] | None:
    if not device.startswith("cuda"):
        return None
    stats = torch.cuda.memory_stats(device)
    return {"device_mallocs": int(stats.get("num_device_alloc", 0)),
            "segments": int(stats.get("segment.all.current", 0)),
            "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
            "alloc_retries": int(stats.get("num_alloc_retries", 0))}


def _top(profile: Any, key: str, count: int) -> list[list[Any]]:
    """The ``count`` operators with the most ``key`` (a FunctionEventAvg attribute, in µs)."""
    rows = sorted(profile.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)
    return [[e.key, round(getattr(e, key, 0) / 1e6, 6), e.count] for e in rows[:count]
            if getattr(e, key, 0) > 0]


def measure(shape: Any, work: Path, *, iterations: int, threads: int, device: str,
            profile: bool) -> dict[str, Any]:
    """Run the cold-start iterations in this process; the JSON object."""
    import torch

    from bench.phases import StreamFlowSync
    from streamflow.config import config_from_dict

    torch.set_num_threads(threads)
    model_dir = build_model_dir(work / "model", shape)
    tree = run_config(shape, model_dir, work / "runs", mode="sync", iterations=10_000,
                      threads=threads, device=device)
    sf = StreamFlowSync(config_from_dict(tree), work / "runs" / "warmup")
    on_gpu = device.startswith("cuda")
    out: list[dict[str, Any]] = []
    try:
        for k in range(iterations):
            ctx: Any = contextlib.nullcontext()
            if profile:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if on_gpu:
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                ctx = torch.profiler.profile(activities=acts)
            start = time.perf_counter()
            with ctx as prof:
                t = sf.iteration(k)
            if on_gpu:
                torch.cuda.synchronize(device)
            row: dict[str, Any] = {
                "k": k, "generation_s": round(t.generation, 6), "reference_s": round(t.reference, 6),
                "train_step_s": round(t.train_step, 6), "weight_sync_s": round(t.weight_sync, 6),
                "total_s": round(t.total, 6), "allocator": _allocator(torch, device)}
            if profile:
                row["profile"] = {"seconds": round(time.perf_counter() - start, 6),
                                  "host_self": _top(prof, "self_cpu_time_total", 8),
                                  "device_self": _top(prof, "self_device_time_total", 8)
                                  if on_gpu else []}
            print(f"warmup: iteration {k}: generation {t.generation:.3f} s, whole "
                  f"{t.total:.3f} s", file=sys.stderr, flush=True)
            out.append(row)
    finally:
        sf.close()
    gens = [r["generation_s"] for r in out]
    steady = statistics.median(gens[2:]) if len(gens) > 2 else None
    return {"device": device, "shape": asdict(shape), "iterations": out,
            "first_over_steady": None if not steady else [round(g / steady, 3) for g in gens[:2]]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamflow bench warmup",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=5, help="iterations (default 5, >= 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (for tests)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler per iteration")
    parser.add_argument("--json", action="store_true", help="stdout holds only the JSON line")
    args = parser.parse_args(argv)
    if args.iterations < 3 or args.threads < 1:
        parser.error("--iterations must be >= 3 and --threads >= 1")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        parser.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    work = Path(tempfile.mkdtemp(prefix="streamflow-bench-warmup-"))
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with quiet:
            report = measure(QUICK if args.quick else G1, work, iterations=args.iterations,
                             threads=args.threads, device=args.device, profile=args.profile)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [f"{'k':>2} {'generation s':>12} {'reference s':>11} {'train s':>8} {'whole s':>8}"]
    for r in report["iterations"]:
        lines.append(f"{r['k']:>2} {r['generation_s']:>12.4f} {r['reference_s']:>11.4f} "
                     f"{r['train_step_s']:>8.4f} {r['total_s']:>8.4f}")
    lines.append(f"first two iterations' generation over the later ones' median: "
                 f"{report['first_over_steady']}")
    print("\n".join(lines), file=sys.stderr if args.json else sys.stdout)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
