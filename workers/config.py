"""Typed configuration of one worker process, as the controller hands it over (a JSON file that
round-trips exactly; unknown fields are an error). See docs/engines.md, "Worker configuration".

Invariant: a knob of the run has one default, the run config's. A record carries the run's
settings objects (``workers.settings``) whole, and every other value that comes from a YAML key is
a field with no default, which ``streamflow.plan`` fills; a field with a default is the worker's
own (no YAML key). tests/test_knobs.py holds every record to this.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from workers.checked import embed, flat
from workers.runtime.cores import CoreShareConfig
from workers.settings import (
    AgentSettings,
    GrpoSettings,
    OptimizerSettings,
    PackingSettings,
    PartialSettings,
    RewardModelSettings,
    RewardSettings,
    SamplingSettings,
    SimulatedDevice,
    TorchGenerateSettings,
    VllmSettings,
)


@dataclass
class WorkerCommon:
    """What every worker needs: who it is, where the store and the controller are."""

    name: str  # unique worker name, e.g. "rollout-0"
    role: str  # rollout | reward | reference | trainer
    store_addresses: list[str]  # one ZeroMQ address per store node
    table: str  # the run's samples table
    seed: int  # run.seed
    threads: int  # torch intra-op threads of this process (<role>.threads; a reward worker: 1)
    # run.trace: the worker reports what it did to each micro-batch (workers.runtime.trace)
    trace_rows: bool
    events_address: str | None = None  # controller's PULL socket (None: keep reports in memory)
    claim_timeout_s: float = 1.0  # one server-side wait; the loop re-checks for shutdown after it
    metrics_host: str | None = None  # serve Prometheus /metrics on this address (None: off)
    metrics_port: int = 0  # 0 = pick a free port (reported in WorkerStatus "ready")
    # a store request unanswered this long (beyond its own wait) raises Unavailable: a dead or
    # restarting store node is noticed in seconds, not the client's 30 s default
    request_timeout_s: float = 10.0
    # the run's coordinator (storage.coordinator): stages claim from the shards it assigns them,
    # stealing from the deepest other shard when theirs are empty; None: claim from any shard
    coordinator_address: str | None = None
    # not None: this worker runs the ``simulated`` engine of its role on this device
    simulated: SimulatedDevice | None = None
    # not None: ``threads`` is ignored; the worker takes its share of the host's thread budget at
    # every compute phase (workers.runtime.cores)
    cores: CoreShareConfig | None = None


@dataclass
class WeightGroupConfig:
    """Collective weight sync (``workers.weights.group``): where the group meets and who we
    are in it. None on a worker config: weights go by file only."""

    address: str  # host:port of the controller's TCP store (the rendezvous)
    rank: int  # 0 = trainer, i + 1 = rollout worker i
    world_size: int  # 1 + rollout workers
    # nccl when every member has a GPU of its own; gloo otherwise (CPU, or processes sharing a GPU:
    # NCCL refuses two ranks on one device, gloo stages CUDA tensors through host memory)
    backend: str
    bucket_bytes: int  # weights.bucket_mb
    timeout_s: float  # weights.timeout_s
    # gloo: "shm" = the bytes go through shared-memory buckets in shm_dir (one host), gloo only
    # signals; "broadcast" = the bytes travel in the collective (always with nccl)
    transport: str = "broadcast"
    shm_dir: str = ""

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return host, int(port)


@flat
@dataclass
class RolloutWorkerConfig:
    common: WorkerCommon
    model_path: str  # HF directory of the initial policy (version 0) and its tokenizer
    weights_dir: str  # where the trainer publishes policy versions
    weights_announce: str | None  # trainer's PUB address for version announcements
    group_size: int
    groups_per_claim: int
    engine: str  # torch | vllm | simulated
    device: str  # cpu | cuda:N (resolved by the controller, streamflow/devices.py)
    dtype: str  # torch engine's parameter dtype
    reference_dtype: str  # the reference copy's (used with reference_path only)
    # the turns are an agent's calls through the gateway (agent.fn set): piece 0 row by row, and
    # only the agent ends a trajectory (workers.agent.pieces.Rules.agent_driven)
    agent_driven: bool
    sampling: SamplingSettings = embed(SamplingSettings)
    weight_wait_s: float = 600.0  # longest wait for a required policy version
    generate: TorchGenerateSettings = embed(TorchGenerateSettings)  # torch engine only
    vllm: VllmSettings = embed(VllmSettings)  # ignored by the torch engine
    # trainer on another host: its WeightServer; versions are copied into weights_dir (local)
    weights_fetch: str | None = None
    weights_group: WeightGroupConfig | None = None  # collective weight sync (None: files)
    # reference.placement=rollout: the frozen reference this worker scores its responses with,
    # on its own device (None: another role writes ref_logprobs, or the KL term is off)
    reference_path: str | None = None
    reference_pack: PackingSettings = field(default_factory=PackingSettings)  # trainer.pack
    # multi-turn tool use (workers.agent.pieces): None = single-turn
    agent: AgentSettings | None = None
    # partial rollout (docs/partial.md): partial, partial_max_cuts
    cuts: PartialSettings = embed(PartialSettings)


@flat
@dataclass
class RewardWorkerConfig:
    common: WorkerCommon
    model_path: str  # for the tokenizer (responses are decoded to text for the verifier)
    rows_per_claim: int
    # the reward model's device and dtype, reward.device / reward.dtype resolved by the plan
    # (streamflow/devices.py; "cpu" and the dtype resolved there without reward.model)
    model_device: str
    model_dtype: str
    hub: str | None  # env.hub: the taskset whose rewards score with reward.fn "hub"
    verifier: RewardSettings = embed(RewardSettings)  # fn, timeout_s, on_error, env_reward
    agent: AgentSettings | None = None  # multi-turn: the trajectory columns it reads
    # reward.model and how its score is read and combined (model None: the verifier alone)
    scorer: RewardModelSettings = embed(RewardModelSettings)
    # partial rollout: with ``agent``, how many pieces a trajectory's row may hold
    cuts: PartialSettings = embed(PartialSettings)


@dataclass
class EnvironmentWorkerConfig:
    """The environment role (workers.roles.environment): answers the tool calls of every turn."""

    common: WorkerCommon
    model_path: str  # for the tokenizer (turns are decoded, observations encoded)
    rows_per_claim: int
    agent: AgentSettings  # max_turns > 1: the env.{k} tasks it serves, its environment, budgets
    # partial rollout: a cut adds a piece, so the env.{k} tasks it serves depend on the cuts too
    cuts: PartialSettings = embed(PartialSettings)


@flat
@dataclass
class ReferenceWorkerConfig:
    common: WorkerCommon
    model_path: str  # the frozen reference (the initial policy unless configured otherwise)
    rows_per_claim: int
    dtype: str
    device: str  # cpu | cuda:N
    sampling: SamplingSettings = embed(SamplingSettings)  # its temperature: the rollout's
    pack: PackingSettings = embed(PackingSettings)


@flat
@dataclass
class TrainerWorkerConfig:
    common: WorkerCommon
    model_path: str  # initial policy (version 0)
    reference_path: str | None  # fused reference (placement=trainer); None when not fused
    weights_dir: str
    weights_bind: str | None  # PUB address for version announcements
    rows_per_iteration: int  # prompts_per_iteration * group_size
    iterations: int
    group_size: int
    # ref_logprobs come from the store (the reference worker or the rollout writes them)
    reference_in_store: bool
    rows_per_claim: int
    reference_dtype: str  # the fused reference's (used with reference_path only)
    checkpoint_every: int
    engine: str  # torch | deepspeed | simulated
    deterministic: bool  # one group per forward + fp64 gradient sums (bitwise updates)
    whole_iterations: bool  # train an iteration only once all its rows are ready
    num_ranks: int  # deepspeed: ranks started by torch's launcher (must match its world size)
    zero_stage: int  # deepspeed: ZeRO stage 1 or 2
    device: str  # cpu | cuda:N: rank 0's device (deepspeed rank r: cuda:N+r)
    dtype: str  # compute dtype: bfloat16 = forward under autocast, fp32 master weights
    # the most tokens of one response: rollout.max_new_tokens (multi-turn: max_total_tokens);
    # dr_grpo's constant normaliser and the overlong shaping's budget
    max_response_tokens: int
    optim: OptimizerSettings = embed(OptimizerSettings)
    # kl_coef is the run's trainer.kl_coef, the KL term's one switch (0: no reference anywhere)
    grpo: GrpoSettings = embed(GrpoSettings)  # the objective (its keys are trainer.*)
    sampling: SamplingSettings = embed(SamplingSettings)  # its temperature: the rollout's
    pack: PackingSettings = embed(PackingSettings)
    # partial rollout: the trainer claims response_version_runs (its per-token staleness)
    cuts: PartialSettings = embed(PartialSettings)
    checkpoint_dir: str | None = None
    start_iteration: int = 0  # first iteration to train (overridden by resume_from's step)
    resume_from: str | None = None  # checkpoint directory (workers.models.checkpoint) to continue from
    checkpoint_keep: int = 2  # complete checkpoints kept (the newest ones)
    weights_keep: int = 4  # published versions kept on disk (older ones are unlinked)
    weights_serve: str | None = None  # serve published versions to other hosts (ROUTER bind)
    weights_group: WeightGroupConfig | None = None  # collective weight sync (None: files)
    def __post_init__(self) -> None:
        # A KL term without reference log-probs would fail mid-step: refuse the record instead.
        if self.grpo.kl_coef > 0 and not (self.reference_path or self.reference_in_store):
            raise ValueError(f"kl_coef={self.grpo.kl_coef} needs a reference (reference_path or "
                             "reference_in_store); set kl_coef=0 to train without one")


@dataclass
class GatewayWorkerConfig:
    """The gateway (workers.gateway) of a gateway run (agent.fn): the OpenAI-compatible endpoint
    whose calls are the turns of the episodes' rows."""

    common: WorkerCommon
    model_path: str  # for the tokenizer and its chat template
    agent: AgentSettings  # max_turns, max_total_tokens, env.format (plain or chat template)
    host: str  # agent.host
    port: int  # agent.port, resolved: a restarted gateway takes the same one
    secret: str  # the run's episode-key secret (hex), shared with the agent workers
    call_timeout_s: float  # agent.call_timeout_s
    lease_seconds: float  # store.lease_seconds
    # JSON lines, one per answered call: what it fed the model and the turn it answered with
    # (the exact-token check); None: not kept
    served_log: str | None = None


@dataclass
class AgentWorkerConfig:
    """An agent worker (workers.roles.agent): runs the user's agent once per episode."""

    common: WorkerCommon
    fn: str  # agent.fn
    gateway_url: str  # http://host:port of the run's gateway
    secret: str  # the run's episode-key secret (hex)
    episodes: int  # agent.episodes_per_worker
    timeout_s: float  # agent.timeout_s
    call_timeout_s: float  # agent.call_timeout_s (how long an episode's end may wait)
    attempts: int  # store.max_deliveries: runs of an agent that makes no call


WorkerConfig = (RolloutWorkerConfig | RewardWorkerConfig | ReferenceWorkerConfig
                | TrainerWorkerConfig | EnvironmentWorkerConfig | GatewayWorkerConfig
                | AgentWorkerConfig)
ROLE_CONFIGS: dict[str, type] = {
    "rollout": RolloutWorkerConfig,
    "reward": RewardWorkerConfig,
    "reference": ReferenceWorkerConfig,
    "trainer": TrainerWorkerConfig,
    "environment": EnvironmentWorkerConfig,
    "gateway": GatewayWorkerConfig,
    "agent": AgentWorkerConfig,
}

T = TypeVar("T")


def to_json(config: WorkerConfig) -> str:
    return json.dumps(dataclasses.asdict(config), indent=2, sort_keys=True)


def _build(cls: type[T], data: dict[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    kwargs = {}
    for key, value in data.items():  # a mapping where a (maybe optional) dataclass goes: build it
        options = (hints[key], *typing.get_args(hints[key]))
        inner = [a for a in options if dataclasses.is_dataclass(a)]
        if inner and isinstance(value, dict):
            value = _build(inner[0], value)
        elif typing.get_origin(hints[key]) is tuple and isinstance(value, list):
            value = tuple(value)  # (JSON has lists only)
        kwargs[key] = value
    return cls(**kwargs)


def from_json(role: str, text: str) -> WorkerConfig:
    if role not in ROLE_CONFIGS:
        raise ValueError(f"unknown role {role!r}; roles: {sorted(ROLE_CONFIGS)}")
    return _build(ROLE_CONFIGS[role], json.loads(text))
