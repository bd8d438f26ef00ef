"""Typed, checked settings dataclasses: the configuration errors that name their key, ``bounded``
numeric fields checked on construction, ``Checked`` (ranges, then the class's own ``check``) and
``embed``/``flat``, which let an owner carry a settings object while callers see its fields as the
owner's own. The settings themselves are declared in ``workers.settings``; the run's sections in
``streamflow.config``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import field
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """Base of every configuration error. ``key`` is the dotted key at fault ('' = whole file)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.detail = message
        super().__init__(f"{key}: {message}" if key else message)

    def with_prefix(self, prefix: str) -> ConfigError:
        """The same error with its key moved under ``prefix`` (used while descending sections)."""
        return type(self)(f"{prefix}.{self.key}" if self.key else prefix, self.detail)


class ConfigValueError(ConfigError):
    """A value of the right type outside its range or allowed choices, or a cross-field conflict."""


def require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigValueError(key, message)


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, why: str = "") -> Any:
    """A numeric field with its allowed range (inclusive ge/le, exclusive gt) and its reason."""
    return field(default=default, metadata={"ge": ge, "gt": gt, "le": le, "why": why})


def check_bounds(obj: Any) -> None:
    """Check every ``bounded`` field of a dataclass instance (None and the strings of a field
    that also takes a choice, such as 'auto', always pass: the converter checked those)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None or isinstance(value, str) or "ge" not in f.metadata:
            continue
        ge, gt, le = f.metadata["ge"], f.metadata["gt"], f.metadata["le"]
        ok = (ge is None or value >= ge) and (gt is None or value > gt)
        if not (ok and (le is None or value <= le)):
            bounds = [f"{op} {b}" for op, b in ((">=", ge), (">", gt), ("<=", le)) if b is not None]
            why = f" ({f.metadata['why']})" if f.metadata["why"] else ""
            raise ConfigValueError(f.name, f"must be {' and '.join(bounds)}, got {value}{why}")


class Checked:
    """Base of a settings dataclass: construction checks its ``bounded`` ranges, then ``check``."""

    def __post_init__(self) -> None:
        check_bounds(self)
        self.check()

    def check(self) -> None:
        """Rules beyond the ranges (raise ``ConfigValueError`` naming the bare field)."""


def embed(cls: type, **defaults: Any) -> Any:
    """A field holding a settings object of class ``cls`` whose fields read and build as the
    owner's own (see ``flat``); ``defaults`` override the class's for this owner."""
    factory: Callable[[], Any] = functools.partial(cls, **defaults) if defaults else cls
    return field(default_factory=factory, metadata={"embed": cls})


def embedded(cls: type) -> dict[str, type]:
    """Field name -> settings class of every ``embed`` field of dataclass ``cls``."""
    return {f.name: f.metadata["embed"] for f in dataclasses.fields(cls) if "embed" in f.metadata}


def flat(cls: type[T]) -> type[T]:
    """Class decorator (after ``@dataclass``): the fields of ``embed`` fields are the owner's own
    to callers: ``Owner(lr=1e-3)`` sets ``owner.optim.lr``, ``owner.lr`` reads it."""
    owner_of: dict[str, str] = {}
    for name, inner in embedded(cls).items():
        for f in dataclasses.fields(inner):
            if f.name in owner_of or f.name in cls.__dataclass_fields__:  # type: ignore
                raise TypeError(f"{cls.__name__}: field {f.name!r} is declared twice")
            owner_of[f.name] = name
    init = cls.__init__
    factories = {f.name: f.default_factory
                 for f in dataclasses.fields(cls) if "embed" in f.metadata}

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        moved: dict[str, dict[str, Any]] = {}
        for key in [k for k in kwargs if k in owner_of]:
            moved.setdefault(owner_of[key], {})[key] = kwargs.pop(key)
        for name, values in moved.items():
            base = kwargs.get(name)
            kwargs[name] = dataclasses.replace(base if base is not None else factories[name](),
                                               **values)
        init(self, *args, **kwargs)

    def __getattr__(self: Any, name: str) -> Any:
        owner = owner_of.get(name)
        if owner is not None:
            try:  # (not yet set while unpickling: fall through to AttributeError)
                return getattr(object.__getattribute__(self, owner), name)
            except AttributeError:
                pass
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    cls.__init__ = __init__  # type: ignore[method-assign]
    cls.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return cls
