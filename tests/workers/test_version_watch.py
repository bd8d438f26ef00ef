"""VersionWatch: the event that cuts a generation is set once a newer version is known, from the
weights directory or the collective announcement (before its apply waits for the engine lock)."""

from __future__ import annotations

import threading

from testkit import wait_until

from workers.weights import collective
from workers.weights.versions import weights_path
from workers.weights.watch import VersionWatch


def test_a_newer_file_sets_the_event_and_arming_with_it_clears_it(tmp_path):
    # Breaks if the directory is not watched, or an event stays set for a version in hand.
    watch = VersionWatch(tmp_path, poll_s=0.01)
    try:
        event = watch.arm(0)
        weights_path(tmp_path, 0).write_bytes(b"")
        weights_path(tmp_path, 1).write_bytes(b"")
        wait_until(event.is_set, timeout=5, what="version 1 seen")
        assert not watch.arm(1).is_set()  # generating with the newest: nothing to cut
        assert watch.arm(0).is_set()  # generating with an older one: cut at once
    finally:
        watch.close()


def test_a_collective_announcement_cuts_before_its_apply_takes_the_engine_lock(monkeypatch,
                                                                               tmp_path):
    # Breaks if the hook runs after _apply (which waits for the lock a generation holds: the
    # broadcast and the generation would wait on each other until the generation ends).
    watch = VersionWatch(tmp_path, poll_s=10.0)
    sub = collective.CollectiveSubscriber(files=None, spec=None, device="cpu")  # type: ignore
    sub.on_announce = watch.notify
    seen: list[bool] = []

    def apply(engine, store, ann):
        seen.append(watch.newer.is_set())
        sub._stop.set()

    monkeypatch.setattr(collective, "current_seq", lambda store: 1)
    monkeypatch.setattr(collective, "read_announcement",
                        lambda store, seq, timeout: {"version": 3, "epoch": 1})
    monkeypatch.setattr(sub, "_apply", apply)
    try:
        watch.arm(2)
        thread = threading.Thread(target=sub._follow, args=(None, None))
        thread.start()
        thread.join(timeout=5)
        assert seen == [True]
    finally:
        watch.close()


def test_a_remote_trainers_announcement_sets_the_event_before_any_file_is_here(tmp_path):
    # weights_fetch: the file reaches this host only when fetched, so the announcement must
    # cut. Breaks if the watch reads only its own directory.
    import torch

    from workers.weights.file_sync import WeightPublisher

    publisher = WeightPublisher(tmp_path / "trainer", "tcp://127.0.0.1:0")
    watch = VersionWatch(tmp_path / "here", announce=publisher.endpoint, poll_s=0.01)
    try:
        event = watch.arm(0)
        state = {"w": torch.zeros(1)}

        def announced() -> bool:  # (re-sent: a SUB socket misses what precedes its connect)
            publisher.publish(state, 1)
            return event.wait(0.05)

        wait_until(announced, timeout=10, what="the announcement of version 1")
        assert not (tmp_path / "here" / "policy-v000001.safetensors").exists()
    finally:
        watch.close()
        publisher.close()
