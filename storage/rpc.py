"""One request/reply layer over ZeroMQ: the ROUTER service loop and the DEALER call with a deadline.

Shared by the store node, the coordinator and ``workers.weights.net``: ``bind_router``,
``RouterService``, ``Channel`` and ``run_until_signalled``. Rules: docs/store-protocol.md ("RPC").
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq

from storage import wire
from storage.errors import BadRequest, StoreError

log = logging.getLogger("storage.rpc")

T = TypeVar("T")
P = TypeVar("P", bound="Parked")
MAX_POLL_S = 0.1  # upper bound on one poll, so stop() and timers are noticed promptly


class InternalError(StoreError, wire=False):
    """A handler failed with a non-``StoreError`` (a bug, logged); a client sees a StoreError."""

    code = "internal"


class BindError(OSError):
    """A ROUTER could not bind: "ADDRESS: cannot bind: REASON" (one line)."""


def as_store_error(exc: Exception, what: str) -> StoreError:
    """``exc`` itself if it is a StoreError, else (a bug) logged and wrapped as InternalError."""
    if isinstance(exc, StoreError):
        return exc
    log.error("%s failed", what, exc_info=exc)
    return InternalError(f"{type(exc).__name__}: {exc}")


def reply_to(req_id: int) -> Callable[[list], wire.Reply | None]:
    """A ``Channel.wait`` matcher: the reply to ``req_id`` (any other is not ours: dropped)."""

    def match(frames: list) -> wire.Reply | None:
        reply = wire.decode_reply(frames)
        return reply if reply.req_id == req_id else None

    return match


def bind_router(
    context: zmq.Context, addresses: Sequence[str], *, max_message_bytes: int,
    linger_ms: int = 1000, setup: Callable[[zmq.Socket], None] | None = None,
) -> tuple[zmq.Socket, list[str]]:
    """A bound ROUTER socket and its endpoints (``setup``: options set before the first bind);
    ``BindError`` if a bind fails. ``tcp://HOST:0`` binds a free port."""
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.LINGER, linger_ms)
    bound = []
    try:
        if setup is not None:
            setup(sock)
        for addr in addresses:
            if addr.startswith("tcp://") and addr.endswith(":0"):
                addr = addr[:-2] + ":*"
            try:
                sock.bind(addr)
            except zmq.ZMQError as exc:
                reason = zmq.strerror(exc.errno)  # exc.strerror repeats the address
                raise BindError(f"{addr}: cannot bind: {reason}") from None
            bound.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    except BaseException:
        sock.close(linger=0)
        raise
    return sock, bound


@dataclass
class Parked:
    """A request answered later, by ``deadline`` (monotonic) at the latest; ``t_recv``:
    perf_counter at receipt."""

    ident: bytes
    req: wire.Request
    t_recv: float
    deadline: float


def earliest(parked: Sequence[Parked], default: float) -> float:
    """The soonest deadline among ``parked`` and ``default``."""
    return min(default, *(p.deadline for p in parked)) if parked else default


def take(parked: MutableSequence[P], pred: Callable[[P], bool]) -> list[P]:
    """Remove and return, in order, the entries ``pred`` selects; the others keep their order."""
    taken = [p for p in parked if pred(p)]
    if taken:
        keep = [p for p in parked if not pred(p)]
        parked.clear()
        parked.extend(keep)
    return taken


# One queued reply: (peer, frames, verb, t_recv, undo). ``undo`` runs if it cannot be delivered.
Outgoing = tuple[bytes, list, str, float, Callable[[], None] | None]


class RouterService:
    """A ROUTER socket served by one loop thread. Subclasses provide ``_open``, ``_decode`` and
    the ``_v_<verb>(ident, req, t_recv)`` handlers, which return a result map (replied at once)
    or None (the reply was queued, or the request parked)."""

    thread_name = "rpc-service"
    max_batch = 256  # requests handled between two rounds of the steps

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket | None = None
        self._out: list[Outgoing] = []

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> Any:
        """Run the loop in a daemon thread; returns once bound (raises the bind error if any)."""
        self._thread = threading.Thread(target=self._run_thread, name=self.thread_name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.thread_name} did not start in time")
        if self._start_error is not None:
            raise self._start_error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the loop to shut down (thread-safe, signal-safe) and wait for it when threaded."""
        self._stop.set()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run_thread(self) -> None:
        try:
            self.run()
        except BaseException as exc:
            if exc is not self._start_error:  # a start error is raised by start() instead
                raise

    def run(self) -> None:
        """Bind, serve until stop(), shut down cleanly. Runs in the calling thread."""
        try:
            self._open()
        except BaseException as exc:
            self._start_error = exc
            self._ready.set()
            self._close()
            raise
        self._ready.set()
        try:
            self._loop()
        finally:
            self._shutdown()

    def _open(self) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _shutdown(self) -> None:
        """Answer what is parked (the subclass), flush the replies, close."""
        try:
            self._flush()
        except Exception:
            log.exception("flushing replies at shutdown")
        self._close()

    # -- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        steps = self._steps()
        while not self._stop.is_set():
            if poller.poll(self._poll_timeout_ms()):
                # Drain up to max_batch before the steps (ZMQ_EVENTS: cheaper than a recv raising)
                for _ in range(self.max_batch):
                    if not sock.get(zmq.EVENTS) & zmq.POLLIN:
                        break
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
            for step in steps:
                try:
                    step()
                except Exception:  # a bug must not take the service down; log it and go on
                    log.exception("%s loop step %s failed", self.thread_name, step.__name__)

    def _poll_timeout_ms(self) -> int:
        return int(MAX_POLL_S * 1000)

    def _steps(self) -> Sequence[Callable[[], None]]:
        """What runs after each batch of requests (and at least every poll timeout)."""
        return (self._flush,)

    @staticmethod
    def _timeout_ms(wait_s: float) -> int:
        return max(0, int(wait_s * 1000) + 1)

    # -- one request -----------------------------------------------------------------------------
    def _decode(self, frames: list) -> wire.Request:
        raise NotImplementedError

    def _received(self, frames: list) -> None:
        """Hook: a message arrived (metrics)."""

    def _bad_request(self) -> None:
        """Hook: a request was refused as malformed (metrics)."""

    def _handle(self, frames: list) -> None:
        t_recv = time.perf_counter()
        if len(frames) < 2:  # only a ROUTER identity: nothing to answer
            return
        ident = frames[0].bytes
        self._received(frames)
        req = wire.Request("invalid", 0, {})
        try:
            req = self._decode(frames[1:])
            result = getattr(self, "_v_" + req.verb)(ident, req, t_recv)
        except Exception as exc:  # a bad request, a refusal, or a bug: answered, the loop goes on
            if isinstance(exc, BadRequest):
                self._bad_request()
                req.req_id = req.req_id or getattr(exc, "req_id", 0)
            self._reply_error(ident, req, as_store_error(exc, req.verb), t_recv)
            return
        if result is not None:
            self._reply(ident, req, result, t_recv)

    # -- replies ---------------------------------------------------------------------------------
    def _reply(
        self, ident: bytes, req: wire.Request, result: dict[str, Any], t_recv: float,
        bodies: Sequence[Any] = (), undo: Callable[[], None] | None = None,
    ) -> None:
        self._out.append(
            (ident, wire.encode_reply(req.req_id, result, bodies), req.verb, t_recv, undo)
        )

    def _reply_error(self, ident: bytes, req: wire.Request, exc: StoreError, t_recv: float) -> None:
        frames = wire.encode_error(req.req_id, exc, acked=req.acked)
        self._out.append((ident, frames, req.verb, t_recv, None))

    def _sent(self, frames: list, verb: str, t_recv: float, now: float) -> None:
        """Hook: a reply left (metrics)."""

    def _flush(self) -> None:
        """Send the queued replies without blocking; one that cannot go is dropped, its undo run."""
        out, self._out = self._out, []
        sock = self._sock
        now = time.perf_counter()
        for ident, frames, verb, t_recv, undo in out:
            try:
                sock.send_multipart([ident, *frames], zmq.NOBLOCK, copy=False)  # type: ignore
            except zmq.ZMQError as exc:
                log.warning("%s: dropping %s reply: %s", self.thread_name, verb, exc)
                if undo is not None:
                    try:
                        undo()
                    except StoreError:
                        pass  # e.g. the lease expired meanwhile: nothing left to undo
                    except Exception:
                        log.exception("undoing an undeliverable reply")
                continue
            self._sent(frames, verb, t_recv, now)


def run_until_signalled(
    service: RouterService, ready_file: str | None, ready: Callable[[], dict[str, Any]]
) -> None:
    """Run ``service`` until SIGTERM/SIGINT; ``ready_file``: ``ready()`` + {"pid"} as JSON there
    (atomically) once bound."""

    def _on_signal(signum: int, frame: Any) -> None:
        service.stop(timeout=0)

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        service.start()
        if ready_file:
            tmp = ready_file + ".tmp"
            with open(tmp, "w") as fh:
                json.dump({**ready(), "pid": os.getpid()}, fh)
            os.replace(tmp, ready_file)
        while service.running:
            time.sleep(0.1)  # the main thread only waits for signals; the loop thread serves
    finally:
        service.stop()
        for s, h in previous.items():
            signal.signal(s, h)


class Channel:
    """One DEALER socket to one peer, replaced after a timeout. Used from ONE thread."""

    def __init__(
        self, context: zmq.Context, address: str, *, name: str = "",
        timeout_error: Callable[[str], Exception] = TimeoutError,
        options: Sequence[tuple[int, Any]] = (),
    ) -> None:
        self.context, self.address = context, address
        self.name = name or address  # how errors name the peer
        self.timeout_error = timeout_error
        self.options = [(zmq.LINGER, 0), *options]
        self.sock: zmq.Socket = self._open()

    def _open(self) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        for opt, value in self.options:
            sock.setsockopt(opt, value)
        sock.connect(self.address)
        # One Poller per socket: Socket.poll() would build (and tear down) one per call.
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        return sock

    def reset(self) -> None:
        """A fresh socket: a late reply must land on one nobody reads any more."""
        self.sock.close(linger=0)
        self.sock = self._open()

    def close(self) -> None:
        self.sock.close(linger=0)

    def call(self, frames: Sequence[Any], match: Callable[[list], T | None], timeout: float) -> T:
        """Send ``frames``; return the first ``match(reply)`` that is not None. None within
        ``timeout`` s: reset the socket and raise ``timeout_error``."""
        self.sock.send_multipart(frames, copy=False)
        return self.wait(match, timeout)

    def request(
        self, req_id: int, verb: str, args: dict[str, Any], bodies: Sequence[Any], timeout: float
    ) -> wire.Reply:
        """One request in the store's format: its reply, or its typed error raised."""
        frames = wire.encode_request(verb, req_id, args, bodies)
        reply = self.call(frames, reply_to(req_id), timeout)
        if reply.error is not None:
            raise reply.error
        return reply

    def wait(self, match: Callable[[list], T | None], timeout: float) -> T:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.poller.poll(int(left * 1000) + 1):
                if time.monotonic() < deadline:
                    continue
                self.reset()
                raise self.timeout_error(f"no reply from {self.name} within {timeout:.3g} s")
            got = match(self.sock.recv_multipart(copy=False))
            if got is not None:
                return got
