"""Benchmark: StreamFlow's own host cost per iteration, against a plain Hugging Face loop.

Workload: G1's batch (``bench._g1``: 16 prompts x G=8 responses x 64 generated tokens, 2-digit
sums, KL coefficient 0.04, the same byte-level BPE vocabulary) over a micro Qwen2 (``MICRO``:
hidden 32, 2 layers) whose compute is small on a CPU, so what is left of an iteration is mostly
what the framework does around the model: store round trips, (de)serialisation, Arrow -> tensor
conversion, host <-> device copies, the optimizer, weight publication, waits. On a GPU the model's
compute is small too, which is why this figure decides the speed a GPU user sees.

Measured in one invocation, with ``bench phases``' own machinery (no second copy of any of it):

- the plain loop alone in a process of its own (``phases.run_plain`` -> ``python -m
  bench._plain``) and real ``streamflow run`` jobs in ``sync``, ``periodic`` and ``async``
  (``phases.run_mode``: steady-state seconds per iteration from the trainer's step spans), all over
  the same model directory and the same prompt rows;
- ``interleaved``: ``bench phases``' in-process pairs (``phases.measure_phases``): StreamFlow's
  sync iteration and the plain loop's, alternating in this process, medians of ``--iterations``
  after a warm-up. The modes above are child processes one after another, so load that comes and
  goes on a shared host moves their ratios; this one it hits on both sides alike;
- ``breakdown``: one ``sync`` iteration taken apart in this process (``phases.StreamFlowSync``,
  the controller's own colocated loop, every role in one thread), two parts:

  * ``instrumented``: what the roles report anyway: the stages' seconds (``StageSeconds``), the
    trainer's ``StepReport`` (step, busy = forward/backward/optimizer, publish seconds) and the
    rollout's ``WeightSyncReport`` (load seconds), from an unprofiled iteration;
  * ``categories``: the split that no report gives (store round trips apart from
    (de)serialisation, tensor conversion, copies, the optimizer), from the next iteration under
    a profile hook (``CategoryProfiler``, ``sys.setprofile``, like cProfile but attributing by
    the call stack): every interval goes to the category of the innermost call that claims it
    (by module, or by function for built-ins), so the categories sum to the profiled iteration
    with nothing counted twice; ``other`` is the time in no category (the roles' own Python).
    The hook's own time is left out (``attributed_s``: the profiled iteration less it), but it
    still slows Python-heavy parts more than the rest, so each category also gives its
    ``fraction`` of ``attributed_s``: read the fractions, and the instrumented seconds for
    absolute time.

Ratios are ``plain / StreamFlow`` seconds (> 1: StreamFlow faster). Targets, printed, not
asserted: ``sync`` >= 0.9x and the best mode >= 1.0x the plain loop.

Output: a table, then one JSON line (with ``--json`` the table goes to stderr): ``{"modes": {MODE:
{"seconds_per_iteration", "ratio_to_plain"}}, "plain_seconds_per_iteration",
"sync_ratio_to_plain", "best_ratio_to_plain", "interleaved": {"sync_seconds_per_iteration",
"plain_seconds_per_iteration", "sync_ratio_to_plain", "phases"}, "breakdown": {"breakdown_method", "instrumented",
"profiled_iteration_s", "attributed_s", "categories": {NAME: {"seconds", "fraction"}},
"other_top"}, "shape", "targets"}`` and, with ``--rounds`` > 1, ``"rounds": [{"plain", MODE:
seconds}]``.
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
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench._g1 import G1, QUICK, G1Shape, build_model_dir, run_config
from bench.phases import (
    MODES,
    StreamFlowSync,
    check_run_args,
    measure_phases,
    run_mode,
    run_plain,
)

# G1's batch and vocabulary over a model whose compute is negligible next to the framework's.
MICRO = replace(G1, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64)
TARGET_SYNC, TARGET_BEST = 0.9, 1.0

def _has(*parts: str) -> Callable[[str], bool]:
    return lambda name: any(p in name for p in parts)


# The categories of one iteration, each a predicate on a function's name: "FILE:FUNCTION" for
# Python code, "MODULE.QUALNAME" for a built-in (C) function (e.g. "None.Tensor.to").
CATEGORIES: dict[str, Callable[[str], bool]] = {
    # the trainer's publish of a version and the rollout's load of it, whatever they call
    "weight_publication": _has("/workers/weights/", "safetensors"),
    # torch.optim and gradient clipping, whatever they call
    "optimizer": _has("torch/optim/", "clip_grad"),
    # Arrow IPC and msgpack, on either side of a store verb
    "serialisation": _has("/storage/wire.py", "pyarrow/ipc.py", "msgspec"),
    # store verbs from the roles' side: send, the embedded server's work, receive
    "store_round_trips": _has("/storage/"),
    # Arrow/Python -> numpy -> tensor
    "tensor_conversion": _has("to_numpy", "to_pylist", "from_numpy", "as_tensor", "torch.tensor",
                              "as_py"),
    # on a GPU each of these is a copy that waits for the device; on the CPU they are cheap
    "host_device_copies": _has("Tensor.to", "Tensor.cpu", "Tensor.cuda", "Tensor.item",
                               "Tensor.copy_", "Tensor.numpy"),
    "waits": _has("time.sleep", "lock.acquire", "/threading.py", "zmq/sugar/poll", "select.",
                  "selectors.py"),
    # the model itself (for scale): generate, forward, backward
    "model_compute": _has("transformers/generation/", "torch/nn/modules/", "run_backward",
                          "torch/autograd/"),
}
# Which category keeps a call made from inside another: publication and the optimizer keep
# everything under them; (de)serialisation is taken out of a store verb; conversions, copies and
# waits are taken out of the model's own code (on a GPU those are where the host waits).
_OVERRIDES = {
    "weight_publication": (), "optimizer": (), "serialisation": (),
    "store_round_trips": ("serialisation",),
    "tensor_conversion": (), "host_device_copies": (), "waits": (),
    "model_compute": ("tensor_conversion", "host_device_copies", "waits", "serialisation",
                      "store_round_trips", "weight_publication", "optimizer"),
    None: tuple(CATEGORIES),
}


def classify(name: str) -> str | None:
    """The category of one function's name (``None``: none)."""
    for cat, pred in CATEGORIES.items():
        if pred(name):
            return cat
    return None


class CategoryProfiler:
    """``sys.setprofile`` over this thread: every interval between two call/return events goes
    to the category in effect at that moment, the innermost call's own category if it may
    override its caller's (``_OVERRIDES``), else the caller's. The categories sum to the whole
    profiled time, with nothing counted twice."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.seconds: dict[str | None, float] = {}
        self.other: dict[str, float] = {}  # time in no category, by the function running it
        self._stack: list[str | None] = [None]
        self._funcs: list[str] = ["(outside)"]  # the function of each stack entry
        self._names: dict[Any, str | None] = {}
        self._last = 0.0

    def _category(self, key: Any, name: Callable[[], str]) -> str | None:
        if key not in self._names:
            self._names[key] = classify(name())
        return self._names[key]

    def _event(self, frame: Any, event: str, arg: Any) -> None:
        now = self._clock()
        top = self._stack[-1]
        self.seconds[top] = self.seconds.get(top, 0.0) + now - self._last
        if top is None:
            func = self._funcs[-1]
            self.other[func] = self.other.get(func, 0.0) + now - self._last
        if event == "call":
            code = frame.f_code
            name = f"{code.co_filename}:{code.co_name}"
            own = self._category(code, lambda: name)
        elif event == "c_call":
            key = (getattr(arg, "__module__", None), getattr(arg, "__qualname__", None))
            name = f"{key[0]}.{key[1]}"
            own = self._category(key, lambda: name)
        else:  # return, c_return, c_exception
            if len(self._stack) > 1:
                self._stack.pop()
                self._funcs.pop()
            self._last = self._clock()
            return
        self._stack.append(own if own is not None and own in _OVERRIDES[top] else top)
        self._funcs.append(name)
        self._last = self._clock()

    def __enter__(self) -> CategoryProfiler:
        self._last = self._clock()
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        top = self._stack[-1]
        self.seconds[top] = self.seconds.get(top, 0.0) + self._clock() - self._last


def breakdown(
    shape: G1Shape, model_dir: Path, work: Path, *, threads: int, device: str
) -> dict[str, Any]:
    """One sync iteration taken apart (module docstring): warm-up, one instrumented iteration,
    one profiled one."""
    import torch

    from streamflow.config import config_from_dict
    from workers.runtime.events import StepReport, WeightSyncReport

    torch.set_num_threads(threads)
    tree = run_config(shape, model_dir, work / "runs", mode="sync", iterations=10_000,
                      threads=threads, device=device)
    sf = StreamFlowSync(config_from_dict(tree), work / "runs" / "overhead")
    try:
        sf.iteration(0)  # warm-up
        times = sf.iteration(1)
        steps = [r for r in sf.sent if isinstance(r, StepReport)]
        loads = [r for r in sf.sent if isinstance(r, WeightSyncReport)]
        start = time.perf_counter()
        with CategoryProfiler() as profiler:
            sf.iteration(2)
        profiled = time.perf_counter() - start
    finally:
        sf.close()
    step = steps[0]
    instrumented = {
        "iteration_s": times.total, "generation_s": times.generation, "reward_s": times.reward,
        "reference_s": times.reference, "train_step_s": times.train_step,
        "trainer_busy_s": step.busy_seconds,  # forward, backward, optimizer
        "trainer_step_s": step.step_seconds,  # first micro-batch to published weights
        "weight_publish_s": step.publish_seconds,
        "weight_load_s": sum(r.seconds for r in loads),
    }
    seconds = {cat: profiler.seconds.get(cat, 0.0) for cat in CATEGORIES}
    seconds["other"] = profiler.seconds.get(None, 0.0)
    attributed = sum(seconds.values())  # the profiled iteration less the hook's own time
    return {
        "breakdown_method": "instrumented: the roles' own reports (StageSeconds, StepReport, "
                            "WeightSyncReport) of one unprofiled sync iteration; categories: "
                            "a sys.setprofile hook over the next in-process sync iteration, "
                            "each interval to the innermost category on the call stack (by "
                            "module, or by function for built-ins)",
        "instrumented": {k: round(v, 6) for k, v in instrumented.items()},
        "profiled_iteration_s": round(profiled, 6),
        "attributed_s": round(attributed, 6),
        "categories": {k: {"seconds": round(v, 6), "fraction": round(v / attributed, 4)}
                       for k, v in seconds.items()},
        # where "other" goes: the functions whose own code (not their callees') ran longest
        "other_top": [[_short(f), round(v, 6)] for f, v in sorted(
            profiler.other.items(), key=lambda kv: -kv[1])[:8]],
    }


def _short(name: str) -> str:
    """A function's name from the package directory on (``workers/roles/trainer.py:step``)."""
    for root in ("/site-packages/", str(Path(__file__).resolve().parents[1]) + "/"):
        if root in name:
            return name.split(root, 1)[1]
    return name


def summarize(modes: dict[str, float], plain_s: float) -> dict[str, Any]:
    """Each mode's ratio to the plain loop and the two headlines."""
    plain = round(plain_s, 6)
    out = {m: {"seconds_per_iteration": round(s, 6),
               "ratio_to_plain": round(plain / round(s, 6), 4)} for m, s in modes.items()}
    return {"modes": out, "plain_seconds_per_iteration": plain,
            "sync_ratio_to_plain": out["sync"]["ratio_to_plain"],
            "best_ratio_to_plain": max(m["ratio_to_plain"] for m in out.values())}


def table(report: dict[str, Any], header: str) -> str:
    lines = [header, f"{'mode':<12} {'s/iteration':>12} {'plain/mode':>11}"]
    for name, m in report["modes"].items():
        lines.append(f"{name:<12} {m['seconds_per_iteration']:>12.4f} {m['ratio_to_plain']:>11.2f}")
    lines.append(f"{'plain loop':<12} {report['plain_seconds_per_iteration']:>12.4f}")
    i = report["interleaved"]
    lines.append(f"interleaved in one process (medians): sync {i['sync_seconds_per_iteration']:.4f}"
                 f" s, plain {i['plain_seconds_per_iteration']:.4f} s, plain/sync "
                 f"{i['sync_ratio_to_plain']:.2f}; phase ratios " + ", ".join(
                     f"{k} {v['ratio']:.2f}" for k, v in i["phases"].items()))
    b = report["breakdown"]
    lines.append("one sync iteration, instrumented: " + ", ".join(
        f"{k} {v:.4f}" for k, v in b["instrumented"].items()))
    lines.append(f"one sync iteration under the profile hook ({b['profiled_iteration_s']:.4f} s, "
                 f"{b['attributed_s']:.4f} s attributed):")
    for name, c in sorted(b["categories"].items(), key=lambda kv: -kv[1]["seconds"]):
        lines.append(f"  {name:<20} {c['seconds']:>9.4f} s {100 * c['fraction']:>6.1f} %")
    lines.append("  other, by function: " + ", ".join(f"{f} {v:.4f}" for f, v in b["other_top"]))
    s, best = report["sync_ratio_to_plain"], report["best_ratio_to_plain"]
    mark = {True: "met", False: "NOT met"}
    lines.append(f"target sync >= {TARGET_SYNC}x the plain loop: {s:.2f}x ({mark[s >= TARGET_SYNC]})")
    lines.append(f"target best mode >= {TARGET_BEST}x the plain loop: {best:.2f}x "
                 f"({mark[best >= TARGET_BEST]})")
    return "\n".join(lines)


def measure_model(
    shape: G1Shape, model_dir: Path, work: Path, *, iterations: int, threads: int, device: str,
    modes: tuple[str, ...] = MODES, rounds: int = 1,
) -> dict[str, Any]:
    """The JSON object over an existing model directory (``bench gpu`` shares one with ``bench
    phases``' measurement). ``modes=()``: the breakdown alone (no child process at all).
    ``rounds``: the plain loop and the modes that many times, alternating which goes first; each
    figure is the median over rounds (on a shared host, load moves between children)."""
    report: dict[str, Any] = {}
    if modes:
        # sync against the plain loop in this process, iteration by iteration: load that moves
        # between the child processes below hits both sides of this ratio alike
        phases, plain_in, extras = measure_phases(shape, model_dir, work / "interleaved",
                                                  iterations=iterations, threads=threads,
                                                  device=device)
        sync_in = extras["streamflow_sync_iteration_s"]
        interleaved = {
            "sync_seconds_per_iteration": round(sync_in, 6),
            "plain_seconds_per_iteration": round(plain_in, 6),
            "sync_ratio_to_plain": round(plain_in / sync_in, 4), "phases": phases}
        kw = dict(iterations=iterations, threads=threads, device=device)
        plains: list[float] = []
        runs: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(rounds):  # the plain loop first in one round, last in the next
            if r % 2 == 0:
                plains.append(run_plain(shape, model_dir, work, **kw))
            for m in modes:
                runs[m].append(run_mode(shape, model_dir, work, mode=m, **kw))
            if r % 2 == 1:
                plains.append(run_plain(shape, model_dir, work, **kw))
        report = summarize({m: statistics.median(v) for m, v in runs.items()},
                           statistics.median(plains))
        report["interleaved"] = interleaved
        if rounds > 1:  # each round's seconds: the spread behind the medians
            report["rounds"] = [{"plain": round(plains[r], 6),
                                 **{m: round(runs[m][r], 6) for m in modes}}
                                for r in range(rounds)]
    report["breakdown"] = breakdown(shape, model_dir, work, threads=threads, device=device)
    return report


def measure(
    shape: G1Shape, *, iterations: int, threads: int, device: str, modes: tuple[str, ...] = MODES,
    rounds: int = 1,
) -> dict[str, Any]:
    """The whole benchmark in a scratch directory; the JSON object."""
    work = Path(tempfile.mkdtemp(prefix="streamflow-bench-overhead-"))
    try:
        model_dir = build_model_dir(work / "model", shape)
        report = measure_model(shape, model_dir, work, iterations=iterations, threads=threads,
                               device=device, modes=modes, rounds=rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["shape"] = asdict(shape)
    report["targets"] = {"sync_ratio_to_plain": TARGET_SYNC, "best_ratio_to_plain": TARGET_BEST}
    return report


def main(argv: list[str]) -> int:
    """Run the benchmark; prints the table then one JSON line. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="streamflow bench overhead",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=None,
                        help="timed iterations per mode and for the plain loop (default 4; "
                             "--quick 1)")
    parser.add_argument("--threads", type=int, default=2, help="threads in all (default 2)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the plain loop and the modes; figures are medians over "
                             "rounds, each round listed (default 1)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated modes to run (default {','.join(MODES)})")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (for tests)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--json", action="store_true", help="stdout holds only the JSON line")
    args = parser.parse_args(argv)
    check_run_args(parser, args, quick_iterations=1)
    modes = tuple(m for m in args.modes.split(",") if m)
    if "sync" not in modes or not set(modes) <= set(MODES):
        parser.error(f"--modes must include sync and name only {', '.join(MODES)}, "
                     f"got {args.modes!r}")
    shape = QUICK if args.quick else MICRO
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    started = time.perf_counter()
    with quiet:
        report = measure(shape, iterations=args.iterations, threads=args.threads,
                         device=args.device, modes=modes, rounds=args.rounds)
    header = (f"host overhead: G1's batch ({shape.prompts} prompts x G={shape.group_size} x "
              f"{shape.new_tokens} tokens) over a micro Qwen2 (hidden {shape.hidden}, "
              f"{shape.layers} layers, vocab {shape.vocab}), {args.threads} threads, "
              f"{args.device}; modes: steady state over {args.iterations} iterations, median "
              f"of {args.rounds} round(s) ({time.perf_counter() - started:.0f} s)")
    print(table(report, header), file=sys.stderr if args.json else sys.stdout)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
