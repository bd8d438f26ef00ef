"""Environments from a hub: an environment written for the ``verifiers`` library (PyPI
``verifiers``, the library of Prime Intellect's Environments Hub), unmodified, as a run's prompts,
the environment that answers its tool calls, and its reward.

``env.hub`` names it (docs/agents.md "Environments from a hub"):

* ``verifiers:ENV_ID``: ``vf.load_environment(ENV_ID)``, i.e. the installed module ``ENV_ID``
  (``-`` read as ``_``; an ``owner/`` prefix dropped) and its ``load_environment()``, called with
  no arguments;
* ``verifiers:module.path:attr``: ``attr`` of a module of yours, an environment or a callable that
  makes one with no arguments.

Three keys each take one part of it, so a run may mix them with its own:

* ``data.task: hub``: ``hub_problems``, every row of the environment's dataset (``get_dataset``)
  as a ``Problem``: its prompt messages rendered in the model's chat template with the
  environment's tool schemas (a tokenizer without a template: the messages' texts, joined by a
  blank line), and its ``answer``.
* ``env.fn: hub``: ``HubEnvironment``, an ``Environment`` (workers.agent.environments) serving the
  environment's tools. A step builds the conversation the environment reads (the row's prompt,
  then the call as an assistant message with ``tool_calls``) and awaits its ``env_response``; the
  tool messages it returns are the observation, and a response the environment marks final
  ends the trajectory. Like any user environment it runs in the child process of
  ``workers.agent.isolated`` (its spec: ``hub_spec``), killed past ``env.timeout_s``.
* ``reward.fn: hub``: ``HubReward``, a reward function ``(completion, answer, trajectory)``
  (workers.tasks.verifiers): the trajectory as the chat the rubric reads (an assistant message
  per model turn, its call as ``tool_calls``, a tool message per observation), scored by the
  environment's ``rubric.score_rollout``, the weighted sum of its reward functions. It runs in
  the reward child, under ``reward.timeout_s`` per sample.

Invariants: a step or a score is rebuilt from its arguments alone (a trajectory's turns may run
on different workers), so per-rollout state of a stateful environment does not carry from one
call to the next, and a step sees the prompt and the call it answers, not the earlier ones. The
dataset row of a step or a score (its prompt messages, ``info`` and ``task``) is the row with the
trajectory's answer (the reward role reads no prompt), among several the one whose last user
message the prompt holds. Only the environment is used: no model client, no hub server. The
verifiers package is imported on first use, so this module is light until then.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
from collections.abc import Sequence
from typing import Any

from workers.agent.environments import Observation, StepContext
from workers.agent.toolcall import (
    PLAIN_CALL_START,
    TOOL_CALL_START,
    ToolCall,
    parse_tool_call,
)
from workers.checked import ConfigValueError
from workers.settings import HUB_PREFIX
from workers.tasks.problem import Problem

KEY = "env.hub"
LIBRARY = "verifiers"


def _named(hub: str | None) -> str:
    if hub is None:
        raise ConfigValueError(KEY, "is required where data.task, env.fn or reward.fn is 'hub'")
    return hub


def hub_spec(hub: str | None) -> str:
    """The spec ``load_environment`` and ``resolve_reward`` read for ``env.hub``."""
    return HUB_PREFIX + _named(hub)


def hub_module(hub: str | None) -> tuple[str, str]:
    """(library, module) of ``env.hub``: what must be importable for it (nothing is imported)."""
    library, _, rest = _named(hub).partition(":")
    module, _, attr = rest.partition(":")
    return library, module if attr else module.replace("-", "_").rpartition("/")[2]


@functools.cache
def hub_environment(hub: str) -> Any:
    """The library's environment object ``env.hub`` names (one per process: a step, a score and
    the prompts share it). ConfigValueError naming ``env.hub`` when it cannot be had."""
    library, _, rest = hub.partition(":")
    if library != LIBRARY:
        raise ConfigValueError(KEY, f"{hub!r}: the hub library must be {LIBRARY!r}")
    try:
        import verifiers as vf
    except ImportError as exc:
        raise ConfigValueError(KEY, f"{hub}: the verifiers package is not installed ({exc})") \
            from None
    module_name, _, attr = rest.partition(":")
    try:
        if not attr:
            env = vf.load_environment(module_name)
        else:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
            env = obj if isinstance(obj, vf.Environment) else obj()
    except Exception as exc:  # the user's module or factory, or the library's loader
        raise ConfigValueError(KEY, f"{hub}: cannot load the environment: {type(exc).__name__}: "
                               f"{str(exc)[:300]}".replace("\n", " ")) from None
    if not isinstance(env, vf.Environment):
        raise ConfigValueError(KEY, f"{hub} made a {type(env).__name__}, not a verifiers "
                               "Environment (SingleTurnEnv, ToolEnv, MultiTurnEnv, ...)")
    return env


# ------------------------------------------------------------------ running the library's code
_LOOP: asyncio.AbstractEventLoop | None = None


def _wait(value: Any) -> Any:
    """``value``, awaited on this process's one event loop when it is awaitable (an
    environment may hold async clients bound to the loop they were made on)."""
    global _LOOP
    if not inspect.isawaitable(value):
        return value
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
    return _LOOP.run_until_complete(value)


def _text(content: Any) -> str:
    """A message content as text (a list of parts: its text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _tool_schemas(env: Any) -> list[dict[str, Any]]:
    """The environment's tools as OpenAI function schemas (none: [])."""
    tools = getattr(env, "oai_tools", None) or []
    return [dict(t) for t in tools if isinstance(t, dict)]


def _tool_names(env: Any) -> tuple[str, ...]:
    names = [t.get("function", {}).get("name") for t in _tool_schemas(env)]
    return tuple(dict.fromkeys(n for n in names if isinstance(n, str) and n))


class _Rows:
    """The environment's dataset, rows looked up by answer (see the module docstring)."""

    def __init__(self, env: Any) -> None:
        dataset = env.get_dataset()
        self.rows: list[dict[str, Any]] = [dict(r) for r in dataset]
        self.by_answer: dict[str, list[dict[str, Any]]] = {}
        for row in self.rows:
            self.by_answer.setdefault(answer_text(row.get("answer")), []).append(row)

    def find(self, answer: str, prompt: str = "") -> dict[str, Any]:
        rows = self.by_answer.get(answer, [])
        if prompt and len(rows) > 1:
            rows = [r for r in rows if _last_user(r.get("prompt")) in prompt] or rows
        if rows:
            return rows[0]
        return {"prompt": [{"role": "user", "content": prompt}], "answer": answer}


def _last_user(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [_text(m.get("content")) for m in prompt or () if m.get("role") == "user"]
    return users[-1] if users else ""


def answer_text(value: Any) -> str:
    """A row's answer as text (a number or a structure: its JSON, as prompt files read it)."""
    if value is None or isinstance(value, str):
        return value or ""
    return json.dumps(value)


@functools.cache
def _rows(hub: str) -> _Rows:
    return _Rows(hub_environment(hub))


def _state(env: Any, row: dict[str, Any], completion: Any) -> dict[str, Any]:
    """A rollout state as the library's environments and rubrics read it."""
    prompt = row.get("prompt")
    info = row.get("info") or {}
    if isinstance(info, str):  # the library's datasets may keep info as JSON text
        try:
            info = json.loads(info)
        except ValueError:
            info = {}
    fields = {"prompt": prompt, "completion": completion, "answer": answer_text(row.get("answer")),
              "task": row.get("task", "default"), "info": info,
              "example_id": row.get("example_id", 0), "input": row, "responses": [],
              "trajectory": [], "turn": 0, "timing": {}, "is_completed": False,
              "oai_tools": _tool_schemas(env)}
    try:
        from verifiers.types import State

        return State(fields)
    except (ImportError, TypeError):
        return fields


# ------------------------------------------------------------------ (a) prompts and answers
def hub_problems(hub: str | None, tokenizer: Any = None) -> list[Problem]:
    """Every row of ``env.hub``'s dataset as a ``Problem`` (the module docstring); ValueError
    when it has none."""
    env, rows = hub_environment(_named(hub)), _rows(_named(hub)).rows
    if not rows:
        raise ConfigValueError(KEY, f"{hub}: the environment's dataset has no rows")
    tools = _tool_schemas(env) or None
    return [Problem(render_prompt(r.get("prompt"), tokenizer, tools), answer_text(r.get("answer")))
            for r in rows]


def render_prompt(prompt: Any, tokenizer: Any = None,
                  tools: list[dict[str, Any]] | None = None) -> str:
    """A row's prompt as the model reads it: messages in the tokenizer's chat template (with the
    tool schemas, ending at the assistant's turn), or their texts joined by a blank line."""
    if isinstance(prompt, str):
        return prompt
    messages = [{"role": m.get("role", "user"), "content": _text(m.get("content"))}
                for m in prompt or ()]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=True))
    return "\n\n".join(m["content"] for m in messages if m["content"])


# ------------------------------------------------------------------ (b) the tool environment
def load_hub_environment(hub: str) -> HubEnvironment:
    """``load_environment``'s part for a hub spec (``env.fn: hub``)."""
    return HubEnvironment(hub)


class HubEnvironment:
    """The hub environment's tools as an ``Environment`` (see the module docstring)."""

    def __init__(self, hub: str) -> None:
        self.hub = hub
        self.env = hub_environment(hub)
        self._tools = _tool_names(self.env)
        if not self._tools or not hasattr(self.env, "env_response"):
            raise ConfigValueError("env.fn", f"'hub': {hub} serves no tools (a ToolEnv or "
                                   "another MultiTurnEnv with tools answers calls); use it "
                                   "with data.task and reward.fn 'hub' only")

    def tools(self) -> tuple[str, ...]:
        return self._tools

    def step(self, call: ToolCall, context: StepContext) -> Observation:
        row = _rows(self.hub).find(context.answer, context.prompt)
        prompt = row.get("prompt")
        if not isinstance(prompt, list):
            prompt = [{"role": "user", "content": _text(prompt) or context.prompt}]
        asked = _call_message(call, context.turn)
        state = _state(self.env, row, [asked])
        out = _wait(self.env.env_response([*prompt, asked], state))
        if isinstance(out, tuple):  # earlier releases return (messages, state)
            out, state = out
        messages = [{"role": "tool", "content": out}] if isinstance(out, str) else list(out)
        text = "\n".join(_text(m.get("content")) for m in messages
                         if m.get("role") in ("tool", "user"))
        done = bool(state.get("final_env_response") is not None or state.get("is_completed"))
        return Observation(text, done=done)


def _call_message(call: ToolCall, turn: int, content: str = "") -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{turn}", "type": "function",
         "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}]}


# ------------------------------------------------------------------ (c) the reward
class HubReward:
    """``reward.fn: hub``: the environment's rubric as a reward function. The environment is
    loaded at the first score (a process that only reads the signature never loads it)."""

    def __init__(self, hub: str) -> None:
        self.hub = hub

    def __repr__(self) -> str:
        return f"HubReward({self.hub!r})"

    def prepare(self) -> None:
        """Load the environment and its dataset now (the reward child calls this before its
        first sample, outside the per-sample timeout)."""
        _rows(self.hub)

    def __call__(self, completion: str, answer: str, trajectory: Any) -> float:
        env = hub_environment(self.hub)
        row = _rows(self.hub).find(answer)
        turns = tuple(getattr(trajectory, "turns", ()) or (completion,))
        observations = tuple(getattr(trajectory, "observations", ()))
        if getattr(env, "message_type", "chat") == "completion":
            chat: Any = completion
        else:
            chat = trajectory_messages(turns, observations)
        state = _state(env, row, chat)
        rubric = env.rubric
        params = inspect.signature(rubric.score_rollout).parameters
        if len(params) == 1:  # score_rollout(state): the reward lands in the state
            _wait(rubric.score_rollout(state))
            return float(state["reward"])
        scored = _wait(rubric.score_rollout(state["prompt"], chat, state["answer"], state,
                                            task=state["task"], info=state["info"]))
        return float(scored.reward)


def trajectory_messages(turns: Sequence[str], observations: Sequence[str]) -> list[dict]:
    """The model's turns and the observations as chat messages: a turn that called a tool is
    an assistant message with the call as ``tool_calls`` (its text before the call as content),
    followed by a tool message with the observation appended after it, if any."""
    out: list[dict[str, Any]] = []
    left = list(observations)
    for t, turn in enumerate(turns):
        call = parse_tool_call(turn)
        plain = isinstance(call, ToolCall) is False and PLAIN_CALL_START in turn
        if plain:
            call = parse_tool_call(turn, plain=True)
        if not isinstance(call, ToolCall):
            out.append({"role": "assistant", "content": turn})
            continue
        before = turn.partition(PLAIN_CALL_START if plain else TOOL_CALL_START)[0]
        out.append(_call_message(call, t, before))
        if left:
            out.append({"role": "tool", "content": left.pop(0), "tool_call_id": f"call_{t}"})
    return out
