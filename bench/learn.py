"""``streamflow bench learn``: does the demo's recipe learn, on every seed and thread count?

What it runs: the demo job (``configs/quickstart.yaml`` unless ``--config``), unchanged but for
``run.seed`` and ``run.host_threads``, once per (seed, threads) case, each in a fresh
``streamflow run`` process so no case inherits another's torch state. Each seed warm-starts its
own policy (cached under ``OUTPUT/.cache``, on one fixed thread count, stopped at the recipe's
target accuracy), so the cases share nothing but the recipe.

What it reports per case, from the run's ``summary.json`` and ``metrics.jsonl``:
- ``accuracy_before``: greedy held-out accuracy of the warm-started policy (version 0), on
  prompts never trained on; ``accuracy_after``: the same after the last iteration;
- ``reward_first_window`` / ``reward_last_window``: mean reward over the first / last window of
  iterations (min(10, iterations // 2) each: single iterations are too noisy to compare);
- ``rl_seconds``: wall seconds of the RL loop (start-up and warm start excluded);
- ``seconds_to_plus_0_10``: RL wall seconds until the first evaluation at least 0.10 above
  ``accuracy_before`` (None if never reached);
- ``tool_calls_per_trajectory``: tool calls answered per trained trajectory (the trainer's
  ``tool_calls_mean``), averaged over the last window of iterations; 0 for a single-turn run;
- ``reward_model_accuracy``: with a recipe that sets ``reward.model`` (configs/reward-model.yaml),
  each seed's reward model is trained first by ``streamflow model train-reward`` from that seed's
  warm-started policy (cached under ``OUTPUT/.cache``, so the command reproduces on a fresh
  machine) and the case runs against it; this is its accuracy on held-out labelled responses
  (None without a reward model), trained to ``reward.train_target_accuracy`` on validation
  responses under the cap ``reward.train_max_epochs``: ``reward_model_epochs`` it ran and
  ``reward_model_cap_hit``;
- ``reward_hacking``: whether any iteration of the run flagged reward hacking (held-out accuracy
  falling while the reward rises: ``streamflow.hacking``).
and, over the cases, ``worst_accuracy_gain`` and ``tool_calls_per_trajectory`` (the lowest).
Target (printed, not asserted here): every case gains at least ``--target-gain`` (0.10), its last
reward window beats its first, and it calls at least ``--min-tool-calls`` (0) tools per
trajectory at the end (configs/agentic.yaml: 0.15 and 0.5, docs/learning.md).

Prints a table, then the JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from streamflow.config import load_config
from streamflow.rundir import reward_window

ROOT = Path(__file__).resolve().parents[1]
TARGET_GAIN = 0.10


@dataclass
class Case:
    """One (seed, threads) run of the recipe and what it learned."""

    seed: int
    threads: int  # run.host_threads: torch threads the run's compute processes share
    accuracy_before: float
    accuracy_after: float
    reward_first_window: float
    reward_last_window: float
    rl_seconds: float
    seconds_to_plus_0_10: float | None
    tool_calls_per_trajectory: float  # over the last window of iterations; 0: single turn
    wall_seconds: float  # the whole process, warm start and start-up included
    reward_model_accuracy: float | None = None  # reward.model recipes: see the module docstring
    reward_model_epochs: int | None = None
    reward_model_cap_hit: bool | None = None
    reward_hacking: bool = False  # an iteration's reward_hacking was 1

    @property
    def gain(self) -> float:
        return self.accuracy_after - self.accuracy_before


def read_case(run_dir: Path, seed: int, threads: int, wall: float) -> Case:
    """The case's figures from a finished run directory."""
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("status") != "ok":
        raise RuntimeError(f"run {run_dir} ended {summary.get('status')}: {summary.get('error')}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    before, after = summary["accuracy_before"], summary["accuracy_last"]
    if before is None or after is None:
        raise RuntimeError(f"run {run_dir} has no held-out evaluation (run.eval_every=0?)")
    elapsed, reached = 0.0, None
    for r in records:
        elapsed += r["wall_seconds"]
        if reached is None and r["accuracy"] is not None and r["accuracy"] >= before + TARGET_GAIN:
            reached = elapsed
    last = records[-max(1, reward_window(len(records))):]
    calls = sum(r.get("tool_calls_mean") or 0.0 for r in last) / len(last) if last else 0.0
    return Case(
        seed=seed, threads=threads, accuracy_before=before, accuracy_after=after,
        reward_first_window=summary["reward_mean_first_window"],
        reward_last_window=summary["reward_mean_last_window"],
        rl_seconds=summary["wall_seconds"], seconds_to_plus_0_10=reached,
        tool_calls_per_trajectory=calls, wall_seconds=wall,
        reward_hacking=any(r.get("reward_hacking") for r in records),
    )


def _subprocess(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): " + " | ".join(tail))
    return proc.stdout


def reward_model(config: Path, out: Path, seed: int, extra: list[str]) -> tuple[list[str], dict]:
    """A recipe with ``reward.model``: (the override naming this seed's reward model, the
    report of its training), trained by ``streamflow model train-reward`` unless cached."""
    rm_dir = out / ".cache" / f"reward-model-seed{seed}"
    cmd = [sys.executable, "-m", "streamflow", "model", "train-reward", str(rm_dir), "--config",
           str(config), *extra, f"run.seed={seed}", f"run.output_dir={out / 'reward-model'}",
           "run.log_level=WARNING", "--json"]
    report = json.loads(_subprocess(cmd, f"train-reward seed={seed}").strip().splitlines()[-1])
    return [f"reward.model={rm_dir}"], report


def run_case(config: Path, out: Path, seed: int, threads: int, extra: list[str]) -> Case:
    run_dir = out / f"seed{seed}-threads{threads}"
    rm, trained = [], None
    if load_config(config, extra).reward.model is not None:
        rm, trained = reward_model(config, out, seed, extra)
    cmd = [sys.executable, "-m", "streamflow", "run", str(config),
           f"run.seed={seed}", f"run.host_threads={threads}", f"run.output_dir={run_dir}",
           "run.progress=false", "run.log_level=WARNING", *extra, *rm]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"case seed={seed} threads={threads} failed "
                           f"(exit {proc.returncode}): " + " | ".join(tail))
    case = read_case(run_dir, seed, threads, wall)
    if trained is not None:
        case.reward_model_accuracy = trained["heldout_accuracy"]
        case.reward_model_epochs = trained["epochs"]
        case.reward_model_cap_hit = trained["cap_hit"]
    return case


def report(cases: list[Case], *, target_gain: float = TARGET_GAIN,
           min_tool_calls: float = 0.0) -> dict:
    worst = min(cases, key=lambda c: c.gain)
    return {
        "cases": [
            {k: v for k, v in asdict(c).items() if k != "wall_seconds"} for c in cases
        ],
        "worst_accuracy_gain": worst.gain,
        "worst_case": {"seed": worst.seed, "threads": worst.threads},
        "tool_calls_per_trajectory": min(c.tool_calls_per_trajectory for c in cases),
        "reward_model_accuracy": min((c.reward_model_accuracy for c in cases
                                      if c.reward_model_accuracy is not None), default=None),
        "target": {"accuracy_gain_at_least": target_gain, "last_reward_window_above_first": True,
                   "tool_calls_per_trajectory_at_least": min_tool_calls},
        "met": all(c.gain >= target_gain and c.reward_last_window > c.reward_first_window
                   and c.tool_calls_per_trajectory >= min_tool_calls for c in cases),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamflow bench learn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="run.host_threads values (torch threads the run's processes share)")
    parser.add_argument("--output", type=Path, default=None,
                        help="keep the run directories here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="an override applied to every case (repeatable), e.g. "
                             "--set run.iterations=30")
    parser.add_argument("--target-gain", type=float, default=TARGET_GAIN,
                        help="the held-out accuracy gain every case must reach")
    parser.add_argument("--min-tool-calls", type=float, default=0.0,
                        help="tool calls per trajectory every case must make at the end")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sf-learn-") as tmp:
        out = args.output or Path(tmp)
        cases = [run_case(args.config, out, seed, threads, args.overrides)
                 for seed in args.seeds for threads in args.threads]
    result = report(cases, target_gain=args.target_gain, min_tool_calls=args.min_tool_calls)
    if not args.json:
        table = Table(title=f"bench learn: {args.config.name} over seeds x threads")
        for col in ("seed", "threads", "accuracy before -> after", "gain", "reward windows",
                    "RL s", "s to +0.10", "tool calls", "RM accuracy", "hacking?", "process s"):
            table.add_column(col)
        for c in cases:
            to = "-" if c.seconds_to_plus_0_10 is None else f"{c.seconds_to_plus_0_10:.1f}"
            table.add_row(str(c.seed), str(c.threads),
                          f"{c.accuracy_before:.3f} -> {c.accuracy_after:.3f}", f"{c.gain:+.3f}",
                          f"{c.reward_first_window:.3f} -> {c.reward_last_window:.3f}",
                          f"{c.rl_seconds:.1f}", to, f"{c.tool_calls_per_trajectory:.2f}",
                          "-" if c.reward_model_accuracy is None
                          else f"{c.reward_model_accuracy:.3f} ({c.reward_model_epochs} ep"
                          + (", cap hit)" if c.reward_model_cap_hit else ")"),
                          "yes" if c.reward_hacking else "no",
                          f"{c.wall_seconds:.0f}")
        Console(stderr=True).print(table)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
