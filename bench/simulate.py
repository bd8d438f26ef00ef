"""``streamflow bench simulate``: the simulated cluster, swept over modes, sizes and skew.

Every case is a real ``streamflow run`` (``bench.sim.cluster.run_sim``): the real controller with
its admission rule, puts and version announcements, the real store node, coordinator and worker
code; only the devices are simulated (every engine ``simulated``, cost preset ``7b-1acc``,
``workers.engines.sim_cost``). Streaming modes run their workers as threads of a few host
processes (``bench.sim.simcluster.SimCluster``); ``sync`` runs the controller's own colocated
loop over ``simulated.devices`` devices. Reported per case: throughput (samples per simulated
second), the lower bound on time from the cost model and the run's own workload
(``bench.sim.bound``: no schedule beats it), efficiency = achieved / bound throughput (<= 1), the
reference schedule's time (a zero-overhead greedy schedule, which runs can beat) and the run's
ratio to it, utilisation per role, and the controller's, coordinator's and store node's CPU
seconds per micro-batch.

Sweeps (``--quick``: a tiny subset for the tests; ``--small``: every sweep at reduced size):
- scaling: ``sync``, ``periodic``, ``async`` s=1 and s=2 at 8, 64, 256 simulated workers (weak
  scaling: each rollout device gets 2 batches of 16 prompts x 8 samples per iteration);
- skew: response-length sigma 0.25 / 1.0 / 1.5 at 64 workers (the long tail);
- equal: a workload whose generation and training take about equal time, ``periodic`` against
  ``sync`` (colocated, same devices) and against ``sync-split`` (the same separate pools taking
  turns, the Periodic Asynchrony paper's baseline: ``periodic`` with ``trainer.whole_iterations``).
- control: ``periodic`` with the coordinator and a ``ConsumerSession`` per stage worker (4
  shards) at each size: the control plane's CPU per micro-batch as workers grow;
- balance: the reference stage is the bottleneck (48/2/4/32 devices), one of its 4 devices 3x
  slower, 4 shards, the coordinator rebalancing against the first ownership kept (stealing on in
  both: the real workers always steal); the spread of utilisation across the reference
  consumers, (max - min) / mean, at time scale 10 (``BALANCE_TIME_SCALE``: why). Its efficiency
  is not meaningful (the bound assumes identical devices).

Worker split for N workers (streaming modes): rollout N/2, trainer 5N/16, reference N/8,
reward N/16 (at least 1 each); ``sync`` colocates all N as devices that take turns.

Output: tables (rich), plots under ``--plots`` (default docs/perf) unless ``--no-plots``, then
one JSON line: ``{"cases": [{"mode", "staleness", "workers", "throughput", "bound",
"efficiency", ...}], "targets": {...}}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from bench.sim.bound import Layout
from bench.sim.cluster import SimConfig, SimResult, run_sim
from workers.engines.sim_cost import Workload

ROOT = Path(__file__).resolve().parents[1]
MODES = (("sync", 0), ("periodic", 0), ("async", 1), ("async", 2))
SWEEPS = ("scaling", "control", "skew", "equal", "balance")
MODE_NAMES = ("sync", "sync-split", "periodic", "async")  # sync-split: the equal sweep only


def layout_for(n: int, mode: str) -> Layout:
    if mode == "sync":
        return Layout(devices=n)
    trainer, reference, reward = max(n * 5 // 16, 1), max(n // 8, 1), max(n // 16, 1)
    return Layout(
        rollout=max(n - trainer - reference - reward, 1),
        reward=reward,
        reference=reference,
        trainer=trainer,
    )


def auto_time_scale(workers: int) -> float:
    """Simulated seconds per real second: 25, lowered to 2560 / workers above 102 workers.

    Every real millisecond of engine overhead (claims, writes, acks, admission, thread wake-ups)
    counts ``time_scale`` simulated milliseconds, so a larger scale is a harsher test. This
    machine runs the client code of ALL simulated workers on 2 shared cores, which a real
    cluster spreads over its hosts; bounding the simulated request rate per real second (it
    grows with workers x time_scale) keeps that artefact from being charged to the engine."""
    return min(25.0, 2560.0 / workers)


def workload_for(n: int, base: Workload) -> Workload:
    rollout = layout_for(n, "periodic").rollout  # same prompts for every mode of a size
    return base.replace(prompts_per_iteration=2 * rollout * base.groups_per_rollout_batch)


def case(
    mode: str, staleness: int, n: int, w: Workload, args: argparse.Namespace, **extra: Any
) -> dict[str, Any]:
    lay = extra.pop("layout", None) or layout_for(n, mode)
    own_scale = extra.pop("time_scale", None)  # a case's own default (balance)
    scale = args.time_scale or own_scale or auto_time_scale(lay.workers)
    cfg = SimConfig(
        mode=mode,
        staleness=staleness,
        layout=lay,
        workload=w,
        time_scale=scale,
        hosts=args.hosts,
        **extra,
    )
    r = run_sim(cfg)
    return summarize(r, w)


def summarize(r: SimResult, w: Workload) -> dict[str, Any]:
    util = list(r.device_utilisation.values())
    return {
        "mode": r.mode,
        "label": r.label,
        "staleness": r.staleness,
        "workers": r.workers,
        "layout": {k: v for k, v in r.layout.items() if v},
        "skew": w.skew,
        "cost_preset": "7b-1acc",
        "prompts_per_iteration": w.prompts_per_iteration,
        "iterations": w.iterations,
        "samples": r.samples,
        "throughput": r.throughput,
        "bound": r.bound_throughput,
        "efficiency": r.efficiency,
        "sim_seconds": r.sim_seconds,
        "bound_seconds": r.bound_seconds,
        # the zero-overhead greedy schedule, to read runs against (not a bound: runs beat it)
        "reference_seconds": r.reference_seconds,
        "reference_ratio": r.reference_seconds / r.sim_seconds,
        "wall_real_s": r.wall_real_s,
        "time_scale": r.time_scale,
        "utilisation": r.utilisation,
        "device_utilisation_min": min(util) if util else 0.0,
        "device_utilisation_max": max(util) if util else 0.0,
        "micro_batches": r.micro_batches,
        "controller_cpu_ms_per_micro_batch": 1e3 * r.controller_cpu_s / r.micro_batches,
        "coordinator_cpu_ms_per_micro_batch": 1e3 * r.coordinator_cpu_s / r.micro_batches,
        "store_cpu_ms_per_micro_batch": 1e3 * r.store_cpu_s / r.micro_batches,
        "hosts_cpu_s": r.hosts_cpu_s,
        "_result": r,
    }


# The balance case runs at this time scale unless ``--time-scale`` is given. Each claim round trip
# costs the same few real milliseconds whatever the scale, and every simulated device is idle for
# round trip x time scale simulated seconds between two micro-batches: a larger share of a fast
# device's micro-batch than of a slow one's, so at a high scale the fast consumers look less busy
# for a reason that has nothing to do with balancing (the spreads at 25 and 10, and why a real
# cluster's round trip is negligible there: docs/benchmarks.md).
BALANCE_TIME_SCALE = 10.0


def balance_case(args: argparse.Namespace, on: bool, base: Workload) -> dict[str, Any]:
    """Reference is the bottleneck (4 devices, ``reference-0`` 3x slower: 3.3 device-equivalents
    against 48 rollout and 32 trainer devices), so once the first rollouts land its consumers
    have a backlog until the last ones; 4 shards; each put lands on one shard (the emptiest), so
    each iteration's rows sit on one shard: the skew the balancer must undo."""
    lay = Layout(rollout=48, reward=2, reference=4, trainer=32)
    waves = 16
    if getattr(args, "small", False):  # the same shape at a quarter of the devices
        lay, waves = Layout(rollout=12, reward=1, reference=4, trainer=8), 2
    w = base.replace(
        prompts_per_iteration=2 * waves * base.groups_per_rollout_batch,
        rows_per_reference_batch=64,
    )
    row = case(
        "async",
        1,
        lay.workers,
        w,
        args,
        layout=lay,
        shards=4,
        balancer=True,
        rebalance=on,
        slowdown={"reference-0": 3.0},
        time_scale=BALANCE_TIME_SCALE,
    )
    refs = {
        d: u for d, u in row["_result"].device_utilisation.items() if d.startswith("reference-")
    }
    refs.update(
        {f"reference-{i}": 0.0 for i in range(lay.reference) if f"reference-{i}" not in refs}
    )
    row["balancer"] = "on" if on else "static"
    row["reference_utilisation"] = dict(sorted(refs.items()))
    mean = sum(refs.values()) / len(refs)
    row["reference_spread"] = (max(refs.values()) - min(refs.values())) / mean if mean else 0.0
    return row


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    base = Workload(iterations=args.iterations, skew=1.0)
    sizes = args.workers
    rows: list[dict[str, Any]] = []

    def run(row_fn: Any, *a: Any, **kw: Any) -> dict[str, Any]:
        t = time.monotonic()
        row = row_fn(*a, **kw)
        if args.verbose:
            print(
                f"  {row['label']:<16} n={row['workers']:<4} skew={row['skew']:<5} "
                f"eff={row['efficiency']:.3f} ({time.monotonic() - t:.1f}s)",
                flush=True,
            )
        return row

    want = set(args.sweeps)
    modes = [(m, s) for m, s in MODES if m in args.modes]
    for n in sizes if "scaling" in want else ():
        for mode, s in modes:
            row = run(case, mode, s, n, workload_for(n, base), args)
            row["sweep"] = "scaling"
            rows.append(row)
    quick = args.quick and not args.small
    for n in sizes if "control" in want and "periodic" in args.modes and not quick else ():
        # The balancer on every stage worker (the real default with >= 2 shards): what the
        # coordinator and the controller cost per micro-batch as workers grow.
        row = run(
            case,
            "periodic",
            0,
            n,
            workload_for(n, base),
            args,
            shards=4,
            balancer=True,
        )
        row["sweep"] = "control"
        rows.append(row)
    if not quick:
        n = sizes[0] if args.small else 64
        for skew in (0.25, 1.5) if "skew" in want else ():
            for mode, s in modes:
                row = run(case, mode, s, n, workload_for(n, base.replace(skew=skew)), args)
                row["sweep"] = "skew"
                rows.append(row)
        # Generation ~ training on separate pools: 16 rollout, 7 trainer devices, rollout
        # batches of 8 groups (64 sequences, 8 waves per iteration) and trainer micro-batches of
        # 2 groups, so training can stream close behind generation (the paper streams groups).
        eq, waves = Layout(rollout=16, reward=1, reference=2, trainer=7), 8
        if args.small:
            eq, waves = Layout(rollout=4, reward=1, reference=1, trainer=2), 2
        w = base.replace(
            prompts_per_iteration=waves * eq.rollout * 8,
            groups_per_rollout_batch=8,
            rows_per_reward_batch=32,
            rows_per_reference_batch=32,
            rows_per_trainer_batch=16,
            skew=0.5,
        )
        for label, mode, extra in (
            (
                ("sync", "sync", {"layout": Layout(devices=eq.workers)}),
                ("sync-split", "sync-split", {"layout": eq}),
                ("periodic", "periodic", {"layout": eq}),
            )
            if "equal" in want
            else ()
        ):
            if label not in args.modes:
                continue
            row = run(case, mode, 0, eq.workers, w, args, **extra)
            row["sweep"] = "equal"
            rows.append(row)
        for on in (True, False) if "balance" in want and "async" in args.modes else ():
            row = run(balance_case, args, on, base)
            row["sweep"] = "balance"
            rows.append(row)
    return {"cases": rows}


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    # Every case whose bound is meaningful: all sweeps but ``balance`` (its bound assumes
    # identical devices, and one of its reference devices is 3x slower on purpose).
    bounded = [r for r in rows if r["sweep"] != "balance"]
    small = [r for r in bounded if r["workers"] <= 64]
    large = [r for r in bounded if r["workers"] >= 256]
    out: dict[str, Any] = {
        "min_efficiency_up_to_64": min(r["efficiency"] for r in small) if small else None,
        "min_efficiency_at_256": min(r["efficiency"] for r in large) if large else None,
        # which case set each minimum (mode, sweep, workers): where to look first
        "min_efficiency_cases": {
            name: f"{m['label']} {m['sweep']} n={m['workers']} skew={m['skew']:g}"
            for name, group in (("up_to_64", small), ("at_256", large))
            if group
            for m in [min(group, key=lambda r: r["efficiency"])]
        },
    }
    eq = {r["label"]: r for r in rows if r["sweep"] == "equal"}
    for other in ("sync", "sync-split"):
        if not {other, "periodic"} <= eq.keys():
            continue
        name = "sync" if other == "sync" else "sync_split"
        out[f"periodic_over_{name}"] = eq["periodic"]["throughput"] / eq[other]["throughput"]
        # The same ratio of the lower bounds, and of the zero-overhead reference schedules:
        # what the schedules themselves allow, to read the measured ratio against.
        out[f"periodic_over_{name}_bound"] = eq["periodic"]["bound"] / eq[other]["bound"]
        if all("reference_seconds" in eq[m] for m in (other, "periodic")):
            out[f"periodic_over_{name}_reference"] = (
                eq[other]["reference_seconds"] / eq["periodic"]["reference_seconds"])
    skew = [r for r in rows if r["workers"] == 64 and r["sweep"] in ("skew", "scaling")]
    by = {(r["label"], r["skew"]): r["throughput"] for r in skew}
    out["async1_over_periodic_by_skew"] = {
        str(k): by[("async(s=1)", k)] / by[("periodic", k)]
        for (label, k) in by
        if label == "periodic" and ("async(s=1)", k) in by
    }
    control = [r for r in rows if r["sweep"] == "control"]
    if control:
        out["control_cpu_ms_per_micro_batch"] = {
            str(r["workers"]): {
                "controller": r["controller_cpu_ms_per_micro_batch"],
                "coordinator": r["coordinator_cpu_ms_per_micro_batch"],
            }
            for r in control
        }
    bal = {r["balancer"]: r for r in rows if r["sweep"] == "balance"}
    if bal:
        out["reference_utilisation_spread"] = {k: v["reference_spread"] for k, v in bal.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="streamflow bench simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--quick", action="store_true", help="a tiny sweep (tests)")
    parser.add_argument(
        "--small",
        action="store_true",
        help="every sweep's cases at reduced size (tests: 8 workers, smaller fixed layouts)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=None,
        help="sizes of the scaling sweep (default 8 32 64 128 256; quick: 8)",
    )
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="simulated seconds per real second (default: auto_time_scale)",
    )
    parser.add_argument("--hosts", type=int, default=2, help="stage host processes")
    parser.add_argument(
        "--sweeps",
        nargs="+",
        default=list(SWEEPS),
        choices=SWEEPS,
        help="which sweeps to run (default: all)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=list(MODE_NAMES),
        choices=MODE_NAMES,
        help="which modes to run (default: all; async = s=1 and s=2)",
    )
    parser.add_argument("--plots", default=str(ROOT / "docs" / "perf"))
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="a line per case as it ends")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the tables as Markdown (docs/performance.md) instead",
    )
    args = parser.parse_args(argv)
    if args.workers is None:
        args.workers = [8] if args.quick or args.small else [8, 64, 256]
    if args.iterations is None:
        args.iterations = 2
    if (args.quick or args.small) and args.time_scale is None:
        args.time_scale = 100.0  # a smoke test of the JSON, not a measurement
    if min(args.workers) < 4:
        parser.error("--workers: each size must be >= 4 (one device per role)")
    result = sweep(args)
    rows = result["cases"]
    result["targets"] = targets(rows)
    result["time_scale"] = args.time_scale
    if not args.no_plots and not args.quick and not args.small:
        from bench._simulate_plots import draw

        draw(rows, Path(args.plots))
    if args.markdown:
        from bench._simulate_plots import markdown

        print(markdown(rows, result["targets"]))
    elif not args.json:
        from bench._simulate_plots import print_tables

        print_tables(rows, result["targets"])
    for r in rows:
        r.pop("_result", None)
    print(json.dumps(result, default=_jsonable))
    return 0


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
