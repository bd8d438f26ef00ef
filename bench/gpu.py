"""Benchmark: the GPU check, one prepared script that writes one JSON (``make gpu-check``).

On a CUDA machine (the first visible GPU) it runs, in this order, each step timed and its failure
recorded rather than fatal (a later step still runs):

- ``phases_g1`` / ``phases_qwen2_150m``: ``bench phases``' in-process phase pairs (StreamFlow's
  colocated sync loop against the plain Hugging Face loop, interleaved) for G1 and for a randomly
  initialised ~150 M-parameter Qwen2 (``Q150``: G1's batch and vocabulary, hidden 1024, 13
  layers); on a GPU the roles' dtype is ``auto``, bfloat16;
- ``overhead_g1`` / ``overhead_qwen2_150m``: ``bench overhead`` over the same model directory:
  the plain loop alone and ``streamflow run`` in ``sync``, ``periodic`` and ``async``, and the
  breakdown of one sync iteration;
- ``warmup_g1``: ``bench warmup --profile`` in a fresh process (a fresh CUDA context): G1's first
  ``sync`` iterations one by one, each profiled, with the caching allocator's counters, to tell
  what makes the first iterations slow on a GPU (docs/gpu.md "First iterations");
- ``weights_0.5b``: ``bench weights --params 5e8`` (in this process): one version of a 0.5 B-parameter bfloat16
  state dict into a rollout process, by file and by collective, against a device-to-device copy;
- ``gpu_tests``: ``pytest -m gpu tests/workers/test_gpu.py`` (last and alone on a GPU; beside the
  other steps on the CPU, where its tests only skip).

Without a GPU the same steps run on the CPU at tiny sizes (``tiny``: G1's ``QUICK`` shape for
both models, 1 iteration, a 1 M-parameter state dict; the gpu tests then skip). ``--smoke`` (the
test's) shrinks further: the overhead steps start no ``streamflow run`` job (the breakdown
only) and the state dict has 0.1 M parameters.

Targets, checked and printed, not asserted (``checks``): best mode >= 1.0x the plain loop on G1
and >= 1.3x at 150 M, the best collective weight sync >= 0.5 of a device copy's bandwidth, every
gpu test passed. A step that did not run leaves its check ``null``, and so does every check on
the CPU (the targets are a GPU's).

Output: the table of steps, then one JSON line ``{"device", "device_name", "size", "versions",
"steps": {NAME: {"ok", "seconds", "result" | "error"}}, "checks": {NAME: bool | null},
"seconds"}``; ``--out FILE`` also writes it to FILE.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench._g1 import G1, QUICK, G1Shape, build_model_dir
from bench.phases import MODES

ROOT = Path(__file__).resolve().parents[1]
# ~150 M parameters: 13 layers of 11.3 M (attention 2.6 M with 4 KV heads, MLP 8.7 M) + embedding
Q150 = replace(G1, hidden=1024, layers=13, heads=16, kv_heads=4, intermediate=2816)
TARGET_G1, TARGET_150M, TARGET_WEIGHTS = 1.0, 1.3, 0.5


def _sizes(size: str) -> dict[str, Any]:
    """What each size runs: the two models' shapes, iterations, modes, state dict parameters."""
    if size == "full":
        return {"models": {"g1": G1, "qwen2_150m": Q150}, "iterations": 2, "modes": MODES,
                "params": 5e8, "repeats": 2}
    return {"models": {"g1": QUICK, "qwen2_150m": QUICK}, "iterations": 1,
            "modes": () if size == "smoke" else MODES,
            "params": 1e5 if size == "smoke" else 1e6, "repeats": 1}


def phases_step(shape: G1Shape, model_dir: Path, work: Path, *, iterations: int, threads: int,
                device: str) -> dict[str, Any]:
    from bench.phases import measure_phases

    phases, plain_s, extras = measure_phases(shape, model_dir, work, iterations=iterations,
                                             threads=threads, device=device)
    return {"phases": phases, "worst_phase_ratio": min(p["ratio"] for p in phases.values()),
            "plain_in_process_seconds_per_iteration": round(plain_s, 6),
            **{k: round(v, 6) for k, v in extras.items()}, "shape": asdict(shape)}


def overhead_step(shape: G1Shape, model_dir: Path, work: Path, *, iterations: int, threads: int,
                  device: str, modes: tuple[str, ...]) -> dict[str, Any]:
    from bench.overhead import measure_model

    work.mkdir(parents=True, exist_ok=True)  # the modes' and the plain loop's configs go here
    return measure_model(shape, model_dir, work, iterations=iterations, threads=threads,
                         device=device, modes=modes)


def warmup_step(*, quick: bool, iterations: int, threads: int, device: str) -> dict[str, Any]:
    """``bench warmup --profile`` in a child process: a cold start is what it measures."""
    argv = [sys.executable, "-m", "bench.warmup", "--json", "--profile", "--iterations",
            str(iterations), "--threads", str(threads), "--device", device,
            *(["--quick"] if quick else [])]
    proc = subprocess.run(argv, cwd=ROOT, env=_child_env(), capture_output=True, text=True,
                          timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench warmup: exit status {proc.returncode}: {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def weights_step(*, params: float, repeats: int, device: str) -> dict[str, Any]:
    """``bench weights --params`` in this process (its receiver is a child of its own)."""
    from bench import weights

    args = argparse.Namespace(device=device, params=params, repeats=repeats, quick=True,
                              bucket_mb=32.0, smollm2_dir="")
    return weights.run(args)


GPU_TESTS = ["-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs",
             "tests/workers/test_gpu.py"]


def _child_env() -> dict[str, str]:
    """This environment with this checkout first on PYTHONPATH (its packages, not another's)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


def _start_gpu_tests() -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *GPU_TESTS], cwd=ROOT, env=_child_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def gpu_tests_step(proc: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise RuntimeError(f"gpu tests: over 300 s: {stdout[-1500:]}") from None
    tail = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    if proc.returncode not in (0, 5) or counts.get("failed") or counts.get("error"):
        raise RuntimeError(f"gpu tests: {tail or stderr[-1500:]}")
    return {"summary": tail, **{k: counts.get(k, 0) for k in ("passed", "failed", "skipped")}}


def run_steps(size: str, device: str, threads: int) -> dict[str, dict[str, Any]]:
    """Every step in order, each timed; a failure is recorded and the next step runs."""
    plan = _sizes(size)
    steps: dict[str, dict[str, Any]] = {}

    def step(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        print(f"gpu check: {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            steps[name] = {"ok": True, "result": fn()}
        except Exception as exc:  # recorded: the check goes on to its other steps
            traceback.print_exc(file=sys.stderr)
            steps[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        steps[name]["seconds"] = round(time.perf_counter() - start, 3)

    # On the CPU the gpu tests only collect and skip: they run beside the other steps there
    # (on a GPU they would compete with the measurements, so they run last, alone).
    tests = _start_gpu_tests() if device == "cpu" else None
    work = Path(tempfile.mkdtemp(prefix="streamflow-bench-gpu-"))
    try:
        kw = dict(iterations=plan["iterations"], threads=threads, device=device)
        dirs: dict[G1Shape, Path] = {}  # one model directory per shape (tiny: both are QUICK)

        def model_dir(name: str, shape: G1Shape) -> Path:
            if shape not in dirs:
                dirs[shape] = build_model_dir(work / f"{name}-model", shape)
            return dirs[shape]

        for name, shape in plan["models"].items():
            here = work / name  # each model's runs apart from the other's
            step(f"phases_{name}", lambda n=name, s=shape, w=here: phases_step(
                s, model_dir(n, s), w / "phases", **kw))
            step(f"overhead_{name}", lambda n=name, s=shape, w=here: overhead_step(
                s, model_dir(n, s), w / "overhead", modes=plan["modes"], **kw))
        step("warmup_g1", lambda: warmup_step(quick=size != "full", iterations=3 if size == "smoke"
                                              else 5, threads=threads, device=device))
        step("weights_0.5b", lambda: weights_step(params=plan["params"],
                                                  repeats=plan["repeats"], device=device))
        step("gpu_tests", lambda: gpu_tests_step(tests or _start_gpu_tests()))
    finally:
        if tests is not None and tests.poll() is None:
            tests.kill()
            tests.communicate()
        shutil.rmtree(work, ignore_errors=True)
    return steps


def checks(steps: dict[str, dict[str, Any]], on_gpu: bool) -> dict[str, bool | None]:
    """The targets against what ran (``None``: the step failed or measured no modes, or this is
    no GPU: the targets are a GPU's)."""
    def best(name: str) -> float | None:
        s = steps.get(name, {})
        return s.get("result", {}).get("best_ratio_to_plain") if s.get("ok") else None

    g1, q150 = best("overhead_g1"), best("overhead_qwen2_150m")
    w = steps.get("weights_0.5b", {})
    ratio = w.get("result", {}).get("best_collective_ratio_to_copy") if w.get("ok") else None
    t = steps.get("gpu_tests", {})
    if not on_gpu:
        g1 = q150 = ratio = None
        t = {}
    return {
        f"g1_best_mode_ge_{TARGET_G1}x_plain": None if g1 is None else g1 >= TARGET_G1,
        f"150m_best_mode_ge_{TARGET_150M}x_plain": None if q150 is None else q150 >= TARGET_150M,
        f"weight_sync_ge_{TARGET_WEIGHTS}_of_copy": None if ratio is None
        else ratio >= TARGET_WEIGHTS,
        "gpu_tests_passed": (t["result"]["failed"] == 0 and t["result"]["passed"] > 0)
        if t.get("ok") else None,
    }


def _versions() -> dict[str, str]:
    import pyarrow
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "pyarrow": pyarrow.__version__, "cuda": str(torch.version.cuda)}


def main(argv: list[str]) -> int:
    """Run the check; prints the table then one JSON line. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="streamflow bench gpu",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("auto", "full", "tiny", "smoke"), default="auto",
                        help="auto (default): full on a GPU, tiny on the CPU")
    parser.add_argument("--smoke", action="store_true", help="the same as --size smoke")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads of the benchmarked runs (default: 4 on a GPU, 1 on the CPU)")
    parser.add_argument("--out", help="also write the JSON to this file")
    parser.add_argument("--json", action="store_true", help="stdout holds only the JSON line")
    args = parser.parse_args(argv)
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    size = "smoke" if args.smoke else args.size
    if size == "auto":
        size = "full" if cuda else "tiny"
    threads = args.threads or (4 if cuda else 1)
    started = time.perf_counter()
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with quiet:
        steps = run_steps(size, device, threads)
    report = {"device": device, "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
              "size": size, "threads": threads, "versions": _versions(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": steps,
              "checks": checks(steps, cuda), "seconds": round(time.perf_counter() - started, 1)}
    out = sys.stderr if args.json else sys.stdout
    print(f"gpu check on {report['device_name']} ({size}, {report['seconds']} s)", file=out)
    for name, s in steps.items():
        print(f"  {name:<22} {'ok' if s['ok'] else 'FAILED':<7} {s['seconds']:>8.1f} s", file=out)
    for name, ok in report["checks"].items():
        print(f"  target {name}: {'met' if ok else 'not run' if ok is None else 'NOT met'}",
              file=out)
    line = json.dumps(report)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)
    return 0 if all(s["ok"] for s in steps.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
