"""A worker process: ``python -m workers.main --role ROLE --config FILE``.

Builds one role from its typed config, runs its loop until the work is done or SIGTERM/SIGINT.
Exit 0 after a clean stop (held leases handed back) or completed work; 1 after an error, also
reported as ``WorkerStatus(state="failed")`` (docs/training.md "Worker processes").
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import torch

import storage
from workers import cores, heap
from workers.checkpoint import read_state, restore_rng, save_checkpoint
from workers.config import (
    ReferenceWorkerConfig,
    RewardWorkerConfig,
    RolloutWorkerConfig,
    TrainerWorkerConfig,
    WorkerConfig,
    from_json,
)
from workers.devices import DTYPES, dtype_of, pin_visible_gpu, torch_device
from workers.engines.base import SamplingParams
from workers.engines.torch_trainer import TorchTrainerEngine
from workers.events import EventSender, WeightSyncReport, WorkerStatus
from workers.loop import LeaseKeeper, serve_stage
from workers.metrics import MeteredClient, MeteredEvents, WorkerMetrics
from workers.models import load_model, load_tokenizer
from workers.reference import ReferenceScorer, ReferenceStage
from workers.reward import RewardStage
from workers.rollout import RolloutStage
from workers.settings import PackingSettings
from workers.trainer import Trainer
from workers.trimodel import TriModel
from workers.weights import WeightPublisher, WeightSubscriber


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
                              max_batch_size=cfg.generate.rows_per_generate or None)


def load_reference(path: str, *, dtype: str, device: str, temperature: float,
                   pack: PackingSettings) -> ReferenceScorer:
    """The frozen reference on ``device``, as the reference worker and the rollout run it."""
    model = load_model(path, dtype=DTYPES[dtype], attn_implementation=pack.attn_implementation)
    return ReferenceScorer(model.to(torch_device(device)), temperature=temperature, pack=pack)


def build_rollout(cfg: RolloutWorkerConfig, events: EventSender) -> RolloutStage:
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
        from workers.weights_group import CollectiveSubscriber

        weights = CollectiveSubscriber(files, spec, device, on_sync, worker=cfg.common.name)
        weights.start(engine)
    reference = None
    # reference.placement=rollout: score the responses here, on our device. Loaded after the
    # engine: vLLM refuses to start unless vllm_gpu_memory_utilization of the GPU is free, then
    # takes only its weights, activations and vllm_kv_cache_gib, which leaves room for the copy.
    if cfg.reference_path:
        reference = load_reference(cfg.reference_path, dtype=cfg.reference_dtype,
                                   device=device, temperature=sampling.temperature,
                                   pack=cfg.reference_pack)
    return RolloutStage(engine, weights, params, worker=cfg.common.name,
                        group_size=cfg.group_size, groups_per_claim=cfg.groups_per_claim,
                        seed=cfg.common.seed, weight_wait_s=cfg.weight_wait_s, on_sync=on_sync,
                        reference=reference)


def build_reward(cfg: RewardWorkerConfig) -> Any:
    r = cfg.verifier
    stage = RewardStage(load_tokenizer(cfg.model_path), r.fn, timeout_s=r.timeout_s,
                        max_rows=cfg.rows_per_claim, on_error=r.on_error)
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
                                  fp64_accumulation=cfg.deterministic), None
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
                  keeper: LeaseKeeper | None = None, metrics: WorkerMetrics | None = None) -> Any:
    """The trainer of ``cfg.engine``: ``Trainer`` (torch, deepspeed) or ``SimulatedTrainer``."""
    if cfg.engine == "simulated":
        return build_simulated_trainer(cfg, client, events, keeper)
    torch.manual_seed(cfg.common.seed)
    start_iteration = cfg.start_iteration
    device = torch_device(cfg.device)
    attn = cfg.pack.attn_implementation
    model = load_model(cfg.resume_from or cfg.model_path, attn_implementation=attn)  # fp32 master
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
    if cfg.reference_path and cfg.loss.kl_coef > 0 and not cfg.reference_in_store:
        reference = load_model(cfg.reference_path, dtype=DTYPES[cfg.reference_dtype],
                               attn_implementation=attn)
        cores.refresh_between_layers(reference)
    compute = dtype_of(cfg.dtype)
    # updates_per_batch: the trainer keeps the first pass's log-probs as the old policy
    tri = TriModel(model, reference=reference,
                   frozen_device=next(model.parameters()).device,
                   autocast_dtype=None if compute == torch.float32 else compute)
    if reference is not None:  # what the fused reference costs (reference.dtype=bfloat16 halves it)
        logging.getLogger("workers.trainer").info(
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
        from workers.weights_group import CollectivePublisher

        publisher = CollectivePublisher(publisher, spec, next(model.parameters()).device)
    return Trainer(
        client, cfg.common.table, engine, tri, cfg, publisher,
        worker=cfg.common.name, send=events.send if leader else (lambda r: None),
        start_iteration=start_iteration, on_step=checkpoint, keeper=keeper, ranks=ranks,
    )


def build_simulated_trainer(cfg: TrainerWorkerConfig, client: Any, events: EventSender,
                            keeper: LeaseKeeper | None) -> Any:
    from workers.engines.simulated_trainer import SimulatedTrainer

    if cfg.resume_from:
        raise ValueError("a simulated trainer writes no checkpoints: it cannot resume")
    publisher = WeightPublisher(cfg.weights_dir, cfg.weights_bind, keep=cfg.weights_keep,
                                serve=cfg.weights_serve)
    return SimulatedTrainer(client, cfg, publisher, send=events.send, keeper=keeper)


def run_worker(cfg: WorkerConfig, stop: threading.Event) -> int:
    common = cfg.common
    heap.keep_heap()  # a step's freed activations are reused, not faulted in again
    torch.set_num_threads(max(common.threads, 1))
    if common.cores is not None:  # the host's budget, shared by phase (workers.cores)
        cores.install(cores.CoreShare(common.cores))
    events: Any = EventSender(common.events_address)
    timeout = common.request_timeout_s
    client: Any = storage.connect(common.store_addresses, request_timeout=timeout)
    keeper = LeaseKeeper(lambda: storage.connect(common.store_addresses, request_timeout=timeout))
    metrics, metrics_address = None, ""
    if common.metrics_host:  # taps on the reports and claims this worker makes anyway
        metrics = WorkerMetrics()
        port = metrics.start_http(common.metrics_host, common.metrics_port)
        host = common.metrics_host
        metrics_address = f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        events, client = MeteredEvents(events, metrics), MeteredClient(client, metrics, common.role)

    def ready() -> WorkerStatus:
        return WorkerStatus(common.name, common.role, "ready", metrics_address=metrics_address)

    session: Any = None  # storage.coordinator_session.ConsumerSession of a stage worker
    try:
        if isinstance(cfg, TrainerWorkerConfig):
            trainer = build_trainer(cfg, client, events, keeper, metrics)
            if trainer.ranks is not None and not trainer.ranks.is_leader:
                trainer.follow()  # rank > 0: rank 0 owns the store, the reports and the stop
                return 0
            trainer.publish_current()
            events.send(ready())
            while not stop.is_set() and trainer.step < cfg.iterations:
                trainer.poll(common.claim_timeout_s)
            trainer.release_held()
            trainer.stop_followers()
        else:
            if isinstance(cfg, RolloutWorkerConfig):
                stage: Any = build_rollout(cfg, events)
            elif isinstance(cfg, RewardWorkerConfig):
                stage = build_reward(cfg)
            else:
                stage = build_reference(cfg)
            events.send(ready())
            if common.coordinator_address:  # the balancer: claim from the shards we own
                from storage.coordinator_session import ConsumerSession

                session = ConsumerSession(
                    common.coordinator_address, common.table, stage.task, common.name,
                    registry=metrics.registry if metrics is not None else None,
                )
            serve_stage(
                client, common.table, stage, stop, worker=common.name, role=common.role,
                events=events, timeout_s=common.claim_timeout_s, keeper=keeper, session=session,
            )
        events.send(WorkerStatus(common.name, common.role, "stopped"))
        return 0
    except Exception as exc:
        detail = "".join(traceback.format_exception(exc))[-4000:]
        error = f"{type(exc).__name__}: {exc}\n{detail}"
        events.send(WorkerStatus(common.name, common.role, "failed", error))
        print(detail, file=sys.stderr, flush=True)
        return 1
    finally:
        if session is not None:
            session.close()  # leave the group: its shards go to the others at once
        keeper.close()
        client.close()
        events.close()
        if metrics is not None:
            metrics.stop_http()
        cores.install(None)


EXIT_BOUND_S = 60.0  # after SIGTERM/SIGINT, a worker leaves within this, done or not


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.main", description=__doc__)
    parser.add_argument("--role", required=True,
                        choices=["rollout", "reward", "reference", "trainer"])
    parser.add_argument("--config", required=True, help="JSON file written by the controller")
    args = parser.parse_args(argv)
    cfg = from_json(args.role, Path(args.config).read_text())
    # One line per event in the worker's log file (the controller keeps logs/<worker>.log).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    install_stop_handlers(stop)
    return run_worker(cfg, stop)


def install_stop_handlers(stop: threading.Event) -> None:
    """SIGTERM/SIGINT set ``stop`` (the loop finishes its turn and releases its rows)."""
    fired: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        # Only the first signal acts. A handler runs in the main thread between two bytecodes,
        # so a second signal can land inside the first one's ``stop.set()`` while it holds the
        # event's (non-reentrant) lock: setting it again there waits on that lock forever (an
        # orphaned worker was found so, four handlers deep, never reaching its exit bound).
        if fired:
            return
        fired.append(signum)
        # The way out is bounded, and the bound is armed before anything that could block: a
        # worker whose store or controller is gone may never finish releasing its rows, and an
        # orphan (its controller SIGKILLed; PR_SET_PDEATHSIG sent this signal) has nobody to
        # SIGKILL it. A supervised worker is SIGKILLed long before (the supervisor's grace is 10 s).
        bound = threading.Timer(EXIT_BOUND_S, os._exit, args=(128 + signum,))
        bound.daemon = True
        bound.start()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


if __name__ == "__main__":
    sys.exit(main())
