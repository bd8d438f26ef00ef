"""On a CUDA device (``@pytest.mark.gpu``: skipped with the reason where torch sees none).

What each test holds the GPU path to:
- the torch rollout engine on the GPU samples the CPU's greedy tokens, with log-probs within fp32
  kernel noise (1e-3) in float32 and within 0.1 mean in bfloat16;
- one trainer step (TriModel forward, AdamW) on the GPU lands within 1e-4 of the CPU's in float32;
  under bf16 autocast the loss is within 2 % and the master weights stay float32;
- a periodic SmolLM2-135M run on one GPU ends ok with every role on cuda and weights broadcast;
- an async run with the reference in the rollout worker ends ok on one GPU;
- vLLM on CUDA receives a broadcast version in its worker (tests/workers/test_vllm_collective.py's
  check on the GPU build);
- ``streamflow bench weights`` runs on the GPU (device-to-device copy as the reference), and
  ``streamflow bench phases --device cuda`` where that bench is part of the tree.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.engines.base import SamplingParams
from workers.engines.torch_rollout import TorchRolloutEngine
from workers.engines.torch_trainer import TorchTrainerEngine
from workers.models.local import TinyModelSpec, build_tiny_model, save_model
from workers.models.tokenizer import build_char_tokenizer, encode_prompt
from workers.rl.packing import PackGroup
from workers.rl.trimodel import TriModel

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _tiny():
    tok = build_char_tokenizer()
    return build_tiny_model(TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2,
                                          num_kv_heads=1, intermediate_size=128), tok), tok


def _generate(device: str, dtype: torch.dtype):
    model, tok = _tiny()
    engine = TorchRolloutEngine(model.to(dtype), tok, device=device)
    prompts = [encode_prompt(tok, p) for p in ("12+34=", "7+8=", "99+1=")]
    out = engine.generate(prompts, 2, SamplingParams(temperature=0.0, max_new_tokens=8))
    return [s.token_ids for g in out for s in g], [s.logprobs for g in out for s in g]


def test_torch_rollout_on_gpu_matches_cpu():
    cpu_tokens, cpu_logp = _generate("cpu", torch.float32)
    gpu_tokens, gpu_logp = _generate("cuda", torch.float32)
    assert gpu_tokens == cpu_tokens
    worst = max(abs(a - b) for x, y in zip(cpu_logp, gpu_logp, strict=True)
                for a, b in zip(x, y, strict=True))
    assert worst < 1e-3, worst
    _, bf16_logp = _generate("cuda", torch.bfloat16)
    first = [abs(x[0] - y[0]) for x, y in zip(cpu_logp, bf16_logp, strict=True)]
    assert sum(first) / len(first) < 0.1, first


def _step(device: str, autocast: torch.dtype | None) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward/backward/AdamW step; parameters as stored (their dtype is checked too)."""
    model, tok = _tiny()
    model = model.to(device)
    tri = TriModel(model, reference=None, autocast_dtype=autocast)
    engine = TorchTrainerEngine(model, lr=1e-3, fp64_accumulation=False)
    groups = [PackGroup(0, encode_prompt(tok, "12+34="), [[5, 6, 7], [8, 9]]),
              PackGroup(1, encode_prompt(tok, "7+8="), [[3, 4, 5, 6]])]
    out = tri.forward(groups, token_budget=256, min_saving=0.0)
    loss = -sum(t.sum() for g in out.policy for t in g)
    engine.backward(loss)
    engine.step(1.0 / 9)
    return float(loss), {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_trainer_step_on_gpu_matches_cpu():
    cpu_loss, cpu_params = _step("cpu", None)
    gpu_loss, gpu_params = _step("cuda", None)
    assert abs(cpu_loss - gpu_loss) < 1e-3 * abs(cpu_loss)
    worst = max(float((cpu_params[k] - gpu_params[k]).abs().max()) for k in cpu_params)
    assert worst < 1e-4, worst
    bf16_loss, bf16_params = _step("cuda", torch.bfloat16)
    assert abs(bf16_loss - cpu_loss) < 0.02 * abs(cpu_loss)
    assert {v.dtype for v in bf16_params.values()} == {torch.float32}  # master weights stay fp32
    moved = max(float((bf16_params[k] - gpu_params[k]).abs().max()) for k in gpu_params)
    assert 0 < moved < 1e-2  # autocast changes the step a little, not the update's size


def _smollm2(tmp_path_factory) -> Path:
    from workers.models.gguf import ConversionError, convert_smollm2

    cached = ROOT / "runs" / "models" / "SmolLM2-135M-Instruct"
    if (cached / "config.json").is_file():
        return cached
    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    try:
        convert_smollm2(out)
    except ConversionError as exc:
        pytest.fail(f"SmolLM2 conversion needed for this test: {exc}")
    return out


def _run_on_one_gpu(run_dir: Path, overrides: list[str]) -> dict:
    """configs/gpu-smollm2.yaml for 2 iterations with ``overrides``; every role on cuda:0 in
    bfloat16, new weights broadcast (gloo: the processes share one GPU). The trainer's record."""
    from streamflow.config import load_config
    from streamflow.controller import run

    cfg = load_config(ROOT / "configs" / "gpu-smollm2.yaml", [
        f"run.output_dir={run_dir}", "run.iterations=2", "data.prompts_per_iteration=8",
        "devices.placement=colocated", "run.progress=false", *overrides])
    summary = run(cfg)
    assert summary.status == "ok"
    workers = run_dir / "workers"
    trainer = json.loads((workers / "trainer-0.json").read_text())
    rollout = json.loads((workers / "rollout-0.json").read_text())
    assert trainer["device"] == "cuda:0" and rollout["device"] == "cuda:0"
    assert trainer["dtype"] == "bfloat16" and trainer["weights_group"]["backend"] == "gloo"
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "broadcast policy version 2:" in log
    return trainer


@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
def test_periodic_run_on_one_gpu_with_a_local_model(tmp_path, engine):
    """The same GPU path with a model built here (nothing to download or convert), on both
    trainer engines."""
    if engine == "deepspeed":
        pytest.importorskip("deepspeed", reason="the deepspeed package is not installed")
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=128, num_layers=2, num_heads=2,
                                           num_kv_heads=1, intermediate_size=256), tok)
    path = save_model(model, tok, tmp_path / "tiny")
    trainer = _run_on_one_gpu(tmp_path / "run", [
        f"model.path={path}", "data.task=arithmetic", "reward.fn=exact_match",
        "rollout.max_new_tokens=8", f"trainer.engine={engine}"])
    assert trainer["engine"] == engine


def test_async_run_on_one_gpu_with_the_reference_in_the_rollout(tmp_path):
    """``bench phases``' async layout on a GPU: the rollout worker holds the frozen reference
    beside its engine on its own device and no reference worker runs."""
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=128, num_layers=2, num_heads=2,
                                           num_kv_heads=1, intermediate_size=256), tok)
    path = save_model(model, tok, tmp_path / "tiny")
    run_dir = tmp_path / "run"
    _run_on_one_gpu(run_dir, [
        f"model.path={path}", "data.task=arithmetic", "reward.fn=exact_match",
        "rollout.max_new_tokens=8", "run.mode=async", "trainer.kl_coef=0.04",
        "reference.placement=rollout"])
    rollout = json.loads((run_dir / "workers" / "rollout-0.json").read_text())
    assert rollout["reference_path"] and rollout["reference_dtype"] == "bfloat16"
    assert not (run_dir / "workers" / "reference-0.json").exists()


def test_periodic_smollm2_run_on_one_gpu(tmp_path, tmp_path_factory):
    from workers.tasks.word import main as write_problems

    model = _smollm2(tmp_path_factory)
    problems = tmp_path / "problems.jsonl"
    assert write_problems([str(problems), "--model", str(model), "--num", "64"]) == 0
    _run_on_one_gpu(tmp_path / "run", [f"model.path={model}", f"data.file={problems}",
                                       "rollout.max_new_tokens=32"])


def test_vllm_on_cuda_receives_a_broadcast_version(tmp_path):
    pytest.importorskip("vllm", reason="the vllm package (streamflow[vllm]) is not installed")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_vllm_collective import check_vllm_collective

    check_vllm_collective(tmp_path, device="cuda")


def test_bench_weights_on_gpu():
    proc = subprocess.run([sys.executable, "-m", "streamflow", "bench", "weights", "--quick",
                           "--json", "--device", "cuda", "--repeats", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {c["device"] for c in report["cases"]} == {"cuda"}
    assert report["best_collective_ratio_to_copy"] > 0


def test_bench_phases_on_gpu():
    pytest.importorskip("bench.phases",
                        reason="bench/phases.py is not part of this tree")
    proc = subprocess.run([sys.executable, "-m", "streamflow", "bench", "phases", "--quick",
                           "--json", "--device", "cuda"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert isinstance(json.loads(proc.stdout.strip().splitlines()[-1]), dict)
