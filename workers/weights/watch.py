"""``VersionWatch``: tells a rollout worker that a policy version newer than the one it generates
with has appeared, so partial rollout can cut the generation in flight (docs/partial.md).

A daemon thread per rollout worker sets ``newer`` (the ``cut`` event the engine's
``generate_until`` checks between decode steps) once a version above ``floor`` (the version now
generating) is known, from whichever source the worker's weight sync has:

* files: the weights directory's newest version, polled every ``poll_s`` (a directory listing);
* a remote trainer (``weights_fetch``): its announcements, on a SUB socket of this thread's own
  (a ZeroMQ socket is never shared between threads), since the file arrives only when fetched;
* collective sync: ``notify`` from ``CollectiveSubscriber.on_announce``, called as a broadcast is
  announced and BEFORE it waits for the engine lock a generation holds: the cut is what lets the
  broadcast in.
"""

from __future__ import annotations

import os
import threading

import msgpack
import zmq

from workers.weights.versions import latest_version


class VersionWatch:
    def __init__(self, directory: str | os.PathLike[str], *, announce: str | None = None,
                 poll_s: float = 0.05) -> None:
        self.directory = directory
        self.announce = announce
        self.poll_s = poll_s
        self.newer = threading.Event()
        self.floor = -1  # the version generating now: newer means above it
        self.seen = -1  # the newest version known
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="version-watch", daemon=True)
        self._thread.start()

    def arm(self, version: int) -> threading.Event:
        """Before a generation with ``version``: ``newer`` is clear unless a newer version is
        already known (then the generation is cut after its first token)."""
        with self._lock:
            self.floor = version
            self.newer.clear()
            if self.seen > version:
                self.newer.set()
        return self.newer

    def notify(self, version: int) -> None:
        """A version was announced or published (any thread)."""
        with self._lock:
            self.seen = max(self.seen, int(version))
            if self.seen > self.floor:
                self.newer.set()

    def _run(self) -> None:
        sock = None
        if self.announce:
            sock = zmq.Context.instance().socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(self.announce)
        try:
            while not self._stop.is_set():
                local = latest_version(self.directory)
                if local is not None:
                    self.notify(local)
                if sock is None:
                    self._stop.wait(self.poll_s)
                    continue
                if sock.poll(int(self.poll_s * 1000)):
                    while sock.poll(0):
                        self._announced(sock.recv())
        finally:
            if sock is not None:
                sock.close()

    def _announced(self, message: bytes) -> None:
        try:  # the trainer's msgpack note (never unpickled); a malformed one is ignored
            version = msgpack.unpackb(message, raw=False, max_str_len=4096).get("version")
        except Exception:  # noqa: BLE001
            return
        if isinstance(version, int):
            self.notify(version)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
