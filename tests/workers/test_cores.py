"""The host's thread budget shared by phase (workers/runtime/cores.py), across real processes."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from workers.config import RewardWorkerConfig, WorkerCommon, from_json, to_json
from workers.runtime import cores
from workers.runtime.cores import CoreShare, CoreShareConfig, create


def test_share_splits_the_budget_among_busy_processes(tmp_path):
    path = create(tmp_path / "cores")
    a = CoreShare(CoreShareConfig(str(path), 1, 2))
    b = CoreShare(CoreShareConfig(str(path), 2, 2))
    c = CoreShare(CoreShareConfig(str(path), 3, 5))
    try:
        assert a.share() == 2  # alone at work: every thread
        with a.busy() as threads:
            assert threads == 2 and torch.get_num_threads() == 2
            assert b.share() == 1  # a is busy: b would get half
            with b.busy():
                assert a.share() == 1 and b.share() == 1
                assert a.refresh() == 1 and torch.get_num_threads() == 1
            assert a.refresh() == 2  # b went idle: a takes both back
        # remainder to the lowest busy slots: 5 threads among 3 busy -> 2, 2, 1
        with a.busy(), b.busy():
            assert c.share() == 1
            c.cfg.slot = 0
            assert c.share() == 2
    finally:
        for s in (a, b, c):
            s.close()


def test_a_capped_process_never_grows_but_still_makes_the_others_yield(tmp_path):
    path = create(tmp_path / "cores")
    rollout = CoreShare(CoreShareConfig(str(path), 1, 2, max_threads=1))
    trainer = CoreShare(CoreShareConfig(str(path), 2, 2))
    try:
        assert rollout.share() == 1  # alone, still capped
        assert trainer.share() == 2
        with rollout.busy():
            assert trainer.share() == 1
    finally:
        rollout.close()
        trainer.close()


def test_busy_is_reentrant_and_marks_idle_on_exit(tmp_path):
    path = create(tmp_path / "cores")
    a = CoreShare(CoreShareConfig(str(path), 4, 2))
    with a.busy(), a.busy():
        assert path.read_bytes()[4] == 1
    assert path.read_bytes()[4] == 0
    with pytest.raises(RuntimeError), a.busy():
        raise RuntimeError("a failing phase still hands its threads back")
    assert path.read_bytes()[4] == 0
    a.close()


def test_module_hooks_are_noops_without_a_share():
    cores.install(None)
    before = torch.get_num_threads()
    with cores.busy() as threads:
        assert threads == before
    assert torch.get_num_threads() == before


def _hold_busy(path: str, started, release) -> None:  # noqa: ANN001
    share = CoreShare(CoreShareConfig(path, 7, 2))
    with share.busy():
        started.set()
        release.wait(10)


def test_another_process_busy_halves_this_ones_share(tmp_path):
    path = create(tmp_path / "cores")
    mine = CoreShare(CoreShareConfig(str(path), 1, 2))
    ctx = mp.get_context("spawn")
    started, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold_busy, args=(str(path), started, release))
    proc.start()
    try:
        assert started.wait(60)
        assert mine.share() == 1
        release.set()
        proc.join(30)
        assert proc.exitcode == 0
        assert mine.share() == 2
    finally:
        release.set()
        proc.join(5)
        mine.close()


def test_worker_config_carries_the_share_through_json(tmp_path):
    common = WorkerCommon(name="reward-0", role="reward", store_addresses=["tcp://127.0.0.1:1"],
                          table="t", seed=0, threads=1, trace_rows=False,
                          cores=CoreShareConfig(str(tmp_path / "c"), 3, 2))
    cfg = RewardWorkerConfig(common=common, model_path="m", rows_per_claim=32, fn="exact_match",
                             model_device="cpu", model_dtype="float32", hub=None)
    back = from_json("reward", to_json(cfg))
    assert back.common.cores == CoreShareConfig(str(tmp_path / "c"), 3, 2)


def test_bad_slots_and_budgets_are_refused(tmp_path):
    path = create(tmp_path / "cores")
    with pytest.raises(ValueError, match="slot"):
        CoreShare(CoreShareConfig(str(path), 64, 2))
    with pytest.raises(ValueError, match="total_threads"):
        CoreShare(CoreShareConfig(str(path), 1, 0))


def test_a_missing_table_is_created_not_truncated(tmp_path):
    path = tmp_path / "other-host-cores"
    a = CoreShare(CoreShareConfig(str(path), 2, 2))
    with a.busy():
        b = CoreShare(CoreShareConfig(str(path), 5, 2))  # opening must keep a's mark
        assert b.share() == 1
        b.close()
    a.close()


def _mark(path, slot: int, busy: bool) -> None:  # noqa: ANN001
    """Another process of the host starting or ending a phase: its byte of the table."""
    with open(path, "r+b") as fh:
        fh.seek(slot)
        fh.write(bytes([int(busy)]))


def test_a_model_takes_a_share_freed_or_claimed_mid_pass_between_its_layers(tmp_path):
    """A trainer's pass is seconds long: the share is re-taken before every layer's forward and
    backward, so a rollout that starts mid-pass gets its thread at the next layer, and one that
    stops hands its thread back at the next layer (not at the next micro-batch)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(config).float()
    assert cores.refresh_between_layers(model) == 3
    layers = model.model.layers
    forward_threads: list[int] = []
    for layer in layers:  # registered after the share's hooks, so they see what those set
        layer.register_forward_pre_hook(lambda m, a: forward_threads.append(torch.get_num_threads()))
    backward_threads: list[int] = []
    for layer in (layers[2], layers[0]):  # a weight's gradient is computed inside its layer
        layer.mlp.down_proj.weight.register_hook(
            lambda g: backward_threads.append(torch.get_num_threads()))

    path = create(tmp_path / "cores")
    rollout_slot = 2

    def rollout_starts(module: torch.nn.Module, args: object, output: object) -> None:
        _mark(path, rollout_slot, True)  # once layer 0 has run

    starts_hook = layers[0].register_forward_hook(rollout_starts)
    trainer = CoreShare(CoreShareConfig(str(path), 1, 2))
    before = torch.get_num_threads()
    cores.install(trainer)
    try:
        with cores.busy() as threads:
            assert threads == 2  # alone at work: both threads
            loss = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.sum()
            assert forward_threads == [2, 1, 1]
            starts_hook.remove()
            _mark(path, rollout_slot, False)  # the rollout is done before the backward
            loss.backward()
            assert backward_threads == [2, 2]  # taken back at the first layer of the backward
        # outside a phase the hooks leave the count alone (a phase's start sets it)
        _mark(path, rollout_slot, True)
        model.eval()
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2]]))
        assert torch.get_num_threads() == 2
    finally:
        cores.install(None)
        trainer.close()
        torch.set_num_threads(before)
