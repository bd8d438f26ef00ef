"""A claim's ``wake`` tasks: one waiting request stands for a consumer of several tasks. It ends
with an empty lease as soon as another of its tasks has ready rows (or at once if one already
has), so the consumer claims there without waiting out the timeout."""

from __future__ import annotations

import threading
import time

import pytest
from testkit import wait_until

from storage.errors import UnknownTask

WAIT_S = 60.0  # a claim that ignored its wake tasks would block this long


def test_a_waiting_claim_ends_when_a_wake_task_gets_rows(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec())
    got: dict[str, object] = {}

    def wait() -> None:
        start = time.monotonic()
        lease = embedded_store.client().claim("t", "train", ["x"], 4, whole_groups=True,
                                              timeout=WAIT_S, wake=["reward"])
        got.update(rows=lease.num_rows, seconds=time.monotonic() - start)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    wait_until(lambda: embedded_store.parked()["claims"] == 1, what="the claim parked")
    c.put("t", h.make_rows(1))  # ready for "reward", not for "train"
    thread.join(WAIT_S)
    assert got["rows"] == 0 and got["seconds"] < WAIT_S / 2
    assert c.claim("t", "reward", ["x"], 4).num_rows == 4  # still there for its own task


def test_a_wake_task_already_ready_ends_the_claim_at_once_and_names_are_checked(embedded_store, h):
    c = embedded_store.client()
    c.create_table(h.make_spec())
    c.put("t", h.make_rows(1))
    start = time.monotonic()
    lease = c.claim("t", "train", ["x"], 4, whole_groups=True, timeout=WAIT_S, wake=["reward"])
    assert lease.num_rows == 0 and time.monotonic() - start < WAIT_S / 2
    held = c.claim("t", "reward", ["x"], 4)
    with pytest.raises(UnknownTask):  # refused before the piggybacked ack: the lease stays held
        c.claim("t", "reward", ["x"], 4, ack=held, wake=["nope"])
    assert c.stats("t").task_total("reward").in_flight == 4
