"""``streamflow bench losses``: which objective learns the demo's recipe, from the same start?

What it runs: the demo job (``configs/quickstart.yaml`` unless ``--config``) once per variant and
seed, each a fresh ``streamflow run`` process (``bench.learn.run_case``), changed only by the
variant's overrides (``VARIANTS``), then the ``--set`` ones. Every variant of a seed starts from the
same warm-started policy: ``bench.learn``'s per-seed cache (``OUTPUT/.cache``) is built by the
seed's first run and read by the others. The loop is seed-major (every variant of the first seed,
then the next seed), so a run cut short still compares the variants on whole seeds.

What it reports per variant and seed (``bench.learn.read_case``): ``accuracy_before`` /
``accuracy_after`` (greedy held-out accuracy of the warm start / after the last iteration),
``gain`` (their difference), ``seconds_to_plus_0_10`` (RL seconds to the first evaluation 0.10
above the start; None if never), ``reward_first_window`` / ``reward_last_window``.

The JSON line: ``{variants: {NAME: {per_seed: {SEED: {the six figures}}, worst_gain}}, worst_gain,
worst, seeds, command, target, met}``; with one seed each variant also carries its six figures
directly. A run that fails (or stops "solved") is reported as ``{error}`` for its seed and fails
the target, and the other runs go on. Target (printed, not asserted): every variant gains at
least ``--target-gain`` (0.10) held-out accuracy on every seed. Results: docs/learning.md
"Which objective learns here".
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.learn import ROOT, TARGET_GAIN, Case, run_case

# name -> the overrides that make the recipe that variant. Every knob of the objective is set,
# so a --config that sets one of them does not leak into another variant.
VARIANTS: dict[str, list[str]] = {
    name: [f"trainer.loss={loss}", f"trainer.advantage={advantage}",
           f"trainer.dynamic_sampling={'on' if loss == 'dapo' else 'off'}"]  # DAPO's is its own
    for name, loss, advantage in (
        ("grpo", "grpo", "grpo"),
        ("dr_grpo", "dr_grpo", "grpo"),
        ("dapo", "dapo", "grpo"),
        ("gspo", "gspo", "grpo"),
        ("cispo", "cispo", "grpo"),
        ("rloo", "grpo", "rloo"),
        ("reinforce_pp", "grpo", "reinforce_pp"),
    )
}
FIGURES = ("accuracy_before", "accuracy_after", "gain", "seconds_to_plus_0_10",
           "reward_first_window", "reward_last_window")


def figures(case: Case) -> dict:
    """The six figures of one variant on one seed."""
    return {k: case.gain if k == "gain" else getattr(case, k) for k in FIGURES}


def run_variant(config: Path, out: Path, name: str, seed: int, threads: int,
                extra: list[str]) -> Case | str:
    """One run of variant ``name``: its Case, or the error (one line) it failed with."""
    variant_out = out / name
    variant_out.mkdir(parents=True, exist_ok=True)
    # run_case puts the run in variant_out/seedS-threadsT and the warm-start cache in
    # variant_out/.cache; pointing that at out/.cache gives every variant the seed's one cache
    cache = variant_out / ".cache"
    if not cache.exists():
        (out / ".cache").mkdir(exist_ok=True)
        cache.symlink_to((out / ".cache").resolve(), target_is_directory=True)
    try:
        return run_case(config, variant_out, seed, threads, [*VARIANTS[name], *extra])
    except RuntimeError as exc:  # a failed or "solved" run: a result, not the end of the bench
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def report(results: dict[str, dict[int, Case | str]], *, command: str,
           target_gain: float = TARGET_GAIN) -> dict:
    """The JSON object from each variant's result per seed (a Case, or an error)."""
    variants: dict[str, dict] = {}
    worst: tuple[float, str, int] | None = None
    for name, by_seed in results.items():
        per_seed = {str(seed): figures(r) if isinstance(r, Case) else {"error": r}
                    for seed, r in by_seed.items()}
        gains = [(r.gain, seed) for seed, r in by_seed.items() if isinstance(r, Case)]
        entry: dict = {"per_seed": per_seed,
                       "worst_gain": min(g for g, _ in gains) if gains else None}
        if len(by_seed) == 1:
            entry.update(next(iter(per_seed.values())))
        variants[name] = entry
        for gain, seed in gains:
            if worst is None or gain < worst[0]:
                worst = (gain, name, seed)
    seeds = sorted({seed for by_seed in results.values() for seed in by_seed})
    failed = any(not isinstance(r, Case) for by_seed in results.values() for r in by_seed.values())
    return {
        "variants": variants,
        "worst_gain": None if worst is None else worst[0],
        "worst": None if worst is None else {"variant": worst[1], "seed": worst[2]},
        "seeds": seeds,
        "command": command,
        "target": {"accuracy_gain_at_least": target_gain},
        "met": worst is not None and not failed and worst[0] >= target_gain,
    }


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def print_table(results: dict[str, dict[int, Case | str]], title: str) -> None:
    table = Table(title=title)
    for col in ("variant", "seed", "accuracy before -> after", "gain", "s to +0.10",
                "reward windows", "RL s"):
        table.add_column(col)
    for name, by_seed in results.items():
        for seed, r in by_seed.items():
            if not isinstance(r, Case):
                table.add_row(name, str(seed), f"failed: {r}", "", "", "", "")
                continue
            table.add_row(name, str(seed), f"{r.accuracy_before:.3f} -> {r.accuracy_after:.3f}",
                          f"{r.gain:+.3f}", _num(r.seconds_to_plus_0_10, ".1f"),
                          f"{_num(r.reward_first_window, '.3f')} -> "
                          f"{_num(r.reward_last_window, '.3f')}",  # None: a 1-iteration run
                          f"{r.rl_seconds:.1f}")
    Console(stderr=True).print(table)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="streamflow bench losses", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        metavar="NAME", help=f"a subset of: {', '.join(VARIANTS)}")
    parser.add_argument("--threads", type=int, default=1,
                        help="run.host_threads of every run (docs/learning.md \"Threads\")")
    parser.add_argument("--output", type=Path, default=None,
                        help="keep the run directories here, OUTPUT/VARIANT/seedS-threadsT "
                             "(default: a temporary directory)")
    parser.add_argument("--json", action="store_true",
                        help="after the table (on stderr), print the JSON line on stdout")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="an override applied to every run after the variant's (repeatable), "
                             "e.g. --set run.iterations=30")
    parser.add_argument("--target-gain", type=float, default=TARGET_GAIN,
                        help="the held-out accuracy gain every variant must reach on every seed")
    args = parser.parse_args(argv)
    names = list(dict.fromkeys(args.variants))  # in the order given, once each
    results: dict[str, dict[int, Case | str]] = {name: {} for name in names}
    progress = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="sf-losses-") as tmp:
        out = args.output or Path(tmp)
        for seed in args.seeds:  # seed-major: a cut-short run has whole seeds
            for name in names:
                result = run_variant(args.config, out, name, seed, args.threads, args.overrides)
                results[name][seed] = result
                line = figures(result) if isinstance(result, Case) else {"error": result}
                progress.print(f"losses: {name} seed {seed}: {json.dumps(line)}",
                               highlight=False, soft_wrap=True)
    command = shlex.join(["streamflow", "bench", "losses", *argv])
    result = report(results, command=command, target_gain=args.target_gain)
    print_table(results, f"bench losses: {args.config.name}, seeds {args.seeds}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
