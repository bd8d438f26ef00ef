"""From a run config to what runs: the model on disk, the prompts, and one typed config per worker.

``build_plan`` resolves everything the controller needs before any process starts; the workers
get their own records (``workers.config``), never this module's types. Details, the held-out
split, evaluation and the resume rules: docs/controller.md "The plan" and "Resume rules".
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from storage.ports import free_port
from streamflow.admission import min_policy_version
from streamflow.config import RunConfig, StoreSection
from streamflow.devices import RoleDevices, resolve_devices, weight_sync_path
from streamflow.rundir import read_jsonl
from workers.config import (
    AgentWorkerConfig,
    EnvironmentWorkerConfig,
    GatewayWorkerConfig,
    ReferenceWorkerConfig,
    RewardWorkerConfig,
    RolloutWorkerConfig,
    TrainerWorkerConfig,
    WeightGroupConfig,
    WorkerCommon,
)
from workers.models.checkpoint import list_checkpoints, read_state
from workers.models.local import TinyModelSpec, load_model, load_tokenizer
from workers.models.tokenizer import encode_prompt
from workers.models.warmstart import BuiltinRecipe, prepare_builtin
from workers.runtime import cores
from workers.runtime.cores import MAX_SLOTS, CoreShareConfig
from workers.runtime.cores import create as create_core_table
from workers.schema import agent_prompt_rows, prompt_rows
from workers.settings import HUB, AgentSettings
from workers.tasks.arithmetic import ArithmeticTask
from workers.tasks.evaluate import greedy_accuracy, reward_scorer
from workers.tasks.heldout import split_prompt_file
from workers.tasks.problem import Problem
from workers.tasks.prompt_file import load_problem_file
from workers.weights.file_sync import weights_path

TABLE = "samples"


def builtin_recipe(cfg: RunConfig) -> BuiltinRecipe:
    b, m = cfg.model.builtin, cfg.model
    spec = TinyModelSpec(hidden_size=b.hidden_size, num_layers=b.num_layers,
                         num_heads=b.num_heads, num_kv_heads=b.num_kv_heads,
                         intermediate_size=b.intermediate_size, seed=b.seed)
    return BuiltinRecipe(
        spec=spec, digits=cfg.data.digits, operations=tuple(cfg.data.operations),
        task_seed=cfg.data.seed, warmstart_steps=m.warmstart_steps,
        target_accuracy=m.warmstart_target_accuracy, batch_size=m.warmstart_batch_size,
        lr=m.warmstart_lr, seed=cfg.run.seed, eval_size=max(min(cfg.run.eval_prompts, 200), 1),
        tool_fraction=m.warmstart_tool_fraction)


def resolve_model(cfg: RunConfig, cache_root: Path,
                  progress: Callable[[int, int], None] | None = None) -> Path:
    """The policy's HF directory: the configured path, or the cached built-in checkpoint
    (``progress(step, total)`` follows its warm start when it has to be built)."""
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path {str(path)!r} is not a Hugging Face model "
                                    "directory")
        return path
    recipe = builtin_recipe(cfg)
    key = hashlib.sha256(json.dumps(recipe.to_json(), sort_keys=True).encode()).hexdigest()[:12]
    return prepare_builtin(cache_root / f"builtin-{key}", recipe, progress=progress)


@dataclass
class RunPlan:
    cfg: RunConfig
    run_dir: Path
    model_path: Path
    weights_dir: Path
    tokenizer: object
    train_problems: list[Problem] | None  # None: procedural arithmetic
    task: ArithmeticTask | None
    eval_problems: list[Problem]
    host_threads: int  # run.host_threads resolved on this host (0 = fixed threads per role)
    table: str = TABLE
    start_iteration: int = 0
    # the host's thread-budget table (workers.runtime.cores); None: each role keeps its own threads
    cores_path: Path | None = None
    rollout: RolloutWorkerConfig = field(init=False)
    reward: RewardWorkerConfig = field(init=False)
    reference: ReferenceWorkerConfig | None = field(init=False)
    # the environment workers' record (rollout.max_turns > 1; None: single-turn or agent.fn)
    environment: EnvironmentWorkerConfig | None = field(init=False)
    # a gateway run's (agent.fn) gateway and agent workers' records; None otherwise
    gateway: GatewayWorkerConfig | None = field(init=False)
    agent: AgentWorkerConfig | None = field(init=False)
    trainer: TrainerWorkerConfig = field(init=False)
    devices: RoleDevices | None = None
    rendezvous: object | None = None  # workers.weights.group.Rendezvous (collective only)

    @property
    def store(self) -> StoreSection:
        return self.cfg.store

    @property
    def store_persist_dir(self) -> str | None:
        """The store node's persistence root with store.persist (tables in <root>/<table>)."""
        return str(self.run_dir / "store") if self.cfg.store.persist else None

    @property
    def table_spec(self):  # noqa: ANN201 - storage.schema.TableSpec
        from workers.schema import samples_table_spec

        s = self.cfg.store
        return samples_table_spec(
            self.table, group_size=self.cfg.data.group_size,
            reference_worker=self.cfg.reference_worker,
            reference_in_rollout=self.cfg.reference_in_rollout, capacity_rows=s.capacity_rows,
            lease_seconds=s.lease_seconds, max_deliveries=s.max_deliveries,
            fsync="always" if s.fsync else "never", max_turns=self.cfg.rollout.max_turns,
            partial_cuts=self.cfg.rollout.cuts.max_cuts,
            gateway=self.cfg.gateway,
            reward_whole_groups=self.cfg.reward.model is not None
            and self.cfg.reward.normalize == "group")

    def problems(self, iteration: int) -> list[Problem]:
        n = self.cfg.data.prompts_per_iteration
        return self.problems_at(iteration * n, n)

    def problems_at(self, first: int, count: int) -> list[Problem]:
        """Prompts ``first`` .. ``first + count - 1`` of the training stream (a file cycles)."""
        if self.task is not None:
            return list(itertools.islice(self.task.iterate(), first, first + count))
        items = self.train_problems or []
        return [items[(first + i) % len(items)] for i in range(count)]

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def prompt_rows(self, iteration: int, staleness: int, first: int | None = None,
                    count: int | None = None) -> pa.RecordBatch:
        """The rows to put for ``iteration`` (``workers.schema.prompt_rows``); ``staleness``: the
        bound that sets their ``min_policy_version`` (``streamflow.admission``). ``first`` /
        ``count``: prompts of the training stream other than iteration's own block (dynamic
        sampling, ``streamflow.provision``); each group's id is its prompt's index in the stream
        either way, so ids never collide across iterations and puts."""
        n = self.cfg.data.prompts_per_iteration
        first, count = iteration * n if first is None else first, n if count is None else count
        problems = self.problems_at(first, count)
        g = self.cfg.data.group_size
        if self.cfg.gateway:  # the agents get the text; the gateway writes prompt_ids
            rows = agent_prompt_rows(iteration, [p.prompt for p in problems],
                                     [p.answer for p in problems], group_size=g,
                                     min_policy_version=min_policy_version(iteration, staleness))
        else:
            rows = prompt_rows(iteration, [self.encode(p.prompt) for p in problems],
                               [p.answer for p in problems], group_size=g,
                               min_policy_version=min_policy_version(iteration, staleness))
        if first != iteration * count:  # (prompt_rows numbers iteration's own block)
            ids = pa.array(np.repeat(np.arange(first, first + count, dtype=np.int64), g))
            at = rows.schema.get_field_index("group_id")
            rows = rows.set_column(at, rows.schema.field(at), ids)
        return rows

    def workers(self, store_addresses: list[str], events_address: str | None,  # noqa: ANN201
                coordinator_address: str | None = None):
        """(name, role, config, threads) for every worker process of a streaming run."""
        c = self.cfg
        out = []
        slots = iter(range(1, MAX_SLOTS))  # slot 0: the controller's evaluation

        def add(role: str, record: Any, i: int, threads: int, **extra: Any) -> None:
            # (seed and the simulated device as build_plan set them on every record)
            common = replace(self.rollout.common, name=f"{role}-{i}", role=role, table=self.table,
                             store_addresses=store_addresses, events_address=events_address,
                             threads=threads, coordinator_address=coordinator_address)
            if role not in ("reward", "environment", "gateway", "agent") and (
                    self.cores_path is not None):  # the host's shared budget
                cap = threads if role == "rollout" else 0  # see CoreShareConfig.max_threads
                share = CoreShareConfig(str(self.cores_path), next(slots), self.host_threads, cap)
                common = replace(common, threads=cap or self.host_threads, cores=share)
            out.append((common.name, role, replace(record, common=common, **extra), common.threads))

        group = self.rollout.weights_group
        for i in range(c.rollout.num_workers):
            add("rollout", self.rollout, i, c.rollout.threads,
                device=self.devices.rollout[i] if self.devices else self.rollout.device,
                weights_group=group and replace(group, rank=i + 1))
        for i in range(c.reward.num_workers):
            add("reward", self.reward, i, 1,
                model_device=self.devices.reward[i] if self.devices else self.reward.model_device)
        if self.environment is not None:  # CPU only: tool calls, observations, no model
            for i in range(c.env.num_workers):
                add("environment", self.environment, i, 1)
        if self.gateway is not None and self.agent is not None:  # CPU only, no model
            add("gateway", self.gateway, 0, 1)
            for i in range(c.agent.num_workers):
                add("agent", self.agent, i, 1)
        if self.reference is not None:
            for i in range(c.reference.num_workers):
                add("reference", self.reference, i, c.reference.threads)
        add("trainer", self.trainer, 0, c.trainer.threads)
        return out

    def cleanup(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None
        if str(self.weights_dir).startswith("/dev/shm/"):
            shutil.rmtree(self.weights_dir, ignore_errors=True)
        if self.cores_path is not None:
            self.cores_path.unlink(missing_ok=True)


def _weights_dir(run_dir: Path) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="streamflow-weights-", dir=shm))
    path = run_dir / "weights"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def build_plan(cfg: RunConfig, run_dir: Path,
               progress: Callable[[int, int], None] | None = None) -> RunPlan:
    """Resolve everything a run needs before any process starts (docs/controller.md)."""
    train, task, evals = _problems(cfg)  # first: a bad split must fail before any warm start
    model_path = resolve_model(cfg, Path(cfg.run.output_dir).parent / ".cache", progress)
    # streaming workers share run.host_threads by phase (workers.runtime.cores)
    plan = RunPlan(cfg, run_dir, model_path, _weights_dir(run_dir), load_tokenizer(model_path),
                   train, task, evals,
                   host_threads=cfg.run.host_thread_budget(cfg.trainer.deterministic))
    if plan.host_threads > 0 and cfg.run.mode != "sync":
        cores_path = plan.weights_dir.with_name(f"{plan.weights_dir.name}.cores")
        plan.cores_path = create_core_table(cores_path)
    resume_from = find_resume(cfg, run_dir)
    if resume_from is not None:
        plan.start_iteration = read_state(resume_from).step
    # Devices: torch's count is authoritative here (the --dry-run check used the driver's).
    plan.devices = resolve_devices(cfg, torch.cuda.device_count())
    group = _weight_group(plan) if weight_sync_path(cfg, plan.devices) == "collective" else None
    # the trainer's PUB address for each published version (sync runs need none)
    announce = None if cfg.run.mode == "sync" else f"tcp://127.0.0.1:{free_port()}"
    _worker_records(plan, announce, group, resume_from)
    return plan


def _problems(cfg: RunConfig) -> tuple[list[Problem] | None, ArithmeticTask | None, list[Problem]]:
    """(training problems of a file, the arithmetic task, held-out problems)."""
    d = cfg.data
    if d.task == HUB:  # the hub taskset's tasks, rendered for the model
        from workers.agent.hub import hub_problems

        tokenizer = load_tokenizer(cfg.model.path) if cfg.model.path is not None else None
        held_out = cfg.run.eval_prompts if cfg.run.eval_every else 0
        train, evals = split_prompt_file(hub_problems(cfg.env.hub, tokenizer), held_out,
                                         source=f"env.hub={cfg.env.hub}")
        return train, None, evals
    if d.task == "file":
        if not d.file:
            raise ValueError("data.file is required when data.task is 'file'")
        rows = load_problem_file(d.file, d.prompt_column, d.answer_column)
        held_out = cfg.run.eval_prompts if cfg.run.eval_every else 0
        train, evals = split_prompt_file(rows, held_out, source=d.file)
        return train, None, evals
    task = ArithmeticTask(digits=d.digits, operations=tuple(d.operations), seed=d.seed)
    return None, task, task.eval_problems(cfg.run.eval_prompts) if cfg.run.eval_prompts else []


def _weight_group(plan: RunPlan) -> WeightGroupConfig:
    """Collective weight sync: start the group's rendezvous here (for the whole run); trainer rank
    0, rollout worker i rank i + 1."""
    from workers.weights.group import Rendezvous

    cfg, devices = plan.cfg, plan.devices
    assert devices is not None
    plan.rendezvous = rendezvous = Rendezvous(cfg.weights.host, cfg.weights.port)
    members = [devices.trainer, *devices.rollout]
    own_gpus = all(m.startswith("cuda") for m in members) and len(set(members)) == len(members)
    return WeightGroupConfig(address=rendezvous.address, rank=0,
                             world_size=1 + cfg.rollout.num_workers,
                             bucket_bytes=int(cfg.weights.bucket_mb * (1 << 20)),
                             timeout_s=cfg.weights.timeout_s,
                             backend="nccl" if own_gpus else "gloo",
                             transport="broadcast" if own_gpus else "shm",
                             shm_dir=str(plan.weights_dir))


def _worker_records(plan: RunPlan, announce: str | None, group: WeightGroupConfig | None,
                    resume_from: Path | None) -> None:
    """One ``workers.config`` record per role: the sections' settings objects go over whole, and
    every other knob of the run fills a record field that has no default of its own."""
    cfg, devices, model = plan.cfg, plan.devices, str(plan.model_path)
    assert devices is not None
    # every role on a simulated device with simulated engines (the config checks both)
    simulated = cfg.simulated.device if cfg.rollout.engine == "simulated" else None
    blank = WorkerCommon(name="", role="", store_addresses=[], table=TABLE, seed=cfg.run.seed,
                         threads=1, simulated=simulated,  # (threads: each record sets its role's)
                         trace_rows=cfg.run.trace)
    r, t, d = cfg.rollout, cfg.trainer, cfg.data
    agent = agent_settings(cfg)
    plan.rollout = RolloutWorkerConfig(
        common=_named(blank, "rollout", r.threads), model_path=model,
        weights_dir=str(plan.weights_dir), weights_announce=announce, group_size=d.group_size,
        groups_per_claim=r.groups_per_claim, sampling=r.sampling, engine=r.engine, generate=r.generate, vllm=r.vllm,
        device=devices.rollout[0], dtype=devices.rollout_dtype,
        weights_group=group and replace(group, rank=1),
        reference_path=model if cfg.reference_in_rollout else None,
        reference_dtype=devices.reference_dtype, reference_pack=t.pack, agent=agent,
        agent_driven=cfg.gateway, cuts=r.cuts)
    plan.environment = EnvironmentWorkerConfig(
        common=_named(blank, "environment", 1), model_path=model,
        rows_per_claim=cfg.env.rows_per_claim, agent=agent, cuts=r.cuts) if agent is not None and (
            not cfg.gateway) else None
    plan.gateway = plan.agent = None
    if cfg.gateway and agent is not None:
        a, secret = cfg.agent, secrets.token_hex(16)
        port = a.port or free_port(a.host)  # fixed for the run: a restart binds the same
        plan.gateway = GatewayWorkerConfig(
            common=_named(blank, "gateway", 1), model_path=model, agent=agent, host=a.host,
            port=port, secret=secret, call_timeout_s=a.call_timeout_s,
            lease_seconds=cfg.store.lease_seconds,
            served_log=str(plan.run_dir / "gateway-served.jsonl"))
        host = "127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host
        plan.agent = AgentWorkerConfig(
            common=_named(blank, "agent", 1), fn=str(a.fn), gateway_url=f"http://{host}:{port}",
            secret=secret, episodes=a.episodes_per_worker, timeout_s=a.timeout_s,
            call_timeout_s=a.call_timeout_s, attempts=cfg.store.max_deliveries)
    plan.reward = RewardWorkerConfig(common=_named(blank, "reward", 1), model_path=model,
                                     verifier=cfg.reward.verifier, hub=cfg.env.hub,
                                     rows_per_claim=cfg.reward.rows_per_claim, agent=agent,
                                     scorer=cfg.reward.scorer, cuts=r.cuts,
                                     model_device=devices.reward[0] if devices.reward else "cpu",
                                     model_dtype=devices.reward_dtype)
    plan.reference = ReferenceWorkerConfig(
        common=_named(blank, "reference", cfg.reference.threads), model_path=model,
        sampling=r.sampling, rows_per_claim=cfg.reference.rows_per_claim, pack=t.pack,
        dtype=devices.reference_dtype, device=devices.reference) if cfg.reference_worker else None
    plan.trainer = TrainerWorkerConfig(
        common=_named(blank, "trainer", t.threads), model_path=model,
        reference_path=model if cfg.kl_active and not cfg.reference_in_store else None,
        weights_dir=str(plan.weights_dir), weights_bind=announce,
        rows_per_iteration=d.prompts_per_iteration * d.group_size, iterations=cfg.run.iterations,
        group_size=d.group_size, reference_in_store=cfg.reference_in_store,
        optim=t.optim, grpo=t.grpo.resolved(cfg.run.mode),
        max_response_tokens=(cfg.rollout.max_total_tokens if cfg.multi_turn
                             else cfg.rollout.max_new_tokens),
        sampling=r.sampling, pack=t.pack, cuts=r.cuts, rows_per_claim=t.rows_per_claim,
        reference_dtype=devices.reference_dtype, checkpoint_dir=str(plan.run_dir / "checkpoints"),
        checkpoint_every=cfg.run.checkpoint_every, engine=t.engine, num_ranks=t.num_ranks,
        deterministic=t.deterministic, whole_iterations=t.whole_iterations,
        zero_stage=t.zero_stage,
        weights_keep=(cfg.run.max_staleness or 0) + 4,
        resume_from=str(resume_from) if resume_from is not None else None,
        start_iteration=plan.start_iteration, device=devices.trainer, dtype=devices.trainer_dtype,
        weights_group=group)


def find_resume(cfg: RunConfig, run_dir: Path) -> Path | None:
    """The checkpoint to continue from (``run.resume``: auto or a path). With auto: the newest
    whose iterations are all in ``metrics.jsonl``, else the newest one (docs/controller.md)."""
    if not cfg.run.resume:
        return None
    if cfg.run.resume == "auto":
        checkpoints = list_checkpoints(run_dir / "checkpoints")
        recorded = {line["iteration"] for line in read_jsonl(run_dir / "metrics.jsonl")}
        complete = [c for c in checkpoints if recorded.issuperset(range(read_state(c).step))]
        return (complete or checkpoints or [None])[-1]
    path = Path(cfg.run.resume)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"run.resume={cfg.run.resume!r} is not a complete checkpoint "
                                "(no trainer_state.json)")
    return path


def agent_settings(cfg: RunConfig) -> AgentSettings | None:
    """Multi-turn: the turn budgets and the environment, env.format resolved for the model (the
    rollout's, the environment workers' and the evaluator's); None for a single-turn run."""
    if not cfg.multi_turn:
        return None
    return AgentSettings(turns=cfg.rollout.turns,
                         env=replace(cfg.env.settings, format=cfg.tool_format))


def reward_fn(cfg: RunConfig) -> str:
    """reward.fn as ``resolve_reward`` reads it: "hub" is env.hub's rewards (its spec)."""
    if cfg.reward.fn != HUB:
        return cfg.reward.fn
    from workers.agent.hub import hub_spec

    return hub_spec(cfg.env.hub)


def _named(common: WorkerCommon, role: str, threads: int) -> WorkerCommon:
    return replace(common, name=f"{role}-0", role=role, threads=threads)


class Evaluator:
    """Held-out accuracy of a published policy version, in the controller's process."""

    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        self._model = None
        # Across hosts: copies a version from the trainer's host into plan.weights_dir.
        self.fetch: Callable[[int], None] | None = None

    def accuracy(self, version: int) -> float | None:
        plan = self.plan
        if not plan.eval_problems:
            return None
        if self._model is None:
            # decoded as the torch rollout engine decodes (its attention), on the controller's
            # CPU (float32: what model.dtype auto means there)
            self._model = load_model(plan.model_path, dtype=torch.float32,
                                     attn_implementation=plan.cfg.rollout.attn_implementation)
        path = weights_path(plan.weights_dir, version)
        if not path.exists() and version != 0 and self.fetch is not None:
            self.fetch(version)
        if path.exists():
            from safetensors.torch import load_file

            # strict: a missing or unknown key means the file belongs to another model
            missing, unexpected = self._model.load_state_dict(load_file(str(path)), strict=False)
            if missing or unexpected:
                raise ValueError(f"weights {path} do not match the model at {plan.model_path}: "
                                 f"missing keys {sorted(missing)[:5]}, unexpected keys "
                                 f"{sorted(unexpected)[:5]}")
        elif version != 0:
            return None  # pruned already (async runs far ahead): skip rather than guess
        r = plan.cfg.reward
        score = reward_scorer(reward_fn(plan.cfg), success_threshold=r.success_threshold,
                              timeout_s=r.timeout_s)
        with torch.no_grad(), cores.busy():  # the controller's slot of the host's budget
            return greedy_accuracy(self._model, plan.tokenizer, plan.eval_problems,
                                   max_new_tokens=plan.cfg.rollout.max_new_tokens, score=score,
                                   agent=agent_settings(plan.cfg))
