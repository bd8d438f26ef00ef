"""Dataclass <-> plain data for the run configuration: the one generic converter, the YAML reader.

Owns the configuration errors, the type check of every value against its annotation, section
<-> mapping (embedded settings objects as flat keys), the safe YAML loader, ``key.sub=value``
overrides and the table of removed or renamed keys (docs/controller.md "Configuration").
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any, Literal

import yaml

from workers.checked import ConfigError, ConfigValueError, embedded


class UnknownKeyError(ConfigError):
    """A key that no section declares."""


class ConfigTypeError(ConfigError):
    """A value of the wrong type (e.g. a string where a float is expected)."""


class OverrideSyntaxError(ConfigError):
    """A command-line override that is not ``key.sub=value``."""


# Keys a user's YAML or override may still set from an older release: the full dotted key -> what
# to do now. Such a key fails with this pointer instead of the list of allowed keys, so nothing
# a user wrote is silently ignored or left without a way forward.
RENAMED_KEYS: dict[str, str] = {
    "reference.enabled": "removed; set trainer.kl_coef: 0 to run without a reference "
                         "(trainer.kl_coef > 0 runs one where reference.placement says)",
}


def type_name(tp: Any) -> str:
    """How a key's type reads in an error and in docs/configuration.md."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_name(args[0])}"
        return f"list of {len(args)} ({', '.join(type_name(a) for a in args)})"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp`` and return it in the dataclass's representation."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key)
            except ConfigTypeError:
                continue
        raise ConfigTypeError(key, f"expected {type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        # Strict: True must not pass for a Literal[1], nor 1 for Literal["1"].
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        raise ConfigValueError(key, f"must be one of {', '.join(repr(c) for c in choices)}; "
                                    f"got {value!r}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigTypeError(key, f"expected {type_name(tp)}, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigTypeError(key, f"expected {type_name(tp)}, got {len(value)} items: "
                                  f"{value!r}")
        pairs = enumerate(zip(args, value, strict=True))
        return tuple(_convert(a, v, f"{key}[{i}]") for i, (a, v) in pairs)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):  # .inf/.nan are valid YAML but never a sane setting
                raise ConfigValueError(key, f"must be a finite number, got {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"config annotation {tp!r} of {key} is not supported by the converter")
    raise ConfigTypeError(key, f"expected {type_name(tp)}, got {value!r} ({type(value).__name__})")


def section_keys(cls: type) -> dict[str, Any]:
    """Key -> resolved annotation of dataclass ``cls``, in declaration order; an embedded
    settings object's fields are keys of ``cls`` itself."""
    hints = typing.get_type_hints(cls)
    inner = embedded(cls)
    keys: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in inner:
            keys.update(section_keys(inner[f.name]))
        else:
            keys[f.name] = hints[f.name]
    return keys


def _unknown_key(cls: type, key: str, section: str) -> UnknownKeyError:
    full = f"{section}.{key}" if section else key
    if full in RENAMED_KEYS:
        return UnknownKeyError(full, RENAMED_KEYS[full])
    allowed = list(section_keys(cls))
    where = f"section '{section}'" if section else "the top level"
    msg = f"unknown key; {where} allows: {', '.join(allowed)}"
    close = difflib.get_close_matches(key, allowed, n=1)
    if close:
        msg += f" (did you mean '{close[0]}'?)"
    return UnknownKeyError(full, msg)


def from_dict(cls: type[Any], data: Any, section: str = "") -> Any:
    """Build dataclass ``cls`` from a plain mapping, checking keys and types; ``section`` is the
    dotted prefix used in error messages. Missing keys take their defaults."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigTypeError(section, f"expected a mapping of keys, got {data!r}")
    hints = section_keys(cls)
    kwargs = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in hints:
            raise _unknown_key(cls, str(key), section)
        kwargs[key] = _convert(hints[key], value, f"{section}.{key}" if section else key)
    try:
        return cls(**kwargs)  # (embedded settings take their keys: workers.checked.flat)
    except ConfigError as err:
        # Section checks name the bare field; the top level's (section '') the full key.
        if section:
            raise err.with_prefix(section) from None
        raise


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain dict of YAML/JSON-safe values (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        inner = embedded(type(obj))
        for f in dataclasses.fields(obj):
            value = to_dict(getattr(obj, f.name))
            if f.name in inner:
                out.update(value)  # an embedded settings object's keys are the section's own
            else:
                out[f.name] = value
        return out
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


class _Loader(yaml.SafeLoader):
    """Safe loader with YAML 1.2 floats (PyYAML reads '1e-4' as a string) and no duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(str(key), f"duplicate key at line {key_node.start_mark.line + 1}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as err:
        raise ConfigError("", f"{where}: invalid YAML: {' '.join(str(err).split())}") from None


_KEY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _field_type(root: type, path: list[str], override: str) -> Any:
    """Annotation of the dotted field ``path`` in ``root`` (unknown keys raise with hints)."""
    tp: Any = root
    for i, name in enumerate(path):
        if not dataclasses.is_dataclass(tp):
            raise UnknownKeyError(".".join(path), f"'{'.'.join(path[:i])}' is a value, not a "
                                  f"section (in {override!r})")
        hints = section_keys(tp)
        if name not in hints:
            raise _unknown_key(tp, name, ".".join(path[:i]))
        tp = hints[name]
    return tp


def _accepts_str(tp: Any) -> bool:
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return tp is str or (union and str in typing.get_args(tp))


def apply_override(tree: dict[str, Any], override: str, root: type) -> None:
    """Apply one ``key.sub=value`` to a raw config tree of dataclass ``root``; the value is parsed
    as YAML (so ``[0.9, 0.99]``, ``null``, ``true``, ``1e-4`` work) and type-checked when the
    tree is built."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not _KEY.match(key):
        raise OverrideSyntaxError(key if sep else "", f"bad override {override!r}: expected "
                                  "key.sub=value, e.g. trainer.lr=1e-4")
    path = key.split(".")
    tp = _field_type(root, path, override)
    value = parse_yaml(text, f"override {override!r}")
    # A free-form string field keeps the text as typed: run.name=007 is the name '007', not 7.
    if _accepts_str(tp) and value is not None and not isinstance(value, str):
        value = text.strip()
    node = tree
    for name in path[:-1]:
        child = node.get(name)
        if child is None:
            child = node[name] = {}
        if not isinstance(child, dict):
            raise ConfigTypeError(name, f"expected a mapping of keys, got {child!r}")
        node = child
    node[path[-1]] = value
