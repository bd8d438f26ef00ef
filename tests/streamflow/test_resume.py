"""Checkpoint and exact resume: a killed run resumed from its checkpoint ends where an uninterrupted
run ends; checkpoints are atomic; resuming at a dataset epoch boundary still trains."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from testkit import wait_until

from streamflow.controller import run
from workers.models.checkpoint import latest_checkpoint, list_checkpoints, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
COMMON = ("run.iterations=6", "run.checkpoint_every=3", "rollout.groups_per_claim=2",
          "run.eval_every=0")


def _params(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def straight(model_cache: Path) -> Path:
    """The uninterrupted run both modes' resumed runs must end at: in-process ``sync`` (no child
    processes), which ``periodic`` equals with trainer.deterministic (tiny.yaml), as
    test_controller.py::test_periodic_equals_sync_through_processes checks."""
    from streamflow.config import load_config

    out = model_cache / "resume-straight"
    run(load_config(ROOT / "configs" / "tiny.yaml",
                    [f"run.output_dir={out}", "run.progress=false", "run.mode=sync", *COMMON]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "periodic"])
def test_killed_and_resumed_run_equals_uninterrupted(tiny_config, straight: Path,
                                                     mode: str) -> None:
    killed_dir = Path(tiny_config().run.output_dir).parent / f"killed-{mode}"
    overrides = [f"run.mode={mode}", *COMMON, f"run.output_dir={killed_dir}", "run.progress=false"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamflow", "run", str(ROOT / "configs" / "tiny.yaml"), *overrides],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        marker = killed_dir / "checkpoints" / "step-000003" / "trainer_state.json"
        deadline = time.monotonic() + 180

        def checkpointed() -> bool:
            assert proc.poll() is None, "the run ended before its first checkpoint"
            return marker.exists()

        wait_until(checkpointed, timeout=180, what="the checkpoint of step 3")
        # A random point after the N-th checkpoint (N=3) that still leaves work to do: once the
        # metrics of iteration 3 + r are written (r random in {0, 1}), plus a random part of
        # one iteration's wall time, so the kill lands anywhere in generation, training,
        # publication or checkpointing. The seed is printed to replay a failure.
        seed = random.randrange(1 << 30)
        rng = random.Random(seed)
        print(f"kill point seed {seed}")
        target = 3 + rng.randint(0, 1) + 1
        metrics = killed_dir / "metrics.jsonl"
        # Not a wait but a measurement: when each metrics line was first seen, polled every 5 ms
        # (wait_until's backoff to 0.1 s would blur the iteration time estimated from it).
        seen: list[float] = []
        while len(seen) < target:
            lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            seen += [time.monotonic()] * (lines - len(seen))
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no progress in time"
            time.sleep(0.005)
        iteration_s = (seen[-1] - seen[3]) / (len(seen) - 4) if len(seen) > 4 else seen[3] - seen[2]
        # The kill point itself (at most half an iteration: work remains), not a wait.
        time.sleep(rng.uniform(0.0, 0.5) * iteration_s)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (killed_dir / "summary.json").exists()
    resumed = tiny_config(f"run.mode={mode}", *COMMON, f"run.output_dir={killed_dir}",
                          "run.resume=auto")
    summary = run(resumed)
    assert summary.status == "ok"
    iterations = [json.loads(x)["iteration"] for x in
                  (killed_dir / "metrics.jsonl").read_text().splitlines()]
    assert iterations == list(range(6)), iterations
    worst = _max_diff(_params(straight, 6), _params(killed_dir, 6))
    assert worst <= 1e-6, worst
    assert _max_diff(_params(killed_dir, 3), _params(killed_dir, 6)) > 1e-4, "nothing trained"


def test_resume_at_dataset_epoch_boundary_still_trains(tiny_config, tmp_path: Path) -> None:
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n"
                            for a in range(8)))
    # 4 prompts per iteration over 8 problems: iteration 2 starts the second epoch.
    base = ("run.mode=sync", "data.task=file", f"data.file={data}", "run.eval_every=0",
            "run.checkpoint_every=2")
    first = tiny_config(*base, "run.iterations=2")
    run(first)
    out = Path(first.run.output_dir)
    second = tiny_config(*base, "run.iterations=4", "run.resume=auto")
    summary = run(second)
    assert summary.status == "ok" and summary.iterations == 4
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [0, 1, 2, 3]
    assert all(r["samples"] == 8 for r in lines[2:])
    assert _max_diff(_params(out, 2), _params(out, 4)) > 0, "the resumed iterations did not train"


class _Boom(RuntimeError):
    pass


class _FailingEngine:
    def save_state(self, directory: str) -> None:
        (Path(directory) / "optimizer.pt").write_bytes(b"partial")
        raise _Boom("disk full")


class _Engine:
    def save_state(self, directory: str) -> None:
        (Path(directory) / "optimizer.pt").write_bytes(b"ok")


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path: Path) -> None:
    from workers.models.local import TinyModelSpec, build_tiny_model
    from workers.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=32), tok)
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, model, tok, _Engine())
    save_checkpoint(root, 2, model, tok, _Engine())
    with pytest.raises(_Boom):
        save_checkpoint(root, 3, model, tok, _FailingEngine())
    assert [p.name for p in list_checkpoints(root)] == ["step-000001", "step-000002"]
    assert latest_checkpoint(root).name == "step-000002"
    assert not list(root.glob(".tmp-*")), "a failed save must not leave a partial directory"
    save_checkpoint(root, 3, model, tok, _Engine())  # keep=2: the oldest goes, only after success
    assert [p.name for p in list_checkpoints(root)] == ["step-000002", "step-000003"]
    # A partial directory left by a killed save (no trainer_state.json) is never taken for one.
    (root / "step-000009").mkdir()
    assert latest_checkpoint(root).name == "step-000003"


class _Marked:
    """An engine whose saved optimizer state names the save, to tell two saves of a step apart."""

    def __init__(self, mark: bytes) -> None:
        self.mark = mark

    def save_state(self, directory: str) -> None:
        (Path(directory) / "optimizer.pt").write_bytes(self.mark)


def test_replacing_a_step_never_leaves_it_missing(tmp_path: Path, monkeypatch) -> None:
    """Re-saving an existing step swaps it in with two renames; a save killed between them
    leaves the old copy under .old-step-N-*, which readers take as step N and the next save
    restores — the newest checkpoint is never absent."""
    from workers.models import checkpoint as ck
    from workers.models.local import TinyModelSpec, build_tiny_model
    from workers.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=32), tok)
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, model, tok, _Marked(b"first"))
    save_checkpoint(root, 1, model, tok, _Marked(b"second"))  # a plain replacement
    assert (root / "step-000001" / "optimizer.pt").read_bytes() == b"second"
    assert [p.name for p in root.iterdir()] == ["step-000001"]  # nothing left behind

    real_rename = os.rename

    def killed_after_first_rename(src, dst):  # the process "dies" right after step-N moved aside
        real_rename(src, dst)
        if Path(dst).name.startswith(".old-step-"):
            raise KeyboardInterrupt("killed between the two renames")

    monkeypatch.setattr(ck.os, "rename", killed_after_first_rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 1, model, tok, _Marked(b"third"))
    monkeypatch.setattr(ck.os, "rename", real_rename)
    assert not (root / "step-000001").exists()
    newest = latest_checkpoint(root)  # still step 1: the complete old copy
    assert newest is not None and newest.name.startswith(".old-step-000001-")
    assert (newest / "optimizer.pt").read_bytes() == b"second"
    save_checkpoint(root, 2, model, tok, _Marked(b"next"))  # settles the half-done replacement
    assert [p.name for p in list_checkpoints(root)] == ["step-000001", "step-000002"]
    assert (root / "step-000001" / "optimizer.pt").read_bytes() == b"second"
    assert not list(root.glob(".old-*")) and not list(root.glob(".tmp-*"))


def test_auto_resume_takes_the_newest_checkpoint_whose_iterations_were_recorded(tmp_path: Path):
    """Checkpoint k is written just after iteration k-1 is reported: a run killed before the
    controller wrote that report's line resumes from the older checkpoint and retrains the
    iteration, so no line of metrics.jsonl is missing for good."""
    from streamflow.plan import find_resume
    from workers.models.checkpoint import FORMAT

    for step in (3, 6):
        state = tmp_path / "checkpoints" / f"step-{step:06d}" / "trainer_state.json"
        state.parent.mkdir(parents=True)
        state.write_text(json.dumps({"format": FORMAT, "step": step}))
    cfg = SimpleNamespace(run=SimpleNamespace(resume="auto"))
    assert find_resume(cfg, tmp_path).name == "step-000006"  # no metrics file: the newest
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"iteration": i}) + "\n" for i in range(5)))
    assert find_resume(cfg, tmp_path).name == "step-000003"  # iteration 5's line never written
    metrics.write_text(metrics.read_text() + '{"iteration": 5, "lo')  # torn by the kill
    assert find_resume(cfg, tmp_path).name == "step-000003"
    metrics.write_text("".join(json.dumps({"iteration": i}) + "\n" for i in range(6)))
    assert find_resume(cfg, tmp_path).name == "step-000006"
