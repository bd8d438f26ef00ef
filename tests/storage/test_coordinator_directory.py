"""The coordinator's key-value directory: register / lookup (server-side wait) / lookup_prefix,
strict request validation, and the process form (``python -m storage.coordinator``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq
from testkit import wait_until

from storage import wire
from storage.coordinator import Coordinator, CoordinatorClient, LookupTimeout
from storage.errors import BadRequest, ShuttingDown


@pytest.fixture
def coord():
    c = Coordinator().start()
    try:
        yield c
    finally:
        c.stop()


def test_register_lookup_prefix(coord):
    assert coord.address.startswith("tcp://127.0.0.1:")
    with CoordinatorClient(coord.address) as cl:
        cl.register("hosts/a", "tcp://127.0.0.1:1")
        cl.register("hosts/b", "tcp://127.0.0.1:2")
        cl.register("other", "x")
        assert cl.lookup("hosts/a", 0.0) == "tcp://127.0.0.1:1"
        cl.register("hosts/a", "tcp://127.0.0.1:3")  # overwrite
        assert cl.lookup("hosts/a", 1.0) == "tcp://127.0.0.1:3"
        assert cl.lookup_prefix("hosts/") == {"hosts/a": "tcp://127.0.0.1:3", "hosts/b": "tcp://127.0.0.1:2"}
        assert cl.lookup_prefix("nothing") == {}
        assert set(cl.lookup_prefix("")) == {"hosts/a", "hosts/b", "other"}


def test_lookup_waits_server_side_then_times_out(coord):
    def later() -> None:
        wait_until(lambda: coord.parked() == 1, what="the lookup to park")
        time.sleep(0.3)  # the wait under test: registered while the lookup waits server-side
        with CoordinatorClient(coord.address) as other:
            other.register("late", "v")

    t = threading.Thread(target=later)
    t.start()
    with CoordinatorClient(coord.address, request_timeout=2.0) as cl:
        t0 = time.monotonic()
        assert cl.lookup("late", timeout=10.0) == "v"
        waited = time.monotonic() - t0
        assert 0.2 < waited < 5.0
        t0 = time.monotonic()
        with pytest.raises(LookupTimeout, match="never"):
            cl.lookup("never", timeout=0.3)
        assert time.monotonic() - t0 >= 0.25
        with pytest.raises(LookupTimeout):
            cl.lookup("never", timeout=0.0)
    t.join(5)


@pytest.mark.parametrize(
    "header, match",
    [
        ({"v": 1, "verb": "register", "req_id": 7, "key": 5, "value": "x"}, "register.key"),
        ({"v": 1, "verb": "register", "req_id": 7, "key": "k"}, "register.value"),
        ({"v": 1, "verb": "lookup", "req_id": 7, "key": "k", "timeout": -1.0}, "lookup.timeout"),
        ({"v": 1, "verb": "lookup", "req_id": 7, "key": "k", "bogus": 1}, "unknown header"),
        ({"v": 1, "verb": "drop_everything", "req_id": 7}, "verb"),
        ({"v": 2, "verb": "hello", "req_id": 7}, "'v'"),
        ({"v": 1, "verb": "heartbeat", "req_id": 7, "table": "t", "task": "x", "consumer": "c",
          "rate": float("nan")}, "heartbeat.rate"),
        ({"v": 1, "verb": "join", "req_id": 7, "table": "", "task": "x", "consumer": "c"}, "join.table"),
    ],
)
def test_bad_requests_get_typed_errors_and_the_loop_survives(coord, header, match):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(coord.address)
    try:
        sock.send_multipart([msgpack.packb(header)])
        assert sock.poll(5000)
        reply = wire.decode_reply(sock.recv_multipart())
        assert reply.req_id == 7
        assert isinstance(reply.error, BadRequest)
        assert match in str(reply.error)
        sock.send_multipart([b"\xc1garbage"])  # not msgpack at all
        assert sock.poll(5000)
        assert isinstance(wire.decode_reply(sock.recv_multipart()).error, BadRequest)
    finally:
        sock.close()
    with CoordinatorClient(coord.address) as cl:  # still serving
        cl.register("k", "v")
        assert cl.lookup("k") == "v"


def test_stop_answers_parked_lookups():
    coord = Coordinator().start()
    errors: list[BaseException] = []

    def wait() -> None:
        with CoordinatorClient(coord.address, request_timeout=5.0) as cl:
            try:
                cl.lookup("never", timeout=30.0)
            except BaseException as exc:
                errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    wait_until(lambda: coord.parked() == 1, what="the lookup to park")
    coord.stop()
    t.join(10)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ShuttingDown)


@pytest.mark.slow
def test_process_form(tmp_path, h):
    ready = tmp_path / "coord.json"
    port = h.free_port()
    env = {**os.environ, "PYTHONPATH": str(h.repo)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "storage.coordinator", "--bind", f"tcp://127.0.0.1:{port}",
         "--ready-file", str(ready), "--metrics-port", "0", "--log-level", "WARNING"],
        cwd=h.repo, env=env,
    )
    try:
        def up() -> bool:
            assert proc.poll() is None, "coordinator exited"
            return ready.exists()

        wait_until(up, 30, what="the coordinator's ready file")
        info = json.loads(ready.read_text())
        assert info["address"] == f"tcp://127.0.0.1:{port}"
        assert info["pid"] == proc.pid and info["metrics_port"] > 0
        with CoordinatorClient(info["address"]) as cl:
            cl.register("x", "1")
            assert cl.lookup_prefix("") == {"x": "1"}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
