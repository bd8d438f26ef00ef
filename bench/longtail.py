"""``streamflow bench longtail``: partial rollout against long-tailed response lengths.

One workload whose response lengths have a long tail (a few responses >= 10x the median), run as
``sync``, ``async`` and ``async`` + ``rollout.partial`` (a generation still running at a newer
policy version is cut, written, and resumed by whichever rollout worker claims it next), on two
engines in the same invocation:

- ``sim``: the simulated cluster (``bench.sim.cluster.run_sim``: the real controller, store and
  worker code; devices priced by the ``7b-1acc`` cost model) with 64 simulated devices
  (``bench.simulate.layout_for``: rollout 32, trainer 20, reference 8, reward 4; ``sync``: 64
  colocated), one batch of 8 groups x 8 (64 rows) per rollout device per iteration, 16
  iterations, ``max_staleness`` 4. Lengths: lognormal (median 400, sigma 0.25) with
  ``simulated.tail_fraction`` 1% of responses replaced by 20x the median (capped at 16384), so
  about half the batches hold a tail. Throughput: samples per simulated second over the second
  half of the run (``steady_throughput``: the pipeline full), and over the whole run
  (``samples_per_s_whole_run``, its fill included: nothing is cut before the first publication,
  and while the pipeline fills the tails' latency, not device time, decides). Time scale 5: every real millisecond
  a worker spends outside a device hold (the trainer's own Python over 2048 rows per iteration,
  on this 2-core machine shared by 64 simulated workers) counts ``time_scale`` simulated ones.
- ``real``: this machine's torch engine on the built-in tiny model, random-initialised (no warm
  start) with its output layer zeroed (``tail_model``): every step samples uniformly from the
  vocabulary, so a response ends at the end-of-sequence token with probability 1/V per step, a
  geometric length (V = 21: median about 15, the longest of a thousand rows about 10x that,
  ``max_new_tokens`` 320). Rewards are ``exact_match`` (a uniform random response all but never
  is the answer): all-zero advantages leave the weights as they are, so every iteration faces the
  same lengths. ``max_staleness`` 2, 16 prompts x 8 per iteration, 12 iterations, 4 groups per
  rollout claim. Throughput: samples per second (wall).

Without partial, a batch holding one tail keeps its device decoding one or two sequences alone
(and holds back that batch's finished rows); with partial, each publication cuts the tails, the
finished rows go on, and the cut rows of many devices are resumed together (one ``rollout.k``
claim), at a small marginal cost per sequence. ``partial_speedup = async_partial / async`` per
engine; the real engine's is the median over ``--repeats`` paired runs (this machine is noisy).

``--quick``: a small version of both (8 simulated devices, 2 iterations, time scale 100; 1 real
repeat of 2 iterations) for the tests: a smoke test of the JSON, not a measurement.

Prints a table, then one JSON line: ``{"sim": {"sync", "async", "async_partial",
"partial_speedup", "staleness", "workload", ...}, "real": {...}, "trace": {...} (only when
``run.trace`` exists), "targets": {...}, "command": ...}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.sim.cluster import SimConfig, run_sim
from bench.simulate import layout_for
from workers.engines.sim_cost import Workload

ROOT = Path(__file__).resolve().parents[1]
CASES = ("sync", "async", "async_partial")
TARGETS = {"sim_partial_speedup": 1.25, "real_partial_speedup_median": 1.0}


# One scoring forward per trainer claim: split into forwards of 4096 tokens (the CPU default), a
# 128-row claim would be priced as many 8-row forwards, each spread over the 20 trainer devices
# and so held for its longest row alone.
SIM_OVERRIDES = ("trainer.tokens_per_forward=0",)


def sim_workload(args: argparse.Namespace) -> Workload:
    """``--sim-batches`` batches of ``--sim-groups-per-batch`` groups of 8 per rollout device per
    iteration."""
    rollout = layout_for(args.sim_devices, "async").rollout
    return Workload(
        prompts_per_iteration=rollout * args.sim_groups_per_batch * args.sim_batches,
        group_size=8, prompt_tokens=256, median_response_tokens=400, skew=0.25,
        tail_fraction=args.tail_fraction, tail_factor=args.tail_factor,
        max_response_tokens=args.sim_max_tokens, groups_per_rollout_batch=args.sim_groups_per_batch,
        rows_per_reward_batch=256, rows_per_reference_batch=256, rows_per_trainer_batch=128,
        iterations=args.sim_iterations, seed=args.seed,
    )


def sim_case(case: str, w: Workload, args: argparse.Namespace) -> dict[str, Any]:
    mode = "sync" if case == "sync" else "async"
    cfg = SimConfig(mode=mode, staleness=args.staleness, layout=layout_for(args.sim_devices, mode),
                    workload=w, time_scale=args.time_scale, partial=case == "async_partial",
                    overrides=SIM_OVERRIDES)
    t = time.monotonic()
    r = run_sim(cfg)
    return {"samples_per_s": steady_throughput(r.holds, w),
            "samples_per_s_whole_run": r.throughput, "sim_seconds": r.sim_seconds,
            "wall_real_s": time.monotonic() - t, "samples": r.samples,
            "utilisation": r.utilisation}


def steady_throughput(holds: list[list[Any]], w: Workload) -> float:
    """Samples per simulated second over the run's second half: from the end of optimizer step
    ``h = iterations // 2 - 1`` to the end of the last, ``iterations - 1 - h`` iterations' samples.
    Leaves out the start, where every iteration up to the staleness bound generates before the
    first publication (nothing is cut before it)."""
    ends = sorted(h[4] for h in holds if h[1] == "trainer" and h[2] == "step")
    half = w.iterations // 2 - 1
    if len(ends) < 2 or half < 0 or ends[-1] <= ends[half]:
        return float("nan")
    return (len(ends) - 1 - half) * w.rows_per_iteration / (ends[-1] - ends[half])


def run_sim_cases(args: argparse.Namespace) -> dict[str, Any]:
    w = sim_workload(args)
    out: dict[str, Any] = {c: sim_case(c, w, args) for c in CASES}
    out["partial_speedup"] = (out["async_partial"]["samples_per_s"]
                              / out["async"]["samples_per_s"])
    out["partial_speedup_whole_run"] = (out["async_partial"]["samples_per_s_whole_run"]
                                        / out["async"]["samples_per_s_whole_run"])
    out["throughput_unit"] = "samples per simulated second, second half of the run"
    out["staleness"] = args.staleness
    out["devices"] = args.sim_devices
    out["time_scale"] = args.time_scale
    out["workload"] = {k: getattr(w, k) for k in (
        "prompts_per_iteration", "group_size", "median_response_tokens", "skew", "tail_fraction",
        "tail_factor", "max_response_tokens", "iterations", "seed")}
    return out


def tail_model(path: Path, max_positions: int) -> Path:
    """configs/tiny.yaml's model (random init, no warm start) with its output layer zeroed (tied
    to the embeddings: every input embeds to zeros too): every next-token distribution is
    uniform over the V-token vocabulary, so a response ends at <eos> with probability 1/V per
    step: geometric lengths. The forward's work is the model's own."""
    import torch

    from workers.models.local import build_tiny_model, save_model
    from workers.models.spec import TinyModelSpec
    from workers.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    spec = TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         intermediate_size=64, max_position_embeddings=max_positions)
    model = build_tiny_model(spec, tok)
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
    return save_model(model, tok, path)


def real_overrides(args: argparse.Namespace, case: str, model: Path, out: Path) -> list[str]:
    mode = "sync" if case == "sync" else "async"
    return [
        f"run.mode={mode}", f"run.iterations={args.real_iterations}", "run.eval_every=0",
        "run.progress=false", "run.log_level=WARNING", "run.plots=false",
        f"run.output_dir={out}", f"run.seed={args.seed}", f"model.path={model}",
        "model.warmstart_steps=0", f"data.prompts_per_iteration={args.real_prompts}",
        "data.group_size=8", f"data.seed={args.seed}",
        f"rollout.max_new_tokens={args.real_max_new_tokens}",
        f"rollout.groups_per_claim={args.real_groups_per_claim}",
        "reward.fn=exact_match", "trainer.kl_coef=0", "trainer.rows_per_claim=32",
        f"run.max_staleness={args.real_staleness}",
        *(["rollout.partial=true"] if case == "async_partial" else []),
    ]


def real_case(args: argparse.Namespace, case: str, model: Path, out: Path,
              extra: tuple[str, ...] = ()) -> dict[str, Any]:
    from streamflow.config import load_config
    from streamflow.controller import run

    run_out = out / f"{case}-{len(list(out.glob(case + '-*')))}"
    cfg = load_config(ROOT / "configs" / "tiny.yaml",
                      [*real_overrides(args, case, model, run_out), *extra])
    s = run(cfg)
    if s.status != "ok":
        raise RuntimeError(f"bench longtail: the real {case} run ended {s.status}: {s.error}")
    metrics = [json.loads(line) for p in run_out.rglob("metrics.jsonl")
               for line in p.read_text().splitlines() if line.strip()]
    trace = [f for d in run_out.rglob("trace") if d.is_dir() for f in d.rglob("*") if f.is_file()]
    return {"samples_per_s": s.samples_per_second, "tokens_per_s": s.tokens_per_second,
            "wall_s": s.wall_seconds, "s_per_iteration": s.wall_seconds / max(s.iterations, 1),
            "samples": s.samples, "generated_tokens": s.generated_tokens,
            "partial_resumes": sum(int(m.get("partial_resumes") or 0) for m in metrics),
            "trace_bytes": sum(f.stat().st_size for f in trace)}


def has_trace_key() -> bool:
    """Whether this build has ``run.trace`` (the row trace)."""
    from streamflow.config.sections import RunSection

    return "trace" in {f.name for f in dataclasses.fields(RunSection)}


def run_real_cases(args: argparse.Namespace) -> dict[str, Any]:
    """``sync`` once, then ``--repeats`` rounds of ``async`` and ``async_partial`` (and, with the
    row trace, ``async_partial`` with ``run.trace=false``), alternating so that a slow spell of
    this shared machine hits every case; each case's figures are medians over its runs."""
    trace = has_trace_key()
    with tempfile.TemporaryDirectory(prefix="sf-longtail-") as tmp:
        out = Path(tmp)
        model = tail_model(out / "model", max_positions=64 + args.real_max_new_tokens)
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in (*CASES, "trace_off")}
        runs["sync"].append(real_case(args, "sync", model, out))
        for _ in range(args.repeats):
            for case in ("async", "async_partial"):
                runs[case].append(real_case(args, case, model, out))
            if trace:
                runs["trace_off"].append(real_case(args, "async_partial", model, out,
                                                   ("run.trace=false",)))
    res: dict[str, Any] = {}
    for case in CASES:
        rs = runs[case]
        res[case] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        res[case]["samples_per_s_runs"] = [r["samples_per_s"] for r in rs]
    ratios = [p["samples_per_s"] / a["samples_per_s"]
              for a, p in zip(runs["async"], runs["async_partial"], strict=True)]
    res["partial_speedup"] = statistics.median(ratios)
    res["partial_speedup_runs"] = ratios
    res["throughput_unit"] = "samples per second (wall)"
    res["staleness"] = args.real_staleness
    res["repeats"] = args.repeats
    res["workload"] = {
        "model": "configs/tiny.yaml's (random init, output layer zeroed: uniform next token)",
        "prompts_per_iteration": args.real_prompts, "group_size": 8,
        "max_new_tokens": args.real_max_new_tokens, "iterations": args.real_iterations,
        "lengths": "geometric: <eos> with probability 1/V per step"}
    if trace:
        on, off = runs["async_partial"], runs["trace_off"]
        res["trace"] = {
            "case": "real async_partial",
            "trace_bytes_per_row": statistics.median(r["trace_bytes"] / r["samples"] for r in on),
            "s_per_iteration_trace_on": statistics.median(r["s_per_iteration"] for r in on),
            "s_per_iteration_trace_off": statistics.median(r["s_per_iteration"] for r in off),
        }
    return res


def _table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Long tails: partial rollout (one invocation)")
    for col in ("engine", "unit", *CASES, "partial_speedup", "s"):
        table.add_column(col)
    for engine in ("sim", "real"):
        r = result.get(engine)
        if r is None:
            continue
        table.add_row(engine, r["throughput_unit"],
                      *(f"{r[c]['samples_per_s']:.2f}" for c in CASES),
                      f"{r['partial_speedup']:.2f}", str(r["staleness"]))
    Console().print(table)
    if "trace" in result:
        Console().print(f"trace: {result['trace']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamflow bench longtail", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--quick", action="store_true", help="a small version (tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--staleness", type=int, default=4, help="run.max_staleness (async)")
    parser.add_argument("--sim-devices", type=int, default=64)
    parser.add_argument("--sim-iterations", type=int, default=16)
    parser.add_argument("--sim-groups-per-batch", type=int, default=8)
    parser.add_argument("--sim-batches", type=int, default=1,
                        help="rollout batches per rollout device per iteration")
    parser.add_argument("--tail-fraction", type=float, default=0.01)
    parser.add_argument("--tail-factor", type=float, default=20.0)
    parser.add_argument("--sim-max-tokens", type=int, default=16384,
                        help="rollout.max_new_tokens of the simulated cluster")
    parser.add_argument("--time-scale", type=float, default=5.0,
                        help="simulated seconds per real second")
    parser.add_argument("--real-iterations", type=int, default=12)
    parser.add_argument("--real-prompts", type=int, default=16, help="prompts per iteration")
    parser.add_argument("--real-groups-per-claim", type=int, default=4)
    parser.add_argument("--real-max-new-tokens", type=int, default=320)
    parser.add_argument("--real-staleness", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="paired real async runs")
    parser.add_argument("--skip-real", action="store_true", help="the simulated cluster only")
    parser.add_argument("--skip-sim", action="store_true", help="the real engine only")
    args = parser.parse_args(argv)
    if args.quick:
        args.sim_devices, args.sim_iterations, args.sim_groups_per_batch = 8, 2, 1
        args.sim_batches = 1
        args.real_iterations, args.real_prompts, args.repeats = 2, 4, 1
        args.time_scale = 100.0  # a smoke test of the report, not a measurement
    result: dict[str, Any] = {"command": "streamflow bench longtail " + " ".join(
        argv if argv is not None else sys.argv[1:])}
    if not args.skip_sim:
        result["sim"] = run_sim_cases(args)
    if not args.skip_real:
        result["real"] = run_real_cases(args)
    if "real" in result and "trace" in result["real"]:
        result["trace"] = result["real"].pop("trace")
    else:
        result["trace_note"] = "no run.trace key in this build: the trace block is left out"
    result["targets"] = TARGETS
    if not args.json:
        _table(result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
