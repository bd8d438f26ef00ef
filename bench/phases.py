"""Benchmark: StreamFlow's phases and modes against a plain Hugging Face GRPO loop (workload G1).

Workload G1 (``bench._g1``): a 4.2 M-parameter Qwen2 with a locally trained 1024-token
byte-level BPE vocabulary, 2-digit sums ``a+b=``, 16 prompts x G=8 responses x 64 generated tokens
per iteration (no eos: every response runs to 64 tokens on both sides), KL coefficient 0.04,
``--threads`` (default 2) threads in all. Measured in one invocation:

- phases, side by side in this process and interleaved iteration by iteration (load from other
  processes hits both sides alike): StreamFlow's sync iteration through the controller's own
  colocated loop (``streamflow.controller.ColocatedLoop``, what ``streamflow run`` runs in
  ``sync``: torch rollout engine, reference stage, torch trainer engine over an embedded store,
  each stage claiming the whole batch; ``StreamFlowSync`` below times its iterations one by one)
  against the plain loop (``_plain``: ``generate``
  with SDPA, reference forward, forward/backward + AdamW). Per phase (generation, reference,
  train step) the MEDIAN of ``--iterations`` iterations after one warm-up iteration;
- modes: real ``streamflow run`` jobs (``sync``, ``periodic``, ``async``) over the G1 model
  directory, ``--iterations`` + 2 iterations each, each mode in the layout that measures best for
  it (``_g1.run_config``: ``sync`` all threads in one process, whole-iteration claims; the
  streaming modes share them by phase among the rollout worker, the reference worker and the
  trainer). Steady-state
  seconds per iteration come from the run's timeline (``timeline.jsonl``, the trainer's step
  spans): from the end of the first optimizer step to the end of the last but one, divided by
  ``--iterations``, so start-up, pipeline fill, the drain (a last iteration generated ahead) and
  the final checkpoint are left out;
- with ``--threads`` of 2 or more, ``periodic`` and ``async`` once more with fixed threads
  (``run.host_threads=0``, half the budget each for the rollout worker and the trainer), so the
  shared default is measured against the layout it replaced (``"fixed_threads"``: seconds per
  iteration and ``shared_speedup`` = fixed ÷ shared seconds, > 1: sharing is faster);
- the plain loop's seconds per iteration: the loop alone in a process of its own
  (``python -m bench._plain``), measured like the modes (a fresh process, its first iteration
  left out, the mean of ``--iterations``), run before the modes in odd rounds and after them in
  even ones; the median whole iteration of the phase measurement is printed beside it
  (``plain_in_process_seconds_per_iteration``).

``--rounds`` repeats all of it; every figure is then the median over rounds and each round's
headlines are listed (``"rounds"``): on a shared machine one round is an anecdote.

Ratios are ``plain / StreamFlow`` (> 1: StreamFlow faster). Targets, printed, not asserted: every
phase >= 1.0x, best mode >= 1.3x the plain loop, best streaming mode >= 1.0x sync.

Output: a table, then one JSON line (with ``--json`` the table goes to stderr and stdout holds only
the JSON line): ``{"phases": {NAME: {"streamflow_s", "baseline_s", "ratio"}}, "modes": {MODE:
{"seconds_per_iteration", "ratio_to_plain"}}, "plain_seconds_per_iteration", "worst_phase_ratio",
"best_ratio_to_plain", "best_streaming_ratio_to_sync",
"plain_in_process_seconds_per_iteration", "fixed_threads"}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench._g1 import G1, KL_COEF, QUICK, G1Shape, build_model_dir, run_config

PHASES = ("generation", "reference", "train_step")
MODES = ("sync", "periodic", "async")
FIXED_MODES = ("periodic", "async")  # also run with fixed threads when --threads >= 2
TARGET_PHASE, TARGET_PLAIN, TARGET_STREAMING = 1.0, 1.3, 1.0
HEADLINES = ("worst_phase_ratio", "best_ratio_to_plain", "best_streaming_ratio_to_sync")


@dataclass
class StreamFlowTimes:
    """Seconds of one sync iteration, per phase (weight movement taken out) and in all."""

    generation: float
    reward: float
    reference: float
    train_step: float
    weight_sync: float  # rollout load + trainer publish
    total: float
    reward_mean: float


class StreamFlowSync:
    """The controller's colocated loop over ``cfg`` (which must give the reference its own
    worker), one timed iteration at a time. Weight movement is not part of a phase: the rollout's
    load of the new policy (``WeightSyncReport.seconds``) is taken out of generation and the
    trainer's publish (``StepReport.publish_seconds``) out of the train step."""

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        from streamflow.controller import ColocatedLoop
        from streamflow.plan import build_plan
        from workers.runtime.events import EventSender

        self.plan = plan = build_plan(cfg, run_dir)
        if plan.reference is None:
            plan.cleanup()
            raise ValueError("bench phases: the StreamFlow side needs reference.placement=worker "
                             "and trainer.kl_coef > 0 (the reference forward is a phase)")
        self.sent: list[Any] = []  # the reports of the iteration being timed
        # the run's own row trace (run.trace), as `streamflow run` sync sends it
        self.loop = ColocatedLoop(plan, EventSender(None, trace=cfg.run.trace), self.sent.extend,
                                  persist=False)

    def iteration(self, k: int) -> StreamFlowTimes:
        from workers.runtime.events import StepReport, WeightSyncReport

        self.sent.clear()
        sec = self.loop.iteration(k)
        loads = sum(r.seconds for r in self.sent if isinstance(r, WeightSyncReport))
        steps = [r for r in self.sent if isinstance(r, StepReport)]
        if len(steps) != 1:
            raise RuntimeError(f"bench phases: iteration {k} gave {len(steps)} trainer steps")
        publish = steps[0].publish_seconds
        return StreamFlowTimes(
            generation=sec.rollout - loads, reward=sec.reward, reference=sec.reference,
            train_step=sec.trainer - publish, weight_sync=loads + publish, total=sec.total,
            reward_mean=steps[0].reward_mean)

    def close(self) -> None:
        try:
            self.loop.__exit__(None, None, None)
        finally:
            self.plan.cleanup()


def measure_phases(
    shape: G1Shape, model_dir: Path, work: Path, *, iterations: int, threads: int, device: str
) -> tuple[dict[str, dict[str, float]], float, dict[str, float]]:
    """Phases of both sides, interleaved: (phases, plain seconds per iteration, extras)."""
    import torch

    from bench._plain import PlainGRPO, settings_of
    from streamflow.config import config_from_dict

    torch.set_num_threads(threads)
    # Far more iterations than are run: the trainer checkpoints at its last one, never here.
    tree = run_config(shape, model_dir, work / "runs", mode="sync", iterations=10_000,
                      threads=threads, device=device)
    cfg = config_from_dict(tree)
    sf = StreamFlowSync(cfg, work / "runs" / "phases")
    plain = PlainGRPO(model_dir, settings_of(cfg), device=device)
    sf_runs, plain_runs = [], []
    try:
        for k in range(iterations + 1):  # iteration 0 is the warm-up of both sides
            sf_times = sf.iteration(k)
            plain_times = plain.iteration(sf.plan.problems(k))
            _progress(f"phases: iteration {k} StreamFlow {sf_times.total:.2f} s, plain "
                      f"{plain_times.total:.2f} s{' (warm-up)' if k == 0 else ''}")
            if k > 0:
                sf_runs.append(sf_times)
                plain_runs.append(plain_times)
    finally:
        sf.close()

    def median(runs: list[Any], name: str) -> float:
        return statistics.median(getattr(r, name) for r in runs)

    phases = {name: _pair(median(sf_runs, name), median(plain_runs, name)) for name in PHASES}
    extras = {
        "streamflow_reward_s": median(sf_runs, "reward"),
        "baseline_reward_s": median(plain_runs, "reward"),
        "streamflow_weight_sync_s": median(sf_runs, "weight_sync"),
        "streamflow_sync_iteration_s": median(sf_runs, "total"),
    }
    return phases, median(plain_runs, "total"), extras


def _pair(streamflow_s: float, baseline_s: float) -> dict[str, float]:
    sf, base = round(streamflow_s, 6), round(baseline_s, 6)
    return {"streamflow_s": sf, "baseline_s": base, "ratio": round(base / sf, 4)}


def run_mode(
    shape: G1Shape, model_dir: Path, work: Path, *, mode: str, iterations: int, threads: int,
    device: str, shared_threads: bool = True,
) -> float:
    """Steady-state seconds per iteration of a real ``streamflow run`` job of ``mode``."""
    from streamflow.rundir import RunDir

    label = mode if shared_threads else f"{mode}-fixed-threads"
    tree, config = _write_config(shape, model_dir, work, mode=mode, iterations=iterations + 2,
                                 threads=threads, device=device, label=label,
                                 shared_threads=shared_threads)
    _child(["-m", "streamflow", "run", str(config)], f"streamflow run ({label})")
    run_dir = RunDir(tree["run"]["output_dir"].replace("{name}", tree["run"]["name"]))
    # The trainer's own clock: the end of each optimizer step (its step span, rows == 0). The
    # iteration records' timestamps are taken when the controller gets around to the report, and
    # the last one also waits for the final checkpoint. Steady state: from the end of the first
    # step (start-up and pipeline fill before it) to the end of the last but one (in the
    # streaming modes the last iteration is the drain: its rows were generated ahead and the
    # trainer has the host to itself).
    stamps = sorted(s.end for s in run_dir.read_spans() if s.stage == "trainer" and s.rows == 0)
    if len(stamps) != iterations + 2:
        raise RuntimeError(f"streamflow run ({mode}): {len(stamps)} trainer steps in its "
                           f"timeline, expected {iterations + 2}")
    seconds = (stamps[-2] - stamps[0]) / iterations
    _progress(f"mode {label}: {seconds:.2f} s per iteration")
    return seconds


def run_plain(
    shape: G1Shape, model_dir: Path, work: Path, *, iterations: int, threads: int, device: str,
) -> float:
    """Seconds per iteration of the plain loop alone in a process of its own (``bench._plain``),
    measured like a mode: a fresh process, the start left out (one warm-up iteration), the mean
    of ``iterations`` iterations."""
    _, config = _write_config(shape, model_dir, work, mode="sync", iterations=iterations,
                              threads=threads, device=device, label="plain")
    out = _child(["-m", "bench._plain", str(config), "--iterations", str(iterations),
                  "--threads", str(threads), "--device", device], "the plain loop")
    seconds = float(json.loads(out.strip().splitlines()[-1])["seconds_per_iteration"])
    _progress(f"plain loop (own process): {seconds:.2f} s per iteration")
    return seconds


def _write_config(
    shape: G1Shape, model_dir: Path, work: Path, *, mode: str, iterations: int, threads: int,
    device: str, label: str | None = None, shared_threads: bool = True,
) -> tuple[dict[str, Any], Path]:
    """The run config tree of ``mode`` and its YAML file ``LABEL.yaml`` (label: the mode), the
    previous round's run directory of that label removed."""
    label = label or mode
    tree = run_config(shape, model_dir, work / "runs", mode=mode, iterations=iterations,
                      threads=threads, device=device, shared_threads=shared_threads)
    tree["run"]["name"] = f"g1-{label}"
    shutil.rmtree(tree["run"]["output_dir"].replace("{name}", tree["run"]["name"]),
                  ignore_errors=True)  # the previous round's run of this label
    config = work / f"{label}.yaml"
    config.write_text(yaml.safe_dump(tree, sort_keys=False))
    return tree, config


def _child(args: list[str], what: str) -> str:
    """Run ``python ARGS`` on this checkout's packages; its stdout, or a RuntimeError."""
    root = str(Path(__file__).resolve().parents[1])  # this checkout's streamflow, not another
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=3600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed with exit status {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout)[-2000:]}")
    return proc.stdout


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def summarize(
    phases: dict[str, dict[str, float]], modes: dict[str, float], plain_s: float
) -> dict[str, Any]:
    """The JSON object: phases as measured, each mode's ratio to the plain loop, the headlines."""
    plain = round(plain_s, 6)
    mode_out = {m: {"seconds_per_iteration": round(s, 6),
                    "ratio_to_plain": round(plain / round(s, 6), 4)} for m, s in modes.items()}
    sync = mode_out["sync"]["seconds_per_iteration"]
    streaming = min(mode_out[m]["seconds_per_iteration"] for m in ("periodic", "async"))
    return {
        "phases": phases,
        "modes": mode_out,
        "plain_seconds_per_iteration": plain,
        "worst_phase_ratio": min(p["ratio"] for p in phases.values()),
        "best_ratio_to_plain": max(m["ratio_to_plain"] for m in mode_out.values()),
        "best_streaming_ratio_to_sync": round(sync / streaming, 4),
    }


def combine(
    rounds: list[tuple[dict[str, dict[str, float]], dict[str, float], float, dict[str, float]]],
) -> tuple[dict[str, Any], dict[str, float]]:
    """One report from the rounds: each figure the median over rounds (ratios recomputed from
    the medians); with more than one round, each round's own summary under ``"rounds"``."""
    def med(values: list[float]) -> float:
        return statistics.median(values)

    phases = {name: _pair(med([r[0][name]["streamflow_s"] for r in rounds]),
                          med([r[0][name]["baseline_s"] for r in rounds])) for name in PHASES}
    modes = {m: med([r[1][m] for r in rounds]) for m in MODES}
    report = summarize(phases, modes, med([r[2] for r in rounds]))
    extras = {k: med([r[3][k] for r in rounds]) for k in rounds[0][3]}
    if len(rounds) > 1:  # each round's headlines: the spread behind the medians
        report["rounds"] = []
        for phases_r, modes_r, plain_r, _ in rounds:
            one = summarize(phases_r, modes_r, plain_r)
            report["rounds"].append({
                "plain_seconds_per_iteration": one["plain_seconds_per_iteration"],
                "modes": {m: one["modes"][m]["seconds_per_iteration"] for m in MODES},
                **{k: one[k] for k in HEADLINES},
            })
    return report, extras


def fixed_threads(report: dict[str, Any], extras: dict[str, float]) -> dict[str, Any] | None:
    """The streaming modes with fixed threads beside the shared default (None: not measured)."""
    if f"{FIXED_MODES[0]}_fixed_s" not in extras:
        return None
    out = {}
    for m in FIXED_MODES:
        fixed = round(extras[f"{m}_fixed_s"], 6)
        shared = report["modes"][m]["seconds_per_iteration"]
        out[m] = {"seconds_per_iteration": fixed, "shared_speedup": round(fixed / shared, 4)}
    return out


def _mark(ok: bool) -> str:
    return "met" if ok else "NOT met"


def table(report: dict[str, Any], extras: dict[str, float], header: str) -> str:
    lines = [header, f"{'phase':<12} {'StreamFlow s':>12} {'plain HF s':>11} {'ratio':>6}"]
    for name, p in report["phases"].items():
        lines.append(f"{name:<12} {p['streamflow_s']:>12.4f} {p['baseline_s']:>11.4f} "
                     f"{p['ratio']:>6.2f}")
    lines.append(f"(not phases: reward {extras['streamflow_reward_s']:.4f} / "
                 f"{extras['baseline_reward_s']:.4f} s; StreamFlow weight load + publish "
                 f"{extras['streamflow_weight_sync_s']:.4f} s; in-process iterations: sync "
                 f"{extras['streamflow_sync_iteration_s']:.4f} s, plain loop "
                 f"{extras['plain_in_process_s']:.4f} s)")
    lines.append(f"{'mode':<12} {'s/iteration':>12} {'plain/mode':>11}")
    for name, m in report["modes"].items():
        lines.append(f"{name:<12} {m['seconds_per_iteration']:>12.4f} {m['ratio_to_plain']:>11.2f}")
    lines.append(f"{'plain loop':<12} {report['plain_seconds_per_iteration']:>12.4f}  "
                 "(alone in its own process)")
    for name, m in (report.get("fixed_threads") or {}).items():
        lines.append(f"{name + ' fixed':<12} {m['seconds_per_iteration']:>12.4f}  (fixed threads; "
                     f"shared by phase is {m['shared_speedup']:.2f}x faster)")
    w, b, s = (report[k] for k in HEADLINES)
    lines.append(f"target every phase >= {TARGET_PHASE}x: worst {w:.2f}x "
                 f"({_mark(w >= TARGET_PHASE)})")
    lines.append(f"target best mode >= {TARGET_PLAIN}x the plain loop: {b:.2f}x "
                 f"({_mark(b >= TARGET_PLAIN)})")
    lines.append(f"target best streaming mode >= {TARGET_STREAMING}x sync: {s:.2f}x "
                 f"({_mark(s >= TARGET_STREAMING)})")
    return "\n".join(lines)


def check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace, *,
                   quick_iterations: int) -> None:
    """The checks of ``--iterations`` (default 4, ``quick_iterations`` with --quick),
    ``--threads``, ``--rounds`` and ``--device`` that bench phases and bench overhead share."""
    if args.iterations is None:
        args.iterations = quick_iterations if args.quick else 4
    if args.iterations < 1 or args.threads < 1 or args.rounds < 1:
        parser.error("--iterations, --threads and --rounds must be >= 1")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        parser.error(f"--device must be cpu or cuda[:N], got {args.device!r}")


def main(argv: list[str]) -> int:
    """Run the benchmark; prints the table then one JSON line. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="streamflow bench phases",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=None,
                        help="timed iterations per side and per mode (default 4; --quick 2)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat phases + modes this many times; figures are the medians "
                             "over rounds, each round's ratios are listed (default 1)")
    parser.add_argument("--threads", type=int, default=2, help="threads in all (default 2)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (for tests)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--json", action="store_true", help="stdout holds only the JSON line")
    args = parser.parse_args(argv)
    check_run_args(parser, args, quick_iterations=2)
    shape = QUICK if args.quick else G1
    try:  # a --device this build cannot place the roles on fails here, before any work
        run_config(shape, Path("g1"), Path("."), mode="sync", iterations=1, threads=args.threads,
                   device=args.device)
    except ValueError as err:
        parser.error(str(err))
    work = Path(tempfile.mkdtemp(prefix="streamflow-bench-phases-"))
    # With --json, whatever the libraries print while we measure (deepspeed's accelerator notice,
    # pulled in by transformers, logs to stdout) goes to stderr: stdout keeps the JSON line.
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with quiet:
        try:
            model_dir = build_model_dir(work / "g1-model", shape)
            started = time.perf_counter()
            rounds = []
            for r in range(args.rounds):
                _progress(f"round {r + 1} of {args.rounds}")
                phases, in_process_s, extras = measure_phases(
                    shape, model_dir, work, iterations=args.iterations, threads=args.threads,
                    device=args.device)
                extras["plain_in_process_s"] = in_process_s
                # The plain loop alone, like the modes; first in one round, last in the next, so
                # the host's drift over a round weighs on both sides alike.
                kw = dict(iterations=args.iterations, threads=args.threads, device=args.device)
                plain_s = 0.0
                if r % 2 == 0:
                    plain_s = run_plain(shape, model_dir, work, **kw)
                modes = {m: run_mode(shape, model_dir, work, mode=m, **kw) for m in MODES}
                if args.threads >= 2:  # the default's shared threads against fixed ones
                    for m in FIXED_MODES:
                        extras[f"{m}_fixed_s"] = run_mode(shape, model_dir, work, mode=m,
                                                          shared_threads=False, **kw)
                if r % 2 == 1:
                    plain_s = run_plain(shape, model_dir, work, **kw)
                rounds.append((phases, modes, plain_s, extras))
            elapsed = time.perf_counter() - started
        finally:
            shutil.rmtree(work, ignore_errors=True)
    report, extras = combine(rounds)
    report["plain_in_process_seconds_per_iteration"] = round(extras["plain_in_process_s"], 6)
    report["fixed_threads"] = fixed_threads(report, extras)
    header = (f"G1{' (quick shapes)' if args.quick else ''}: Qwen2 hidden={shape.hidden} "
              f"layers={shape.layers} vocab={shape.vocab}, {shape.prompts} prompts x G="
              f"{shape.group_size} x {shape.new_tokens} tokens, beta={KL_COEF}, {args.threads} "
              f"threads, {args.device}; phases: median of {args.iterations} after 1 warm-up; "
              f"modes: steady state over {args.iterations} iterations; median of "
              f"{args.rounds} round(s) ({elapsed:.0f} s)")
    print(table(report, extras, header), file=sys.stderr if args.json else sys.stdout)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
