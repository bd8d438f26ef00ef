"""Devices per role: placement on one host's GPUs, dtypes, and one-line errors (at --dry-run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import streamflow.devices as devices
from streamflow.config import ConfigValueError, load_config
from streamflow.devices import resolve_devices, visible_gpus, weight_sync_path

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def cfg(*overrides: str):
    return load_config(TINY, ["run.output_dir=/nonexistent/x", *overrides])


def test_no_gpu_puts_every_role_on_the_cpu_in_float32():
    d = resolve_devices(cfg("rollout.num_workers=2"), gpus=0)
    assert d.rollout == ("cpu", "cpu") and d.trainer == "cpu" and d.reference == "cpu"
    assert (d.rollout_dtype, d.reference_dtype, d.trainer_dtype) == ("float32",) * 3
    assert weight_sync_path(cfg(), d) == "file"


def test_one_gpu_colocates_every_role_in_bfloat16():
    d = resolve_devices(cfg("rollout.num_workers=2"), gpus=1)
    assert d.rollout == ("cuda:0", "cuda:0") and d.trainer == "cuda:0" and d.reference == "cuda:0"
    assert (d.rollout_dtype, d.reference_dtype, d.trainer_dtype) == ("bfloat16",) * 3
    assert weight_sync_path(cfg(), d) == "collective"  # auto: the trainer is on a GPU
    assert weight_sync_path(cfg("run.mode=sync"), resolve_devices(cfg("run.mode=sync"), 1)) == "file"


def test_enough_gpus_give_each_process_its_own():
    # tiny.yaml: kl_coef > 0 and a reference worker: trainer 1 + reference 1 + rollout 2 = 4
    d = resolve_devices(cfg("rollout.num_workers=2"), gpus=4)
    assert (d.trainer, d.reference, d.rollout) == ("cuda:0", "cuda:1", ("cuda:2", "cuda:3"))
    # too few for separate: auto falls back to colocated; sync mode always colocates
    assert resolve_devices(cfg("rollout.num_workers=2"), gpus=3).rollout == ("cuda:0", "cuda:0")
    assert resolve_devices(cfg("run.mode=sync"), gpus=4).rollout == ("cuda:0",)
    assert resolve_devices(cfg("devices.placement=colocated"), gpus=4).reference == "cuda:0"


def test_explicit_devices_and_dtypes_are_kept():
    d = resolve_devices(cfg("rollout.device=cuda:1", "trainer.device=cpu",
                            "trainer.dtype=float32", "reference.dtype=float32"), gpus=2)
    assert d.rollout == ("cuda:1",) and d.trainer == "cpu"
    assert (d.rollout_dtype, d.trainer_dtype, d.reference_dtype) == ("bfloat16", "float32",
                                                                     "float32")
    assert resolve_devices(cfg("rollout.dtype=float32"), gpus=1).rollout_dtype == "float32"


def test_model_dtype_is_the_dtype_of_roles_left_auto():
    d = resolve_devices(cfg("model.dtype=float32", "trainer.dtype=bfloat16"), gpus=1)
    assert (d.rollout_dtype, d.reference_dtype, d.trainer_dtype) == ("float32", "float32",
                                                                     "bfloat16")
    d = resolve_devices(cfg("model.dtype=bfloat16", "trainer.device=cpu"), gpus=1)
    assert d.trainer == "cpu" and d.trainer_dtype == "bfloat16"


@pytest.mark.parametrize(("overrides", "gpus", "key", "words"), [
    (("rollout.device=cuda",), 0, "rollout.device", "no CUDA device is visible"),
    (("trainer.device=cuda:0",), 0, "trainer.device", "no CUDA device is visible"),
    (("reference.device=cuda:3",), 2, "reference.device", "cuda:3 does not exist (2 GPU(s)"),
    (("devices.placement=separate", "rollout.num_workers=2"), 2, "devices.placement",
     "'separate' needs 4 GPUs (trainer 1 + reference 1 + rollout 2), 2 visible"),
    (("trainer.engine=deepspeed", "trainer.num_ranks=2", "trainer.device=cuda"), 1,
     "trainer.num_ranks", "need GPUs cuda:0..cuda:1"),
])
def test_device_errors_name_the_key(overrides, gpus, key, words):
    with pytest.raises(ConfigValueError) as err:
        resolve_devices(cfg(*overrides), gpus=gpus)
    assert err.value.key == key
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("text", "key"), [
    ("rollout.device=gpu", "rollout.device"),
    ("trainer.device=cuda:x", "trainer.device"),
    ("trainer.dtype=float16", "trainer.dtype"),
])
def test_bad_device_values_are_config_errors(text, key):
    with pytest.raises(ConfigValueError) as err:
        cfg(text)
    assert err.value.key == key


@pytest.mark.parametrize(("overrides", "words"), [
    (("run.mode=sync",), "needs run.mode periodic or async"),
    (("rollout.engine=simulated", "trainer.engine=simulated", "run.eval_every=0"),
     "needs real engines"),
])
def test_collective_sync_needs_a_group(overrides, words):
    with pytest.raises(ConfigValueError) as err:
        cfg("weights.sync=collective", *overrides)
    assert err.value.key == "weights.sync" and words in str(err.value)


def test_visible_gpus_honours_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(devices, "_driver_gpus", lambda: 4)
    for env, want in (("", 0), ("-1", 0), ("1,3", 2), ("0,1,2,3,4,5", 4)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
        assert visible_gpus() == want, env
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus() == 4


def _dry_run(*overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, whatever this machine has
    return subprocess.run([sys.executable, "-m", "streamflow", "run", TINY, *overrides,
                           "--dry-run"], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=60)


def test_dry_run_refuses_cuda_without_a_gpu_in_one_line():
    proc = _dry_run("trainer.device=cuda")
    assert proc.returncode == 2, proc.stdout
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "trainer.device" in lines[0] and "no CUDA device" in lines[0]
    ok = _dry_run("trainer.device=auto")
    assert ok.returncode == 0, ok.stderr


def test_worker_checks_its_device_with_torch():
    import torch

    from workers.runtime.devices import dtype_of, torch_device

    assert torch_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        assert torch_device("cuda:0", offset=count - 1) == torch.device("cuda", count - 1)
        with pytest.raises(RuntimeError, match=f"cuda:{count} does not exist"):
            torch_device(f"cuda:{count}")
    else:
        with pytest.raises(RuntimeError, match="'cuda:1' asked for but this process sees no CUDA"):
            torch_device("cuda:1")
    assert dtype_of("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        dtype_of("float16")


def test_a_reference_in_the_rollout_sits_on_the_rollouts_device():
    d = resolve_devices(cfg("reference.placement=rollout", "rollout.num_workers=2"), gpus=4)
    # no reference process: trainer 1 + rollout 2 GPUs, the reference copy on the rollout's
    assert (d.trainer, d.rollout, d.reference) == ("cuda:0", ("cuda:1", "cuda:2"), "cuda:1")
    assert d.reference_dtype == d.rollout_dtype == "bfloat16"


def test_a_vllm_rollout_sees_only_its_own_gpu_counted_among_the_visible_ones():
    from workers.runtime.devices import pin_visible_gpu

    # cuda:N is entry N of the list the process was started with, not physical GPU N
    env = {"CUDA_VISIBLE_DEVICES": "4, 7"}
    assert pin_visible_gpu("cuda:1", env) == "cuda:0" and env["CUDA_VISIBLE_DEVICES"] == "7"
    env = {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}  # UUIDs pass through as they are
    assert pin_visible_gpu("cuda:0", env) == "cuda:0" and env["CUDA_VISIBLE_DEVICES"] == "GPU-aa"
    env = {}  # nothing hidden: the index is the physical one
    assert pin_visible_gpu("cuda:3", env) == "cuda:0" and env["CUDA_VISIBLE_DEVICES"] == "3"
    for spec in ("cpu", "cuda"):  # nothing to pin: left as it is
        env = {"CUDA_VISIBLE_DEVICES": "2,3"}
        assert pin_visible_gpu(spec, env) == spec and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    with pytest.raises(RuntimeError, match=r"'cuda:2' does not exist \(2 GPU\(s\) visible"):
        pin_visible_gpu("cuda:2", env)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"  # unchanged by the refusal
    with pytest.raises(RuntimeError, match=r"'cuda:0' does not exist \(0 GPU"):
        pin_visible_gpu("cuda:0", {"CUDA_VISIBLE_DEVICES": "-1"})
