"""Typed configuration of a run: the one place where every knob is declared, defaulted and checked.

Owns: the frozen dataclasses of every section of a run (``RunConfig`` and its sections), loading
them from YAML files and ``key.sub=value`` command-line overrides, and turning them back into
plain dicts / YAML (for ``config.yaml`` in the run directory and ``--dry-run``).

Invariants:
- YAML only *fills values*: files are read with a safe loader (no tags, no eval, no
  interpolation, duplicate keys rejected). The only substitution is ``{name}`` in
  ``run.output_dir``, replaced by ``run.name``.
- Every value is type-checked against the dataclass annotation by one generic converter
  (nested dataclasses, Optional, Literal, tuple, int/float with int accepted for float, strict
  bool). Each section validates its own ranges in ``__post_init__``; ``RunConfig.__post_init__``
  does the cross-field checks. So a ``RunConfig`` that exists is valid, however it was built.
- Every bad input raises a ``ConfigError`` subclass whose one-line message names the full key
  (``trainer.lr``), what was expected and what was given; unknown keys list the allowed keys
  and a "did you mean" suggestion.

To add a knob: add a field with a default and a comment to its section, and (if it has a range)
a check in that section's ``__post_init__``. Loading, overrides, dumping and errors follow.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# --------------------------------------------------------------------------------------------
# Errors


class ConfigError(ValueError):
    """Base of every configuration error. ``key`` is the dotted key at fault ('' = whole file)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.detail = message
        super().__init__(f"{key}: {message}" if key else message)

    def with_prefix(self, prefix: str) -> ConfigError:
        """The same error with its key moved under ``prefix`` (used while descending sections)."""
        key = f"{prefix}.{self.key}" if self.key else prefix
        err = type(self).__new__(type(self))
        ConfigError.__init__(err, key, self.detail)
        return err


class UnknownKeyError(ConfigError):
    """A key that no section declares."""


class ConfigTypeError(ConfigError):
    """A value of the wrong type (e.g. a string where a float is expected)."""


class ConfigValueError(ConfigError):
    """A value of the right type outside its range or allowed choices, or a cross-field conflict."""


class OverrideSyntaxError(ConfigError):
    """A command-line override that is not ``key.sub=value``."""


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigValueError(key, message)


# --------------------------------------------------------------------------------------------
# Sections. Every field has a comment; numeric ranges are declared with _f(default, ge=/gt=/le=)
# and checked by _check_bounds; other rules live in the section's __post_init__.

Mode = Literal["sync", "periodic", "async"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
DType = Literal["float32", "bfloat16"]
# A role's parameter dtype: "auto" = bfloat16 on a GPU, float32 on the CPU
RoleDType = Literal["auto", "float32", "bfloat16"]
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _check_device(value: str) -> None:
    """A role's device: auto (the GPU when there is one), cpu, cuda (GPU placement) or cuda:N."""
    _require(bool(_DEVICE.match(value)), "device",
             f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")
Operation = Literal["+", "-", "*"]


def _f(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    why: str = "",
) -> Any:
    """A numeric field with its allowed range (inclusive ge/le, exclusive gt) and its reason."""
    return field(default=default, metadata={"ge": ge, "gt": gt, "le": le, "why": why})


def _check_bounds(obj: Any) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None or not f.metadata:
            continue
        ge, gt, le = f.metadata["ge"], f.metadata["gt"], f.metadata["le"]
        ok = (ge is None or value >= ge) and (gt is None or value > gt)
        if not (ok and (le is None or value <= le)):
            bounds = [f"{op} {b}" for op, b in ((">=", ge), (">", gt), ("<=", le)) if b is not None]
            why = f" ({f.metadata['why']})" if f.metadata["why"] else ""
            raise ConfigValueError(f.name, f"must be {' and '.join(bounds)}, got {value}{why}")


@dataclass(frozen=True)
class RunSection:
    name: str = "run"  # run name; also names the run directory via {name}
    # sync: stages take turns; periodic: on-policy streaming; async: bounded staleness
    mode: Mode = "periodic"
    iterations: int = _f(10, ge=1)  # RL iterations (= optimizer steps in sync/periodic)
    seed: int = 0  # global seed: model init, sampling, data order
    output_dir: str = "runs/{name}"  # run directory; '{name}' is replaced by run.name
    # None: fresh run; "auto": latest checkpoint in output_dir if any; or a checkpoint path
    resume: str | None = None
    # an output_dir that already holds a run is refused unless this is true (its run files are
    # then deleted first) or run.resume continues it
    overwrite: bool = False
    # async only: max policy versions a trained sample may lag behind the trainer (0 = on-policy)
    max_staleness: int = _f(1, ge=0)
    eval_every: int = _f(1, ge=0)  # evaluate held-out accuracy every N iterations (0 = never)
    # number of held-out evaluation prompts (data.task=file: that many distinct prompts, drawn with
    # data.seed, are removed from training while eval_every > 0)
    eval_prompts: int = _f(64, ge=0)
    checkpoint_every: int = _f(0, ge=0)  # checkpoint every N iterations (0 = only at the end)
    # fail the run when worker processes are not all ready after this long (start-up, model load)
    startup_timeout_s: float = _f(300.0, gt=0)
    # fail the run when no worker reports progress for this long (0 = wait forever)
    stall_timeout_s: float = _f(300.0, ge=0)
    # a worker (or the run's own store node, with store.persist) that dies after it was ready is
    # restarted up to this many times, with backoff; a trainer restart also needs
    # checkpoint_every=1 (streamflow/supervisor.py, docs/faults.md). 0 = any death fails the run
    max_restarts: int = _f(3, ge=0)
    # torch threads this host's compute processes (rollout, reference, trainer, evaluation) share
    # in the streaming modes, handed back and forth by phase: one process at work gets them all,
    # two split them (workers/cores.py). sync uses them all in its one process. 0 = off: each
    # role keeps its own `threads`. Ignored (fixed threads) with trainer.deterministic.
    host_threads: int = _f(0, ge=0, le=1024)
    progress: bool = True  # live display on a TTY; otherwise one log line per iteration
    log_level: LogLevel = "INFO"  # logging level of every process of the run

    def __post_init__(self) -> None:
        _check_bounds(self)
        _require(bool(self.name.strip()), "name", "must be a non-empty string")
        _require(bool(self.output_dir.strip()), "output_dir", "must be a non-empty path")
        _require(
            self.eval_every == 0 or self.eval_prompts > 0,
            "eval_prompts",
            "must be > 0 when eval_every > 0 (set eval_every=0 to disable evaluation)",
        )
        _require(not (self.overwrite and self.resume), "overwrite",
                 "cannot be combined with run.resume (continue the run or replace it, not both)")
        # The only substitution YAML values get: the run directory may be named after the run.
        object.__setattr__(self, "output_dir", self.output_dir.replace("{name}", self.name))


@dataclass(frozen=True)
class TinyModelConfig:
    hidden_size: int = _f(128, ge=1)  # width of the built-in causal LM
    num_layers: int = _f(2, ge=1)  # transformer blocks
    num_heads: int = _f(4, ge=1)  # attention heads; divides hidden_size
    num_kv_heads: int = _f(2, ge=1)  # key/value heads (grouped-query attention); divides num_heads
    intermediate_size: int = _f(256, ge=1)  # MLP width
    seed: int = 0  # seed of the random initialisation (before the warm start)

    def __post_init__(self) -> None:
        _check_bounds(self)
        _require(
            self.hidden_size % self.num_heads == 0,
            "num_heads",
            f"must divide hidden_size ({self.hidden_size}), got {self.num_heads}",
        )
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}",
        )


@dataclass(frozen=True)
class ModelSection:
    path: str | None = None  # local Hugging Face model directory; None = the built-in tiny model
    builtin: TinyModelConfig = field(default_factory=TinyModelConfig)  # used when path is None
    # Built-in model only: supervised warm start, at most this many steps (0 = none)...
    warmstart_steps: int = _f(200, ge=0)
    # ...stopped at the first check where greedy accuracy on training problems reaches this (0 =
    # run every step). Makes the starting policy the same on any machine and thread count.
    warmstart_target_accuracy: float = _f(0.0, ge=0, le=1)
    warmstart_lr: float = _f(1e-3, gt=0)  # learning rate of the warm start
    warmstart_batch_size: int = _f(32, ge=1)  # examples per warm-start step
    dtype: DType = "float32"  # parameter dtype of the policy

    def __post_init__(self) -> None:
        _check_bounds(self)
        if self.path is not None:
            _require(bool(self.path.strip()), "path", "must be a directory path or null")


@dataclass(frozen=True)
class DataSection:
    task: Literal["arithmetic", "file"] = "arithmetic"  # procedural arithmetic, or a prompt file
    digits: int = _f(2, ge=1, le=18)  # arithmetic: max digits per operand
    operations: tuple[Operation, ...] = ("+",)  # arithmetic: operators to draw from
    file: str | None = None  # task=file: a .jsonl or .parquet file (read with pyarrow)
    prompt_column: str = "prompt"  # task=file: column holding the prompt text
    answer_column: str = "answer"  # task=file: column holding the reference answer
    prompts_per_iteration: int = _f(16, ge=1)  # prompts per iteration (rows = x group_size)
    # G: responses sampled per prompt
    group_size: int = _f(8, ge=2, why="GRPO advantages compare responses within a group")
    seed: int = 0  # seed of prompt generation / shuffling (eval prompts are held out from it)

    def __post_init__(self) -> None:
        _check_bounds(self)
        _require(len(self.operations) > 0, "operations", "must list at least one of '+', '-', '*'")
        _require(len(set(self.operations)) == len(self.operations), "operations", "has duplicates")
        if self.task == "file":
            _require(self.file is not None, "file", "is required when data.task is 'file'")
        _require(bool(self.prompt_column), "prompt_column", "must be a non-empty column name")
        _require(bool(self.answer_column), "answer_column", "must be a non-empty column name")


@dataclass(frozen=True)
class RolloutSection:
    # generation engine behind the rollout Protocol ("simulated": no model, see ``simulated``)
    engine: Literal["torch", "vllm", "simulated"] = "torch"
    num_workers: int = _f(1, ge=1)  # rollout worker processes
    # sampling temperature
    temperature: float = _f(1.0, gt=0, why="GRPO needs stochastic samples and finite log-probs")
    top_p: float = _f(1.0, gt=0, le=1)  # nucleus sampling mass
    max_new_tokens: int = _f(16, ge=1)  # generation limit per response
    groups_per_claim: int = _f(4, ge=1)  # prompt groups claimed from the store per micro-batch
    threads: int = _f(1, ge=1)  # torch threads per rollout worker
    # torch engine only: attention kernel ("sdpa": same tokens as "eager", log-probs within 1e-5
    # on the embedded model, faster; `streamflow bench generate`, docs/engines.md) and rows per forward
    # batch of one generate call (0 = the whole claim: groups_per_claim x group_size rows)
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    rows_per_generate: int = _f(0, ge=0)
    # vLLM engine only (engine=vllm): weights dtype ("auto" = the checkpoint's; "float32" matches
    # the trainer's log-probs exactly), context length (None = the model's), KV-cache GiB on CPU,
    # fraction of GPU memory on GPU, and eager mode (no graph capture: faster start, CPU-safe).
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    vllm_max_model_len: int | None = _f(None, ge=16)
    vllm_kv_cache_gib: float = _f(1.0, gt=0)
    vllm_gpu_memory_utilization: float = _f(0.9, gt=0, le=1)
    vllm_enforce_eager: bool = True
    # where the rollout engine runs: auto (a GPU when there is one, see devices.placement), cpu,
    # cuda or cuda:N; and the torch engine's parameter dtype (auto: bfloat16 on GPU, else float32)
    device: str = "auto"
    dtype: RoleDType = "auto"

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check_device(self.device)


_REWARD_FN = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")


@dataclass(frozen=True)
class RewardSection:
    fn: str = "exact_match"  # registry name, or "package.module:function" for a user verifier
    timeout_s: float = _f(2.0, gt=0)  # per-sample scoring timeout; a timeout scores as failed
    num_workers: int = _f(1, ge=1)  # reward worker processes
    rows_per_claim: int = _f(32, ge=1)  # rows claimed per micro-batch
    # a sample whose verifier raised or timed out: "retry" hands it back as a failed delivery
    # (quarantined DEAD after store.max_deliveries, its group left out of training); "zero"
    # scores it 0.0 with reward_ok=false and trains on it
    on_error: Literal["retry", "zero"] = "retry"
    # held-out accuracy counts a prompt as solved when the reward of its greedy response is >= this
    # (1.0: the full score of a 0/1 verifier such as exact_match)
    success_threshold: float = 1.0

    def __post_init__(self) -> None:
        _check_bounds(self)
        _require(
            bool(_REWARD_FN.match(self.fn)),
            "fn",
            f"must be a registry name or 'module.path:function', got {self.fn!r}",
        )


@dataclass(frozen=True)
class ReferenceSection:
    enabled: bool = True  # compute frozen-reference log-probs (forced off when kl_coef == 0)
    placement: Literal["worker", "trainer"] = "worker"  # own worker process, or fused in trainer
    rows_per_claim: int = _f(32, ge=1)  # rows claimed per micro-batch
    threads: int = _f(1, ge=1)  # torch threads of the reference worker
    # dtype of the frozen reference copy (auto: bfloat16 on a GPU, float32 on the CPU)
    dtype: RoleDType = "auto"
    device: str = "auto"  # where the reference runs (auto | cpu | cuda | cuda:N)

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check_device(self.device)


@dataclass(frozen=True)
class TrainerSection:
    # training engine behind the Protocol ("simulated": no model, see ``simulated``)
    engine: Literal["torch", "deepspeed", "simulated"] = "torch"
    lr: float = _f(1e-4, gt=0)  # AdamW learning rate
    weight_decay: float = _f(0.0, ge=0)  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas, each in [0, 1)
    clip_eps: float = _f(0.2, gt=0)  # ratio clip epsilon
    kl_coef: float = _f(0.02, ge=0)  # beta of the k3 KL-to-reference term (0 = no reference)
    std_normalize: bool = True  # divide group-centred rewards by the group std (+eps)
    max_grad_norm: float = _f(1.0, ge=0)  # gradient clipping norm (0 = no clipping)
    rows_per_claim: int = _f(16, ge=1)  # rows per trainer micro-batch
    # optimizer steps per iteration's batch (1: the ratio is exactly 1 when on-policy)
    updates_per_batch: int = _f(1, ge=1)
    importance_correction: bool = False  # async: correct the ratio by behaviour log-probs
    is_cap: float = _f(2.0, ge=1)  # cap of the truncated importance weight
    packing: bool = True  # pack a group as prompt + r1 + r2 + ... (shared-prompt attention; exact)
    # ... in the micro-batches (trainer and reference) whose token saving 1 - packed/unpacked
    # reaches this (0 = every batch). Below it, packing is slower than plain rows: measured with
    # `streamflow bench packing` (docs/engines.md); = workers.packing.DEFAULT_MIN_SAVING
    packing_min_saving: float = _f(0.25, ge=0, le=1)
    token_budget: int = _f(4096, ge=1)  # max tokens per packed micro-batch
    threads: int = _f(1, ge=1)  # torch threads of the trainer (per rank)
    # Bitwise-reproducible updates whatever order groups arrive in: one group per forward/backward
    # and float64 gradient sums (torch engine). Slower (smaller forwards) and 8 bytes/parameter.
    deterministic: bool = False
    # engine=deepspeed: data-parallel ranks started by torch's launcher, and the ZeRO stage
    num_ranks: int = _f(1, ge=1)
    zero_stage: int = _f(2, ge=1, le=2)
    # where the trainer runs (auto | cpu | cuda | cuda:N; deepspeed rank r uses the device after
    # it + r) and its compute dtype: master weights and AdamW stay float32; bfloat16 runs the
    # forward under autocast (auto: bfloat16 on GPU, float32 on the CPU)
    device: str = "auto"
    dtype: RoleDType = "auto"

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check_device(self.device)
        _require(
            all(0 <= b < 1 for b in self.betas), "betas", f"must be in [0, 1), got {self.betas}"
        )
        _require(
            self.num_ranks == 1 or self.engine == "deepspeed",
            "num_ranks",
            f"{self.num_ranks} ranks need engine 'deepspeed' (the torch engine is one process)",
        )


@dataclass(frozen=True)
class SimulatedSection:
    """Simulated devices (``rollout.engine`` and ``trainer.engine`` both ``simulated``): every role
    holds its device for the cost model's time instead of computing (workers/sim/roles.py); the
    controller, workers, store, balancer and modes are the real ones. For capacity planning."""

    cost: str = "7b-1acc"  # cost preset (workers/sim/cost.py; README "Performance" cites its sources)
    time_scale: float = _f(50.0, gt=0)  # simulated seconds per real second
    # response lengths: lognormal with this median and sigma, capped at rollout.max_new_tokens
    median_response_tokens: int = _f(600, ge=1)
    skew: float = _f(1.0, ge=0, le=4)

    def __post_init__(self) -> None:
        _check_bounds(self)
        from workers.engines.sim_cost import PRESETS

        _require(self.cost in PRESETS, "cost", f"must be one of {sorted(PRESETS)}, got {self.cost!r}")


@dataclass(frozen=True)
class StoreSection:
    host: str = "127.0.0.1"  # address the store nodes bind (loopback by default)
    port: int = _f(0, ge=0, le=65535)  # first port of the store nodes (0 = pick free ports)
    num_shards: int = _f(2, ge=1)  # shards of the transfer queue
    lease_seconds: float = _f(30.0, gt=0)  # a claimed row not acked within this is redelivered
    max_deliveries: int = _f(3, ge=1)  # deliveries of a row before it is dropped as poison
    capacity_rows: int = _f(100_000, ge=1)  # back-pressure: puts wait beyond this many live rows
    persist: bool = False  # log the store's data to the run directory (for restart)
    fsync: bool = False  # fsync that log on every write (durable, slower)
    # Store nodes already running (`streamflow store serve`), e.g. "tcp://store:5555"; empty: the
    # run starts its own node. The run's table is (re)created on them at start.
    addresses: tuple[str, ...] = ()
    # Shard coordinator (storage/coordinator.py) in streaming modes: stage workers own shards,
    # rebalanced by live queue depth, and steal from the deepest shard when theirs are empty.
    # Started only when the store has >= 2 shards (one shard has nothing to balance).
    balancer: bool = True

    def __post_init__(self) -> None:
        _check_bounds(self)
        _require(bool(self.host), "host", "must be a non-empty address")
        bad = [a for a in self.addresses if not a.startswith(("tcp://", "ipc://"))]
        _require(not bad, "addresses", f"must be ZeroMQ addresses like tcp://host:port, got {bad}")


@dataclass(frozen=True)
class MetricsSection:
    enabled: bool = True  # serve Prometheus metrics from every process
    host: str = "127.0.0.1"  # address the metrics endpoints bind
    port: int = _f(0, ge=0, le=65535)  # controller's metrics port (0 = pick a free one)

    def __post_init__(self) -> None:
        _check_bounds(self)


_WILDCARDS = ("", "0.0.0.0", "*", "::", "[::]")


@dataclass(frozen=True)
class PlacementNode:
    # what this host's services bind and what the other hosts connect to: a concrete address
    host: str = "127.0.0.1"
    store_nodes: int = _f(0, ge=0)  # store node processes here (store.num_shards shards each)
    rollout: int = _f(0, ge=0)  # rollout worker processes here
    reward: int = _f(0, ge=0)  # reward worker processes here
    reference: int = _f(0, ge=0)  # the reference worker (0 or 1 in all, when one runs)
    trainer: int = _f(0, ge=0)  # trainer ranks here (torch engine: 1 in all; deepspeed: num_ranks)

    def __post_init__(self) -> None:
        _check_bounds(self)
        _require(
            self.host.strip() not in _WILDCARDS,
            "host",
            f"must be an address the other hosts can reach (not a wildcard), got {self.host!r}",
        )


@dataclass(frozen=True)
class PlacementSection:
    # One entry per host of `streamflow launch` (its --node-rank indexes this list); node 0 also
    # runs the coordinator and the controller. Empty: everything on one host (`streamflow run`).
    nodes: tuple[PlacementNode, ...] = ()
    # A node whose launcher is silent this long fails the run; keep it above any network cut the
    # run should ride out (leases expire much sooner and hand the node's rows to others).
    node_timeout_s: float = _f(60.0, gt=0)

    def __post_init__(self) -> None:
        _check_bounds(self)


@dataclass(frozen=True)
class DevicesSection:
    # How the roles whose device is 'auto' or 'cuda' share the GPUs of one host: colocated = all
    # on GPU 0; separate = trainer ranks, reference and each rollout worker on GPUs of their own
    # (streaming modes; one GPU per process); auto = separate when there are enough GPUs, else
    # colocated. Checked against the visible GPUs at --dry-run and at start (streamflow/devices.py).
    placement: Literal["auto", "colocated", "separate"] = "auto"


@dataclass(frozen=True)
class WeightsSection:
    # How a new policy version reaches the rollout workers: file = safetensors in /dev/shm and a
    # reload; collective = the trainer sends it over a torch.distributed group in buckets, copied
    # into the live parameters (workers/weights_collective.py): NCCL broadcast when every process
    # has a GPU of its own, else gloo signals + shared-memory buckets; auto = collective when the
    # trainer is on a GPU and the run is streaming on one host, else file.
    sync: Literal["auto", "file", "collective"] = "auto"
    bucket_mb: float = _f(32.0, gt=0)  # bucket size (MiB; a larger tensor goes alone)
    # a broadcast (or joining the group) that takes longer fails with a clear error; the version
    # then reaches the rollout through its file (the file is always written after the broadcast)
    timeout_s: float = _f(300.0, gt=0)
    host: str = "127.0.0.1"  # address of the group's rendezvous (a TCP store in the controller)
    port: int = _f(0, ge=0, le=65535)  # its port (0 = pick a free one)

    def __post_init__(self) -> None:
        _check_bounds(self)
        _require(bool(self.host.strip()), "host", "must be a non-empty address")


def _check_weights(cfg: RunConfig) -> None:
    """weights.sync=collective needs a group to broadcast to: streaming workers on one host."""
    if cfg.weights.sync != "collective":
        return
    _require(cfg.run.mode != "sync", "weights.sync",
             "'collective' needs run.mode periodic or async (sync runs every role in one process: "
             "there is no group to broadcast to)")
    _require(not cfg.placement.nodes, "weights.sync",
             "'collective' is for one host; across hosts (placement.nodes) use 'file' or 'auto'")
    _require(cfg.rollout.engine != "simulated", "weights.sync",
             "'collective' needs real engines (simulated engines publish version numbers only)")


def _check_placement(cfg: RunConfig) -> None:
    """Cross-section rules of a multi-host placement: every process of the run is placed once."""
    nodes = cfg.placement.nodes
    if not nodes:
        return
    _require(
        cfg.run.mode != "sync",
        "placement.nodes",
        "run.mode 'sync' keeps every role in one process: use periodic or async across hosts",
    )
    reference_worker = (
        cfg.trainer.kl_coef > 0 and cfg.reference.enabled and cfg.reference.placement == "worker"
    )
    wanted = {
        "rollout": (cfg.rollout.num_workers, "rollout.num_workers"),
        "reward": (cfg.reward.num_workers, "reward.num_workers"),
        "reference": (int(reference_worker), "a reference worker (trainer.kl_coef > 0, "
                      "reference.enabled, reference.placement=worker)"),
        "trainer": (cfg.trainer.num_ranks, "trainer.num_ranks"),
    }
    for role, (want, source) in wanted.items():
        placed = sum(getattr(n, role) for n in nodes)
        _require(
            placed == want,
            "placement.nodes",
            f"places {placed} {role} process(es) but the run has {want} ({source})",
        )
    stores = sum(n.store_nodes for n in nodes)
    if cfg.store.addresses:
        _require(stores == 0, "placement.nodes",
                 f"places {stores} store node(s) but store.addresses names external ones")
    else:
        _require(1 <= stores <= 256, "placement.nodes",
                 f"must place between 1 and 256 store nodes (store_nodes), got {stores}")
    ranks = {n.trainer for n in nodes if n.trainer}
    _require(
        len(ranks) <= 1,
        "placement.nodes",
        f"trainer ranks must be spread evenly (torch's launcher starts the same number per host), "
        f"got {sorted(n.trainer for n in nodes if n.trainer)}",
    )


def _check_simulated(cfg: RunConfig) -> None:
    """Simulated engines go together: a simulated trainer publishes version numbers, not weights
    a real rollout engine could load, and a real trainer cannot learn from drawn tokens."""
    rollout, trainer = cfg.rollout.engine == "simulated", cfg.trainer.engine == "simulated"
    if rollout != trainer:
        which = "rollout.engine" if rollout else "trainer.engine"
        raise ConfigError(which, "'simulated' needs rollout.engine and trainer.engine both "
                          f"'simulated' (got rollout.engine={cfg.rollout.engine!r}, "
                          f"trainer.engine={cfg.trainer.engine!r})")
    if not rollout:
        return
    _require(cfg.run.eval_every == 0, "run.eval_every",
             "must be 0 with simulated engines (there is no model to evaluate)")
    _require(cfg.run.resume is None, "run.resume",
             "simulated engines write no checkpoints: there is nothing to resume from")
    _require(cfg.trainer.num_ranks == 1, "trainer.num_ranks",
             "must be 1 with trainer.engine 'simulated' (one simulated trainer device)")


@dataclass(frozen=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)  # the loop: mode, iterations, outputs
    model: ModelSection = field(default_factory=ModelSection)  # policy model and warm start
    data: DataSection = field(default_factory=DataSection)  # prompts and group size
    rollout: RolloutSection = field(default_factory=RolloutSection)  # generation
    reward: RewardSection = field(default_factory=RewardSection)  # verifiers
    reference: ReferenceSection = field(default_factory=ReferenceSection)  # frozen reference
    trainer: TrainerSection = field(default_factory=TrainerSection)  # GRPO update
    store: StoreSection = field(default_factory=StoreSection)  # transfer queue nodes
    metrics: MetricsSection = field(default_factory=MetricsSection)  # Prometheus endpoints
    # hosts of a multi-host run (`streamflow launch`); empty: one host
    placement: PlacementSection = field(default_factory=PlacementSection)
    # the simulated devices of rollout.engine / trainer.engine "simulated" (ignored otherwise)
    simulated: SimulatedSection = field(default_factory=SimulatedSection)
    devices: DevicesSection = field(default_factory=DevicesSection)  # GPUs of one host per role
    weights: WeightsSection = field(default_factory=WeightsSection)  # weight sync path

    def __post_init__(self) -> None:
        # With no KL term the reference log-probs are never used: don't pay for computing them.
        if self.trainer.kl_coef == 0 and self.reference.enabled:
            object.__setattr__(
                self, "reference", dataclasses.replace(self.reference, enabled=False)
            )
        if self.trainer.packing and self.trainer.engine != "simulated":  # (no packing to do)
            longest = self.rollout.max_new_tokens * self.data.group_size
            _require(
                self.trainer.token_budget >= longest,
                "trainer.token_budget",
                f"must hold one packed group (>= rollout.max_new_tokens x data.group_size "
                f"= {longest} tokens plus the prompt), got {self.trainer.token_budget}",
            )
        _check_simulated(self)
        _require(
            self.trainer.engine in ("torch", "simulated") or self.run.mode != "sync",
            "trainer.engine",
            f"'{self.trainer.engine}' trains in its own ranks: use run.mode periodic or async "
            "(sync keeps the trainer inside the controller process)",
        )
        _check_placement(self)
        _check_weights(self)

    @property
    def max_staleness(self) -> int:
        """Policy versions a trained sample may lag: 0 in sync/periodic (on-policy), else the cap."""
        return self.run.max_staleness if self.run.mode == "async" else 0

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output_dir)


def config_warnings(cfg: RunConfig) -> list[str]:
    """Settings that are valid but have no effect in this configuration (printed by the CLI)."""
    notes = []
    if cfg.run.mode != "async" and cfg.run.max_staleness != RunSection.max_staleness:
        notes.append(
            f"run.max_staleness={cfg.run.max_staleness} is ignored in mode '{cfg.run.mode}' "
            "(on-policy: staleness is always 0)"
        )
    if cfg.run.mode != "async" and cfg.trainer.importance_correction:
        notes.append(
            f"trainer.importance_correction has no effect in mode '{cfg.run.mode}' "
            "(behaviour and trained policy are the same version)"
        )
    if cfg.model.path is not None and cfg.model.warmstart_steps > 0:
        notes.append(
            "model.warmstart_steps applies to the built-in model only; ignored with model.path"
        )
    if cfg.data.task != "arithmetic" and cfg.data.digits != DataSection.digits:
        notes.append("data.digits applies to task 'arithmetic' only")
    return notes


# --------------------------------------------------------------------------------------------
# Generic dataclass <-> dict conversion (written once, used for every section).


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_name(args[0])}"
        return f"list of {len(args)} ({', '.join(_type_name(a) for a in args)})"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp`` and return it in the dataclass's representation."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key)
            except ConfigTypeError:
                continue
        raise ConfigTypeError(key, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        # Strict: True must not pass for a Literal[1], nor 1 for Literal["1"].
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        raise ConfigValueError(
            key, f"must be one of {', '.join(repr(c) for c in choices)}; got {value!r}"
        )
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigTypeError(key, f"expected {_type_name(tp)}, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigTypeError(
                key, f"expected {_type_name(tp)}, got {len(value)} items: {value!r}"
            )
        return tuple(
            _convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):  # .inf/.nan are valid YAML but never a sane setting
                raise ConfigValueError(key, f"must be a finite number, got {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"config annotation {tp!r} of {key} is not supported by the converter")
    raise ConfigTypeError(key, f"expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _fields(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation (annotations are strings under `from __future__`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown_key(cls: type, key: str, section: str) -> UnknownKeyError:
    allowed = list(_fields(cls))
    where = f"section '{section}'" if section else "the top level"
    msg = f"unknown key; {where} allows: {', '.join(allowed)}"
    close = difflib.get_close_matches(key, allowed, n=1)
    if close:
        msg += f" (did you mean '{close[0]}'?)"
    return UnknownKeyError(f"{section}.{key}" if section else key, msg)


def from_dict(cls: type[Any], data: Any, section: str = "") -> Any:
    """Build dataclass ``cls`` from a plain mapping, checking keys and types; ``section`` is the
    dotted prefix used in error messages. Missing keys take their defaults."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigTypeError(section, f"expected a mapping of keys, got {data!r}")
    hints = _fields(cls)
    kwargs = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in hints:
            raise _unknown_key(cls, str(key), section)
        kwargs[key] = _convert(hints[key], value, f"{section}.{key}" if section else key)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        # Section __post_init__ checks name the bare field; RunConfig's already name the full key.
        if section and cls is not RunConfig:
            raise err.with_prefix(section) from None
        raise


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain dict of YAML/JSON-safe values (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------------------------
# YAML loading and overrides


class _Loader(yaml.SafeLoader):
    """Safe loader with YAML 1.2 floats (PyYAML reads '1e-4' as a string) and no duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(str(key), f"duplicate key at line {key_node.start_mark.line + 1}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as err:
        raise ConfigError("", f"{where}: invalid YAML: {' '.join(str(err).split())}") from None


_KEY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _field_type(path: list[str], override: str) -> Any:
    """Annotation of the dotted field ``path`` in ``RunConfig`` (unknown keys raise with hints)."""
    tp: Any = RunConfig
    for i, name in enumerate(path):
        if not dataclasses.is_dataclass(tp):
            raise UnknownKeyError(
                ".".join(path),
                f"'{'.'.join(path[:i])}' is a value, not a section (in {override!r})",
            )
        hints = _fields(tp)
        if name not in hints:
            raise _unknown_key(tp, name, ".".join(path[:i]))
        tp = hints[name]
    return tp


def _accepts_str(tp: Any) -> bool:
    if tp is str:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return str in typing.get_args(tp)
    return False


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Apply one ``key.sub=value`` to a raw config tree; the value is parsed as YAML (so
    ``[0.9, 0.99]``, ``null``, ``true``, ``1e-4`` work) and type-checked when the tree is built."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not _KEY.match(key):
        raise OverrideSyntaxError(
            key if sep else "",
            f"bad override {override!r}: expected key.sub=value, e.g. trainer.lr=1e-4",
        )
    path = key.split(".")
    tp = _field_type(path, override)
    value = _parse_yaml(text, f"override {override!r}")
    # A free-form string field keeps the text as typed: run.name=007 is the name '007', not 7.
    if _accepts_str(tp) and value is not None and not isinstance(value, str):
        value = text.strip()
    node = tree
    for name in path[:-1]:
        child = node.get(name)
        if child is None:
            child = node[name] = {}
        if not isinstance(child, dict):
            raise ConfigTypeError(name, f"expected a mapping of keys, got {child!r}")
        node = child
    node[path[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML file (None = all defaults), apply overrides in order, and validate."""
    tree: Any = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise ConfigError("", f"config file not found: {p}") from None
        except OSError as err:
            raise ConfigError("", f"cannot read config file {p}: {err.strerror}") from None
        tree = _parse_yaml(text, str(p))
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise ConfigTypeError("", f"{p}: the top level must be a mapping of sections")
    for override in overrides:
        apply_override(tree, override)
    return from_dict(RunConfig, tree)


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return to_dict(cfg)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    return from_dict(RunConfig, data)


def dump_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML; ``load_config`` of this text gives back an equal config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)
