"""Message headers as typed msgspec Structs: the store's verbs, the coordinator's, a table spec.

Owns the schema of every request header and the translation of msgspec's errors into one-line
``BadRequest`` messages naming the field. Shared rules: docs/store-protocol.md ("Headers")."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct

from storage.errors import BadRequest
from storage.schema import TableSpec

PROTOCOL_VERSION = 1
MAX_NAME_LEN = 256
MAX_TEXT_LEN = 4096
MAX_LIST_LEN = 4096  # columns, shards, tasks per request
MAX_ROWS_PER_CLAIM = 10_000_000
MAX_TIMEOUT_S = 24 * 3600.0
MAX_KEY_LEN = 256  # coordinator directory keys and prefixes
MAX_VALUE_LEN = 4096  # coordinator directory values

Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_LEN)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_LEN)]
Names = Annotated[list[Name], Meta(max_length=MAX_LIST_LEN)]
U64 = Annotated[int, Meta(ge=0)]  # msgpack ints end at 2**64 - 1
Timeout = Annotated[float, Meta(ge=0.0, le=MAX_TIMEOUT_S)]
Seconds = Annotated[float, Meta(ge=0.001, le=MAX_TIMEOUT_S)]
ShardId = Annotated[int, Meta(ge=0, le=65535)]
Rows = Annotated[int, Meta(ge=1, le=MAX_ROWS_PER_CLAIM)]


class Header(Struct, tag_field="verb", forbid_unknown_fields=True, kw_only=True):
    """Fields every request carries; subclasses add a verb's own (their tag is the verb)."""

    v: Literal[1]
    req_id: U64

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)


# -- table spec (the body of create_table) --------------------------------------------------------

_SPEC_DEFAULTS = {k: f.default for k, f in TableSpec.__dataclass_fields__.items()}


class WireTask(Struct, forbid_unknown_fields=True, kw_only=True):
    name: Name
    needs: Names
    whole_groups: bool = False
    skip_null: Name | None = None


class WireSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    """A ``TableSpec`` on the wire: the Arrow schema as IPC bytes, tasks as maps. Semantic checks
    (columns exist, tasks unique, fsync policy) are ``storage._validate``'s."""

    name: Name
    schema: bytes
    tasks: Annotated[list[WireTask], Meta(max_length=MAX_LIST_LEN)]
    group_column: Name | None = None
    group_size: Annotated[int, Meta(ge=1, le=65535)] | None = None
    capacity_rows: Annotated[int, Meta(ge=1, le=1 << 48)] = _SPEC_DEFAULTS["capacity_rows"]
    capacity_bytes: Annotated[int, Meta(ge=1, le=1 << 50)] = _SPEC_DEFAULTS["capacity_bytes"]
    lease_seconds: Seconds = _SPEC_DEFAULTS["lease_seconds"]
    max_deliveries: Annotated[int, Meta(ge=1, le=65535)] = _SPEC_DEFAULTS["max_deliveries"]
    fsync: Literal["always", "interval", "never"] = _SPEC_DEFAULTS["fsync"]
    fsync_interval_s: Annotated[float, Meta(gt=0.0, le=3600.0)] = _SPEC_DEFAULTS[
        "fsync_interval_s"
    ]


SPEC_SCALARS = tuple(f for f in WireSpec.__struct_fields__ if f not in ("name", "schema", "tasks"))


# -- the store's verbs (served by storage.server) -------------------------------------------------


def _verb(tag: str, base: type[Header] = Header) -> Any:
    """The header Struct of a verb with no fields beyond ``base``'s."""
    name = tag.title().replace("_", "")
    return msgspec.defstruct(name, [], bases=(base,), tag=tag, module=__name__)


class _OfTable(Header):
    table: Name


Hello, Tables = _verb("hello"), _verb("tables")
DropTable = _verb("drop_table", _OfTable)
Stats = _verb("stats", _OfTable)
Snapshot = _verb("snapshot", _OfTable)


class CreateTable(Header, tag="create_table"):
    spec: WireSpec


class Put(_OfTable, tag="put"):
    timeout: Timeout = 0.0
    shard_id: ShardId | None = None


class Claim(_OfTable, tag="claim"):
    task: Name
    columns: Names
    max_rows: Rows
    min_rows: Rows = 1
    whole_groups: bool = False
    timeout: Timeout = 0.0
    lease_seconds: Seconds | None = None
    # null = every shard of the node; an empty list is refused
    shards: Annotated[list[ShardId], Meta(min_length=1, max_length=MAX_LIST_LEN)] | None = None
    # Piggybacked ack: a lease of the table to ack (after writing the body) before the claim.
    ack_lease_id: U64 | None = None
    # Other tasks of the table: a waiting claim ends (empty lease) once any has ready rows, so a
    # consumer of several tasks waits on all of them with one request.
    wake: Names | None = None


class Write(_OfTable, tag="write"):
    lease_id: U64 | None = None
    ack: bool = False
    overwrite: bool = False


class Ack(_OfTable, tag="ack"):
    lease_id: U64


class Extend(Ack, tag="extend"):
    seconds: Seconds | None = None


class Release(Ack, tag="release"):
    error: Text | None = None


class Clear(_OfTable, tag="clear"):
    dead: bool = False


class Cancel(Header, tag="cancel"):
    target: U64


STORE_HEADERS = (Hello, Tables, CreateTable, DropTable, Put, Claim, Write, Ack, Extend, Release,
                 Stats, Clear, Snapshot, Cancel)


# -- the coordinator's verbs (served by storage.coordinator) --------------------------------------

Key = Annotated[str, Meta(min_length=1, max_length=MAX_KEY_LEN)]


CoordHello = _verb("hello")


class Register(Header, tag="register"):
    key: Key
    value: Annotated[str, Meta(max_length=MAX_VALUE_LEN)]


class Lookup(Header, tag="lookup"):
    key: Key
    timeout: Timeout = 0.0


class LookupPrefix(Header, tag="lookup_prefix"):
    prefix: Annotated[str, Meta(max_length=MAX_KEY_LEN)]


class _Group(Header):
    table: Name
    task: Name


class _Member(_Group):
    consumer: Name


Join, Leave = _verb("join", _Member), _verb("leave", _Member)
Assignment = _verb("assignment", _Group)


class Heartbeat(_Member, tag="heartbeat"):
    generation: Annotated[int, Meta(ge=0, le=1 << 62)] = 0
    rate: Annotated[float, Meta(ge=0.0, le=1e12)] = 0.0
    in_flight: Annotated[int, Meta(ge=0, le=1 << 48)] = 0


COORD_HEADERS = (CoordHello, Register, Lookup, LookupPrefix, Join, Heartbeat, Leave, Assignment)


def verb_of(cls: type[Header]) -> str:
    return str(cls.__struct_config__.tag)


VERB_OF = {cls: verb_of(cls) for cls in STORE_HEADERS + COORD_HEADERS}


def fields_by_verb(classes: tuple[type[Header], ...]) -> dict[str, tuple[str, ...]]:
    """verb -> the verb's own header fields (without ``v`` and ``req_id``)."""
    return {
        verb_of(c): tuple(f for f in c.__struct_fields__ if f not in ("v", "req_id"))
        for c in classes
    }


def decoder(classes: tuple[type[Header], ...]) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Union[classes])  # noqa: UP007 (a runtime tuple of types)


# -- msgspec's errors as BadRequest naming the field ----------------------------------------------

_AT = re.compile(r"^(?P<detail>.*?)(?: - at `\$(?P<path>.*)`)?$", re.S)
_FIELD = re.compile(r"^Object (?P<how>missing required|contains unknown) field `(?P<name>.*)`$")
_TOP = frozenset({"v", "req_id", "verb"})


def field_error(
    exc: msgspec.ValidationError, scope: str, kind: str = "header", verbs: Any = ()
) -> BadRequest:
    """One line naming the field msgspec refused (``scope``: the verb, or "" for a spec), e.g.
    ``header field 'claim.max_rows': Expected `int` >= 1``; ``verbs``: listed for a bad verb."""
    m = _AT.match(str(exc))
    detail, path = m["detail"], (m["path"] or "").lstrip(".")  # type: ignore[index]
    named = _FIELD.match(detail)  # a missing or unknown field is named in the detail
    if named:
        path = ".".join(p for p in (path, named["name"]) if p)
    where = ".".join(p for p in (scope, path) if p).replace(".[", "[")
    if kind == "header" and path in _TOP:
        where = path
    if named:
        text = f"{named['how'].split()[0].replace('contains', 'unknown')} {kind} field {where!r}"
    else:
        text = f"{kind} field {where!r}: {detail}"
    if path.endswith("persist_dir"):
        text += ": where a table is persisted is the node's configuration (--persist-dir)"
    if path == "verb" and verbs:
        text += f" (one of {sorted(verbs)})"
    return BadRequest(text)
