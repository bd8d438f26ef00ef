"""The accounting of requests parked by a store server, and the limits on it.

Owns: how many claims are parked on the node, how many body bytes parked puts hold, how many
requests each peer (ROUTER identity) has parked and since when, and the refusal of a request
that would go past a limit (``StoreFull`` for a put, ``TooManyWaiting`` for a claim; the limits
are ``ServerConfig``'s, the rules ``storage/wire.py``'s). The server's loop thread is its only
caller: it calls ``admit`` before parking a request and ``release`` whenever one leaves.
"""

from __future__ import annotations

import time

from storage.errors import StoreFull, TooManyWaiting


class ParkedBook:
    """Counts of parked requests of one server, checked against its limits."""

    def __init__(self, node_index: int, max_bytes: int, max_per_peer: int, max_claims: int):
        self.node_index = node_index
        self.max_bytes, self.max_per_peer, self.max_claims = max_bytes, max_per_peer, max_claims
        self.claims = 0
        self.put_bytes = 0  # body bytes of parked puts
        self.per_peer: dict[bytes, int] = {}
        self.since: dict[bytes, float] = {}  # monotonic: when a peer's parked count left 0

    def admit(self, ident: bytes, verb: str, nbytes: int, table: str) -> None:
        """Count a request about to be parked, or raise the typed refusal naming the limit."""
        held = self.per_peer.get(ident, 0)
        if verb == "claim":
            if held >= self.max_per_peer:
                raise TooManyWaiting(
                    f"this peer already has {held} requests waiting (max_parked_per_peer "
                    f"{self.max_per_peer})"
                )
            if self.claims >= self.max_claims:
                raise TooManyWaiting(
                    f"node {self.node_index} already has {self.claims} claims waiting "
                    f"(max_parked_claims {self.max_claims})"
                )
            self.claims += 1
        else:
            if held >= self.max_per_peer:
                raise StoreFull(
                    f"table {table!r} is at capacity and this peer already has {held} requests "
                    f"waiting (max_parked_per_peer {self.max_per_peer})"
                )
            if self.put_bytes + nbytes > self.max_bytes:
                raise StoreFull(
                    f"table {table!r} is at capacity and node {self.node_index} already holds "
                    f"{self.put_bytes} bytes of waiting puts (max_parked_bytes {self.max_bytes})"
                )
            self.put_bytes += nbytes
        self.per_peer[ident] = held + 1
        if not held:
            self.since[ident] = time.monotonic()

    def release(self, ident: bytes, verb: str, nbytes: int) -> None:
        """Count a parked request that left (answered, timed out, cancelled, dropped)."""
        if verb == "claim":
            self.claims -= 1
        else:
            self.put_bytes -= nbytes
        left = self.per_peer.get(ident, 0) - 1
        if left > 0:
            self.per_peer[ident] = left
        else:
            self.per_peer.pop(ident, None)
            self.since.pop(ident, None)

    def waiting_since(self, before: float) -> list[bytes]:
        """Peers that have had requests parked since ``before`` (monotonic) or earlier."""
        return [ident for ident, since in self.since.items() if since <= before]

    def clear(self) -> None:
        self.claims = self.put_bytes = 0
        self.per_peer.clear()
        self.since.clear()
