"""storage: the sharded, Arrow-backed transfer queue over ZeroMQ (the project's data store).

``storage.connect(addresses)`` or ``storage.embedded(num_shards=2)`` (a real Server in a thread
over inproc://); see docs/store-protocol.md. ``storage`` imports neither workers nor streamflow."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import zmq

from storage.client import Client, CurveClientKeys, connect
from storage.errors import StoreError
from storage.schema import Lease, TableSpec, TableStats, TaskSpec

if TYPE_CHECKING:
    from storage.server import Server, ServerConfig, serve


def __getattr__(name: str) -> Any:
    # Lazy: `python -m storage.server` must not find the module already imported (runpy warns).
    if name in ("Server", "ServerConfig", "serve"):
        from storage import server

        return getattr(server, name)
    if name in ("Coordinator", "CoordinatorClient", "ConsumerSession"):  # the shard coordinator
        from storage import coordinator

        return getattr(coordinator, name)
    raise AttributeError(f"module 'storage' has no attribute {name!r}")


__all__ = [
    "Client", "ConsumerSession", "Coordinator", "CoordinatorClient", "CurveClientKeys",
    "EmbeddedStore", "Lease", "Server", "ServerConfig", "StoreError", "TableSpec", "TableStats",
    "TaskSpec", "connect", "embedded", "serve",
]


class EmbeddedStore:
    """A store node served from a background thread of this process, plus clients for it.
    Constructed started; ``close()`` closes its clients, stops the server and ends its context."""

    def __init__(
        self, num_shards: int = 1, *, node_index: int = 0, tcp: bool = False,
        metrics_port: int | None = None, persist_dir: str | None = None, **client_kwargs: Any,
    ) -> None:
        from storage.server import Server, ServerConfig, inproc_address

        self.context = zmq.Context()
        bind = "tcp://127.0.0.1:0" if tcp else inproc_address()
        config = ServerConfig(bind=(bind,), num_shards=num_shards, node_index=node_index,
                              metrics_port=metrics_port, persist_dir=persist_dir)
        self.server: Server = Server(config, context=self.context).start()
        self.address = self.server.addresses[0]
        self._client_kwargs = client_kwargs
        self._clients: list[Client] = []
        self._lock = threading.Lock()

    def client(self, **kwargs: Any) -> Client:
        """A new Client on this store (thread-safe to call; use the Client from one thread)."""
        c = Client(self.address, context=self.context, **{**self._client_kwargs, **kwargs})
        with self._lock:
            self._clients.append(c)
        return c

    def parked(self) -> dict[str, int]:
        """What the node has parked now: {"claims", "puts", "put_bytes", "peers"} (any thread)."""
        return self.server.parked()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for c in clients:
            c.close()
        self.server.stop()
        self.context.term()

    def __enter__(self) -> EmbeddedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def embedded(num_shards: int = 1, **kwargs: Any) -> EmbeddedStore:
    """Start an in-process store node (see EmbeddedStore); use it as a context manager."""
    return EmbeddedStore(num_shards, **kwargs)
