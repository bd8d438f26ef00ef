"""Environments: what answers a model's tool calls, the built-in ones, and loading a user's.

An ``Environment`` serves the tools named by ``tools()`` and answers one call at a time with
``step(call, context) -> Observation``. It is STATELESS per call: a trajectory lives in the store
between turns and its next turn may run on another worker, so everything a step may depend on
comes in its ``StepContext`` (the prompt, the ``answer`` column, the turn index, the earlier
calls). ``execute`` is what the environment role calls for each model turn: it parses the call,
dispatches it and turns every failure (malformed call, unknown tool, a user environment that
raises or returns garbage) into an error ``Observation`` the model can learn from; it never
raises an ``Exception``.

Built-ins (``env.fn`` names them; a user's is ``"package.module:ClassOrFactory"``):

* ``calculator`` (argument ``expression``): exact ``+ - * / ( )`` and unary minus over integer
  and decimal literals with ``fractions.Fraction``, by a whitelist walk over
  ``ast.parse(mode="eval")``: nothing is evaluated by Python, ``**``, names, calls and
  attributes are refused, and the expression length and every intermediate number are bounded,
  so a step is pure and small. That is why it runs in-process, unlike code.
* ``python`` (argument ``code``): the snippet runs in the sandbox (``workers.agent.sandbox``,
  imported at the first call, or any runner with its ``run_python(code[, limits])`` shape);
  stdout, stderr and the exit status come back as text, the sandbox's failure as the error.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from workers.agent.toolcall import ToolCall, ToolCallError, parse_tool_call
from workers.checked import ConfigValueError

if TYPE_CHECKING:
    from workers.agent.sandbox import SandboxLimits, SandboxResult

ERROR_KINDS = ("timeout", "memory", "output_limit", "crashed", "bad_call", "unknown_tool",
               "tool_error")
ENV_KEY = "env.fn"  # the config key that names the environment
MAX_OBSERVATION_CHARS = 8192  # longer observation texts are cut (a user's env is not trusted)
_MESSAGE_CHARS = 200  # of an exception's message shown to the model


@dataclass(frozen=True)
class StepContext:
    """What a step may know about its trajectory (all of it is in the store between turns)."""

    prompt: str  # the trajectory's prompt text
    answer: str  # its ``answer`` column ('' when the task has none)
    turn: int  # 0-based index of the model turn that made this call
    calls: tuple[ToolCall, ...] = ()  # the calls of the earlier turns, oldest first


@dataclass(frozen=True)
class Observation:
    """An environment's answer. ``done`` ends the trajectory; ``reward``, when set, is the
    environment's score of it."""

    text: str
    error: str | None = None  # None, or one of ERROR_KINDS
    done: bool = False
    reward: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Observation.text must be a str, got {type(self.text).__name__}")
        if self.error is not None and self.error not in ERROR_KINDS:
            raise ValueError(f"Observation.error must be None or one of {ERROR_KINDS}, "
                             f"got {self.error!r}")
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError(f"Observation.reward must be finite, got {self.reward!r}")


@runtime_checkable
class Environment(Protocol):
    """Serves the tools it names; one pure call per step (see the module docstring)."""

    def tools(self) -> tuple[str, ...]: ...

    def step(self, call: ToolCall, context: StepContext) -> Observation: ...


def execute(env: Environment, model_turn_text: str, context: StepContext, *,
            plain: bool = False, allowed: Sequence[str] = ()) -> Observation:
    """The observation for one model turn. A turn without a call is the model's answer:
    ``Observation("", done=True)``. ``plain`` picks the call form (workers.agent.toolcall);
    ``allowed`` (``env.tools``) narrows the tools the model may call (empty: all it serves)."""
    parsed = parse_tool_call(model_turn_text, plain=plain)
    if parsed is None:
        return Observation("", done=True)
    if isinstance(parsed, ToolCallError):
        return Observation(f"bad tool call ({parsed.kind}): {parsed.message}", "bad_call")
    try:
        tools = tuple(allowed) or tuple(env.tools())
        if parsed.name not in tools:
            return Observation(f"unknown tool {parsed.name[:40]!r}; the tools are "
                               f"{', '.join(tools)}", "unknown_tool")
        obs = env.step(parsed, context)
    except Exception as exc:  # a user's environment: its failure is the model's observation
        return Observation(_describe(exc), "tool_error")
    if not isinstance(obs, Observation):
        return Observation(f"the environment returned {type(obs).__name__}, not an Observation",
                           "tool_error")
    if len(obs.text) > MAX_OBSERVATION_CHARS:
        obs = dataclasses.replace(obs, text=obs.text[:MAX_OBSERVATION_CHARS] + " [truncated]")
    return obs


def _describe(exc: BaseException) -> str:
    try:
        message = str(exc)
    except Exception:  # a hostile __str__ must not escape execute either
        message = "(unprintable)"
    return f"{type(exc).__name__}: {message[:_MESSAGE_CHARS]}".replace("\n", " ")


# --------------------------------------------------------------------------- calculator
class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the model sees the message)."""


_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv}
_LITERAL = re.compile(r"[0-9]+\.?[0-9]*|\.[0-9]+")  # no exponent, underscore, hex or complex


def evaluate(expression: str, *, max_chars: int = 256, max_bits: int = 4096) -> Fraction:
    """The exact value of ``expression``; CalculatorError names what is wrong."""
    if len(expression) > max_chars:
        raise CalculatorError(f"expression over {max_chars} characters")
    source = expression.strip()
    if not source:
        raise CalculatorError("empty expression")
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("not an arithmetic expression") from None
    return _walk(tree.body, source, max_bits)


def _walk(node: ast.AST, source: str, max_bits: int) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        literal = ast.get_source_segment(source, node) or ""
        if not _LITERAL.fullmatch(literal):
            raise CalculatorError(f"unsupported number {literal[:40]!r}")
        return _bounded(Fraction(literal), max_bits)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _walk(node.operand, source, max_bits)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _walk(node.left, source, max_bits)
        right = _walk(node.right, source, max_bits)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right), max_bits)
    if isinstance(node, ast.BinOp):
        raise CalculatorError(f"unsupported operator {type(node.op).__name__}; use + - * / ( )")
    raise CalculatorError(f"unsupported syntax {type(node).__name__}; use numbers and + - * / ( )")


def _bounded(value: Fraction, max_bits: int) -> Fraction:
    # every intermediate stays small, so each operation on it is cheap
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > max_bits:
        raise CalculatorError("number too large")
    return value


def format_number(value: Fraction) -> str:
    """An integer as itself, a terminating fraction as an exact decimal, any other as ``p/q``."""
    den = value.denominator
    twos = fives = 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    if places == 0:
        return str(value.numerator)
    scaled = abs(value.numerator) * (10**places // value.denominator)
    whole, frac = divmod(scaled, 10**places)
    sign = "-" if value < 0 else ""
    return f"{sign}{whole}.{str(frac).rjust(places, '0').rstrip('0')}"


@dataclass(frozen=True)
class CalculatorEnvironment:
    """The ``calculator`` tool: ``{"expression": "123*45"}`` -> ``5535`` (see ``evaluate``)."""

    max_chars: int = 256
    max_bits: int = 4096

    def tools(self) -> tuple[str, ...]:
        return ("calculator",)

    def step(self, call: ToolCall, context: StepContext) -> Observation:
        expression = call.arguments.get("expression")
        if set(call.arguments) != {"expression"} or not isinstance(expression, str):
            return Observation("calculator takes one string argument 'expression'", "bad_call")
        try:
            value = evaluate(expression, max_chars=self.max_chars, max_bits=self.max_bits)
        except CalculatorError as err:
            return Observation(str(err), "tool_error")
        return Observation(format_number(value))


# --------------------------------------------------------------------------- python
# The sandbox's failures as observation errors; its text for the model.
_SANDBOX_ERRORS = {"timeout": "timeout", "memory": "memory", "output_limit": "output_limit",
                   "crashed": "crashed", "killed": "crashed", "unavailable": "tool_error"}
_SANDBOX_NOTES = {"timeout": "the program ran out of time", "memory": "the program ran out of "
                  "memory", "output_limit": "the output was cut at its size limit",
                  "crashed": "the program crashed", "killed": "the program was killed",
                  "unavailable": "the sandbox is unavailable"}


@dataclass
class PythonEnvironment:
    """The ``python`` tool: ``{"code": "print(6*7)"}`` runs in the sandbox -> ``42``."""

    runner: Callable[..., SandboxResult] | None = None  # None: workers.agent.sandbox.run_python
    limits: SandboxLimits | None = None  # None: the runner's defaults
    _resolved: Callable[..., SandboxResult] | None = field(default=None, init=False, repr=False)

    def tools(self) -> tuple[str, ...]:
        return ("python",)

    def step(self, call: ToolCall, context: StepContext) -> Observation:
        code = call.arguments.get("code")
        if set(call.arguments) != {"code"} or not isinstance(code, str):
            return Observation("python takes one string argument 'code'", "bad_call")
        result = self._runner()(code) if self.limits is None else self._runner()(code, self.limits)
        return sandbox_observation(result)

    def _runner(self) -> Callable[..., SandboxResult]:
        if self._resolved is None:
            if self.runner is None:
                from workers.agent.sandbox import run_python  # the sandbox loads on first use

                self._resolved = run_python
            else:
                self._resolved = self.runner
        return self._resolved


def sandbox_observation(result: SandboxResult) -> Observation:
    """stdout, then ``stderr:`` and stderr, then the failure or a non-zero exit code."""
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    if result.error is not None:
        parts.append(f"error: {_SANDBOX_NOTES.get(result.error, result.error)}")
    elif result.exit_code not in (0, None):
        parts.append(f"exit code {result.exit_code}")
    text = "\n".join(parts) if parts else "(no output)"
    error = None if result.error is None else _SANDBOX_ERRORS.get(result.error, "tool_error")
    return Observation(text, error)


# --------------------------------------------------------------------------- loading
BUILTIN_ENVIRONMENTS: dict[str, Callable[[], Environment]] = {
    "calculator": CalculatorEnvironment, "python": PythonEnvironment}


def load_environment(spec: str) -> Environment:
    """A built-in by name, or ``"package.module:ClassOrFactory"`` called with no arguments (a hub
    taskset's spec is ``workers.agent.isolated``'s: the hub adapter builds on this module).
    ConfigValueError (a ValueError) naming ``env.fn`` when it cannot be had."""
    if spec in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[spec]()
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise _error(f"unknown environment {spec!r}; built-in: {', '.join(BUILTIN_ENVIRONMENTS)}"
                     " (or give an import path 'package.module:Class')")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the user's module raised while being imported
        raise _error(f"environment {spec!r}: cannot import module {module_name!r}: "
                     f"{_describe(exc)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise _error(f"environment {spec!r}: module {module_name!r} has no attribute "
                         f"{attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise _error(f"environment {spec!r} is not a class or factory")
    try:
        env = obj()
    except Exception as exc:
        raise _error(f"environment {spec!r} raised when made with no arguments: "
                     f"{_describe(exc)}") from None
    return _checked(spec, env)


def _checked(spec: str, env: Any) -> Environment:
    """``env`` if it serves a non-empty tuple of tool names."""
    if not isinstance(env, Environment):
        raise _error(f"environment {spec!r} made a {type(env).__name__}, which lacks tools() "
                     "and step(call, context)")
    try:
        tools = env.tools()
    except Exception as exc:
        raise _error(f"environment {spec!r}: tools() raised {_describe(exc)}") from None
    if not isinstance(tools, tuple) or not tools or not all(
            isinstance(t, str) and t for t in tools):
        raise _error(f"environment {spec!r}: tools() must return a non-empty tuple of names, "
                     f"got {tools!r:.80}")
    return env


def _error(message: str) -> ConfigValueError:
    return ConfigValueError(ENV_KEY, message)  # one line: exceptions pass through _describe
