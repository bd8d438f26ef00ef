"""The two ends of collective weight sync: ``CollectivePublisher`` (trainer) and
``CollectiveSubscriber`` (rollout worker), over ``workers.weights.group``. A version's file is
always written too: the fallback of a failed broadcast. See docs/engines.md, "Collective weight
sync: the two ends".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from workers.config import WeightGroupConfig
from workers.runtime.events import WeightSyncReport
from workers.weights.file_sync import (
    PublishedWeights,
    WeightPublisher,
    WeightSubscriber,
    WeightSyncTimeout,
)
from workers.weights.group import (
    CollectiveSyncError,
    GroupMember,
    announce,
    connect_store,
    copy_into,
    current_seq,
    read_announcement,
    tensor_meta,
)

log = logging.getLogger("workers.weights.file_sync")


class CollectivePublisher:
    """Trainer side (rank 0). Same interface as ``WeightPublisher``."""

    def __init__(self, files: WeightPublisher, spec: WeightGroupConfig,
                 device: str | torch.device) -> None:
        self.files = files
        self.spec = spec
        self.device = torch.device(device)
        self.store = connect_store(spec)
        # A (re)started trainer always opens a new epoch: members of an older one rejoin.
        self.epoch = int(self.store.add("sf/epoch", 1))
        self.member: GroupMember | None = None
        self._published_once = False
        self.broadcasts = 0
        self.failures = 0
        self.last_broadcast_seconds = 0.0

    @property
    def directory(self):  # noqa: ANN201 - pathlib.Path
        return self.files.directory

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> PublishedWeights:
        start = time.perf_counter()
        if self._published_once:
            self._broadcast(state, version)
        self._published_once = True
        written = self.files.publish(state, version)
        return PublishedWeights(version, written.path, written.bytes, time.perf_counter() - start)

    def _broadcast(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        start = time.perf_counter()
        first = self.member is None
        meta = tensor_meta(state)
        try:
            announce(self.store, {"version": version, "epoch": self.epoch, "first": first,
                                  "tensors": meta, "bucket_bytes": self.spec.bucket_bytes})
            if first:
                self.member = GroupMember(self.spec, self.store, self.epoch, self.device)
                self.store.set(f"sf/formed/{self.epoch}", b"1")
            nbytes = self.member.send(list(state.values()), self.spec.bucket_bytes)
            self.member.barrier()  # every member has the version in its parameters
        except CollectiveSyncError as exc:
            self.failures += 1
            log.warning("collective sync of version %d failed (%s); it goes by file, and the "
                        "group is rebuilt at the next version", version, exc)
            self.store.set(f"sf/failed/{self.epoch}", b"1")
            if self.member is not None:
                self.member.close_shm()
            self.member = None
            self.epoch = int(self.store.add("sf/epoch", 1))
            return
        self.broadcasts += 1
        self.last_broadcast_seconds = time.perf_counter() - start
        log.info("broadcast policy version %d: %d bytes in %.3f s (epoch %d)", version, nbytes,
                 self.last_broadcast_seconds, self.epoch)

    def close(self) -> None:
        if self.member is not None:
            self.member.close_shm()
        self.member = None
        self.files.close()


class CollectiveSubscriber:
    """Rollout side (rank > 0): follows announcements on a thread; see docs/engines.md."""

    def __init__(
        self, files: WeightSubscriber, spec: WeightGroupConfig, device: str | torch.device,
        on_sync: Callable[[WeightSyncReport], None] = lambda r: None, worker: str = "rollout",
    ) -> None:
        self.files = files
        self.spec = spec
        self.device = torch.device(device)
        self.on_sync = on_sync
        self.worker = worker
        self.engine_lock = threading.Lock()
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.member: GroupMember | None = None
        self._epoch: int | None = None  # the epoch this process (or its engine) is a member of
        # the version the follower thread is receiving now (None between broadcasts): its file can
        # appear before the receive returns (the trainer writes it right after the barrier), and
        # waiting for the receive is cheaper than loading the same version again from disk
        self._receiving: int | None = None
        self._reports: list[WeightSyncReport] = []
        self.received = 0
        self.failures = 0
        # partial rollout (workers.weights.watch): told of each announced version before its
        # apply waits for the engine lock, so the generation holding the lock is cut
        self.on_announce: Callable[[int], None] | None = None

    def __getattr__(self, name: str) -> Any:
        """The WeightSubscriber interface the rollout stage uses for file loads (``directory``,
        ``newest``, ``wait_for``, ``load``): the file subscriber's."""
        if name == "files":
            raise AttributeError(name)
        return getattr(self.files, name)

    def start(self, engine: Any) -> None:
        store = connect_store(self.spec)
        self._thread = threading.Thread(target=self._follow, args=(engine, store),
                                        name="weight-group", daemon=True)
        self._thread.start()

    def wait_engine(self, engine: Any, required: int, timeout_s: float) -> bool:
        """True once the engine holds a version >= ``required`` (by broadcast); False when a file
        of such a newer version is on disk (load it); WeightSyncTimeout after ``timeout_s``."""
        self.drain_reports()
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                if engine.policy_version >= required:
                    return True
                newest = self.files.newest()
                in_flight = self._receiving is not None and self._receiving >= required
                if newest is not None and newest >= required and not in_flight:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeightSyncTimeout(
                        f"policy version {required} neither broadcast nor published within "
                        f"{timeout_s:.1f}s (engine holds {engine.policy_version}; newest file "
                        f"{newest}) in {self.files.directory}")
                self._changed.wait(min(left, self.files.recheck_s))

    def _follow(self, engine: Any, store: Any) -> None:
        seq = max(current_seq(store), 1)  # the newest announcement may be an epoch forming now
        while not self._stop.is_set():
            ann = read_announcement(store, seq, 0.5)
            if ann is None:
                continue
            seq += 1
            if self.on_announce is not None:
                self.on_announce(int(ann["version"]))
            with self._changed:
                self._receiving = int(ann["version"])
            failed = None
            try:
                self._apply(engine, store, ann)
            except Exception as exc:  # noqa: BLE001 - the file path delivers this version
                self.failures += 1
                failed, self._epoch, self.member = self.member, None, None
                log.warning("collective sync of version %s failed (%s); loading it from its "
                            "file", ann.get("version"), exc)
            finally:
                with self._changed:  # a waiter that saw the file waits for this outcome
                    self._receiving = None
                    self._changed.notify_all()
            # The failed member's process group is torn down only now, after the waiters were
            # told: its teardown joins threads that may still wait out an operation on a dead
            # peer, and the file path must not wait for that.
            del failed

    def _apply(self, engine: Any, store: Any, ann: dict[str, Any]) -> None:
        epoch, version = int(ann["epoch"]), int(ann["version"])
        remote = hasattr(engine, "join_weight_group")  # vLLM: its worker process is the member
        if self._epoch != epoch:
            self._epoch, self.member = None, None
            opened = bool(ann.get("first")) and not store.check(
                [f"sf/formed/{epoch}"]) and not store.check([f"sf/failed/{epoch}"])
            if not opened:  # not a member of this epoch: the version comes by file
                return
            if remote:
                engine.join_weight_group(self.spec, epoch)
            else:
                self.member = GroupMember(self.spec, store, epoch, self.device)
            self._epoch = epoch
        start = time.perf_counter()
        meta, bucket = ann["tensors"], int(ann["bucket_bytes"])
        with self.engine_lock:
            if remote:  # receives, copies into the model and joins the barrier in its worker
                nbytes = engine.receive_weights(meta, bucket, version)
            else:
                assert self.member is not None
                nbytes = self.member.receive(meta, bucket, copy_into(engine.weight_targets(), meta))
                engine.policy_version = version
            self.received += 1
        if self.member is not None:
            self.member.barrier()
        log.info("received policy version %d by broadcast (%d bytes, epoch %d)", version, nbytes,
                 epoch)
        report = WeightSyncReport(self.worker, version, time.perf_counter() - start, nbytes)
        with self._changed:
            self._reports.append(report)  # sent from the stage's thread (sockets are not shared)
            self._changed.notify_all()

    def drain_reports(self) -> None:
        with self._changed:
            reports, self._reports = self._reports, []
        for report in reports:
            self.on_sync(report)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self.member = None
        self.files.close()
