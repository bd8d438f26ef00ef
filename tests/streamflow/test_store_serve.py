"""`streamflow store serve` (and `python -m storage`) as an operator sees it: a busy port is one
line naming the address and the flag (exit 2, nothing left running), and a node started with
--persist-dir serves the tables kept there as soon as it is up, saying so in its log."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import wait_until

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
SERVE = [sys.executable, "-m", "streamflow", "store", "serve"]
NODE = [sys.executable, "-m", "storage"]


@pytest.fixture
def busy_port():
    """A port held by a listening socket of this test on 127.0.0.1 (bind(0) is right here: held
    from the pick to the end of the test, it leaves no gap for anything else to take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("command", [SERVE, NODE], ids=["streamflow-store-serve", "python-m-storage"])
@pytest.mark.parametrize("flag", ["--bind", "--metrics-port"])
def test_a_busy_port_is_one_line_naming_the_address_and_the_flag(busy_port, command, flag, tmp_path):
    ready = tmp_path / "ready.json"
    if flag == "--bind":
        args = ["--bind", f"tcp://127.0.0.1:{busy_port}"]
    else:
        args = ["--bind", "tcp://127.0.0.1:0", "--metrics-port", str(busy_port)]
    proc = subprocess.run([*command, *args, "--ready-file", str(ready)], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env=ENV)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2
    assert len(lines) == 1, proc.stderr
    assert flag in lines[0] and f"127.0.0.1:{busy_port}" in lines[0]
    assert "in use" in lines[0]
    assert proc.stdout == "" and not ready.exists()  # it never served; the process is gone


def _start(args: list[str], ready: Path, log: Path) -> subprocess.Popen:
    with open(log, "a") as err:
        proc = subprocess.Popen([*SERVE, "--bind", "tcp://127.0.0.1:0", "--ready-file",
                                 str(ready), *args], cwd=REPO, env=ENV,
                                stdout=subprocess.DEVNULL, stderr=err)

    def up() -> bool:
        assert proc.poll() is None, log.read_text()
        return ready.exists()

    wait_until(up, timeout=60, what="the node's ready file")
    return proc


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_store_serve_persist_dir_recovers_every_table_at_start(tmp_path):
    import pyarrow as pa

    import storage
    from storage.errors import Unavailable
    from storage.schema import TableSpec, TaskSpec

    root, log = tmp_path / "data", tmp_path / "node.log"
    spec = TableSpec("samples", pa.schema([("x", pa.int64())]), (TaskSpec("t", ("x",)),))
    args = ["--persist-dir", str(root), "--log-level", "info", "--max-message-bytes", "65536"]
    ready = tmp_path / "ready-1.json"
    proc = _start(args, ready, log)
    try:
        address = json.loads(ready.read_text())["addresses"][0]
        with storage.connect(address, request_timeout=10) as c:
            c.create_table(spec)
            c.put("samples", pa.record_batch({"x": pa.array(range(5), pa.int64())}))
        big = pa.record_batch({"x": pa.array(range(20_000), pa.int64())})  # > 64 KiB
        with storage.connect(address, request_timeout=1.0) as c, pytest.raises(Unavailable):
            # --max-message-bytes applies: ZeroMQ drops it unanswered. timeout=0: a put the node
            # took would be answered at once (nothing to wait for), so only the 1 s request
            # timeout is waited out, not the default 30 s server-side wait on top.
            c.put("samples", big, timeout=0.0)
    finally:
        assert _stop(proc) == 0
    ready = tmp_path / "ready-2.json"
    proc = _start(args, ready, log)
    try:
        address = json.loads(ready.read_text())["addresses"][0]
        with storage.connect(address, request_timeout=10) as c:
            assert c.tables() == ["samples"]  # nobody called create_table
            assert c.claim("samples", "t", ["x"], 10).num_rows == 5
    finally:
        assert _stop(proc) == 0
    assert "table samples recovered" in log.read_text()
