"""The sections of a run's configuration: every knob of the controller, declared and checked once.

One frozen dataclass per YAML section with defaults, a comment per field, ranges and its own
``check``; the workers' knobs are embedded ``workers.settings`` objects. Cross-section rules live
in ``streamflow.config``; how to add a knob: docs/controller.md "Configuration".
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Literal

from storage.schema import TableSpec
from workers.checked import Checked, bounded, embed, flat, require
from workers.models.spec import TinyModelSpec
from workers.settings import (
    EnvSettings,
    GrpoSettings,
    OptimizerSettings,
    PackingSettings,
    PartialSettings,
    RewardModelSettings,
    RewardSettings,
    SamplingSettings,
    SimulatedDevice,
    TorchGenerateSettings,
    TurnSettings,
    VllmSettings,
)

Mode = Literal["sync", "periodic", "async"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
# A parameter dtype: "auto" = bfloat16 on a GPU, float32 on the CPU
RoleDType = Literal["auto", "float32", "bfloat16"]
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _check_device(value: str) -> None:
    """A role's device: auto (the GPU when there is one), cpu, cuda (GPU placement) or cuda:N."""
    require(bool(_DEVICE.match(value)), "device",
            f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")
Operation = Literal["+", "-", "*"]


@dataclass(frozen=True)
class RunSection(Checked):
    name: str = "run"  # run name; also names the run directory via {name}
    # sync: stages take turns; periodic: on-policy streaming; async: bounded staleness
    mode: Mode = "periodic"
    iterations: int = bounded(10, ge=1)  # RL iterations (= optimizer steps in sync/periodic)
    seed: int = 0  # global seed: model init, sampling, data order
    output_dir: str = "runs/{name}"  # run directory; '{name}' is replaced by run.name
    # None: fresh run; "auto": latest checkpoint in output_dir if any; or a checkpoint path
    resume: str | None = None
    # an output_dir that already holds a run is refused unless this is true (its run files are
    # then deleted first) or run.resume continues it
    overwrite: bool = False
    # async only: max policy versions a trained sample may lag behind the trainer (0 = on-policy)
    max_staleness: int = bounded(1, ge=0)
    eval_every: int = bounded(1, ge=0)  # evaluate held-out accuracy every N iterations (0 = never)
    # number of held-out evaluation prompts (data.task=file: that many distinct prompts, chosen by
    # the held-out rule on their canonical form, whatever the seed, leave training while
    # eval_every > 0; docs/training.md "Tasks")
    eval_prompts: int = bounded(64, ge=0)
    checkpoint_every: int = bounded(0, ge=0)  # checkpoint every N iterations (0 = only at the end)
    # fail the run when worker processes are not all ready after this long (start-up, model load)
    startup_timeout_s: float = bounded(300.0, gt=0)
    # fail the run when no worker reports progress for this long (0 = wait forever)
    stall_timeout_s: float = bounded(300.0, ge=0)
    # a worker (or the run's own store node, with store.persist) that dies after it was ready is
    # restarted up to this many times, with backoff; a trainer restart also needs
    # checkpoint_every=1 (streamflow/supervisor.py, docs/faults.md). 0 = any death fails the run
    max_restarts: int = bounded(3, ge=0)
    # torch threads this host's compute processes (rollout, reference, trainer, evaluation) share
    # in the streaming modes, handed back and forth by phase: one process at work gets them all,
    # two split them (workers/runtime/cores.py). sync uses them all in its one process. 'auto' =
    # the CPUs this process may run on; 0 = off: each role keeps its own `threads`. Ignored
    # (fixed threads) with trainer.deterministic.
    host_threads: int | Literal["auto"] = bounded("auto", ge=0, le=1024)

    def host_thread_budget(self, deterministic: bool) -> int:
        """``host_threads`` as a count (0 = off): 'auto' resolved on this host."""
        if deterministic:  # thread counts that move by phase would move the last bits
            return 0
        if self.host_threads == "auto":
            return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else os.cpu_count() or 1
        return self.host_threads
    progress: bool = True  # live display on a TTY; otherwise one log line per iteration
    log_level: LogLevel = "INFO"  # logging level of every process of the run
    # draw plots/rewards.png and plots/timeline.png when the run ends (off: sweeps of throwaway
    # runs; `streamflow report RUN` draws missing plots later from the files)
    plots: bool = True
    # record who wrote each row's cells, when, with which policy version, and its tool calls, in
    # RUN/trace/*.parquet (`streamflow trace RUN`; docs/partial.md "The trace")
    trace: bool = True

    def check(self) -> None:
        require(bool(self.name.strip()), "name", "must be a non-empty string")
        require(bool(self.output_dir.strip()), "output_dir", "must be a non-empty path")
        require(self.eval_every == 0 or self.eval_prompts > 0, "eval_prompts",
                "must be > 0 when eval_every > 0 (set eval_every=0 to disable evaluation)")
        require(not (self.overwrite and self.resume), "overwrite",
                "cannot be combined with run.resume (continue the run or replace it, not both)")
        # The only substitution YAML values get: the run directory may be named after the run.
        object.__setattr__(self, "output_dir", self.output_dir.replace("{name}", self.name))


@dataclass(frozen=True)
class TinyModelConfig(Checked):
    # the defaults are the embedded model's own (workers.models.spec.TinyModelSpec)
    hidden_size: int = bounded(TinyModelSpec.hidden_size, ge=1)  # width of the built-in causal LM
    num_layers: int = bounded(TinyModelSpec.num_layers, ge=1)  # transformer blocks
    # attention heads; divides hidden_size
    num_heads: int = bounded(TinyModelSpec.num_heads, ge=1)
    # key/value heads (grouped-query); divides num_heads
    num_kv_heads: int = bounded(TinyModelSpec.num_kv_heads, ge=1)
    intermediate_size: int = bounded(TinyModelSpec.intermediate_size, ge=1)  # MLP width
    seed: int = TinyModelSpec.seed  # seed of the random initialisation (before the warm start)

    def check(self) -> None:
        require(self.hidden_size % self.num_heads == 0, "num_heads",
                f"must divide hidden_size ({self.hidden_size}), got {self.num_heads}")
        require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}")


@dataclass(frozen=True)
class ModelSection(Checked):
    path: str | None = None  # local Hugging Face model directory; None = the built-in tiny model
    builtin: TinyModelConfig = field(default_factory=TinyModelConfig)  # used when path is None
    # Built-in model only: supervised warm start, at most this many steps (0 = none)...
    warmstart_steps: int = bounded(200, ge=0)
    # ...stopped at the first check where greedy accuracy on training problems reaches this (0 =
    # run every step). Makes the starting policy the same on any machine and thread count.
    warmstart_target_accuracy: float = bounded(0.0, ge=0, le=1)
    warmstart_lr: float = bounded(1e-3, gt=0)  # learning rate of the warm start
    warmstart_batch_size: int = bounded(32, ge=1)  # examples per warm-start step
    # the fraction of warm-start examples written as a plain-form calculator tape,
    # "12*34=" -> "(=12*34=)408 408" (the observation masked out of the loss), so that RL
    # starts from a model that sometimes calls the tool (0: answers only; configs/agentic.yaml)
    warmstart_tool_fraction: float = bounded(0.0, ge=0, le=1)
    # dtype of every role whose own dtype (rollout/reference/trainer.dtype) is "auto"
    dtype: RoleDType = "auto"

    def check(self) -> None:
        if self.path is not None:
            require(bool(self.path.strip()), "path", "must be a directory path or null")


@dataclass(frozen=True)
class DataSection(Checked):
    # procedural arithmetic, a prompt file, or "hub": the tasks of env.hub's taskset
    task: Literal["arithmetic", "file", "hub"] = "arithmetic"
    digits: int = bounded(2, ge=1, le=18)  # arithmetic: max digits per operand
    operations: tuple[Operation, ...] = ("+",)  # arithmetic: operators to draw from
    file: str | None = None  # task=file: a .jsonl or .parquet file (read with pyarrow)
    prompt_column: str = "prompt"  # task=file: column holding the prompt text
    answer_column: str = "answer"  # task=file: column holding the reference answer
    prompts_per_iteration: int = bounded(16, ge=1)  # prompts per iteration (rows = x group_size)
    # G: responses sampled per prompt
    group_size: int = bounded(8, ge=2, why="GRPO advantages compare responses within a group")
    seed: int = 0  # seed of prompt generation / shuffling (the held-out split does not depend on it)

    def check(self) -> None:
        require(len(self.operations) > 0, "operations", "must list at least one of '+', '-', '*'")
        require(len(set(self.operations)) == len(self.operations), "operations", "has duplicates")
        if self.task == "file":
            require(self.file is not None, "file", "is required when data.task is 'file'")
        require(bool(self.prompt_column), "prompt_column", "must be a non-empty column name")
        require(bool(self.answer_column), "answer_column", "must be a non-empty column name")


@flat
@dataclass(frozen=True)
class RolloutSection(Checked):
    # generation engine behind the rollout Protocol ("simulated": no model, see ``simulated``)
    engine: Literal["torch", "vllm", "simulated"] = "torch"
    num_workers: int = bounded(1, ge=1)  # rollout worker processes
    sampling: SamplingSettings = embed(SamplingSettings)  # temperature, top_p, max_new_tokens
    # max_turns, max_total_tokens: multi-turn tool use (> 1 turn: the env.* section answers)
    turns: TurnSettings = embed(TurnSettings)
    # partial, partial_max_cuts: partial rollout across weight updates (docs/partial.md)
    cuts: PartialSettings = embed(PartialSettings)
    groups_per_claim: int = bounded(4, ge=1)  # prompt groups claimed from the store per micro-batch
    threads: int = bounded(1, ge=1)  # torch threads per rollout worker
    # torch engine only: attn_implementation, rows_per_generate
    generate: TorchGenerateSettings = embed(TorchGenerateSettings)
    vllm: VllmSettings = embed(VllmSettings)  # vllm_* keys: engine=vllm only
    # where the rollout engine runs: auto (a GPU when there is one, see devices.placement), cpu,
    # cuda or cuda:N; and the torch engine's parameter dtype (auto: model.dtype)
    device: str = "auto"
    dtype: RoleDType = "auto"

    def check(self) -> None:
        _check_device(self.device)


@flat
@dataclass(frozen=True)
class RewardSection(Checked):
    verifier: RewardSettings = embed(RewardSettings)  # fn, timeout_s, on_error
    # model, template, judge*, combine, *_weight, normalize: a reward model (docs/rewards.md)
    scorer: RewardModelSettings = embed(RewardModelSettings)
    num_workers: int = bounded(1, ge=1)  # reward worker processes
    rows_per_claim: int = bounded(32, ge=1)  # rows claimed per micro-batch
    # held-out accuracy counts a prompt as solved when the reward of its greedy response is >= this
    # (1.0: the full score of a 0/1 verifier such as exact_match)
    success_threshold: float = 1.0
    # with reward.model: where the reward model runs (auto | cpu | cuda | cuda:N; placed by the
    # devices.placement rules like the other roles) and its dtype (auto: model.dtype)
    device: str = "auto"
    dtype: RoleDType = "auto"
    # `streamflow model train-reward`: train until the accuracy on validation responses (to
    # training-split prompts it does not train on) reaches this (0: no target, every epoch of
    # the cap runs), at most train_max_epochs epochs (reaching the cap is reported: "cap hit");
    # the best epoch's weights are kept either way
    train_target_accuracy: float = bounded(0.93, ge=0, le=1)
    train_max_epochs: int = bounded(40, ge=1)
    # a run refuses a reward model whose manifest (reward_manifest.json, written by train-reward)
    # records a held-out accuracy below this (0: never refuses), unless allow_weak; a model
    # without a manifest (your own) is not checked, with a note
    min_accuracy: float = bounded(0.85, ge=0, le=1)
    allow_weak: bool = False  # start RL from a reward model below min_accuracy anyway
    # reward hacking, watched during a run (metrics.jsonl `reward_hacking`, the live panel, the
    # report): the mean held-out accuracy of the last hacking_window evaluations is at least
    # hacking_drop below the best such mean earlier in the run while the mean reward over the
    # iterations they span is above the reward when that best window began (docs/rewards.md
    # "Reward hacking")
    hacking_window: int = bounded(3, ge=2)
    hacking_drop: float = bounded(0.1, gt=0, le=1)

    def check(self) -> None:
        _check_device(self.device)


@flat
@dataclass(frozen=True)
class EnvSection(Checked):
    """The environment workers of a multi-turn run (rollout.max_turns > 1; no effect otherwise):
    they answer the tool call that ended a model turn (tasks env.{t})."""

    # fn, tools, format, max_observation_tokens, timeout_s, mcp_command / mcp_url, sandbox.*
    settings: EnvSettings = embed(EnvSettings)
    num_workers: int = bounded(1, ge=1)  # environment worker processes (CPU only)
    rows_per_claim: int = bounded(32, ge=1)  # rows claimed per micro-batch


_AGENT_FN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class AgentSection(Checked):
    """A user's agent that drives the run through the OpenAI-compatible gateway (docs/agents.md):
    with ``fn`` set, each prompt is an episode of that agent; its calls are the trajectory's
    turns (at most rollout.max_turns), the env.* workers do not run."""

    # "package.module:function", called as fn(base_url, api_key, prompt, answer) -> reward
    # (a number, or None: the run's verifier scores the trajectory); None: no agent
    fn: str | None = None
    num_workers: int = bounded(1, ge=1)  # agent worker processes
    episodes_per_worker: int = bounded(16, ge=1)  # episodes one agent worker runs at once
    timeout_s: float = bounded(300.0, gt=0)  # an episode's agent is killed past this
    host: str = "127.0.0.1"  # the gateway's address
    port: int = bounded(0, ge=0, le=65535)  # the gateway's port (0: a free one, fixed per run)
    # a call waits this long for its turn (generation, admission and weight loads included)
    call_timeout_s: float = bounded(600.0, gt=0)

    def check(self) -> None:
        require(self.fn is None or bool(_AGENT_FN.match(self.fn)), "fn",
                f"must be 'package.module:function', got {self.fn!r}")
        require(bool(self.host), "host", "must be a non-empty address")


@dataclass(frozen=True)
class ReferenceSection(Checked):
    """Where the frozen reference runs; whether one runs is trainer.kl_coef's (0: none anywhere)."""

    # own worker process, fused into the trainer's pass, or run by each rollout worker on what it
    # generated (docs/training.md "The reference role")
    placement: Literal["worker", "trainer", "rollout"] = "worker"
    # reference worker processes (placement 'worker'), sharing the rows through the store (and
    # the balancer) as rollout and reward workers do; all of them on reference.device
    num_workers: int = bounded(1, ge=1)
    rows_per_claim: int = bounded(32, ge=1)  # rows claimed per micro-batch
    threads: int = bounded(1, ge=1)  # torch threads of each reference worker
    # dtype of the frozen reference copy (auto: model.dtype)
    dtype: RoleDType = "auto"
    device: str = "auto"  # where the reference runs (auto | cpu | cuda | cuda:N)

    def check(self) -> None:
        _check_device(self.device)


@flat
@dataclass(frozen=True)
class TrainerSection(Checked):
    # training engine behind the Protocol ("simulated": no model, see ``simulated``)
    engine: Literal["torch", "deepspeed", "simulated"] = "torch"
    # lr, warmup_steps, weight_decay, betas, max_grad_norm
    optim: OptimizerSettings = embed(OptimizerSettings)
    # loss, advantage, clip_eps(_low/_high), kl_coef, std_normalize, updates_per_batch,
    # importance_correction, is_cap, overlong_buffer/_penalty (the keys: GrpoSettings's fields)
    grpo: GrpoSettings = embed(GrpoSettings)
    rows_per_claim: int = bounded(16, ge=1)  # rows per trainer micro-batch
    # attn_implementation, packing, packing_min_saving, token_budget (trainer and reference
    # forwards)
    pack: PackingSettings = embed(PackingSettings)
    threads: int = bounded(1, ge=1)  # torch threads of the trainer (per rank)
    # Bitwise-reproducible updates whatever order groups arrive in: one group per forward/backward
    # and float64 gradient sums (torch engine). Slower (smaller forwards) and 8 bytes/parameter.
    deterministic: bool = False
    # Train iteration k only once every row of k is ready, instead of streaming its groups as
    # they complete: the separate-pools baseline of the Periodic Asynchrony paper (pools take
    # turns; `streamflow bench simulate` compares it). Off for real runs: it only adds waiting.
    whole_iterations: bool = False
    # engine=deepspeed: data-parallel ranks started by torch's launcher (and the ZeRO stage);
    # engine=simulated: data-parallel simulated devices modelled in the one trainer process
    num_ranks: int = bounded(1, ge=1)
    zero_stage: int = bounded(2, ge=1, le=2)
    # where the trainer runs (auto | cpu | cuda | cuda:N; deepspeed rank r uses the device after
    # it + r) and its compute dtype: master weights and AdamW stay float32; bfloat16 runs the
    # forward under autocast (auto: model.dtype)
    device: str = "auto"
    dtype: RoleDType = "auto"

    def check(self) -> None:
        _check_device(self.device)
        require(self.num_ranks == 1 or self.engine in ("deepspeed", "simulated"), "num_ranks",
                f"{self.num_ranks} ranks need engine 'deepspeed' or 'simulated' (the torch engine "
                "is one process)")


@flat
@dataclass(frozen=True)
class SimulatedSection(Checked):
    """Simulated devices (``rollout.engine`` and ``trainer.engine`` both ``simulated``): every role
    holds its device for the cost model's time instead of computing (workers/engines/simulated.py);
    the controller, workers, store, balancer and modes are the real ones. For capacity planning."""

    device: SimulatedDevice = embed(SimulatedDevice)  # cost, time_scale, median tokens, skew

    def check(self) -> None:
        from workers.engines.sim_cost import PRESETS  # (standard library only)

        require(self.device.cost in PRESETS, "cost",
                f"must be one of {sorted(PRESETS)}, got {self.device.cost!r}")


@dataclass(frozen=True)
class StoreSection(Checked):
    host: str = "127.0.0.1"  # address the store nodes bind (loopback by default)
    port: int = bounded(0, ge=0, le=65535)  # first port of the store nodes (0 = pick free ports)
    num_shards: int = bounded(2, ge=1)  # shards of the transfer queue
    # a claimed row not acked within this is redelivered (the table's limits below default to the
    # store's own, declared once in storage.schema.TableSpec)
    lease_seconds: float = bounded(TableSpec.lease_seconds, gt=0)
    # deliveries of a row before it is quarantined as poison
    max_deliveries: int = bounded(TableSpec.max_deliveries, ge=1)
    # back-pressure: puts wait while the table holds this many rows
    capacity_rows: int = bounded(TableSpec.capacity_rows, ge=1)
    persist: bool = False  # log the store's data to the run directory (for restart)
    # fsync that log on every write (TableSpec.fsync "always"; false: "never"): durable, slower
    fsync: bool = False
    # Store nodes already running (`streamflow store serve`), e.g. "tcp://store:5555"; empty: the
    # run starts its own node. The run's table is (re)created on them at start.
    addresses: tuple[str, ...] = ()
    # Shard coordinator (storage/coordinator.py) in streaming modes: stage workers own shards,
    # rebalanced by live queue depth, and steal from the deepest shard when theirs are empty.
    # Started only when the store has >= 2 shards (one shard has nothing to balance).
    balancer: bool = True

    def check(self) -> None:
        require(bool(self.host), "host", "must be a non-empty address")
        bad = [a for a in self.addresses if not a.startswith(("tcp://", "ipc://"))]
        require(not bad, "addresses", f"must be ZeroMQ addresses like tcp://host:port, got {bad}")


@dataclass(frozen=True)
class MetricsSection(Checked):
    enabled: bool = True  # serve Prometheus metrics from every process
    host: str = "127.0.0.1"  # address the metrics endpoints bind
    port: int = bounded(0, ge=0, le=65535)  # controller's metrics port (0 = pick a free one)


_WILDCARDS = ("", "0.0.0.0", "*", "::", "[::]")


@dataclass(frozen=True)
class PlacementNode(Checked):
    # what this host's services bind and what the other hosts connect to: a concrete address
    host: str = "127.0.0.1"
    store_nodes: int = bounded(0, ge=0)  # store node processes here (store.num_shards shards each)
    rollout: int = bounded(0, ge=0)  # rollout worker processes here
    reward: int = bounded(0, ge=0)  # reward worker processes here
    reference: int = bounded(0, ge=0)  # reference worker processes here (reference.num_workers)
    # environment worker processes here (env.num_workers when rollout.max_turns > 1)
    environment: int = bounded(0, ge=0)
    # trainer ranks here (torch and simulated: 1 process in all; deepspeed: num_ranks)
    trainer: int = bounded(0, ge=0)

    def check(self) -> None:
        require(self.host.strip() not in _WILDCARDS, "host",
                f"must be an address the other hosts can reach (not a wildcard), got {self.host!r}")


@dataclass(frozen=True)
class PlacementSection(Checked):
    # One entry per host of `streamflow launch` (its --node-rank indexes this list); node 0 also
    # runs the coordinator and the controller. Empty: everything on one host (`streamflow run`).
    nodes: tuple[PlacementNode, ...] = ()
    # A node whose launcher is silent this long fails the run; keep it above any network cut the
    # run should ride out (leases expire much sooner and hand the node's rows to others).
    node_timeout_s: float = bounded(60.0, gt=0)


@dataclass(frozen=True)
class DevicesSection(Checked):
    # How the roles whose device is 'auto' or 'cuda' share the GPUs of one host: colocated = all
    # on GPU 0; separate = trainer ranks, reference and each rollout worker on GPUs of their own
    # (streaming modes; one GPU per process); auto = separate when there are enough GPUs, else
    # colocated. Checked against the visible GPUs at --dry-run and at start (streamflow/devices.py).
    placement: Literal["auto", "colocated", "separate"] = "auto"


@dataclass(frozen=True)
class WeightsSection(Checked):
    # How a new policy version reaches the rollout workers: file = safetensors in /dev/shm and a
    # reload; collective = the trainer sends it over a torch.distributed group in buckets, copied
    # into the live parameters (workers/weights/group.py): NCCL broadcast when every process
    # has a GPU of its own, else gloo signals + shared-memory buckets; auto = collective when the
    # trainer is on a GPU and the run is streaming on one host, else file.
    sync: Literal["auto", "file", "collective"] = "auto"
    bucket_mb: float = bounded(32.0, gt=0)  # bucket size (MiB; a larger tensor goes alone)
    # a broadcast (or joining the group) that takes longer fails with a clear error; the version
    # then reaches the rollout through its file (the file is always written after the broadcast)
    timeout_s: float = bounded(300.0, gt=0)
    host: str = "127.0.0.1"  # address of the group's rendezvous (a TCP store in the controller)
    port: int = bounded(0, ge=0, le=65535)  # its port (0 = pick a free one)

    def check(self) -> None:
        require(bool(self.host.strip()), "host", "must be a non-empty address")
