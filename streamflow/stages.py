"""From a run config to what runs: the model on disk, the prompts, and one typed config per worker.

``build_plan`` resolves everything the controller needs before any process starts:

- the policy model directory (a local HF directory, or the built-in tiny model warm-started once
  and cached under ``runs/.cache/`` keyed by its recipe, so repeated runs reuse it);
- the prompt source (procedural arithmetic or a user's JSONL/Parquet file) and held-out problems;
- the weights directory for policy versions (``/dev/shm`` when available: weight sync never
  touches a disk there);
- the samples table spec and one ``workers.config`` record per worker.

The workers get plain records (``workers.config``), never this module's types: the layers point
downwards only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from streamflow.config import RunConfig, StoreSection
from streamflow.supervisor import free_port
from workers.checkpoint import latest_checkpoint, read_state
from workers.config import (
    ReferenceWorkerConfig,
    RewardWorkerConfig,
    RolloutWorkerConfig,
    SimulatedDevice,
    TrainerWorkerConfig,
    WorkerCommon,
)
from workers.models import TinyModelSpec, load_model, load_tokenizer
from workers.tasks import ArithmeticTask, Problem, load_problem_file
from workers.tokenizer import encode_prompt
from workers.warmstart import BuiltinRecipe, evaluate, prepare_builtin
from workers.weights import weights_path

TABLE = "samples"


def builtin_recipe(cfg: RunConfig) -> BuiltinRecipe:
    b = cfg.model.builtin
    spec = TinyModelSpec(
        hidden_size=b.hidden_size,
        num_layers=b.num_layers,
        num_heads=b.num_heads,
        num_kv_heads=b.num_kv_heads,
        intermediate_size=b.intermediate_size,
        seed=b.seed,
    )
    return BuiltinRecipe(
        spec=spec,
        digits=cfg.data.digits,
        operations=tuple(cfg.data.operations),
        task_seed=cfg.data.seed,
        warmstart_steps=cfg.model.warmstart_steps,
        batch_size=cfg.model.warmstart_batch_size,
        lr=cfg.model.warmstart_lr,
        seed=cfg.run.seed,
        eval_size=max(min(cfg.run.eval_prompts, 200), 1),
    )


def resolve_model(cfg: RunConfig, cache_root: Path) -> Path:
    """The policy's HF directory: the configured path, or the cached built-in checkpoint."""
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model.path {str(path)!r} is not a Hugging Face model directory"
            )
        return path
    recipe = builtin_recipe(cfg)
    key = hashlib.sha256(json.dumps(recipe.to_json(), sort_keys=True).encode()).hexdigest()[:12]
    return prepare_builtin(cache_root / f"builtin-{key}", recipe)


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
    table: str = TABLE
    start_iteration: int = 0
    rollout: RolloutWorkerConfig = field(init=False)
    reward: RewardWorkerConfig = field(init=False)
    reference: ReferenceWorkerConfig | None = field(init=False)
    trainer: TrainerWorkerConfig = field(init=False)

    @property
    def store(self) -> StoreSection:
        return self.cfg.store

    @property
    def kl_active(self) -> bool:
        return self.cfg.trainer.kl_coef > 0 and self.cfg.reference.enabled

    @property
    def reference_worker(self) -> bool:
        return self.kl_active and self.cfg.reference.placement == "worker"

    @property
    def table_spec(self):  # noqa: ANN201 - storage.schema.TableSpec
        from workers.schema import samples_table_spec

        s = self.cfg.store
        persist = str(self.run_dir / "store") if s.persist else None
        return samples_table_spec(
            self.table,
            group_size=self.cfg.data.group_size,
            reference_worker=self.reference_worker,
            capacity_rows=s.capacity_rows,
            lease_seconds=s.lease_seconds,
            max_deliveries=s.max_deliveries,
            persist_dir=persist,
            fsync="always" if s.fsync else "never",
        )

    def problems(self, iteration: int) -> list[Problem]:
        n = self.cfg.data.prompts_per_iteration
        if self.task is not None:
            return self.task.train_problems(n, epoch_or_offset=iteration)
        assert self.train_problems is not None
        items = self.train_problems
        return [items[(iteration * n + i) % len(items)] for i in range(n)]

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def workers(  # noqa: ANN201
        self,
        store_addresses: list[str],
        events_address: str | None,
        coordinator_address: str | None = None,
    ):
        """(name, role, config, threads) for every worker process of a streaming run."""
        c = self.cfg
        out = []

        def common(role: str, i: int, threads: int) -> WorkerCommon:
            return WorkerCommon(
                name=f"{role}-{i}",
                role=role,
                store_addresses=store_addresses,
                table=self.table,
                events_address=events_address,
                threads=threads,
                seed=c.run.seed,
                coordinator_address=coordinator_address,
                simulated=self.rollout.common.simulated,
            )

        for i in range(c.rollout.num_workers):
            w = _replace_common(self.rollout, common("rollout", i, c.rollout.threads))
            out.append((w.common.name, "rollout", w, c.rollout.threads))
        for i in range(c.reward.num_workers):
            w = _replace_common(self.reward, common("reward", i, 1))
            out.append((w.common.name, "reward", w, 1))
        if self.reference is not None:
            w = _replace_common(self.reference, common("reference", 0, c.reference.threads))
            out.append((w.common.name, "reference", w, c.reference.threads))
        w = _replace_common(self.trainer, common("trainer", 0, c.trainer.threads))
        out.append((w.common.name, "trainer", w, c.trainer.threads))
        return out

    def cleanup(self) -> None:
        if str(self.weights_dir).startswith("/dev/shm/"):
            shutil.rmtree(self.weights_dir, ignore_errors=True)


def _replace_common(w, common: WorkerCommon):  # noqa: ANN001, ANN202
    from dataclasses import replace

    return replace(w, common=common)


def _weights_dir(run_dir: Path) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="streamflow-weights-", dir=shm))
    path = run_dir / "weights"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def build_plan(cfg: RunConfig, run_dir: Path) -> RunPlan:
    cache_root = Path(cfg.run.output_dir).parent / ".cache"
    model_path = resolve_model(cfg, cache_root)
    tokenizer = load_tokenizer(model_path)
    d = cfg.data
    if d.task == "file":
        if not d.file:
            raise ValueError("data.file is required when data.task is 'file'")
        train = load_problem_file(d.file, d.prompt_column, d.answer_column)
        task, evals = None, train[: cfg.run.eval_prompts]
    else:
        task = ArithmeticTask(digits=d.digits, operations=tuple(d.operations), seed=d.seed)
        train, evals = (
            None,
            task.eval_problems(cfg.run.eval_prompts) if cfg.run.eval_prompts else [],
        )
    plan = RunPlan(cfg, run_dir, model_path, _weights_dir(run_dir), tokenizer, train, task, evals)
    resume_from = find_resume(cfg, run_dir)
    if resume_from is not None:
        plan.start_iteration = read_state(resume_from).step
    simulated = None
    if cfg.rollout.engine == "simulated":  # every role on a simulated device (config checks both)
        sim = cfg.simulated
        simulated = SimulatedDevice(cost=sim.cost, time_scale=sim.time_scale,
                                    median_response_tokens=sim.median_response_tokens, skew=sim.skew)
    blank = WorkerCommon(name="", role="", store_addresses=[], table=TABLE, seed=cfg.run.seed,
                         simulated=simulated)
    r, t = cfg.rollout, cfg.trainer
    # The trainer announces each published version on this PUB address; rollout workers SUBscribe
    # and wake at once instead of waiting for their next directory check. (In-process sync runs
    # need no announcement.) Across hosts, bind the trainer's address and share weights_dir.
    announce = None if cfg.run.mode == "sync" else f"tcp://127.0.0.1:{free_port()}"
    plan.rollout = RolloutWorkerConfig(
        common=_named(blank, "rollout"),
        model_path=str(model_path),
        weights_dir=str(plan.weights_dir),
        weights_announce=announce,
        group_size=d.group_size,
        groups_per_claim=r.groups_per_claim,
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        engine=r.engine,
        attn_implementation=r.attn_implementation,
        rows_per_generate=r.rows_per_generate,
        vllm_dtype=r.vllm_dtype,
        vllm_max_model_len=r.vllm_max_model_len,
        vllm_kv_cache_gib=r.vllm_kv_cache_gib,
        vllm_gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        vllm_enforce_eager=r.vllm_enforce_eager,
    )
    plan.reward = RewardWorkerConfig(
        common=_named(blank, "reward"),
        model_path=str(model_path),
        reward_fn=cfg.reward.fn,
        timeout_s=cfg.reward.timeout_s,
        rows_per_claim=cfg.reward.rows_per_claim,
        on_error=cfg.reward.on_error,
    )
    plan.reference = None
    if plan.reference_worker:
        plan.reference = ReferenceWorkerConfig(
            common=_named(blank, "reference"),
            model_path=str(model_path),
            temperature=r.temperature,
            rows_per_claim=cfg.reference.rows_per_claim,
            packing=t.packing,
            packing_min_saving=t.packing_min_saving,
            token_budget=t.token_budget,
            dtype=cfg.reference.dtype,
        )
    plan.trainer = TrainerWorkerConfig(
        common=_named(blank, "trainer"),
        model_path=str(model_path),
        reference_path=str(model_path) if plan.kl_active and not plan.reference_worker else None,
        weights_dir=str(plan.weights_dir),
        weights_bind=announce,
        rows_per_iteration=d.prompts_per_iteration * d.group_size,
        iterations=cfg.run.iterations,
        group_size=d.group_size,
        reference_worker=plan.reference_worker,
        lr=t.lr,
        weight_decay=t.weight_decay,
        betas=list(t.betas),
        clip_eps=t.clip_eps,
        kl_coef=t.kl_coef if plan.kl_active else 0.0,
        std_normalize=t.std_normalize,
        max_grad_norm=t.max_grad_norm,
        rows_per_claim=t.rows_per_claim,
        updates_per_batch=t.updates_per_batch,
        importance_correction=t.importance_correction,
        is_cap=t.is_cap,
        temperature=r.temperature,
        packing=t.packing,
        packing_min_saving=t.packing_min_saving,
        token_budget=t.token_budget,
        reference_dtype=cfg.reference.dtype,
        checkpoint_dir=str(run_dir / "checkpoints"),
        checkpoint_every=cfg.run.checkpoint_every,
        engine=t.engine,
        num_ranks=t.num_ranks,
        deterministic=t.deterministic,
        zero_stage=t.zero_stage,
        weights_keep=(cfg.run.max_staleness or 0) + 4,
        resume_from=str(resume_from) if resume_from is not None else None,
        start_iteration=plan.start_iteration,
    )
    return plan


def find_resume(cfg: RunConfig, run_dir: Path) -> Path | None:
    """The checkpoint to continue from: ``resume=auto`` takes the latest complete one in the run
    directory (none: a fresh start), a path names one explicitly (it must exist)."""
    if not cfg.run.resume:
        return None
    if cfg.run.resume == "auto":
        return latest_checkpoint(run_dir / "checkpoints")
    path = Path(cfg.run.resume)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"run.resume={cfg.run.resume!r} is not a complete checkpoint "
                                "(no trainer_state.json)")
    return path


def _named(common: WorkerCommon, role: str) -> WorkerCommon:
    from dataclasses import replace

    return replace(common, name=f"{role}-0", role=role)


class Evaluator:
    """Greedy held-out accuracy of a published policy version (in the controller's process)."""

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
            self._model = load_model(plan.model_path)
        path = weights_path(plan.weights_dir, version)
        if not path.exists() and version != 0 and self.fetch is not None:
            self.fetch(version)
        if path.exists():
            from safetensors.torch import load_file

            self._model.load_state_dict(load_file(str(path)), strict=False)
        elif version != 0:
            return None  # pruned already (async runs far ahead): skip rather than guess
        max_new = self.plan.cfg.rollout.max_new_tokens
        with torch.no_grad():
            return evaluate(self._model, plan.tokenizer, plan.eval_problems, max_new_tokens=max_new)
