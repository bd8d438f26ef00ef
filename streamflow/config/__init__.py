"""Typed configuration of a run: every knob of a run declared, defaulted and checked once.

Owns ``RunConfig`` (one field per YAML section), the cross-section rules, the no-effect warnings
and ``load_config`` / ``dump_yaml``; the one import point of ``sections`` and ``convert``. A
``RunConfig`` that exists is valid; every bad input is a one-line ``ConfigError`` naming the full
key. Invariants: docs/controller.md "Configuration".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from streamflow.config.convert import (
    ConfigError,
    ConfigTypeError,
    ConfigValueError,
    OverrideSyntaxError,
    UnknownKeyError,
    apply_override,
    from_dict,
    parse_yaml,
    to_dict,
)
from streamflow.config.sections import (
    AgentSection,
    DataSection,
    DevicesSection,
    EnvSection,
    MetricsSection,
    ModelSection,
    PlacementNode,
    PlacementSection,
    ReferenceSection,
    RewardSection,
    RolloutSection,
    RunSection,
    SimulatedSection,
    StoreSection,
    TinyModelConfig,
    TrainerSection,
    WeightsSection,
)
from workers.checked import require

__all__ = [  # (re-exported: the sections and errors callers import from here)
    "AgentSection", "ConfigError", "ConfigTypeError", "ConfigValueError", "DataSection", "DevicesSection",
    "EnvSection", "MetricsSection", "ModelSection", "OverrideSyntaxError", "PlacementNode", "PlacementSection",
    "ReferenceSection", "RewardSection", "RolloutSection", "RunConfig", "RunSection",
    "SimulatedSection", "StoreSection", "TinyModelConfig", "TrainerSection", "UnknownKeyError",
    "WeightsSection", "config_from_dict", "config_to_dict", "config_warnings", "dump_yaml",
    "from_dict", "load_config", "to_dict",
]


def _check_weights(cfg: RunConfig) -> None:
    """weights.sync=collective needs a group to broadcast to: streaming workers on one host."""
    if cfg.weights.sync != "collective":
        return
    require(cfg.run.mode != "sync", "weights.sync",
            "'collective' needs run.mode periodic or async (sync runs every role in one process: "
            "there is no group to broadcast to)")
    require(not cfg.placement.nodes, "weights.sync",
            "'collective' is for one host; across hosts (placement.nodes) use 'file' or 'auto'")
    require(cfg.rollout.engine != "simulated", "weights.sync",
            "'collective' needs real engines (simulated engines publish version numbers only)")


def _check_placement(cfg: RunConfig) -> None:
    """Cross-section rules of a multi-host placement: every process of the run is placed once."""
    nodes = cfg.placement.nodes
    if not nodes:
        return
    require(cfg.run.mode != "sync", "placement.nodes",
            "run.mode 'sync' keeps every role in one process: use periodic or async across hosts")
    wanted = {
        "rollout": (cfg.rollout.num_workers, "rollout.num_workers"),
        "reward": (cfg.reward.num_workers, "reward.num_workers"),
        "reference": (cfg.reference.num_workers if cfg.reference_worker else 0,
                      "reference.num_workers, when trainer.kl_coef > 0 and "
                      "reference.placement=worker"),
        "environment": (cfg.env.num_workers if cfg.multi_turn else 0,
                        "env.num_workers, when rollout.max_turns > 1"),
        "trainer": (cfg.trainer.num_ranks if cfg.trainer.engine == "deepspeed" else 1,
                    "trainer.num_ranks with engine deepspeed, else 1 process"),
    }
    for role, (want, source) in wanted.items():
        placed = sum(getattr(n, role) for n in nodes)
        require(placed == want, "placement.nodes",
                f"places {placed} {role} process(es) but the run has {want} ({source})")
    stores = sum(n.store_nodes for n in nodes)
    if cfg.store.addresses:
        require(stores == 0, "placement.nodes",
                f"places {stores} store node(s) but store.addresses names external ones")
    else:
        require(1 <= stores <= 256, "placement.nodes",
                f"must place between 1 and 256 store nodes (store_nodes), got {stores}")
    ranks = [n.trainer for n in nodes if n.trainer]
    require(len(set(ranks)) <= 1, "placement.nodes", "trainer ranks must be spread evenly "
            f"(torch's launcher starts the same number per host), got {sorted(ranks)}")


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
    require(cfg.run.eval_every == 0, "run.eval_every",
            "must be 0 with simulated engines (there is no model to evaluate)")
    require(cfg.run.resume is None, "run.resume",
            "simulated engines write no checkpoints: there is nothing to resume from")
    require(cfg.simulated.devices == 1 or cfg.run.mode == "sync", "simulated.devices",
            "must be 1 in the streaming modes (one simulated device per worker: use "
            "rollout/reward/reference.num_workers and trainer.num_ranks)")
    require(not cfg.reference_in_rollout, "reference.placement",
            "'rollout' needs a real rollout engine (a simulated one holds no model to score "
            "with): use 'worker' or 'trainer'")


def _check_turns(cfg: RunConfig) -> None:
    """Multi-turn trajectories (rollout.max_turns > 1) are assembled across workers, turn by turn,
    from real tokens (the model context bound is the preflight's: it reads the model)."""
    if not cfg.multi_turn:
        return
    require(not cfg.reference_in_rollout, "reference.placement",
            f"'rollout' cannot score a trajectory of rollout.max_turns={cfg.rollout.max_turns} "
            "(its turns are generated by different claims, its observations written by the "
            "environment): use 'worker' or 'trainer', or rollout.max_turns=1")
    require(cfg.rollout.engine != "simulated", "rollout.max_turns",
            f"{cfg.rollout.max_turns} needs a real rollout engine (simulated engines draw "
            "token counts, not text a tool call can be parsed from): use 1")


def _check_partial(cfg: RunConfig) -> None:
    """Partial rollout continues a cut generation with newer weights: only async admits a
    version newer than the rows' own."""
    if not cfg.rollout.partial:
        return
    require(cfg.run.mode == "async", "rollout.partial",
            f"needs run.mode async (got {cfg.run.mode!r}): a cut generation is continued with "
            "newer weights, which only async admits")


def _check_dynamic(cfg: RunConfig) -> None:
    """Dynamic sampling (workers.rl.dynamic): its largest put (prompts_per_iteration x
    trainer.oversample_cap prompts) must fit the store (a put over a table's capacity is
    refused). A group of one sample, which never has reward variance, is refused by
    data.group_size's own bound."""
    if not cfg.trainer.grpo.dynamic:
        return
    d = cfg.data
    rows = math.ceil(d.prompts_per_iteration * cfg.trainer.oversample_cap - 1e-9) * d.group_size
    require(cfg.store.capacity_rows >= rows, "trainer.oversample_cap",
            f"{cfg.trainer.oversample_cap} makes puts of up to {rows} rows (data."
            f"prompts_per_iteration x it x data.group_size), over store.capacity_rows="
            f"{cfg.store.capacity_rows}")


def _check_objective(cfg: RunConfig) -> None:
    """Combinations of trainer.loss / trainer.advantage and their knobs that contradict each
    other or the generation budget (docs/training.md "Objectives")."""
    t = cfg.trainer
    require(not (t.loss == "dr_grpo" and t.advantage == "reinforce_pp"), "trainer.advantage",
            "'reinforce_pp' divides advantages by the batch's reward std, which loss 'dr_grpo' "
            "exists to remove: use advantage grpo or rloo with dr_grpo")
    correction = t.grpo.resolved(cfg.run.mode).correction
    require(cfg.rollout.top_p >= 1.0 or correction == "off" or cfg.rollout.engine == "simulated",
            "rollout.top_p", f"{cfg.rollout.top_p} < 1 with trainer.importance_correction "
            f"{correction!r} (run.mode {cfg.run.mode}): behaviour log-probs are not those of the "
            "truncated distribution on every engine (docs/engines.md); use rollout.top_p 1 or "
            "trainer.importance_correction off")
    budget, key = ((cfg.rollout.max_total_tokens, "rollout.max_total_tokens") if cfg.multi_turn
                   else (cfg.rollout.max_new_tokens, "rollout.max_new_tokens"))
    require(t.overlong_buffer is None or t.overlong_buffer <= budget, "trainer.overlong_buffer",
            f"{t.overlong_buffer} is longer than the generation budget ({key}={budget}): the "
            "penalty would start before any response could be long")


def _check_reward_model(cfg: RunConfig) -> None:
    """A reward model scores single-turn text from real engines; group normalisation claims
    whole groups (docs/rewards.md). Its directory and template are preflight's (it reads files)."""
    w = cfg.reward
    if w.model is None:
        return
    require(cfg.rollout.engine != "simulated", "reward.model",
            "needs real engines (simulated engines draw token counts, not text to score)")
    require(not cfg.multi_turn, "reward.model",
            f"scores single-turn responses (rollout.max_turns={cfg.rollout.max_turns}): use "
            "rollout.max_turns=1 or a verifier (reward.fn)")
    require(w.normalize != "group" or w.rows_per_claim >= cfg.data.group_size,
            "reward.rows_per_claim", f"{w.rows_per_claim} is smaller than a group "
            f"(data.group_size={cfg.data.group_size}): reward.normalize=group claims whole groups")


def _check_agent(cfg: RunConfig) -> None:
    """A gateway run (agent.fn): the agent's calls are the turns of a streaming, one-host run."""
    if cfg.agent.fn is None:
        return
    require(cfg.multi_turn, "rollout.max_turns",
            "must be >= 2 with agent.fn (each of the agent's calls is a turn), got 1")
    require(cfg.run.mode != "sync", "agent.fn",
            "needs run.mode periodic or async (the agent and the gateway run as processes)")
    require(not cfg.placement.nodes, "agent.fn",
            "runs on one host for now (placement.nodes must be empty)")
    require(not cfg.partial, "rollout.partial", "is not supported with agent.fn")
    require(cfg.rollout.engine != "simulated", "agent.fn", "needs a real rollout engine")


def _check_hub(cfg: RunConfig) -> None:
    """data.task and reward.fn "hub" take their part of env.hub's environment (env.fn "hub" is
    checked with env.hub itself, in workers.settings.EnvSettings)."""
    for key, used in (("data.task", cfg.data.task == "hub"), ("reward.fn", cfg.reward.fn == "hub")):
        require(not used or cfg.env.hub is not None, key, "'hub' needs env.hub: the hub "
                "taskset (docs/agents.md \"Environments from a hub\")")


@dataclass(frozen=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)  # the loop: mode, iterations, outputs
    model: ModelSection = field(default_factory=ModelSection)  # policy model and warm start
    data: DataSection = field(default_factory=DataSection)  # prompts and group size
    rollout: RolloutSection = field(default_factory=RolloutSection)  # generation
    reward: RewardSection = field(default_factory=RewardSection)  # verifiers
    reference: ReferenceSection = field(default_factory=ReferenceSection)  # frozen reference
    trainer: TrainerSection = field(default_factory=TrainerSection)  # GRPO update
    # the environment workers of multi-turn trajectories (rollout.max_turns > 1)
    env: EnvSection = field(default_factory=EnvSection)
    # a user's agent driving the run through the OpenAI-compatible gateway (docs/agents.md)
    agent: AgentSection = field(default_factory=AgentSection)
    store: StoreSection = field(default_factory=StoreSection)  # transfer queue nodes
    metrics: MetricsSection = field(default_factory=MetricsSection)  # Prometheus endpoints
    # hosts of a multi-host run (`streamflow launch`); empty: one host
    placement: PlacementSection = field(default_factory=PlacementSection)
    # the simulated devices of rollout.engine / trainer.engine "simulated" (ignored otherwise)
    simulated: SimulatedSection = field(default_factory=SimulatedSection)
    devices: DevicesSection = field(default_factory=DevicesSection)  # GPUs of one host per role
    weights: WeightsSection = field(default_factory=WeightsSection)  # weight sync path

    def __post_init__(self) -> None:
        if self.trainer.packing and self.trainer.engine != "simulated":  # (no packing to do)
            # a multi-turn response is its turns and observations: max_total_tokens at most
            response, key = ((self.rollout.max_total_tokens, "rollout.max_total_tokens")
                             if self.multi_turn else
                             (self.rollout.max_new_tokens, "rollout.max_new_tokens"))
            longest = response * self.data.group_size
            require(self.trainer.token_budget >= longest, "trainer.token_budget",
                    f"must hold one packed group (>= {key} x data.group_size "
                    f"= {longest} tokens plus the prompt), got {self.trainer.token_budget}")
        _check_simulated(self)
        require(self.trainer.engine in ("torch", "simulated") or self.run.mode != "sync",
                "trainer.engine", f"'{self.trainer.engine}' trains in its own ranks: use run.mode "
                "periodic or async (sync keeps the trainer inside the controller process)")
        _check_turns(self)
        _check_partial(self)
        _check_objective(self)
        _check_placement(self)
        _check_weights(self)
        _check_dynamic(self)
        _check_reward_model(self)
        _check_agent(self)
        _check_hub(self)

    @property
    def multi_turn(self) -> bool:
        """Trajectories of several model turns with tool calls between them: the env.* workers
        run and the table has the env.{k} tasks (workers.schema.samples_table_spec)."""
        return self.rollout.max_turns > 1

    @property
    def gateway(self) -> bool:
        """A user's agent drives the run (agent.fn): the gateway and agent workers run, the
        env.* workers do not (workers.schema.samples_table_spec(gateway=True))."""
        return self.agent.fn is not None

    @property
    def partial(self) -> bool:
        """Partial rollout: cut generations continue with newer weights (the table has the part
        columns and the resume tasks, workers.schema.samples_table_spec)."""
        return self.rollout.partial

    @property
    def tool_format(self) -> str:
        """env.format resolved: "auto" is the plain form for the built-in character model (its
        tokens are characters: the short (=expr=) marker), hermes for a model.path."""
        if self.env.format != "auto":
            return self.env.format
        return "plain" if self.model.path is None else "hermes"

    @property
    def kl_active(self) -> bool:
        """The KL term is on, so a frozen reference runs where reference.placement says: the one
        switch is trainer.kl_coef (0 = no KL term and no reference anywhere)."""
        return self.trainer.kl_coef > 0

    @property
    def reference_worker(self) -> bool:
        """Reference log-probs come from a reference worker (not fused into the trainer)."""
        return self.kl_active and self.reference.placement == "worker"

    @property
    def reference_in_rollout(self) -> bool:
        """Each rollout worker scores its responses with the reference and writes them."""
        return self.kl_active and self.reference.placement == "rollout"

    @property
    def reference_in_store(self) -> bool:
        """The trainer reads ``ref_logprobs`` from the store (another role wrote them)."""
        return self.reference_worker or self.reference_in_rollout

    @property
    def max_staleness(self) -> int:
        """Versions a trained sample may lag: 0 in sync/periodic (on-policy), else the cap."""
        return self.run.max_staleness if self.run.mode == "async" else 0


def config_warnings(cfg: RunConfig) -> list[str]:
    """Settings that are valid but have no effect in this configuration (printed by the CLI)."""
    notes = []
    if cfg.run.mode != "async" and cfg.run.max_staleness != RunSection.max_staleness:
        notes.append(f"run.max_staleness={cfg.run.max_staleness} is ignored in mode "
                     f"'{cfg.run.mode}' (on-policy: staleness is always 0)")
    # the default (the demo's cap) and 0 (the way to say "none") are silent with a model.path
    if cfg.model.path is not None and cfg.model.warmstart_steps not in (
            0, ModelSection.warmstart_steps):
        notes.append("model.warmstart_steps applies to the built-in model only; ignored with "
                     "model.path")
    if cfg.data.task != "arithmetic" and cfg.data.digits != DataSection.digits:
        notes.append("data.digits applies to task 'arithmetic' only")
    # (env.hub also serves data.task and reward.fn "hub", single-turn too)
    if not cfg.multi_turn and replace(cfg.env, settings=replace(cfg.env.settings, hub=None)) \
            != EnvSection():
        notes.append("env.* has no effect with rollout.max_turns 1 (no tool calls to answer)")
    if cfg.multi_turn and cfg.run.mode == "sync" and cfg.env.num_workers != EnvSection.num_workers:
        notes.append("env.num_workers is ignored in mode 'sync' (the controller's process "
                     "answers the tool calls)")
    if cfg.reward.model is None and cfg.reward.scorer != type(cfg.reward.scorer)():
        notes.append("reward.template, reward.judge*, reward.combine, reward.*_weight and "
                     "reward.normalize have no effect without reward.model")
    if cfg.reward.model is None and (cfg.reward.device, cfg.reward.dtype) != ("auto", "auto"):
        notes.append("reward.device and reward.dtype apply to a reward model (reward.model)")
    if not cfg.kl_active and cfg.reference != ReferenceSection():
        notes.append("reference.* has no effect with trainer.kl_coef 0 (no reference runs)")
    if cfg.reference_in_rollout and (cfg.reference.threads != ReferenceSection.threads
                                     or cfg.reference.device != ReferenceSection.device):
        notes.append("reference.threads and reference.device apply to a reference worker; with "
                     "reference.placement 'rollout' the reference runs on each rollout worker's "
                     "threads and device")
    return notes


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
        tree = parse_yaml(text, str(p))
        tree = {} if tree is None else tree
        if not isinstance(tree, dict):
            raise ConfigTypeError("", f"{p}: the top level must be a mapping of sections")
    for override in overrides:
        apply_override(tree, override, RunConfig)
    return from_dict(RunConfig, tree)


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return to_dict(cfg)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    return from_dict(RunConfig, data)


def dump_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML; ``load_config`` of this text gives back an equal config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)
