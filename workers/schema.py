"""The RL sample table: the one place where the columns of a GRPO run are defined.

One row per sample; the G rows of a prompt share a ``group_id``. Each column is written by one
task; the columns each task claims (``*_READS``) and writes (``*_COLUMNS``) are declared here,
once. The column table: docs/training.md "The sample table".
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from storage.schema import TableSpec, TaskSpec
from workers.settings import TurnSettings

SAMPLES_SCHEMA = pa.schema([  # who writes each column, and when: docs/training.md
    # the G samples of one prompt share it (the store's group column)
    pa.field("group_id", pa.int64(), nullable=False),
    # iteration (= optimizer step) whose batch the sample belongs to
    pa.field("iteration", pa.int64(), nullable=False),
    # admission: rollout must generate with a version >= this (iteration - max_staleness)
    pa.field("min_policy_version", pa.int64(), nullable=False),
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),  # tokenised prompt [P]
    pa.field("answer", pa.string(), nullable=False),  # what the verifier compares against
    pa.field("response_ids", pa.list_(pa.int32())),  # generated tokens, stop token included [L]
    # behaviour log-probs: log softmax(logits / T) of each sampled token [L]
    pa.field("response_logprobs", pa.list_(pa.float32())),
    # per response token, 1: the model generated it (trained on); 0: the environment appended it
    # (a tool's answer: context for later tokens, never trained on; its response_logprobs entry is
    # 0.0). NULL: all ones [L]. Every rollout writes it with response_ids, NULL when single-turn
    # (the trainer claims it, and a claimed column must be written)
    pa.field("response_loss_mask", pa.list_(pa.int8())),
    pa.field("policy_version", pa.int64()),  # trainer step count of the generating weights
    # "stop" (stop token) or "length" (max_new_tokens); a multi-turn trajectory also "tool" (its
    # last allowed turn called a tool), "budget" (max_total_tokens) or "done" (the environment)
    pa.field("finish_reason", pa.string()),
    pa.field("reward", pa.float32()),  # verifier score; 0.0 when scoring failed
    pa.field("reward_ok", pa.bool_()),  # False when the verifier raised or timed out
    pa.field("reward_error", pa.string()),  # why, when reward_ok is False
    pa.field("ref_logprobs", pa.list_(pa.float32())),  # frozen reference's log-probs [L]
    pa.field("advantage", pa.float32()),  # group-normalised advantage of the sample's update
])



def piece_bound(max_turns: int, max_cuts: int) -> int:
    """K: the most pieces of a trajectory, its T model turns, the T-1 observations between them
    and one more model piece per cut (``max_cuts``, 0: no partial rollout)."""
    return 2 * max_turns - 1 + max_cuts


# the cells of one piece, in order: (name, type, what)
PIECE_FIELDS = (
    ("ids", pa.list_(pa.int32())),  # the piece's tokens [L_k]; NULL: the row ended before it
    ("logprobs", pa.list_(pa.float32())),  # model: behaviour log-probs [L_k]; observation: NULL
    ("version", pa.int64()),  # model: the policy version that generated it; observation: NULL
    ("seed", pa.int64()),  # model: the seed of its turn's random stream; observation: NULL
    # model: stop | length | tool | budget | cut; observation: "observation", or the finish
    # (done | budget) of one that ended the row unappended (its ids NULL)
    ("end", pa.string()),
    ("error", pa.string()),  # observation: NULL or its error kind
    # who continues the row after the piece: the model (``rollout.{k+1}`` needs it) or the
    # environment (``env.{k+1}``), True for one of them and NULL for the other; both NULL once
    # the row ended
    ("to_model", pa.bool_()),
    ("to_env", pa.bool_()),
)


def piece_columns(bound: int) -> list[pa.Field]:
    """The piece columns of a table whose trajectories have at most ``bound`` pieces, in the
    order a trajectory writes them: piece0, piece1, ... Invariant: the written piece cells of a
    row are a prefix, since whoever ends a trajectory writes every later one as NULL in the same
    write (docs/training.md "Trajectories")."""
    return [pa.field(f"piece{k}_{name}", typ) for k in range(bound) for name, typ in PIECE_FIELDS]


# per-token policy versions of response_ids, run-length: run i covers tokens [start_i,
# start_{i+1}) (the last one to the end), sampled by ``version`` (an observation's tokens belong
# to the run before them); versions grow along the response, so the first run's is
# ``policy_version`` (the oldest token's). Written with the assembled response columns
VERSION_RUNS_FIELD = pa.field("response_version_runs", pa.list_(pa.struct([
    pa.field("start", pa.int32()), pa.field("version", pa.int64())])))


# the environment's reward of the trajectory (Observation.reward of the observation that ended
# it, or the gateway agent's), written with the assembled columns by whoever ends it; NULL: none
# (the reward role reads it, reward.env_reward)
ENV_REWARD_FIELD = pa.field("env_reward", pa.float32())


# gateway runs (``agent.fn``; workers.gateway): the problem's prompt as text, handed to the user's
# agent, which calls the gateway itself; ``prompt_ids`` is then its first call's rendered messages,
# written by the gateway (docs/agents.md)
AGENT_PROMPT_FIELD = pa.field("agent_prompt", pa.string())


def call_columns(max_turns: int) -> list[pa.Field]:
    """Gateway runs: per model turn t, the canonical JSON of the messages and tools of the call
    that turn t answers, written with what that call fed the model (``prompt_ids`` for t = 0,
    the observation piece before turn t after). A later call is known to extend the episode, or to repeat call t
    (an agent's retry or a redelivered agent), by comparing against these."""
    # canonical JSON {"messages": [...], "tools": [...]} of the call turn t answers; NULL: none
    return [pa.field(f"call{t}_messages", pa.string()) for t in range(max_turns)]


PUT_COLUMNS = ("group_id", "iteration", "min_policy_version", "prompt_ids", "answer")
ROLLOUT_READS = ("group_id", "iteration", "min_policy_version", "prompt_ids")
ROLLOUT_COLUMNS = ("response_ids", "response_logprobs", "policy_version", "finish_reason",
                   "response_loss_mask")
REWARD_READS = ("response_ids", "answer", "iteration", "group_id")
REWARD_COLUMNS = ("reward", "reward_ok", "reward_error")
REFERENCE_READS = ("group_id", "iteration", "prompt_ids", "response_ids")
REFERENCE_COLUMNS = ("ref_logprobs",)
TRAINER_READS = ("group_id", "iteration", "prompt_ids", "response_ids", "response_logprobs",
                 "response_loss_mask", "policy_version", "reward", "reward_ok")
TRAINER_COLUMNS = ("advantage",)
_PUT_SCHEMA = pa.schema([SAMPLES_SCHEMA.field(c) for c in PUT_COLUMNS])
AGENT_PUT_COLUMNS = ("group_id", "iteration", "min_policy_version", "answer", "agent_prompt")
_AGENT_PUT_SCHEMA = pa.schema([*(SAMPLES_SCHEMA.field(c) for c in AGENT_PUT_COLUMNS[:-1]),
                               AGENT_PROMPT_FIELD])


def prompt_rows(iteration: int, prompts: Sequence[Sequence[int]], answers: Sequence[str], *,
                group_size: int, min_policy_version: int) -> pa.RecordBatch:
    """The ``PUT_COLUMNS`` rows of one iteration: each tokenised prompt ``group_size`` times (one
    row per sample), prompt i of the iteration in group ``iteration * len(prompts) + i``."""
    n, g = len(prompts), group_size
    return pa.RecordBatch.from_pydict({
        "group_id": [iteration * n + i for i in range(n) for _ in range(g)],
        "iteration": [iteration] * (n * g),
        "min_policy_version": [min_policy_version] * (n * g),
        "prompt_ids": [list(p) for p in prompts for _ in range(g)],
        "answer": [a for a in answers for _ in range(g)],
    }, schema=_PUT_SCHEMA)


def agent_prompt_rows(iteration: int, prompts: Sequence[str], answers: Sequence[str], *,
                      group_size: int, min_policy_version: int) -> pa.RecordBatch:
    """``prompt_rows`` of a gateway run: the prompts as text (``agent_prompt``), no
    ``prompt_ids`` (the gateway writes them at each episode's first call)."""
    n, g = len(prompts), group_size
    return pa.RecordBatch.from_pydict({
        "group_id": [iteration * n + i for i in range(n) for _ in range(g)],
        "iteration": [iteration] * (n * g),
        "min_policy_version": [min_policy_version] * (n * g),
        "answer": [a for a in answers for _ in range(g)],
        "agent_prompt": [p for p in prompts for _ in range(g)],
    }, schema=_AGENT_PUT_SCHEMA)


def samples_table_spec(name: str, *, group_size: int, reference_worker: bool, fsync: str,
                       reference_in_rollout: bool = False,
                       capacity_rows: int = TableSpec.capacity_rows,
                       lease_seconds: float = TableSpec.lease_seconds,
                       max_deliveries: int = TableSpec.max_deliveries,
                       max_turns: int = TurnSettings.max_turns,
                       partial_cuts: int = 0, reward_whole_groups: bool = False,
                       gateway: bool = False) -> TableSpec:
    """The table of one run. ``reference_worker`` adds the reference task and makes the trainer
    wait for ``ref_logprobs`` (off when the KL term is off or the reference is fused into the
    trainer); ``reference_in_rollout``: the rollout writes them with its responses, so the trainer
    waits for them without a reference task. A trajectory of ``max_turns`` = T turns and
    ``partial_cuts`` = R cuts (partial rollout; 0: none) has up to K = ``piece_bound(T, R)``
    pieces: K > 1 adds the ``piece_columns``, ``response_version_runs``, ``env_reward`` and the
    ``piece_tasks``; K = 1 (single-turn, uncut) is the single-turn table exactly.
    ``gateway``: the turns are an agent's calls (workers.gateway, docs/agents.md): rows are put
    with ``agent_prompt`` instead of ``prompt_ids``; task ``agent`` runs the user's agent, task
    ``open`` is the gateway's wait for an episode's first call (it writes ``prompt_ids``), rollout
    takes rows one by one (the episodes of a group open at different times), and ``env.{k}`` is
    the gateway's wait for the next call after every turn, the last one's too: only the agent
    ends an episode.
    ``reward_whole_groups``: the reward task is claimed by whole groups (a reward model's scores
    normalised within each group, ``reward.normalize=group``). ``fsync``: the table's log policy,
    the run's store.fsync ("always" | "never"; the store's own default differs); the other limits
    default to the store's, which the run's store.* keys take too."""
    if max_turns < 1 or partial_cuts < 0:
        raise ValueError(f"max_turns must be >= 1 and partial_cuts >= 0, got {max_turns} and "
                         f"{partial_cuts}")
    if gateway and (max_turns < 2 or partial_cuts):
        raise ValueError(f"a gateway run is multi-turn and not partial, got max_turns="
                         f"{max_turns}, partial_cuts={partial_cuts}")
    tasks = [TaskSpec("rollout", ("prompt_ids",), whole_groups=not gateway)]
    if gateway:
        tasks = [TaskSpec("agent", ("agent_prompt",)), TaskSpec("open", ("agent_prompt",)),
                 *tasks]
    tasks += piece_tasks(max_turns, partial_cuts, gateway=gateway)
    tasks.append(TaskSpec("reward", ("response_ids",), whole_groups=reward_whole_groups))
    trainer_needs: tuple[str, ...] = ("response_ids", "reward")
    if reference_worker:
        tasks.append(TaskSpec("reference", ("response_ids",)))
    if reference_worker or reference_in_rollout:
        trainer_needs += REFERENCE_COLUMNS
    tasks.append(TaskSpec("trainer", trainer_needs, whole_groups=True))
    bound = piece_bound(max_turns, partial_cuts)
    schema = SAMPLES_SCHEMA
    if bound > 1:
        schema = pa.schema([*SAMPLES_SCHEMA, VERSION_RUNS_FIELD, ENV_REWARD_FIELD,
                            *piece_columns(bound)])
    if gateway:
        schema = pa.schema([*schema, AGENT_PROMPT_FIELD, *call_columns(max_turns)])
    return TableSpec(
        name=name, tasks=tuple(tasks), schema=schema, group_column="group_id",
        group_size=group_size, capacity_rows=capacity_rows, lease_seconds=lease_seconds,
        max_deliveries=max_deliveries, fsync=fsync,
    )


def piece_tasks(max_turns: int, max_cuts: int, *, gateway: bool = False) -> list[TaskSpec]:
    """The tasks that continue a row with piece k >= 1, in piece order: ``rollout.{k}`` (a model
    piece: needs ``piece{k-1}_to_model``) where one can be piece k (after a cut, or an
    observation), ``env.{k}`` (an observation: needs ``piece{k-1}_to_env``) where one can (after a
    tool call; a gateway run: after every turn, the last one's too, K = ``piece_bound``). Each
    skips (``TaskSpec.skip_null``) a row whose needed cell was written NULL: the row goes to the
    other side, or ended; the store consumes it for the task and no worker claims it. Rows one
    by one: the rows of a group go on differently."""
    bound = piece_bound(max_turns, max_cuts)
    last_observation = bound if gateway else 2 * max_turns - 3 + max_cuts
    tasks = []
    for k in range(1, bound + 1):
        if k < bound and (max_cuts or k % 2 == 0):
            need = f"piece{k - 1}_to_model"
            tasks.append(TaskSpec(f"rollout.{k}", (need,), skip_null=need))
        if max_turns > 1 and (max_cuts or k % 2 == 1) and k <= last_observation:
            need = f"piece{k - 1}_to_env"
            tasks.append(TaskSpec(f"env.{k}", (need,), skip_null=need))
    return tasks


def piece_of(task: str) -> int:
    """The piece a rollout or environment task writes: 0 for ``rollout``, k for ``rollout.{k}``
    and ``env.{k}``."""
    return int(task.split(".")[1]) if "." in task else 0


def trainer_columns(reference_in_store: bool, partial: bool) -> tuple[str, ...]:
    """What the trainer claims: ``ref_logprobs`` too when another role (the reference worker or
    the rollout) writes them to the store; ``response_version_runs`` in a partial run (its
    per-token staleness; a multi-turn table has the column too, unclaimed)."""
    return (TRAINER_READS + (REFERENCE_COLUMNS if reference_in_store else ())
            + ((VERSION_RUNS_FIELD.name,) if partial else ()))
