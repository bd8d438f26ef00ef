"""Environments from a hub: a taskset written for the ``verifiers`` library (PyPI ``verifiers``,
the library of Prime Intellect's Environments Hub; its ``verifiers.v1`` API), unmodified, as a
run's prompts, the environment that answers its tool calls, and its reward.

``env.hub`` names it (docs/agents.md "Environments from a hub"):

* ``verifiers:TASKSET_ID``: the installed taskset package, loaded as the library loads it
  (``verifiers.v1.utils.loaders.load_taskset``: the module ``TASKSET_ID``, ``-`` read as ``_``, an
  ``owner/`` prefix dropped, exporting its ``vf.Taskset`` subclass in ``__all__``; its config's
  defaults);
* ``verifiers:module.path:attr``: ``attr`` of a module of yours, a ``vf.Taskset``, a subclass of
  one (made with its config's defaults), or a callable that makes one with no arguments.

Three keys each take one part of it, so a run may mix them with its own:

* ``data.task: hub``: ``hub_problems``, every task of the taskset as a ``Problem``: its prompt
  (``TaskData.system_prompt`` and ``prompt``) rendered in the model's chat template with the
  tools' schemas (a tokenizer without a template: the messages' texts, joined by a blank line),
  and its ``answer`` field (a task without one: its ``key``).
* ``env.fn: hub``: ``HubEnvironment``, an ``Environment`` (workers.agent.environments) serving the
  tools of the task's and the taskset's ``vf.Toolset``s. Each toolset is served as the library
  serves it, by an MCP server (``mcp``'s ``MCPServer``, the toolset's ``register``), here in this
  process with no transport; a tool is named as harnesses name it (``{TOOL_PREFIX}_{tool}``, the
  bare name with ``TOOL_PREFIX = None``). A call is that server's ``call_tool``: its text is the
  observation, a tool that raised a "tool_error" one. Like any user environment it runs in the
  child process of ``workers.agent.isolated`` (its spec: ``hub_spec``), killed past
  ``env.timeout_s``.
* ``reward.fn: hub``: ``HubReward``, a reward function ``(completion, answer, trajectory)``
  (workers.tasks.verifiers): the trajectory as a ``vf.Trace`` (the prompt, an assistant message
  per model turn with its call as ``tool_calls``, a tool message per observation), scored by the
  task's own ``Task.score`` with no runtime (rewards that need one are skipped, as the library
  skips them offline): the weighted sum of its ``@vf.reward``s. It runs in the reward child,
  under ``reward.timeout_s`` per sample, the taskset loaded before the first one (``prepare``).

Invariants: a step or a score is rebuilt from its arguments alone (a trajectory's turns may run
on different workers): a toolset's ``setup`` runs once per process and ``setup_task`` before each
call, and no per-rollout state carries between calls. A trajectory's task is the one with its
answer (the reward role reads no prompt); among several, a step takes the one whose prompt text
the prompt holds, a score the first. Only the taskset is used: no harness, runtime, model client
or hub server. The library is imported on first use, so this module is light until then.
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
from workers.agent.toolcall import PLAIN_CALL_START, TOOL_CALL_START, ToolCall, parse_tool_call
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


def hub_modules(hub: str | None) -> tuple[str, tuple[str, ...]]:
    """The library of ``env.hub`` and the modules one of which must be importable for it (a
    taskset id: its own package, or the library's built-in of that name). Nothing is imported."""
    library, _, rest = _named(hub).partition(":")
    module, _, attr = rest.partition(":")
    if attr:
        return library, (module,)
    module = module.rpartition("/")[2].replace("-", "_").lower()
    return library, (module, f"{library}.v1.tasksets.{module}")


# ------------------------------------------------------------------ loading (one per process)
_LOOP: asyncio.AbstractEventLoop | None = None


def _wait(value: Any) -> Any:
    """``value``, awaited on this process's one event loop when it is awaitable (a toolset may
    hold async clients bound to the loop it was set up on)."""
    global _LOOP
    if not inspect.isawaitable(value):
        return value
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
    return _LOOP.run_until_complete(value)


@functools.cache
def hub_taskset(hub: str) -> Any:
    """The library's taskset ``env.hub`` names; ConfigValueError naming ``env.hub`` when it
    cannot be had."""
    library, _, rest = hub.partition(":")
    if library != LIBRARY:
        raise ConfigValueError(KEY, f"{hub!r}: the hub library must be {LIBRARY!r}")
    try:
        import verifiers.v1 as vf
        from verifiers.v1.utils.loaders import load_taskset, taskset_config_type
    except ImportError as exc:
        raise ConfigValueError(KEY, f"{hub}: the verifiers package is not installed ({exc})") \
            from None
    module_name, _, attr = rest.partition(":")
    try:
        if not attr:
            taskset = load_taskset(taskset_config_type(module_name).model_validate(
                {"id": module_name}))
        else:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
            if isinstance(obj, type) and issubclass(obj, vf.Taskset):
                obj = obj(_config_type(obj)())
            taskset = obj() if callable(obj) and not isinstance(obj, vf.Taskset) else obj
    except Exception as exc:  # the user's module or factory, or the library's loader
        raise ConfigValueError(KEY, f"{hub}: cannot load the taskset: {type(exc).__name__}: "
                               f"{str(exc)[:300]}".replace("\n", " ")) from None
    if not isinstance(taskset, vf.Taskset):
        raise ConfigValueError(KEY, f"{hub} made a {type(taskset).__name__}, not a verifiers "
                               "Taskset (verifiers.v1)")
    if not taskset.bounded:
        raise ConfigValueError(KEY, f"{hub}: the taskset is infinite; bound it in its config")
    return taskset


def _config_type(cls: type) -> type:
    from verifiers.v1 import Taskset, TasksetConfig
    from verifiers.v1.utils.generic import concrete_type

    return concrete_type(cls, TasksetConfig, origin=Taskset) or TasksetConfig


class _Tasks:
    """The taskset's tasks, looked up by answer (see the module docstring)."""

    def __init__(self, taskset: Any) -> None:
        self.tasks: list[Any] = list(taskset)
        self.by_answer: dict[str, list[Any]] = {}
        for task in self.tasks:
            self.by_answer.setdefault(task_answer(task), []).append(task)

    def find(self, answer: str, prompt: str = "") -> Any:
        tasks = self.by_answer.get(answer, [])
        if prompt and len(tasks) > 1:
            tasks = [t for t in tasks if t.data.prompt_text in prompt] or tasks
        if not tasks:
            raise ValueError(f"no task of the taskset has the answer {answer[:80]!r}")
        return tasks[0]


@functools.cache
def _tasks(hub: str) -> _Tasks:
    return _Tasks(hub_taskset(hub))


def task_answer(task: Any) -> str:
    """A task's ``answer`` field as text (a number or a structure: its JSON, as prompt files
    read it); a task without one: its ``key``."""
    value = getattr(task.data, "answer", None)
    if value is None:
        return str(task.key)
    return value if isinstance(value, str) else json.dumps(value)


def _prompt_messages(task: Any) -> list[Any]:
    """The task's opening messages, as the library's rollout makes them."""
    from verifiers.v1.types import SystemMessage, UserMessage

    data = task.data
    prompt = data.prompt
    messages = [UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt or [])
    if data.system_prompt is not None:
        messages.insert(0, SystemMessage(content=data.system_prompt))
    return messages


# ------------------------------------------------------------------ (b) the tools
class _Tools:
    """Every toolset of the taskset and its task type, each behind its own in-process MCP
    server: name -> (server, toolset, the tool's own name, task-scoped)."""

    def __init__(self, hub: str) -> None:
        from mcp.server.mcpserver import MCPServer

        taskset, tasks = hub_taskset(hub), _tasks(hub).tasks
        scoped = [(t, True) for t in type(tasks[0]).toolsets(tasks[0].config)] if tasks else []
        scoped += [(t, False) for t in type(taskset).toolsets(taskset.config)]
        self.dispatch: dict[str, tuple[Any, Any, str, bool]] = {}
        self.schemas: list[dict[str, Any]] = []
        for toolset, task_scoped in scoped:
            server = MCPServer(toolset.server_name or type(toolset).__name__)
            toolset.register(server)
            _wait(toolset.setup())
            for tool in _wait(server.list_tools()):
                name = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
                if name in self.dispatch:  # (the library refuses this too)
                    raise ConfigValueError(KEY, f"{hub}: two toolsets serve a tool {name!r}; "
                                           "give one a distinct TOOL_PREFIX")
                self.dispatch[name] = (server, toolset, tool.name, task_scoped)
                self.schemas.append({"type": "function", "function": {
                    "name": name, "description": tool.description or "",
                    "parameters": tool.input_schema}})


@functools.cache
def _tools(hub: str) -> _Tools:
    return _Tools(hub)


def load_hub_environment(hub: str) -> HubEnvironment:
    """``load_environment``'s part for a hub spec (``env.fn: hub``)."""
    return HubEnvironment(hub)


class HubEnvironment:
    """The taskset's tools as an ``Environment`` (see the module docstring)."""

    def __init__(self, hub: str) -> None:
        self.hub, self._served = hub, _tools(hub)
        if not self._served.dispatch:
            raise ConfigValueError("env.fn", f"'hub': {hub} serves no tools (no vf.Toolset on "
                                   "its task or taskset); use it with data.task and reward.fn "
                                   "'hub' only")

    def tools(self) -> tuple[str, ...]:
        return tuple(self._served.dispatch)

    def step(self, call: ToolCall, context: StepContext) -> Observation:
        server, toolset, name, task_scoped = self._served.dispatch[call.name]
        if task_scoped:
            _wait(toolset.setup_task(_tasks(self.hub).find(context.answer, context.prompt)))
        try:
            result = _wait(server.call_tool(name, call.arguments))
        except Exception as exc:  # ToolError: bad arguments; UnexpectedToolError: it raised
            cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
            return Observation(f"{exc}{cause}", "tool_error")
        text = "\n".join(str(getattr(b, "text", b)) for b in getattr(result, "content", []))
        return Observation(text, "tool_error" if getattr(result, "is_error", False) else None)


# ------------------------------------------------------------------ (a) prompts and answers
def hub_problems(hub: str | None, tokenizer: Any = None) -> list[Problem]:
    """Every task of ``env.hub``'s taskset as a ``Problem`` (the module docstring)."""
    tasks = _tasks(_named(hub)).tasks
    if not tasks:
        raise ConfigValueError(KEY, f"{hub}: the taskset has no tasks")
    # the tools' schemas go into a chat template (the toolsets are set up here only for them)
    chat = tokenizer is not None and getattr(tokenizer, "chat_template", None)
    schemas = (_tools(_named(hub)).schemas or None) if chat else None
    return [Problem(render_prompt(_prompt_messages(t), tokenizer, schemas), task_answer(t))
            for t in tasks]


def render_prompt(messages: Sequence[Any], tokenizer: Any = None,
                  tools: list[dict[str, Any]] | None = None) -> str:
    """Opening messages as the model reads them: in the tokenizer's chat template (with the
    tool schemas, ending at the assistant's turn), or their texts joined by a blank line."""
    from verifiers.v1.types import content_text

    plain = [{"role": m.role, "content": content_text(m.content)} for m in messages]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(plain, tools=tools, tokenize=False,
                                                 add_generation_prompt=True))
    return "\n\n".join(m["content"] for m in plain if m["content"])


# ------------------------------------------------------------------ (c) the reward
class HubReward:
    """``reward.fn: hub``: the task's rewards as a reward function. The taskset is loaded by
    ``prepare`` or at the first score (a process that only reads the signature never loads
    it)."""

    def __init__(self, hub: str) -> None:
        self.hub = hub
        self.reward_spec = HUB_PREFIX + hub  # what the reward child resolves again

    def __repr__(self) -> str:
        return f"HubReward({self.hub!r})"

    def prepare(self) -> None:
        """Load the library and the taskset now (the reward child calls this before its first
        sample, outside the per-sample timeout)."""
        _tasks(self.hub)

    def __call__(self, completion: str, answer: str, trajectory: Any) -> float:
        import verifiers.v1 as vf
        from verifiers.v1.configs.agent import AgentConfig
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, TraceTask

        task = _tasks(self.hub).find(answer)
        turns = tuple(getattr(trajectory, "turns", ()) or (completion,))
        chat = trajectory_messages(turns, tuple(getattr(trajectory, "observations", ())))
        prompt = _prompt_messages(task)
        nodes = [MessageNode(message=m, parent=i - 1 if i else None,
                             sampled=m.role == "assistant" and i >= len(prompt))
                 for i, m in enumerate([*prompt, *chat])]
        trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                        hash=task.hash),
                         agent=AgentInfo(config=AgentConfig()), nodes=nodes,
                         is_completed=True, ok=True)
        _wait(task.score(trace))
        return float(trace.reward)


def trajectory_messages(turns: Sequence[str], observations: Sequence[str]) -> list[Any]:
    """The model's turns and the observations as the library's messages: a turn that called a
    tool is an assistant message with the call as ``tool_calls`` (its text before the call as
    content), followed by a tool message with the observation appended after it, if any."""
    from verifiers.v1.types import AssistantMessage, ToolMessage
    from verifiers.v1.types import ToolCall as Call

    out: list[Any] = []
    left = list(observations)
    for t, turn in enumerate(turns):
        plain = not isinstance(parse_tool_call(turn), ToolCall) and PLAIN_CALL_START in turn
        call = parse_tool_call(turn, plain=plain)
        if not isinstance(call, ToolCall):
            out.append(AssistantMessage(content=turn))
            continue
        before = turn.partition(PLAIN_CALL_START if plain else TOOL_CALL_START)[0]
        out.append(AssistantMessage(content=before, tool_calls=[
            Call(id=f"call_{t}", name=call.name, arguments=json.dumps(call.arguments))]))
        if left:
            out.append(ToolMessage(tool_call_id=f"call_{t}", content=left.pop(0)))
    return out
