"""Each role built from its typed worker config: engines, models, weight sync, the stage object.

``build_rollout`` / ``build_reward`` / ``build_reference`` / ``build_trainer`` are what a worker
process (``workers.main``) and the colocated loop (``sync``) run; nothing here loops or signals.
A rollout worker's stages are built here only (``build_rollout_stages``: piece 0 and every
``rollout.{k}``, with what the loop needs to let rows ride along and write them early).
"""


from __future__ import annotations

import logging
import os
from typing import Any

import torch

from workers.agent.pieces import Rules
from workers.agent.toolcall import marker_ids
from workers.config import (
    ReferenceWorkerConfig,
    RewardWorkerConfig,
    RolloutWorkerConfig,
    TrainerWorkerConfig,
)
from workers.engines.base import SamplingParams
from workers.engines.torch_trainer import TorchTrainerEngine
from workers.models.checkpoint import read_state, restore_rng, save_checkpoint
from workers.models.local import load_model, load_tokenizer
from workers.rl.reference import ReferenceScorer
from workers.rl.trimodel import TriModel
from workers.roles.continuation import ContinueStage, rollout_stages
from workers.roles.reference import ReferenceStage
from workers.roles.reward import RewardStage
from workers.roles.rollout import RolloutStage
from workers.roles.trainer import Trainer
from workers.runtime import cores
from workers.runtime.devices import DTYPES, dtype_of, pin_visible_gpu, torch_device
from workers.runtime.events import EventSender, WeightSyncReport
from workers.runtime.leases import LeaseKeeper
from workers.runtime.metrics import WorkerMetrics
from workers.settings import HUB, PackingSettings
from workers.weights.file_sync import WeightPublisher, WeightSubscriber
from workers.weights.watch import VersionWatch


def make_rollout_engine(cfg: RolloutWorkerConfig, device: str) -> Any:
    """The configured rollout engine on ``device`` (this process's name for the rollout's
    device: for vLLM, ``build_rollout`` has made it the only GPU visible here)."""
    if cfg.engine == "vllm":
        from workers.engines.vllm_rollout import VllmRolloutEngine  # needs the [vllm] extra

        return VllmRolloutEngine(cfg.model_path, seed=cfg.common.seed, **cfg.vllm.engine_kwargs())
    tokenizer = load_tokenizer(cfg.model_path)
    if cfg.engine == "simulated":  # no model: the cost model's device (workers.engines.simulated)
        from workers.engines.simulated import SimulatedRolloutEngine

        if cfg.common.simulated is None:
            raise ValueError("rollout engine 'simulated' needs common.simulated (the device)")
        return SimulatedRolloutEngine(cfg.common.simulated, len(tokenizer))
    from workers.engines.torch_rollout import TorchRolloutEngine

    model = load_model(cfg.model_path, dtype=dtype_of(cfg.dtype),
                       attn_implementation=cfg.generate.attn_implementation)
    return TorchRolloutEngine(model, tokenizer, device=torch_device(device),
                              max_batch_size=cfg.generate.rows_per_generate or None,
                              cut_live_fraction=cfg.cuts.partial_cut_live_fraction)


def load_reference(path: str, *, dtype: str, device: str, temperature: float,
                   pack: PackingSettings) -> ReferenceScorer:
    """The frozen reference on ``device``, as the reference worker and the rollout run it."""
    model = load_model(path, dtype=DTYPES[dtype], attn_implementation=pack.attn_implementation)
    return ReferenceScorer(model.to(torch_device(device)), temperature=temperature, pack=pack)


def build_rollout_stages(cfg: RolloutWorkerConfig, events: EventSender
                         ) -> list[RolloutStage | ContinueStage]:
    """Every stage a rollout worker serves (``workers.roles.continuation.rollout_stages``)."""
    return rollout_stages(build_rollout(cfg, events))


def build_rollout(cfg: RolloutWorkerConfig, events: EventSender) -> RolloutStage:
    """The rollout stage (piece 0) with its engine, weights and rules."""
    tokenizer = load_tokenizer(cfg.model_path)
    stops = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    sampling = cfg.sampling
    params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                            max_new_tokens=sampling.max_new_tokens, stop_token_ids=stops)
    files = WeightSubscriber(cfg.weights_dir, cfg.weights_announce, fetch=cfg.weights_fetch)

    def on_sync(report: WeightSyncReport) -> None:  # a fetched version's copy is sync cost too
        report.seconds += files.fetch_seconds.pop(report.policy_version, 0.0)
        events.send(report)

    device = cfg.device
    if cfg.engine == "vllm":  # vLLM places itself on the first visible GPU: make that ours
        device = pin_visible_gpu(cfg.device)
    engine = make_rollout_engine(cfg, device)
    weights: Any = files
    spec = cfg.weights_group  # None: weights go by file only
    if spec is not None:  # collective sync: a thread receives each broadcast version
        from workers.weights.collective import CollectiveSubscriber

        weights = CollectiveSubscriber(files, spec, device, on_sync, worker=cfg.common.name)
    watch = None  # partial rollout: what cuts a generation (workers.weights.watch)
    if cfg.cuts.partial:
        # a remote trainer's file comes only when fetched: its announcements tell first
        watch = VersionWatch(cfg.weights_dir,
                             announce=cfg.weights_announce if cfg.weights_fetch else None)
        if spec is not None:
            weights.on_announce = watch.notify
    if spec is not None:
        weights.start(engine)
    reference = None
    # reference.placement=rollout: score the responses here, on our device. Loaded after the
    # engine: vLLM refuses to start unless vllm_gpu_memory_utilization of the GPU is free, then
    # takes only its weights, activations and vllm_kv_cache_gib, which leaves room for the copy.
    if cfg.reference_path:
        reference = load_reference(cfg.reference_path, dtype=cfg.reference_dtype,
                                   device=device, temperature=sampling.temperature,
                                   pack=cfg.reference_pack)
    rules = None  # single-turn and uncut: one piece per row
    agent, cuts = cfg.agent, cfg.cuts.max_cuts
    if agent is not None and agent.max_turns > 1:
        rules = Rules(agent.max_turns, sampling.max_new_tokens, agent.max_total_tokens,
                      marker_ids(tokenizer, agent.format), max_cuts=cuts,
                      agent_driven=cfg.agent_driven)
    elif cuts:
        rules = Rules(1, sampling.max_new_tokens, sampling.max_new_tokens, max_cuts=cuts)
    return RolloutStage(engine, weights, params, worker=cfg.common.name,
                        group_size=cfg.group_size, groups_per_claim=cfg.groups_per_claim,
                        seed=cfg.common.seed, weight_wait_s=cfg.weight_wait_s, on_sync=on_sync,
                        reference=reference, rules=rules, watch=watch,
                        tail_cut=cfg.cuts.partial and cfg.cuts.partial_tail_cut)


def build_reward(cfg: RewardWorkerConfig) -> Any:
    r = cfg.verifier
    scorer = None
    if cfg.scorer.model is not None:  # reward.model: scored in batched forwards on its device
        from workers.models.reward_model import load_reward_model

        scorer = load_reward_model(cfg.scorer, device=cfg.model_device, dtype=cfg.model_dtype)
    fn = r.fn
    if fn == HUB:  # env.hub's rewards, run in the reward child like a user's function
        from workers.agent.hub import hub_spec

        fn = hub_spec(cfg.hub)
    stage = RewardStage(load_tokenizer(cfg.model_path), fn, timeout_s=r.timeout_s,
                        max_rows=cfg.rows_per_claim, on_error=r.on_error, agent=cfg.agent,
                        max_cuts=cfg.cuts.max_cuts,
                        env_reward=r.env_reward, scorer=scorer, scoring=cfg.scorer)
    if cfg.common.simulated is not None:  # the real verifier, plus the cost model's time
        from workers.engines.simulated import SimulatedRewardStage

        return SimulatedRewardStage(stage, cfg.common.simulated)
    return stage


def build_reference(cfg: ReferenceWorkerConfig) -> Any:
    if cfg.common.simulated is not None:
        from workers.engines.simulated import SimulatedReferenceStage

        return SimulatedReferenceStage(cfg.common.simulated, cfg.rows_per_claim)
    return ReferenceStage(
        load_reference(cfg.model_path, dtype=cfg.dtype, device=cfg.device,
                       temperature=cfg.sampling.temperature, pack=cfg.pack),
        max_rows=cfg.rows_per_claim)


def make_trainer_engine(cfg: TrainerWorkerConfig, model: torch.nn.Module) -> tuple[Any, Any]:
    """The configured training engine and, for DeepSpeed (one process per rank, joining the
    group torch's launcher describes), this process's ``RankGroup``."""
    if cfg.engine == "torch":
        o = cfg.optim
        return TorchTrainerEngine(model, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas,
                                  max_grad_norm=o.max_grad_norm, warmup_steps=o.warmup_steps,
                                  fp64_accumulation=cfg.deterministic,
                                  # the reference loop where runs are compared bitwise
                                  optimizer_impl="single" if cfg.deterministic else "fused"), None
    if cfg.engine == "deepspeed":  # needs the [deepspeed] extra (clear error if missing)
        if cfg.device.startswith("cuda"):  # rank r on the GPU after the trainer's first + r
            torch.cuda.set_device(torch_device(cfg.device, int(os.environ.get("LOCAL_RANK", 0))))
        from workers.engines.deepspeed_trainer import (
            DeepSpeedSettings,
            DeepSpeedTrainerEngine,
            start_ranks,
        )

        settings = DeepSpeedSettings(optim=cfg.optim, zero_stage=cfg.zero_stage)
        ranks = start_ranks()
        if cfg.num_ranks != ranks.world_size:
            raise ValueError(f"trainer.num_ranks={cfg.num_ranks} but the launcher started "
                             f"{ranks.world_size} ranks")
        return DeepSpeedTrainerEngine(model, settings, ranks), ranks
    raise ValueError(
        f"unknown trainer engine {cfg.engine!r}; engines: ['deepspeed', 'simulated', 'torch']")


def build_trainer(cfg: TrainerWorkerConfig, client: Any, events: EventSender,
                  keeper: LeaseKeeper, metrics: WorkerMetrics | None = None) -> Any:
    """The trainer of ``cfg.engine``: ``Trainer`` (torch, deepspeed) or ``SimulatedTrainer``;
    ``keeper`` renews the leases it holds until their rows are trained and acked."""
    if cfg.engine == "simulated":
        return build_simulated_trainer(cfg, client, events, keeper)
    torch.manual_seed(cfg.common.seed)
    start_iteration = cfg.start_iteration
    device = torch_device(cfg.device)
    attn = cfg.pack.attn_implementation
    # float32 master weights (trainer.dtype is the forward's autocast dtype)
    model = load_model(cfg.resume_from or cfg.model_path, dtype=torch.float32,
                       attn_implementation=attn)
    if cfg.engine == "torch":  # (DeepSpeed places the model on its rank's device itself)
        model = model.to(device)
    engine, ranks = make_trainer_engine(cfg, model)
    cores.refresh_between_layers(model)  # a pass is seconds long: re-take the share per layer
    leader = ranks is None or ranks.is_leader
    if cfg.resume_from:  # weights above; optimizer, RNG and step from the same checkpoint
        engine.load_state(cfg.resume_from)
        restore_rng(cfg.resume_from)
        start_iteration = read_state(cfg.resume_from).step
    reference = None
    if cfg.reference_path and cfg.grpo.kl_coef > 0 and not cfg.reference_in_store:
        reference = load_model(cfg.reference_path, dtype=DTYPES[cfg.reference_dtype],
                               attn_implementation=attn)
        cores.refresh_between_layers(reference)
    compute = dtype_of(cfg.dtype)
    # updates_per_batch: the trainer keeps the first pass's log-probs as the old policy
    tri = TriModel(model, reference=reference,
                   frozen_device=next(model.parameters()).device,
                   autocast_dtype=None if compute == torch.float32 else compute)
    if reference is not None:  # what the fused reference costs (reference.dtype=bfloat16 halves it)
        logging.getLogger("workers.roles.trainer").info(
            "tri-model: frozen reference copy holds %d bytes beside the policy", tri.extra_bytes())
    tokenizer = load_tokenizer(cfg.model_path)

    def checkpoint(step: int) -> None:
        every = cfg.checkpoint_every
        if cfg.checkpoint_dir and (step == cfg.iterations or (every and step % every == 0)):
            if leader:
                save_checkpoint(cfg.checkpoint_dir, step, model, tokenizer, engine,
                                keep=cfg.checkpoint_keep)
                if metrics is not None:
                    metrics.checkpoint_saved()
            else:  # join rank 0's collective engine save (the directory comes from rank 0)
                engine.save_state("")

    publisher: Any = WeightPublisher(cfg.weights_dir, cfg.weights_bind if leader else None,
                                     keep=cfg.weights_keep,
                                     serve=cfg.weights_serve if leader else None)
    spec = cfg.weights_group  # None: weights go by file only
    if spec is not None and leader:  # collective sync: rank 0 broadcasts to the rollout workers
        from workers.weights.collective import CollectivePublisher

        publisher = CollectivePublisher(publisher, spec, next(model.parameters()).device)
    return Trainer(
        client, cfg.common.table, engine, tri, cfg, publisher,
        worker=cfg.common.name, send=events.send if leader else (lambda r: None),
        start_iteration=start_iteration, on_step=checkpoint, keeper=keeper, ranks=ranks,
    )


def build_simulated_trainer(cfg: TrainerWorkerConfig, client: Any, events: EventSender,
                            keeper: LeaseKeeper) -> Any:
    from workers.roles.simulated_trainer import SimulatedTrainer

    if cfg.resume_from:
        raise ValueError("a simulated trainer writes no checkpoints: it cannot resume")
    publisher = WeightPublisher(cfg.weights_dir, cfg.weights_bind, keep=cfg.weights_keep,
                                serve=cfg.weights_serve)
    return SimulatedTrainer(client, cfg, publisher, send=events.send, keeper=keeper)
