"""Which device and dtype each process of a run gets, and whether this host has the GPUs for it.

``visible_gpus`` probes without torch; ``resolve_devices`` is pure (config + GPU count ->
``RoleDevices``) and raises one-line ``ConfigValueError``s naming the key. Placement and dtype
rules: docs/controller.md "Devices".
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass

from streamflow.config import ConfigValueError, RunConfig


def _driver_gpus() -> int:
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def visible_gpus() -> int:
    """GPUs this process's children would see (without importing torch)."""
    physical = _driver_gpus()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return physical
    entries = [e for e in env.replace(" ", "").split(",") if e]
    if not entries or entries[0].startswith("-"):  # "" or "-1": CUDA hides every device
        return 0
    return min(len(entries), physical)


@dataclass(frozen=True)
class RoleDevices:
    """Device string per process and dtype name per role, as the workers receive them."""

    gpus: int  # GPUs visible when resolved
    rollout: tuple[str, ...]  # one per rollout worker
    reference: str
    trainer: str  # rank 0's; deepspeed rank r uses index + r on CUDA
    rollout_dtype: str
    reference_dtype: str
    trainer_dtype: str  # compute (autocast) dtype; master weights stay float32
    # one per reward worker: the reward model's device ("cpu" without reward.model) and dtype
    reward: tuple[str, ...]
    reward_dtype: str


def _dtype(choice: str, model: str, device: str) -> str:
    """A role's dtype: its own, else model.dtype, else by device (bfloat16 on a GPU)."""
    for name in (choice, model):
        if name != "auto":
            return name
    return "bfloat16" if device.startswith("cuda") else "float32"


def _check_index(key: str, device: str, gpus: int) -> None:
    if not device.startswith("cuda"):
        return
    if gpus == 0:
        raise ConfigValueError(key, f"{device!r} asked for but no CUDA device is visible "
                                    "(set it to 'auto' or 'cpu', or check CUDA_VISIBLE_DEVICES)")
    index = int(device.partition(":")[2] or 0)
    if index >= gpus:
        raise ConfigValueError(key, f"{device} does not exist ({gpus} GPU(s) visible: "
                                    f"cuda:0..cuda:{gpus - 1})")


def resolve_devices(cfg: RunConfig, gpus: int) -> RoleDevices:
    """Every process's device for ``gpus`` visible GPUs (docs/controller.md "Devices")."""
    r, t, ref = cfg.rollout, cfg.trainer, cfg.reference
    rew = cfg.reward
    for key, device in (("rollout.device", r.device), ("trainer.device", t.device),
                        ("reference.device", ref.device), ("reward.device", rew.device)):
        if device == "cuda":
            _check_index(key, device, gpus)
    streaming = cfg.run.mode != "sync"
    rollouts = r.num_workers if streaming else 1
    refs = int(cfg.reference_worker and streaming)
    # reward workers hold a model only with reward.model (a verifier needs no GPU)
    scorers = (rew.num_workers if streaming else 1) if rew.model is not None else 0
    need = t.num_ranks + refs + rollouts + scorers
    placement = cfg.devices.placement
    if placement == "separate" and gpus < need:
        raise ConfigValueError(
            "devices.placement",
            f"'separate' needs {need} GPUs (trainer {t.num_ranks} + reference {refs} + rollout "
            f"{rollouts}{f' + reward model {scorers}' if scorers else ''}), {gpus} visible "
            "(use 'colocated' or 'auto')")
    separate = gpus >= need and (placement == "separate" or (placement == "auto" and streaming))

    def pick(device: str, slot: int) -> str:
        if device == "cpu" or device.startswith("cuda:"):
            return device
        return f"cuda:{slot if separate else 0}" if gpus else "cpu"

    trainer = pick(t.device, 0)
    if trainer.startswith("cuda") and t.engine == "deepspeed":
        base = int(trainer.partition(":")[2] or 0)
        if base + t.num_ranks > gpus:
            raise ConfigValueError(
                "trainer.num_ranks", f"{t.num_ranks} DeepSpeed ranks from {trainer} need GPUs "
                f"cuda:{base}..cuda:{base + t.num_ranks - 1} (NCCL: one GPU per rank), "
                f"{gpus} visible")
    reference = pick(ref.device, t.num_ranks)
    rollout = tuple(pick(r.device, t.num_ranks + refs + i) for i in range(r.num_workers))
    first = t.num_ranks + refs + rollouts
    reward = tuple(pick(rew.device, first + i) if scorers else "cpu"
                   for i in range(rew.num_workers))
    for key, device in (("trainer.device", trainer), ("reference.device", reference),
                        *(("rollout.device", d) for d in rollout),
                        *(("reward.device", d) for d in reward)):
        _check_index(key, device, gpus)
    if cfg.reference_in_rollout:  # each rollout worker holds the reference on its own device
        reference = rollout[0]
    if r.engine == "simulated":  # simulated roles hold no model: nothing to place
        rollout = tuple("cpu" for _ in rollout)
        trainer = reference = "cpu"
        reward = tuple("cpu" for _ in reward)
    return RoleDevices(gpus=gpus, rollout=rollout, reference=reference, trainer=trainer,
                       rollout_dtype=_dtype(r.dtype, cfg.model.dtype, rollout[0]),
                       reference_dtype=_dtype(ref.dtype, cfg.model.dtype, reference),
                       trainer_dtype=_dtype(t.dtype, cfg.model.dtype, trainer),
                       reward=reward, reward_dtype=_dtype(rew.dtype, cfg.model.dtype, reward[0]))


def weight_sync_path(cfg: RunConfig, devices: RoleDevices) -> str:
    """'file' or 'collective' for this run (``weights.sync``; auto: collective when the trainer is
    on a GPU and the run streams on one host with real engines)."""
    if cfg.weights.sync != "auto":
        return cfg.weights.sync
    one_host = not cfg.placement.nodes and cfg.run.mode != "sync"
    real = cfg.rollout.engine != "simulated"
    return "collective" if one_host and real and devices.trainer.startswith("cuda") else "file"


def check_devices(cfg: RunConfig) -> RoleDevices:
    """``resolve_devices`` against this host's GPUs (the --dry-run check)."""
    return resolve_devices(cfg, visible_gpus())
