"""Typed errors of the store; each has a stable wire ``code`` (see docs/store-protocol.md)."""

from __future__ import annotations

import re

_BY_CODE: dict[str, type[StoreError]] = {}


class StoreError(Exception):
    """Base class. ``code``, the stable identifier used on the wire, is the class name in
    snake_case unless set; every subclass is known by its code unless ``wire=False``."""

    code = "store_error"

    def __init_subclass__(cls, wire: bool = True, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "code" not in cls.__dict__:
            cls.code = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()
        if wire:
            _BY_CODE[cls.code] = cls


class BadRequest(StoreError):
    """The request is malformed: wrong header fields or types, sizes, invalid Arrow data."""


class SchemaMismatch(BadRequest):
    """A batch's columns or types do not match the table's declared schema."""


class UnknownTable(StoreError):
    pass


class TableExists(StoreError):
    pass


class UnknownTask(StoreError):
    pass


class UnknownRows(StoreError):
    """A row id names no live row on this node (never put, or already released)."""


class CellAlreadyWritten(StoreError):
    """A (row, column) cell is written at most once; overwriting needs the admin verb."""


class LeaseExpired(StoreError):
    """Fencing: the lease passed its deadline (or was revoked); its rows may belong to another
    consumer now, so writes and acks carrying it are refused."""


class UnknownLease(LeaseExpired):
    """The lease id was never issued by this node, or was already acked/released."""


class StoreFull(StoreError):
    """``put`` would exceed the table's capacity and its timeout elapsed, or the node already
    holds its limit of bytes (or of requests from this peer) in parked puts."""


class TooManyWaiting(StoreError):
    """A waiting ``claim`` refused: its peer (or the node) already has the most parked claims."""


class ShuttingDown(StoreError):
    """The node is shutting down; long waits end early with this error."""


class Unavailable(StoreError):
    """Client side: no reply from a node within the request timeout."""


class AuthError(StoreError):
    pass


_BY_CODE[StoreError.code] = StoreError


def error_from_code(code: str, message: str) -> StoreError:
    """Rebuild the typed exception for a wire error code (unknown codes give ``StoreError``)."""
    return _BY_CODE.get(code, StoreError)(message)
