"""The coordinator's request schema and validation (``storage/coordinator.py`` serves it).

Owns: the coordinator's verbs and their header fields (rules of ``storage.wire.F``), and
``decode_request``, which applies the store's frame limits (``wire.unpack_header``) and checks
every field, raising ``BadRequest`` naming the field (with ``.req_id`` when known). Coordinator
requests carry no Arrow bodies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from storage import wire
from storage.errors import BadRequest

MAX_KEY_LEN = 256
MAX_VALUE_LEN = 4096

_F = wire.F
_NAME = _F("name", required=True)
_KEY = _F("name", required=True)  # 1..256 characters
# verb -> field -> rule (wire.F). Unknown fields are refused, as in the store's protocol.
COORD_VERBS: dict[str, dict[str, wire.F]] = {
    "hello": {},
    "register": {"key": _KEY, "value": _F("str", required=True)},
    "lookup": {"key": _KEY, "timeout": _F("float", default=0.0, lo=0.0, hi=wire.MAX_TIMEOUT_S)},
    "lookup_prefix": {"prefix": _F("str", required=True)},
    "join": {"table": _NAME, "task": _NAME, "consumer": _NAME},
    "heartbeat": {
        "table": _NAME,
        "task": _NAME,
        "consumer": _NAME,
        "generation": _F("int", default=0, lo=0, hi=(1 << 62)),
        "rate": _F("float", default=0.0, lo=0.0, hi=1e12),
        "in_flight": _F("int", default=0, lo=0, hi=1 << 48),
    },
    "leave": {"table": _NAME, "task": _NAME, "consumer": _NAME},
    "assignment": {"table": _NAME, "task": _NAME},
}


def decode_request(frames: Sequence[Any]) -> wire.Request:
    """Validate a coordinator request (header rules of ``wire``; no bodies allowed)."""
    if not frames:
        raise BadRequest("empty message")
    header = wire.unpack_header(wire._bytes_view(frames[0]))
    req_id = wire.peek_req_id(header)
    try:
        if header.get("v") != wire.PROTOCOL_VERSION:
            raise BadRequest(
                f"header field 'v' must be {wire.PROTOCOL_VERSION}, got {header.get('v')!r}"
            )
        if "req_id" not in header or req_id != header["req_id"]:
            raise BadRequest("header field 'req_id' must be an int in [0, 2**64)")
        verb = header.get("verb")
        if not isinstance(verb, str) or verb not in COORD_VERBS:
            raise BadRequest(
                f"header field 'verb' must be one of {sorted(COORD_VERBS)}, got {verb!r}"
            )
        rules = COORD_VERBS[verb]
        unknown = header.keys() - {"v", "verb", "req_id"} - rules.keys()
        if unknown:
            raise BadRequest(f"unknown header fields for {verb!r}: {sorted(unknown)}")
        args: dict[str, Any] = {}
        for name, rule in rules.items():
            if name not in header:
                if rule.required:
                    raise BadRequest(f"missing header field '{verb}.{name}'")
                args[name] = rule.default
            else:
                args[name] = wire._check_value(verb, name, rule, header[name])
        if len(frames) > 1:
            raise BadRequest(f"{verb!r} takes no body frames, got {len(frames) - 1}")
        if verb == "register" and len(args["value"]) > MAX_VALUE_LEN:
            raise BadRequest(f"register.value is longer than {MAX_VALUE_LEN} characters")
        if verb == "lookup_prefix" and len(args["prefix"]) > MAX_KEY_LEN:
            raise BadRequest(f"lookup_prefix.prefix is longer than {MAX_KEY_LEN} characters")
        return wire.Request(verb, req_id, args)
    except BadRequest as exc:
        exc.req_id = req_id  # type: ignore[attr-defined]
        raise
