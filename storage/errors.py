"""Typed errors of the store; each has a stable wire ``code`` (see docs/store-protocol.md)."""

from __future__ import annotations


class StoreError(Exception):
    """Base class. ``code`` is the stable identifier used on the wire."""

    code = "store_error"


class BadRequest(StoreError):
    """The request is malformed: wrong header fields or types, sizes, invalid Arrow data."""

    code = "bad_request"


class SchemaMismatch(BadRequest):
    """A batch's columns or types do not match the table's declared schema."""

    code = "schema_mismatch"


class UnknownTable(StoreError):
    code = "unknown_table"


class TableExists(StoreError):
    code = "table_exists"


class UnknownTask(StoreError):
    code = "unknown_task"


class UnknownRows(StoreError):
    """A row id names no live row on this node (never put, or already released)."""

    code = "unknown_rows"


class CellAlreadyWritten(StoreError):
    """A (row, column) cell is written at most once; overwriting needs the admin verb."""

    code = "cell_already_written"


class LeaseExpired(StoreError):
    """Fencing: the lease passed its deadline (or was revoked); its rows may belong to another
    consumer now, so writes and acks carrying it are refused."""

    code = "lease_expired"


class UnknownLease(LeaseExpired):
    """The lease id was never issued by this node, or was already acked/released."""

    code = "unknown_lease"


class StoreFull(StoreError):
    """``put`` would exceed the table's row or byte capacity and its timeout elapsed, or the
    node already holds its limit of bytes (or of requests from this peer) in parked puts."""

    code = "store_full"


class TooManyWaiting(StoreError):
    """A waiting ``claim`` refused: its peer (or the node) already has the most parked claims
    allowed (``ServerConfig.max_parked_per_peer`` / ``max_parked_claims``)."""

    code = "too_many_waiting"


class ShuttingDown(StoreError):
    """The node is shutting down; long waits end early with this error."""

    code = "shutting_down"


class Unavailable(StoreError):
    """Client side: no reply from a node within the request timeout."""

    code = "unavailable"


class AuthError(StoreError):
    code = "auth_error"


_BY_CODE: dict[str, type[StoreError]] = {}


def _register(cls: type[StoreError]) -> None:
    _BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _register(sub)


_register(StoreError)


def error_from_code(code: str, message: str) -> StoreError:
    """Rebuild the typed exception for a wire error code (unknown codes give ``StoreError``)."""
    return _BY_CODE.get(code, StoreError)(message)
