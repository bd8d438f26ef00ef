"""Weights across hosts: a subscriber with ``fetch=`` copies versions from the trainer's
WeightServer into its own directory (hosts share no /dev/shm), atomically and exactly."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import torch
import zmq
from testkit import wait_until

from workers.weights.file_sync import WeightPublisher, WeightSubscriber, latest_version
from workers.weights.net import WeightFetcher, WeightFetchError


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def test_remote_subscriber_fetches_into_its_own_directory(tmp_path) -> None:
    pub = WeightPublisher(
        tmp_path / "trainer", "tcp://127.0.0.1:*", keep=2, serve="tcp://127.0.0.1:*"
    )
    announce = pub.endpoint
    serve = pub.serve_endpoint
    sub = WeightSubscriber(tmp_path / "rollout", announce, fetch=serve, recheck_s=0.1)
    try:
        assert sub.newest() is None
        pub.publish(_state(0), 0)
        assert sub.wait_for(0, 10.0) == 0
        tensors, nbytes = sub.load(0)
        assert torch.equal(tensors["w"], _state(0)["w"]) and nbytes == sub.fetched_bytes > 0
        assert 0 in sub.fetch_seconds
        # A waiter is woken by the announcement and copies the new version (published 0.3 s
        # into its wait, on purpose: the waiter must already be waiting).
        threading.Timer(0.3, lambda: pub.publish(_state(1), 1)).start()
        t0 = time.monotonic()
        assert sub.wait_for(1, 10.0) == 1
        assert time.monotonic() - t0 < 5
        assert torch.equal(sub.load(1)[0]["b"], _state(1)["b"])
        # Opportunistic: newest() notices an announcement and copies without waiting.
        pub.publish(_state(2), 2)
        wait_until(lambda: sub.newest() == 2, timeout=10, what="newest() to copy version 2")
        # Our own directory holds the copies; the trainer's pruned v0 (keep=2) is refused.
        assert latest_version(tmp_path / "rollout") == 2
        assert not list((tmp_path / "rollout").glob("*.part"))
        with pytest.raises(WeightFetchError, match="not available"):
            WeightFetcher(serve).fetch(0, tmp_path)
    finally:
        sub.close()
        pub.close()


def test_server_answers_malformed_requests_and_keeps_serving(tmp_path) -> None:
    pub = WeightPublisher(tmp_path, serve="tcp://127.0.0.1:*")
    address = pub.serve_endpoint
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        for bad in (
            b"\xc1junk",
            msgpack.packb([1, 2]),
            msgpack.packb({"id": 1, "op": "rm"}),
            msgpack.packb({"id": 2, "op": "fetch", "version": -1}),
        ):
            sock.send(bad)
            assert sock.poll(5000)
            header = msgpack.unpackb(sock.recv_multipart()[0])
            assert header["ok"] is False and header["error"]
        pub.publish(_state(3), 3)
        assert WeightFetcher(address).newest() == 3
    finally:
        sock.close()
        pub.close()


def test_fetch_times_out_when_no_server_answers(tmp_path) -> None:
    with zmq.Context.instance().socket(zmq.ROUTER) as silent:  # accepts, never replies
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        fetcher = WeightFetcher(f"tcp://127.0.0.1:{port}", timeout_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(WeightFetchError, match="no reply"):
            fetcher.fetch(0, tmp_path)
        assert time.monotonic() - t0 < 3
        fetcher.close()
