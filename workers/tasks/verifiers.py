"""Reward functions: a registry of rule-based verifiers, and a runner that scores with timeouts.

A reward function is ``fn(completion, answer) -> float`` or ``fn(completion, answer, trajectory)
-> float``: the form is read from its signature once, when it is loaded (``takes_trajectory``);
``trajectory`` is a ``Trajectory`` (the model's turns, the observations, their errors, the tool
calls, the environment's reward; a single-turn sample is a trajectory of one turn). Built-ins
run in-process; any other ``"package.module:function"`` runs in a spawned child that a
per-sample timeout kills and restarts (a reward object's ``prepare()``, where it has one, runs
there before the first sample, outside that timeout); a failure scores 0.0 with ``ok=False`` and
the reason (docs/training.md "The reward role"). Stays light to import (no torch): the child imports it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from workers.agent.toolcall import PLAIN_CALL_END, TOOL_RESPONSE_END
from workers.runtime.child import ChildDied, ChildLink, ChildStartError, ChildTimeout
from workers.settings import HUB, HUB_PREFIX

RewardFn = Callable[..., float]  # (completion, answer) or (completion, answer, trajectory)

_REGISTRY: dict[str, RewardFn] = {}


class RewardError(ValueError):
    """A reward function cannot be found or used."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` resolvable by ``name`` (a name may be registered once)."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise RewardError(f"reward {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return deco


def available_rewards() -> list[str]:
    """Names accepted by ``resolve_reward`` (besides ``module:function`` import paths)."""
    return sorted(_REGISTRY)


# Modules of this package that reward.fn could name before they moved: a one-line pointer.
MOVED_MODULES = {"workers.rewards": "workers.tasks.verifiers", "workers.tasks_word": "workers.tasks.word"}


def _import_path(path: str) -> RewardFn:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise RewardError(
            f"reward import path must look like 'package.module:function', got {path!r}")
    if module_name in MOVED_MODULES:
        raise RewardError(f"reward {path!r}: module {module_name!r} moved; use "
                          f"'{MOVED_MODULES[module_name]}:{attr}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(f"reward {path!r}: cannot import module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardError(f"reward {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(f"reward {path!r} is not callable")
    return obj


def resolve_reward(name_or_import_path: str) -> RewardFn:
    """A registered name (see ``available_rewards``), ``"package.module:function"``, or a hub
    taskset's spec (its tasks' rewards: ``workers.agent.hub.hub_spec``)."""
    if name_or_import_path in _REGISTRY:
        return _REGISTRY[name_or_import_path]
    if name_or_import_path.startswith(HUB_PREFIX):  # loads the environment at its first score
        from workers.agent.hub import HubReward

        return HubReward(name_or_import_path.removeprefix(HUB_PREFIX))
    if name_or_import_path == HUB:
        raise RewardError("reward 'hub' needs env.hub: the hub taskset whose rewards score")
    if ":" in name_or_import_path:
        return _import_path(name_or_import_path)
    raise RewardError(f"unknown reward {name_or_import_path!r}; registered: {available_rewards()} "
                      "(or give an import path 'package.module:function')")


@dataclass(frozen=True)
class Trajectory:
    """What a trajectory-aware reward function reads besides the completion (the whole
    response, turns and observations decoded together) and the answer."""

    turns: tuple[str, ...]  # the model's turns, decoded, in order
    observations: tuple[str, ...]  # the observation texts appended after turns 0, 1, ...
    errors: tuple[str | None, ...]  # per executed tool call: None or its error kind
    tool_calls: int  # calls the environment executed (an unanswered last-turn call not counted)
    env_reward: float | None = None  # the environment's reward of the trajectory, if it gave one
    finish_reason: str = ""  # "stop", "length", "tool", "budget" or "done"


def takes_trajectory(fn: RewardFn) -> bool:
    """Whether ``fn`` is called as ``fn(completion, answer, trajectory)`` (it accepts three
    positional arguments) rather than ``fn(completion, answer)``; RewardError when neither."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): the classic form
        return False
    for args, three in (((0, 0, 0), True), ((0, 0), False)):
        try:
            sig.bind(*args)
        except TypeError:
            continue
        return three
    raise RewardError(f"reward {getattr(fn, '__qualname__', fn)!r} must take (completion, "
                      f"answer) or (completion, answer, trajectory), not {sig}")


# --------------------------------------------------------------------------- built-ins
@register_reward("exact_match")
def exact_match(completion: str, answer: str) -> float:
    """1.0 if the completion equals the answer after stripping surrounding whitespace."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@register_reward("numeric_close")
def numeric_close(completion: str, answer: str) -> float:
    """1.0 if the first number in the completion is within 1e-6 (relative) of the answer."""
    found = _NUMBER.search(completion)
    if found is None:
        return 0.0
    try:
        got, want = float(found.group()), float(answer.strip())
    except ValueError:
        return 0.0
    return 1.0 if math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9) else 0.0


@register_reward("brevity")
def brevity(completion: str, answer: str) -> float:
    """1 / (1 + characters in the completion), ignoring the answer: prefers short answers, and a
    dense signal for smoke tests (an untrained model's random outputs still score differently)."""
    return 1.0 / (1.0 + len(completion.strip()))


@register_reward("final_answer")
def final_answer(completion: str, answer: str) -> float:
    """``exact_match`` of the model's final words in a tool-using trajectory: what follows the
    last tool answer (the plain form's ``(=expr=)OBS `` or ``</tool_response>``); a completion
    with no call is scored whole. A trajectory that stops at a tool answer scores 0: copying the
    answer is the model's job, the observation alone is not its answer. (A plain observation is
    one word; an error observation with spaces can only lose a point, never give one.)"""
    return exact_match(final_words(completion), answer)


def final_words(completion: str) -> str:
    """The text of ``completion`` after its last tool answer (the whole text without a call)."""
    if TOOL_RESPONSE_END in completion:
        return completion.rpartition(TOOL_RESPONSE_END)[2]
    if PLAIN_CALL_END in completion:
        _observation, space, rest = completion.rpartition(PLAIN_CALL_END)[2].partition(" ")
        return rest if space else ""
    return completion


_BUILTINS = frozenset(_REGISTRY.values())  # pure and fast: they run in-process


# --------------------------------------------------------------------------- runner
@dataclass
class RewardResult:
    """The score of one sample; a failure scores 0.0 with ``ok=False`` and the reason."""

    score: float
    ok: bool
    error: str | None = None


def _check_score(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"reward returned {type(value).__name__}, expected a float")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward returned a non-finite value {score}")
    return score


def _score_one(fn: RewardFn, completion: str, answer: str,
               trajectory: Trajectory | None = None) -> RewardResult:
    """``trajectory`` is None for a classic ``fn(completion, answer)``."""
    try:
        args = (completion, answer) if trajectory is None else (completion, answer, trajectory)
        return RewardResult(_check_score(fn(*args)), True, None)
    except Exception as exc:  # a user's bug must not escape: it becomes a failed sample
        return RewardResult(0.0, False, f"{type(exc).__name__}: {exc}")


def _child_main(import_path: str, conn: Connection) -> None:
    """Child loop: receive (completion, answer, trajectory or None), send (score, ok, error)."""
    try:
        fn = resolve_reward(import_path)
        prepare = getattr(fn, "prepare", None)  # loading is not scored against the timeout
        if callable(prepare):
            prepare()
    except Exception as exc:
        conn.send(("load_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    with contextlib.suppress(EOFError):  # the parent is gone
        while (msg := conn.recv()) is not None:  # None: stop
            r = _score_one(fn, str(msg[0]), str(msg[1]), msg[2])
            conn.send((r.score, r.ok, r.error))


def _import_path_of(fn: RewardFn) -> str | None:
    spec = getattr(fn, "reward_spec", None)  # an object resolve_reward made from this spec
    if isinstance(spec, str):
        return spec
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    return f"{module}:{qualname}"


class RewardRunner:
    """Scores completions with ``fn`` (a registered name, an import path, or a callable), each
    sample under ``timeout_s``. ``isolate=None``: built-ins in-process, the rest in the child,
    which needs an import path (a module-level function of an importable module)."""

    def __init__(self, fn: RewardFn | str, timeout_s: float, *,
                 isolate: bool | None = None) -> None:
        if not timeout_s > 0:
            raise RewardError(f"RewardRunner: timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.fn: RewardFn = resolve_reward(fn) if isinstance(fn, str) else fn
        self.takes_trajectory = takes_trajectory(self.fn)  # read once, here
        self.isolated = (self.fn not in _BUILTINS) if isolate is None else isolate
        self.import_path: str | None = None
        if self.isolated:
            # The child gets an import path, never a pickled function; a registered name is
            # mapped to its function's module path (the child has not run the user's register).
            is_path = isinstance(fn, str) and fn not in _REGISTRY and ":" in fn
            self.import_path = fn if is_path else _import_path_of(self.fn)
            if self.import_path is None:
                raise RewardError(
                    f"reward {self.fn!r} cannot run in a child process: it has no import path "
                    "(use a module-level function of an importable module)"
                )
        self._child = ChildLink(_child_main, self.import_path or "", "reward-fn")

    @property
    def restarts(self) -> int:  # children killed after a timeout or a crash
        return self._child.restarts

    def close(self) -> None:
        """Stop the child process (if any); the runner restarts one if used again."""
        self._child.close()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- scoring -------------------------------------------------------------------------------
    def score(self, completions: Sequence[str], answers: Sequence[str],
              trajectories: Sequence[Trajectory] | None = None) -> list[RewardResult]:
        """One ``RewardResult`` per completion, in order; never raises for a bad sample. A
        trajectory-aware ``fn`` gets ``trajectories`` (None: each completion as one turn)."""
        if len(completions) != len(answers):
            raise ValueError(f"score: {len(completions)} completions but {len(answers)} answers")
        if not self.takes_trajectory:
            trajs: list[Trajectory | None] = [None] * len(completions)
        elif trajectories is None:
            trajs = [Trajectory((str(c),), (), (), 0) for c in completions]
        else:
            trajs = list(trajectories)
        one = self._score_isolated if self.isolated else functools.partial(_score_one, self.fn)
        return [one(str(c), str(a), t)
                for c, a, t in zip(completions, answers, trajs, strict=True)]

    def _score_isolated(self, completion: str, answer: str,
                        trajectory: Trajectory | None = None) -> RewardResult:
        self._child.arg = self.import_path or ""  # a (re)started child loads the current path
        try:
            score, ok, error = self._child.ask((completion, answer, trajectory), self.timeout_s)
            return RewardResult(float(score), bool(ok), error)
        except ChildStartError as exc:
            if exc.detail is None:
                raise RewardError(f"reward child for {self.import_path!r} did not start") from None
            raise RewardError(f"reward {self.import_path!r} failed to load in the child: "
                              f"{exc.detail}") from None
        except ChildTimeout:
            reason = f"timeout after {self.timeout_s:g}s"
        except ChildDied as exc:
            reason = f"reward process died: {exc}"
        return RewardResult(0.0, False, reason)
