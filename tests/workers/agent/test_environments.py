"""Environments: the exact calculator and its limits, the python tool over a fake sandbox runner,
``execute``'s error observations, and loading environments by name or dotted path."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from fractions import Fraction

import pytest

from workers.agent.environments import (
    ERROR_KINDS,
    MAX_OBSERVATION_CHARS,
    CalculatorEnvironment,
    Environment,
    Observation,
    PythonEnvironment,
    StepContext,
    execute,
    format_number,
    load_environment,
)
from workers.agent.toolcall import ToolCall, render_tool_call

CTX = StepContext(prompt="What is 2+2?", answer="4", turn=0)


class GuessEnv:
    """A ten-line user environment: guess the answer, be told higher or lower."""

    def tools(self) -> tuple[str, ...]:
        return ("guess",)

    def step(self, call: ToolCall, context: StepContext) -> Observation:
        guess, target = int(call.arguments["number"]), int(context.answer)
        if guess == target:
            return Observation("correct", done=True, reward=1.0)
        return Observation("higher" if guess < target else "lower")


def make_guess_env() -> GuessEnv:
    return GuessEnv()


def calc(expression: str, env: CalculatorEnvironment | None = None) -> Observation:
    return (env or CalculatorEnvironment()).step(ToolCall("calculator", {"expression": expression}),
                                                 CTX)


def turn(name: str, **arguments: object) -> str:
    return "thinking... " + render_tool_call(ToolCall(name, dict(arguments)))


# --------------------------------------------------------------------------- calculator
@pytest.mark.parametrize("expression, expected", [
    ("123456789*987654321", str(123456789 * 987654321)),
    ("1/3+1/3", "2/3"),
    ("1/3*3", "1"),
    ("0.1+0.2", "0.3"),
    ("-(2-5)*1.5", "4.5"),
    ("2/-4", "-0.5"),
    ("-1/3", "-1/3"),
    (" 7 - 10 ", "-3"),
    ("+5", "5"),
    ("99999999999999999999*99999999999999999999", str(99999999999999999999**2)),
])
def test_calculator_is_exact(expression, expected):
    assert calc(expression) == Observation(expected)


@pytest.mark.parametrize("expression, says", [
    ("9**9**9", "Pow"),  # refused before any power is taken: this returns at once
    ("2**10", "Pow"),
    ("7//2", "FloorDiv"),
    ("1e999999999", "unsupported number"),  # Fraction would build 10**999999999
    ("0x10", "unsupported number"),
    ("1_000", "unsupported number"),
    ("2j", "unsupported syntax"),
    ("True", "unsupported syntax"),
    ("__import__('os').system('true')", "unsupported syntax"),
    ("x+1", "unsupported syntax"),
    ("[1]", "unsupported syntax"),
    ("1;2", "not an arithmetic expression"),
    ("1+", "not an arithmetic expression"),
    ("(" * 150 + "1" + ")" * 150, "over 256 characters"),
    ("", "empty expression"),
    ("1/0", "division by zero"),
    ("1/(2-2)", "division by zero"),
    ("0/0", "division by zero"),
])
def test_calculator_refuses(expression, says):
    obs = calc(expression)
    assert obs.error == "tool_error" and says in obs.text, obs


def test_calculator_bounds_every_intermediate_number():
    wide = CalculatorEnvironment(max_chars=10_000, max_bits=64)
    assert calc("99999999*99999999", wide) == Observation(str(99999999**2))
    obs = calc("99999999*99999999*99999999", wide)
    assert obs.error == "tool_error" and "too large" in obs.text


@pytest.mark.parametrize("arguments", [{}, {"expression": 12}, {"expression": "1", "x": "2"}])
def test_calculator_bad_arguments(arguments):
    obs = CalculatorEnvironment().step(ToolCall("calculator", arguments), CTX)
    assert obs.error == "bad_call" and "expression" in obs.text


@pytest.mark.parametrize("value, text", [(Fraction(5535), "5535"), (Fraction(-1, 8), "-0.125"),
                                         (Fraction(1, 3), "1/3"), (Fraction(7, 20), "0.35"),
                                         (Fraction(-3, 2), "-1.5"), (Fraction(1, 1024), "0.0009765625")])
def test_format_number(value, text):
    assert format_number(value) == text
    assert Fraction(text) == value


# --------------------------------------------------------------------------- python
@dataclass(frozen=True)
class FakeResult:
    """The shape of workers.agent.sandbox.SandboxResult."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = 0
    error: str | None = None
    wall_s: float = 0.01


class FakeRunner:
    def __init__(self, result: FakeResult) -> None:
        self.result = result
        self.calls: list[tuple] = []

    def __call__(self, *args: object) -> FakeResult:
        self.calls.append(args)
        return self.result


def run_python(result: FakeResult, limits: object = None) -> tuple[Observation, FakeRunner]:
    runner = FakeRunner(result)
    env = PythonEnvironment(runner=runner, limits=limits)
    return env.step(ToolCall("python", {"code": "print(6*7)"}), CTX), runner


def test_python_returns_stdout_and_passes_the_code():
    obs, runner = run_python(FakeResult(stdout="42\n"))
    assert obs == Observation("42")
    assert runner.calls == [("print(6*7)",)]


def test_python_passes_its_limits():
    limits = object()  # the runner owns the limits type; the environment only passes it on
    _, runner = run_python(FakeResult(stdout="42\n"), limits=limits)
    assert runner.calls == [("print(6*7)", limits)]


def test_python_failed_program_is_an_answer_not_an_error():
    obs, _ = run_python(FakeResult(stdout="a\n", stderr="Traceback...\nZeroDivisionError\n",
                                   exit_code=1))
    assert obs == Observation("a\nstderr:\nTraceback...\nZeroDivisionError\nexit code 1")


def test_python_no_output():
    assert run_python(FakeResult())[0] == Observation("(no output)")


@pytest.mark.parametrize("sandbox_error, error", [
    ("timeout", "timeout"), ("memory", "memory"), ("output_limit", "output_limit"),
    ("crashed", "crashed"), ("killed", "crashed"), ("unavailable", "tool_error")])
def test_python_sandbox_failures(sandbox_error, error):
    obs, _ = run_python(FakeResult(stdout="partial", exit_code=None, error=sandbox_error))
    assert obs.error == error
    assert obs.text.startswith("partial\nerror: ")


def test_python_runs_in_the_sandbox_by_default():
    from workers.agent import sandbox

    assert PythonEnvironment()._runner() is sandbox.run_python


@pytest.mark.parametrize("arguments", [{}, {"code": 1}, {"code": "1", "stdin": ""}])
def test_python_bad_arguments_do_not_reach_the_sandbox(arguments):
    runner = FakeRunner(FakeResult())
    obs = PythonEnvironment(runner=runner).step(ToolCall("python", arguments), CTX)
    assert obs.error == "bad_call" and runner.calls == []


# --------------------------------------------------------------------------- execute
def test_execute_answers_a_call():
    assert execute(CalculatorEnvironment(), turn("calculator", expression="6*7"), CTX) == \
        Observation("42")
    assert execute(CalculatorEnvironment(), "12*34+5=(=12*34=)", CTX, plain=True) == \
        Observation("408")


def test_execute_without_a_call_ends_the_trajectory():
    assert execute(CalculatorEnvironment(), "The answer is 4.", CTX) == Observation("", done=True)


def test_execute_malformed_call_is_bad_call():
    obs = execute(CalculatorEnvironment(), '<tool_call>{"name": "calculator"', CTX)
    assert obs.error == "bad_call" and "unterminated" in obs.text


def test_execute_unknown_tool_names_the_tools():
    obs = execute(CalculatorEnvironment(), turn("python", code="1"), CTX)
    assert obs.error == "unknown_tool" and "'python'" in obs.text and "calculator" in obs.text


def test_user_environment_end_to_end():
    env = GuessEnv()
    assert execute(env, turn("guess", number=3), CTX) == Observation("higher")
    assert execute(env, turn("guess", number=4), CTX) == Observation("correct", done=True,
                                                                     reward=1.0)


class Hostile(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message for you")


class Misbehaving:
    def __init__(self, outcome: object) -> None:
        self.outcome = outcome

    def tools(self) -> tuple[str, ...]:
        return ("t",)

    def step(self, call: ToolCall, context: StepContext) -> Observation:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


@pytest.mark.parametrize("outcome, says", [
    (KeyError("number"), "KeyError: 'number'"),
    (ValueError("x" * 10_000 + "\nsecond line"), "ValueError: xxx"),
    (Hostile(), "Hostile: (unprintable)"),
    (ValueError("first line\nsecond line"), "ValueError: first line second line"),
    ("just a string", "the environment returned str, not an Observation"),
])
def test_execute_turns_a_failing_environment_into_tool_error(outcome, says):
    obs = execute(Misbehaving(outcome), turn("t"), CTX)
    assert obs.error == "tool_error" and obs.text.startswith(says)
    assert len(obs.text) < 300 and "\n" not in obs.text


def test_execute_cuts_long_observations():
    obs = execute(Misbehaving(Observation("y" * (MAX_OBSERVATION_CHARS * 3))), turn("t"), CTX)
    assert obs.text == "y" * MAX_OBSERVATION_CHARS + " [truncated]"


def test_observation_checks_its_fields():
    assert set(ERROR_KINDS) >= {"timeout", "bad_call", "unknown_tool", "tool_error"}
    with pytest.raises(ValueError, match="Observation.error"):
        Observation("x", "oops")
    with pytest.raises(ValueError, match="finite"):
        Observation("x", reward=float("nan"))
    with pytest.raises(TypeError, match="Observation.text"):
        Observation(None)


# --------------------------------------------------------------------------- loading
@pytest.mark.parametrize("spec, kind, tools", [
    ("calculator", CalculatorEnvironment, ("calculator",)),
    ("python", PythonEnvironment, ("python",)),
    (f"{__name__}:GuessEnv", GuessEnv, ("guess",)),
    (f"{__name__}:make_guess_env", GuessEnv, ("guess",)),
])
def test_load_environment(spec, kind, tools):
    env = load_environment(spec)
    assert type(env) is kind and isinstance(env, Environment) and env.tools() == tools


def write_module(tmp_path, monkeypatch, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_load_user_environment_from_a_file(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "user_envs_ok", (
        "from workers.agent.environments import Observation\n"
        "class Echo:\n"
        "    def tools(self):\n"
        "        return ('echo',)\n"
        "    def step(self, call, context):\n"
        "        return Observation(str(call.arguments.get('text', '')))\n"))
    env = load_environment("user_envs_ok:Echo")
    assert execute(env, turn("echo", text="hi"), CTX) == Observation("hi")


@pytest.mark.parametrize("spec, says", [
    ("calculater", "unknown environment 'calculater'; built-in: calculator, python"),
    ("mod:", "unknown environment"),
    ("no_such_module_xyz:Env", "cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
    ("user_envs_bad:Env", "cannot import module 'user_envs_bad': ZeroDivisionError"),
    (f"{__name__}:Nope", "has no attribute 'Nope'"),
    (f"{__name__}:CTX", "is not a class or factory"),
    (f"{__name__}:Hostile", "which lacks tools() and step(call, context)"),
    (f"{__name__}:Misbehaving", "raised when made with no arguments: TypeError"),
    (f"{__name__}:NoTools", "tools() must return a non-empty tuple of names"),
    (f"{__name__}:BrokenTools", "tools() raised RuntimeError: down"),
])
def test_load_environment_errors_name_the_key(spec, says, tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "user_envs_bad", "x = 1\n1 / 0\n")
    with pytest.raises(ValueError) as err:
        load_environment(spec)
    message = str(err.value)
    assert message.startswith("env.fn: ") and says in message and "\n" not in message, message


class NoTools(GuessEnv):
    def tools(self) -> tuple[str, ...]:
        return ()


class BrokenTools(GuessEnv):
    def tools(self) -> tuple[str, ...]:
        raise RuntimeError("down")
