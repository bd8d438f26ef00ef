"""The gateway worker process (role ``gateway``): an ``EpisodeBook`` on the run's store and the
HTTP server in front of it, until SIGTERM; then the held leases are handed back, so a restarted
gateway (same port: the plan fixes it) serves the same episodes at once."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import storage
from workers.config import GatewayWorkerConfig
from workers.gateway.app import GatewayServer
from workers.gateway.book import EpisodeBook, Served
from workers.gateway.chat import ChatFormat
from workers.runtime.leases import LeaseKeeper
from workers.runtime.trace import Tracer

SWITCH_INTERVAL_S = 0.0005


class ServedLog:
    """``served_log``: one JSON line per answered call, flushed as it is written."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115
        self._lock = threading.Lock()

    def __call__(self, served: Served) -> None:
        if self._file is None:
            return
        line = json.dumps({"row_id": served.row_id, "call": served.call, "fed": served.fed,
                           "turn": served.turn})
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_served(path: str | Path) -> list[Served]:
    """The calls a gateway answered, from its ``served_log`` (a repeat may appear twice)."""
    out = []
    for line in Path(path).read_text().splitlines():
        d = json.loads(line)
        out.append(Served(int(d["row_id"]), int(d["call"]), list(d["fed"]), list(d["turn"])))
    return out


def run_gateway(cfg: GatewayWorkerConfig, stop: threading.Event, ready: Any,
                events: Any = None) -> None:
    """Serve until ``stop``; ``ready()`` once the port is bound; ``events``: the worker's report
    sender (the row trace)."""
    from workers.models.local import load_tokenizer  # (transformers: a real worker needs it)

    common = cfg.common
    timeout = common.request_timeout_s
    # an I/O-bound process whose every call hops threads (server loop, call thread, claim
    # thread): a thread woken by a reply should not wait out the default 5 ms GIL slice
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    def connect() -> Any:
        return storage.connect(common.store_addresses, request_timeout=timeout)

    fmt = ChatFormat(load_tokenizer(cfg.model_path), plain=cfg.agent.env.plain)
    keeper = LeaseKeeper(connect)
    log = ServedLog(cfg.served_log)
    book = EpisodeBook(connect, common.table, fmt, max_turns=cfg.agent.max_turns,
                       max_total_tokens=cfg.agent.max_total_tokens,
                       secret=bytes.fromhex(cfg.secret), keeper=keeper,
                       wait_s=cfg.call_timeout_s, lease_seconds=cfg.lease_seconds,
                       on_served=log,
                       tracer=Tracer.of(events, common.name) if events is not None else None)
    server = GatewayServer(book, cfg.host, cfg.port)
    book.start()
    try:
        server.start()
        ready()
        stop.wait()
    finally:
        server.stop()
        book.close()
        keeper.close()
        log.close()
