"""`streamflow bench weights --quick --json`: the embedded model by file and by collective."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"model", "path", "device", "bytes", "seconds", "gb_per_s", "ratio_to_copy"}


def test_quick_bench_prints_table_then_the_json_line():
    proc = subprocess.run(
        [sys.executable, "-m", "streamflow", "bench", "weights", "--quick", "--json",
         "--device", "cpu", "--repeats", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1  # --json: stdout holds only the JSON line; the table is on stderr
    report = json.loads(lines[-1])
    assert "gloo+shm" in proc.stderr and "safetensors" in proc.stderr
    cases = report["cases"]
    assert [(c["model"], c["path"], c["transport"]) for c in cases] == [
        ("embedded", "file", "safetensors"), ("embedded", "collective", "gloo+shm"),
        ("embedded", "collective", "gloo+broadcast")]
    from workers.models.local import TinyModelSpec, build_tiny_model
    from workers.models.tokenizer import build_char_tokenizer

    model = build_tiny_model(TinyModelSpec(), build_char_tokenizer())
    want = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for c in cases:
        assert FIELDS <= set(c) and c["device"] == "cpu"
        assert c["bytes"] == want  # every name once, the tied alias as its own copy
        assert c["seconds"] > 0
        assert abs(c["gb_per_s"] - c["bytes"] / c["seconds"] / 1e9) < 0.01 * c["gb_per_s"] + 1e-3
        assert c["ratio_to_copy"] == round(c["gb_per_s"] / c["copy_gb_per_s"], 4) or abs(
            c["ratio_to_copy"] - c["gb_per_s"] / c["copy_gb_per_s"]) < 1e-3
    best = max(c["ratio_to_copy"] for c in cases if c["path"] == "collective")
    assert report["best_collective_ratio_to_copy"] == best
    assert report["notes"] == []


def test_cuda_without_a_gpu_is_a_one_line_error():
    import torch

    if torch.cuda.is_available():  # covered by tests/workers/test_gpu.py on a GPU
        return
    proc = subprocess.run(
        [sys.executable, "-m", "streamflow", "bench", "weights", "--quick", "--device", "cuda"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--device cuda: no CUDA device is visible")
