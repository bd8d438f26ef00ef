"""``streamflow bench pipeline``: the same RL workload in sync, periodic and async, side by side.

What it measures: samples/s and generated tokens/s of the RL loop (from all workers ready to the
last optimizer step; process start-up excluded), each stage's busy seconds, and each mode's
speedup over ``sync`` next to the theoretical bound for fully separate stages,
``(sum of stage times) / (largest stage time)`` computed from the stage times measured in the
``sync`` run of the same invocation.

Threads (this machine has 2 cores): ``sync`` runs every stage in one process with
``--threads`` (default 2) torch threads, as a colocated deployment would; the streaming modes give
the rollout worker and the trainer ``threads // 2`` threads each (their own core) and the reward
worker 1. The workload uses no reference model (``kl_coef = 0``) so that two busy processes share
two cores; the model is the built-in architecture without a warm start (it rarely emits the stop
token, so every response runs to ``max_new_tokens``: a steady, system-level workload, not a
learning run).

Prints a table, then one JSON line: ``{"sync": {...}, "periodic": {...}, "async": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from streamflow.config import load_config
from streamflow.controller import run

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("rollout", "reward", "reference", "trainer")


def workload(args: argparse.Namespace, mode: str, out: Path) -> list[str]:
    half = max(args.threads // 2, 1)
    overrides = [
        f"run.mode={mode}", f"run.iterations={args.iterations}", "run.eval_every=0",
        "run.progress=false", "run.log_level=WARNING", f"run.output_dir={out / mode}",
        "model.warmstart_steps=0", f"model.builtin.hidden_size={args.hidden}",
        f"model.builtin.num_layers={args.layers}", f"model.builtin.intermediate_size={args.hidden * 2}",
        f"data.prompts_per_iteration={args.prompts}", f"data.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.groups_per_claim=2",
        "trainer.kl_coef=0", "trainer.rows_per_claim=32", "trainer.packing=true",
        "reward.rows_per_claim=64",
    ]
    if mode == "sync":
        overrides += [f"rollout.threads={args.threads}", f"trainer.threads={args.threads}"]
    else:
        overrides += [f"rollout.threads={half}", f"trainer.threads={half}"]
    if mode == "async":
        overrides.append("run.max_staleness=1")
    return overrides


def measure(args: argparse.Namespace) -> dict[str, dict]:
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="sf-bench-") as tmp:
        out = Path(tmp)
        for mode in ("sync", "periodic", "async"):
            cfg = load_config(ROOT / "configs" / "tiny.yaml", workload(args, mode, out))
            summary = run(cfg)
            results[mode] = {
                "samples_per_second": summary.samples_per_second,
                "tokens_per_second": summary.tokens_per_second,
                "wall_seconds": summary.wall_seconds,
                "samples": summary.samples,
                "generated_tokens": summary.generated_tokens,
                "stage_busy_seconds": dict(summary.stage_busy_seconds),
                "max_staleness_observed": summary.max_staleness_observed,
                "threads": (f"{args.threads} threads in one process" if mode == "sync" else
                            f"rollout {max(args.threads // 2, 1)}, trainer "
                            f"{max(args.threads // 2, 1)}, reward 1 (one process each)"),
            }
    busy = results["sync"]["stage_busy_seconds"]
    times = [busy.get(s, 0.0) for s in STAGES if busy.get(s, 0.0) > 0]
    bound = sum(times) / max(times) if times else 1.0
    base = results["sync"]["samples_per_second"] or 1e-12
    for mode, r in results.items():
        r["speedup"] = r["samples_per_second"] / base
        r["bound"] = bound if mode != "sync" else 1.0
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamflow bench pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="total torch threads per mode")
    args = parser.parse_args(argv)
    results = measure(args)
    if not args.json:
        table = Table(title="RL pipeline: one workload, three modes (same run)")
        for col in ("mode", "samples/s", "tokens/s", "speedup", "bound", "rollout s", "reward s",
                    "trainer s", "threads"):
            table.add_column(col)
        for mode, r in results.items():
            b = r["stage_busy_seconds"]
            table.add_row(mode, f"{r['samples_per_second']:.1f}", f"{r['tokens_per_second']:.0f}",
                          f"{r['speedup']:.2f}x", f"{r['bound']:.2f}x",
                          f"{b.get('rollout', 0):.2f}", f"{b.get('reward', 0):.2f}",
                          f"{b.get('trainer', 0):.2f}", r["threads"])
        Console().print(table)
    print(json.dumps(results))
    return 0
