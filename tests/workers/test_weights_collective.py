"""Collective weight sync over gloo: buckets, in-place loads, timeouts, and a member's restart."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from workers.config import WeightGroupConfig
from workers.weights.collective import CollectivePublisher, CollectiveSubscriber
from workers.weights.file_sync import WeightPublisher, WeightSubscriber
from workers.weights.group import (
    CollectiveSyncError,
    GroupMember,
    Rendezvous,
    bucket_layout,
    connect_store,
    copy_into,
    tensor_meta,
)


class Engine:
    """The slice of a rollout engine collective sync uses (TorchRolloutEngine has the same)."""

    def __init__(self, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 8)).to(dtype)
        self.model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.policy_version = 0

    def weight_targets(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_weights(self, weights, version: int) -> None:
        targets = self.model.state_dict()
        for k, v in weights.items():
            targets[k].copy_(v)
        self.policy_version = version


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"0.weight": torch.randn(48, 64, generator=g), "0.bias": torch.randn(48, generator=g),
            "1.weight": torch.randn(8, 48, generator=g), "1.bias": torch.randn(8, generator=g),
            "steps": torch.tensor([seed, 2 * seed, 3], dtype=torch.int64)}


def _spec(address: str, rank: int, world: int, timeout: float = 30.0, bucket: int = 4096):
    return WeightGroupConfig(address, rank, world, "gloo", bucket, timeout)


def test_bucket_layout_keeps_order_and_puts_a_large_tensor_alone():
    meta = [["a", "float32", [10]], ["b", "bfloat16", [4]], ["c", "float32", [100]],
            ["d", "int64", [2]]]
    assert bucket_layout(meta, 64) == [[0, 1], [2], [3]]  # 40+8 | 400 (alone) | 16
    assert bucket_layout(meta, 1 << 20) == [[0, 1, 2, 3]]


def test_mixed_dtypes_round_trip_into_live_parameters(tmp_path: Path):
    rdv = Rendezvous("127.0.0.1", 0)
    state = {"w": torch.randn(33, 7), "h": torch.randn(5).to(torch.bfloat16),
             "i": torch.arange(9, dtype=torch.int64)}
    meta = tensor_meta(state)
    targets = {k: torch.zeros_like(v, dtype=torch.float32 if k != "i" else torch.int64)
               for k, v in state.items()}
    errors: list[BaseException] = []

    def receiver() -> None:
        try:
            spec = _spec(rdv.address, 1, 2, bucket=64)
            member = GroupMember(spec, connect_store(spec), 7, torch.device("cpu"))
            member.receive(meta, 64, copy_into(targets, meta))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=receiver)
    t.start()
    spec = _spec(rdv.address, 0, 2, bucket=64)
    sender = GroupMember(spec, connect_store(spec), 7, torch.device("cpu"))
    sent = sender.send(list(state.values()), 64)
    t.join(30)
    assert not errors, errors
    assert sent == 33 * 7 * 4 + 5 * 2 + 9 * 8
    assert torch.equal(targets["w"], state["w"])
    assert torch.equal(targets["h"], state["h"].float())  # copy_ converts the dtype
    assert torch.equal(targets["i"], state["i"])


def test_unknown_names_or_shapes_are_refused_before_receiving():
    meta = tensor_meta({"w": torch.zeros(3, 2)})
    with pytest.raises(KeyError, match="unknown parameter"):
        copy_into({"v": torch.zeros(3, 2)}, meta)
    with pytest.raises(ValueError, match=r"w has shape \(3, 2\), expected \(2, 3\)"):
        copy_into({"w": torch.zeros(2, 3)}, meta)


def test_publish_reaches_every_member_in_place_then_the_file(tmp_path: Path):
    rdv = Rendezvous("127.0.0.1", 0)
    pub = CollectivePublisher(WeightPublisher(tmp_path / "t"), _spec(rdv.address, 0, 3), "cpu")
    engines = [Engine(), Engine(torch.bfloat16)]
    subs = []
    for rank, engine in enumerate(engines, start=1):
        sub = CollectiveSubscriber(WeightSubscriber(tmp_path / "t"), _spec(rdv.address, rank, 3),
                                   "cpu")
        sub.start(engine)
        subs.append(sub)
    pub.publish(_state(0), 0)  # the initial version: its file only
    assert pub.broadcasts == 0 and all(e.policy_version == 0 for e in engines)
    pointers = [p.data_ptr() for p in engines[0].model.parameters()]
    for version in (1, 2):
        pub.publish(_state(version), version)
        for sub, engine in zip(subs, engines, strict=True):
            assert sub.wait_engine(engine, version, 30.0) is True  # by broadcast, not file
    assert pub.broadcasts == 2 and pub.failures == 0
    assert [p.data_ptr() for p in engines[0].model.parameters()] == pointers  # in place
    want = _state(2)
    for engine in engines:
        got = engine.model.state_dict()
        for k, v in want.items():
            assert torch.equal(got[k], v.to(got[k].dtype)), k
    assert (tmp_path / "t" / "policy-v000002.safetensors").is_file()  # the fallback exists too
    assert all(s.received == 2 for s in subs)
    for s in subs:
        s.close()
    pub.close()


def test_a_missing_member_times_out_and_the_version_goes_by_file(tmp_path: Path):
    rdv = Rendezvous("127.0.0.1", 0)
    pub = CollectivePublisher(WeightPublisher(tmp_path), _spec(rdv.address, 0, 3, timeout=2.0),
                              "cpu")
    engine = Engine()
    sub = CollectiveSubscriber(WeightSubscriber(tmp_path), _spec(rdv.address, 1, 3, timeout=2.0),
                               "cpu")
    sub.start(engine)  # rank 2 never comes
    pub.publish(_state(0), 0)
    start = time.monotonic()
    pub.publish(_state(1), 1)
    assert time.monotonic() - start < 15.0  # bounded by the timeout, never a hang
    assert pub.failures == 1 and pub.broadcasts == 0
    assert sub.wait_engine(engine, 1, 10.0) is False  # not broadcast: the stage loads the file
    tensors, _ = sub.load(1)
    engine.load_weights(tensors, 1)
    assert torch.equal(engine.model.state_dict()["0.weight"], _state(1)["0.weight"])
    sub.close()
    pub.close()


class RemoteEngine(Engine):
    """Like vLLM: the member lives behind an RPC, so the barrier passes (and the trainer writes
    the version's file) before ``receive_weights`` returns and sets ``policy_version``. The RPC's
    way back is held until the test opens ``returned``: that moment is what is under test."""

    def __init__(self) -> None:
        super().__init__()
        self.member: GroupMember | None = None
        self.returned = threading.Event()

    def join_weight_group(self, spec: WeightGroupConfig, epoch: int) -> None:
        self.member = GroupMember(spec, connect_store(spec), epoch, torch.device("cpu"))

    def receive_weights(self, meta: list, bucket_bytes: int, version: int) -> int:
        assert self.member is not None
        nbytes = self.member.receive(meta, bucket_bytes,
                                     copy_into(self.weight_targets(), meta))
        self.member.barrier()
        assert self.returned.wait(30), "the test never let the RPC return"
        self.policy_version = version
        return nbytes


def test_a_version_in_flight_is_waited_for_although_its_file_already_exists(tmp_path: Path):
    rdv = Rendezvous("127.0.0.1", 0)
    pub = CollectivePublisher(WeightPublisher(tmp_path), _spec(rdv.address, 0, 2), "cpu")
    engine = RemoteEngine()
    sub = CollectiveSubscriber(WeightSubscriber(tmp_path), _spec(rdv.address, 1, 2), "cpu")
    looked = threading.Event()  # the waiter has seen version 1's file on disk
    newest = sub.files.newest

    def newest_seen() -> int | None:
        version = newest()
        if version is not None and version >= 1:
            looked.set()
        return version

    outcome: list[bool] = []
    waiter = threading.Thread(target=lambda: outcome.append(sub.wait_engine(engine, 1, 30.0)))
    try:
        sub.start(engine)
        pub.publish(_state(0), 0)
        pub.publish(_state(1), 1)  # returns after the barrier, with the file written
        assert sub.newest() == 1 and engine.policy_version == 0  # the receive is still returning
        sub.files.newest = newest_seen
        waiter.start()
        assert looked.wait(30)  # it saw the file while the receive was in flight ...
        engine.returned.set()
        waiter.join(30)
        assert outcome == [True]  # ... and waited for it: not a second load of the same version
        assert pub.broadcasts == 1 and sub.received == 1
        assert torch.equal(engine.model.state_dict()["0.weight"], _state(1)["0.weight"])
    finally:
        engine.returned.set()
        sub.close()
        pub.close()


def _member(address: str, rank: int, directory: str, versions: list[int], q, done) -> None:  # noqa: ANN001
    """A rollout worker's weight side in its own process: report how each version arrived on its
    own queue ``q``, then stay in the group until the test has every report (``done``)."""
    engine = Engine()
    sub = CollectiveSubscriber(WeightSubscriber(directory), _spec(address, rank, 3, timeout=10.0),
                               "cpu")
    sub.start(engine)
    q.put(("up", rank, 0, 0.0))
    for v in versions:
        how = "broadcast"
        if not sub.wait_engine(engine, v, 120.0):
            with sub.engine_lock:
                tensors, _ = sub.load(sub.newest())
                engine.load_weights(tensors, sub.newest())
            how = "file"
        q.put((how, rank, v, float(engine.model.state_dict()["0.weight"].sum())))
    done.wait(120)
    sub.close()  # its follower thread stops before the interpreter does (no exit with it mid-call)


@pytest.mark.slow
def test_a_restarted_member_loads_files_then_rejoins_at_the_next_epoch(tmp_path: Path):
    # One queue per member process: a queue's writers share one lock, and the member killed below
    # may die holding it (its feeder thread releases it only after the test has read the report),
    # which would leave every other member's report stuck behind it.
    ctx = mp.get_context("spawn")
    rdv = Rendezvous("127.0.0.1", 0)
    qa, qb, qb2 = ctx.Queue(), ctx.Queue(), ctx.Queue()
    done = ctx.Event()
    pub = CollectivePublisher(WeightPublisher(tmp_path), _spec(rdv.address, 0, 3, timeout=10.0),
                              "cpu")
    pub.publish(_state(0), 0)
    a = ctx.Process(target=_member, args=(rdv.address, 1, str(tmp_path), [1, 2, 3], qa, done))
    b = ctx.Process(target=_member, args=(rdv.address, 2, str(tmp_path), [1, 2, 3], qb, done))
    procs = [a, b]
    try:
        a.start()
        b.start()
        assert (qa.get(timeout=120)[:2], qb.get(timeout=120)[:2]) == (("up", 1), ("up", 2))
        pub.publish(_state(1), 1)
        got = (qa.get(timeout=60)[:3], qb.get(timeout=60)[:3])
        assert got == (("broadcast", 1, 1), ("broadcast", 2, 1))
        os.kill(b.pid, signal.SIGKILL)  # rank 2 dies; its restart comes up fresh at version 0
        b.join(10)
        pub.publish(_state(2), 2)  # fails on the dead member: version 2 goes by file
        assert pub.failures == 1
        # the survivor has it (broadcast, or file once its receive timed out: 10 s)
        assert qa.get(timeout=120)[1:3] == (1, 2)
        b2 = ctx.Process(target=_member, args=(rdv.address, 2, str(tmp_path), [2, 3], qb2, done))
        procs.append(b2)
        b2.start()
        assert qb2.get(timeout=120)[:2] == ("up", 2)
        assert qb2.get(timeout=60)[:3] == ("file", 2, 2)  # the fresh member catches up from the file
        pub.publish(_state(3), 3)  # a new epoch: both members join it
        final = (qa.get(timeout=60), qb2.get(timeout=60))
        want = float(_state(3)["0.weight"].sum())
        assert tuple(f[:3] for f in final) == (("broadcast", 1, 3), ("broadcast", 2, 3))
        assert all(abs(f[3] - want) < 1e-3 for f in final)
        assert pub.broadcasts == 2 and pub.failures == 1
    finally:
        done.set()  # every report is in (or the test failed): the members may leave
        for p in procs:  # a member stuck on its way out must not hold pytest's exit
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
        pub.close()


def test_an_unreachable_rendezvous_is_a_clear_error():
    with pytest.raises(CollectiveSyncError, match="rendezvous 127.0.0.1:1 unreachable"):
        connect_store(_spec("127.0.0.1:1", 1, 2, timeout=1.0))


def test_shared_memory_buckets_over_gloo_signals(tmp_path: Path):
    """transport=shm: gloo carries the signals, the bytes go through two shared buckets."""
    rdv = Rendezvous("127.0.0.1", 0)
    state = {f"t{i}": torch.randn(40 + i, 3) for i in range(7)}
    state["b"] = torch.randn(11).to(torch.bfloat16)
    meta = tensor_meta(state)
    targets = [{k: torch.zeros_like(v) for k, v in state.items()} for _ in range(2)]
    errors: list[BaseException] = []

    def spec(rank: int) -> WeightGroupConfig:
        return WeightGroupConfig(rdv.address, rank, 3, "gloo", 1200, 30.0, "shm", str(tmp_path))

    def receiver(rank: int) -> None:
        try:
            member = GroupMember(spec(rank), connect_store(spec(rank)), 3, torch.device("cpu"))
            for _ in range(2):  # two versions through the same slots
                member.receive(meta, 1200, copy_into(targets[rank - 1], meta))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sender = GroupMember(spec(0), connect_store(spec(0)), 3, torch.device("cpu"))
    assert len(bucket_layout(meta, 1200)) >= 4  # several buckets: both slots are reused
    sender.send([torch.zeros_like(v) for v in state.values()], 1200)
    sent = sender.send(list(state.values()), 1200)
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert sent == sum(v.numel() * v.element_size() for v in state.values())
    for got in targets:
        for k, v in state.items():
            assert torch.equal(got[k], v), k
    assert len(list(tmp_path.glob("sf-weights-*"))) == 2
    sender.close_shm()
    assert list(tmp_path.glob("sf-weights-*")) == []
