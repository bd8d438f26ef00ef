"""MCP tools: an ``Environment`` whose tools are a Model Context Protocol server's (``env.fn:
"mcp"``), through the official ``mcp`` SDK (``ClientSession`` over ``stdio_client``, or
``streamable_http_client`` for a server that already runs).

``McpEnvironment(command=argv)`` starts the server as a subprocess speaking MCP over its stdin
and stdout, ONCE per environment (one per environment worker), lists its tools and keeps the
session open: ``tools()`` are their names, ``tool_schemas()`` their descriptions and JSON input
schemas in the ``{"type": "function", "function": {...}}`` form chat templates render
(``workers.tasks.word.chat_prompt_text(..., tools=...)``). ``step`` answers a parsed call with
``call_tool``: the result's text content is the observation's text; a result flagged
``isError`` or an MCP error reply is a "tool_error" observation, arguments that break the tool's
input schema a "bad_call" one (checked here, before the server sees them), no answer within
``timeout_s`` a "timeout" one (the server, which may be stuck, is stopped), a server that died
a "crashed" one. A server found dead before a call (killed, crashed, out of memory) is started
again for that call; the tool list stays the one read at the start (the model's prompt named
those tools). ``McpEnvironment(url=...)`` talks to a server someone else runs (streamable
HTTP): nothing is started or stopped, a lost connection is opened again on the next call.

The SDK is async: every session of this environment lives on one private event-loop thread, and
a caller waits for each request at most its bound (``timeout_s`` per call, the child start bound
for a start). The stdio server runs in a session of its own (the SDK's ``start_new_session``),
so its PID is its process group; the SDK does not hand the process out, so the PID is the child
that appeared with the transport and leads its own session. ``close`` closes its stdin (a server
exits on end of input), then kills the group by that PID; a server replaced (dead, stuck) is
killed by it at once: nothing it started outlives the environment. The server gets the SDK's minimal environment variables (HOME, PATH, ...) plus this
process's ``PYTHONPATH``, so ``python -m package.server`` finds what the worker finds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import jsonschema
import psutil
from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import (
    CONNECTION_CLOSED,
    CallToolResult,
    PaginatedRequestParams,
    TextContent,
    Tool,
)

from workers.agent.environments import Observation, StepContext
from workers.agent.toolcall import MAX_NAME_CHARS, ToolCall
from workers.checked import ConfigValueError
from workers.runtime.child import START_TIMEOUT_S

log = logging.getLogger(__name__)

STOP_S = 5.0  # a server given end of input this long to exit before its group is killed
_MAX_PAGES = 100  # of a tools/list reply: a server that pages for ever is refused
_MESSAGE_CHARS = 200  # of an MCP error shown to the model


@dataclass(frozen=True)
class McpTool:
    """One tool the server serves, as it listed it."""

    name: str
    description: str
    input_schema: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        """The function-tool form chat templates (``apply_chat_template(tools=...)``) render."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.input_schema}}


@dataclass
class _Connection:
    session: ClientSession
    stop: asyncio.Event  # set on the loop: the session and its transport wind down
    task: concurrent.futures.Future[None]  # the coroutine that holds them open
    server: psutil.Process | None  # the stdio server (None: HTTP, or not found)


class McpEnvironment:
    """The tools of one MCP server: ``command`` (stdio, started here) or ``url`` (streamable
    HTTP), exactly one; ``timeout_s`` bounds each call (see the module docstring)."""

    def __init__(self, *, command: Sequence[str] = (), url: str | None = None,
                 timeout_s: float, start_s: float = START_TIMEOUT_S) -> None:
        if bool(command) == (url is not None):
            raise ValueError("McpEnvironment takes a command or a url, exactly one")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.command, self.url = tuple(command), url
        self.timeout_s, self.start_s = float(timeout_s), float(start_s)
        self.key = "env.mcp_command" if command else "env.mcp_url"  # what a start failure names
        self.restarts = 0  # servers started again after one was found dead, stuck or lost
        self._lock = threading.Lock()  # one request at a time; close waits for it
        self._closed = False
        self._conn: _Connection | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-client",
                                        daemon=True)
        self._thread.start()
        try:
            listed = self._connect()
        except Exception as exc:
            self.close()
            raise ConfigValueError(self.key, f"the MCP server did not start: {_describe(exc)}") \
                from None
        self._tools = _usable(listed)
        if not self._tools:
            self.close()
            raise ConfigValueError(self.key, "the MCP server serves no tool a model can call "
                                   f"(names of 1-{MAX_NAME_CHARS} characters)")
        self._validators = {t.name: _validator(t.input_schema) for t in self._tools}

    # ----------------------------------------------------------------- the Environment protocol
    def tools(self) -> tuple[str, ...]:
        return tuple(t.name for t in self._tools)

    def tool_schemas(self) -> tuple[dict[str, Any], ...]:
        """Each tool's name, description and input schema for a chat template's ``tools``."""
        return tuple(t.schema() for t in self._tools)

    @property
    def pid(self) -> int | None:
        """The running stdio server's PID (None: HTTP, or no server up)."""
        conn = self._conn
        return conn.server.pid if conn is not None and conn.server is not None else None

    def step(self, call: ToolCall, context: StepContext) -> Observation:
        error = _schema_error(self._validators.get(call.name), call.arguments)
        if error is not None:
            return Observation(f"bad arguments for {call.name}: {error}", "bad_call")
        with self._lock:
            if self._closed:
                return Observation("the MCP server is closed", "crashed")
            if not self._alive():
                self._drop(graceful=False)
                try:
                    self._connect()
                except Exception as exc:
                    return Observation(f"the MCP server could not be started again: "
                                       f"{_describe(exc)}", "crashed")
                self.restarts += 1
            conn = self._conn
            assert conn is not None
            future = asyncio.run_coroutine_threadsafe(
                conn.session.call_tool(call.name, call.arguments), self._loop)
            try:
                result = future.result(self.timeout_s)
            except TimeoutError:
                future.cancel()
                self._drop(graceful=False)  # a server that did not answer may be stuck
                return Observation(f"the MCP server did not answer within {self.timeout_s:g}s",
                                   "timeout")
            except MCPError as exc:  # the server's error reply; or its connection is gone
                if exc.code != CONNECTION_CLOSED and self._alive():
                    return Observation(f"MCP error: {exc.message[:_MESSAGE_CHARS]}",
                                       "tool_error")
                self._drop(graceful=False)
                return Observation("the MCP server crashed", "crashed")
            except RuntimeError as exc:  # the SDK refused the reply (e.g. its output schema)
                return Observation(_describe(exc), "tool_error")
            except Exception as exc:  # the transport failed: a new connection for the next call
                self._drop(graceful=False)
                return Observation(f"the MCP server crashed ({_describe(exc)})", "crashed")
        return result_observation(result)

    def close(self) -> None:
        """Stop the server (by its PID, after its end of input) and the event-loop thread;
        idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop(graceful=True)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STOP_S)
            if not self._thread.is_alive():
                self._loop.close()

    # ----------------------------------------------------------------- the connection
    def _connect(self) -> list[Tool]:
        """Open a session (starting the stdio server) and list its tools, within ``start_s``."""
        ready: concurrent.futures.Future[tuple[ClientSession, list[Tool]]] = \
            concurrent.futures.Future()
        found: list[psutil.Process] = []
        stop = asyncio.Event()  # (bound to the loop at its first wait, which is on the loop)
        task = asyncio.run_coroutine_threadsafe(self._serve(ready, stop, found), self._loop)
        try:
            session, listed = ready.result(self.start_s)
        except BaseException as exc:
            self._end(stop, task, found[0] if found else None, graceful=False)
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"no answer within {self.start_s:g}s") from None
            raise
        self._conn = _Connection(session, stop, task, found[0] if found else None)
        return listed

    async def _serve(self, ready: concurrent.futures.Future[Any], stop: asyncio.Event,
                     found: list[psutil.Process]) -> None:
        """Hold one session open until ``stop`` (on the loop thread)."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                if self.url is not None:
                    streams = await stack.enter_async_context(streamable_http_client(self.url))
                else:
                    before = {p.pid for p in psutil.Process().children()}
                    streams = await stack.enter_async_context(stdio_client(
                        self._parameters(), errlog=_errlog(stack)))
                    found.extend(_new_session_leaders(before))
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                listed = await _list_tools(session)
                ready.set_result((session, listed))
                await stop.wait()
        except BaseException as exc:  # a start that fails is the caller's error; later, a log
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else
                                    ConnectionError("the connection was cancelled"))
            elif isinstance(exc, Exception):
                log.warning("MCP connection ended: %s", _describe(exc))
            if not isinstance(exc, Exception):
                raise

    def _parameters(self) -> StdioServerParameters:
        extra = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
        return StdioServerParameters(command=self.command[0], args=list(self.command[1:]),
                                     env=extra)

    def _alive(self) -> bool:
        conn = self._conn
        if conn is None or conn.task.done():
            return False
        if conn.server is None:
            return True  # HTTP: a lost connection shows in the call itself
        try:
            return conn.server.is_running() and conn.server.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _drop(self, *, graceful: bool) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._end(conn.stop, conn.task, conn.server, graceful=graceful)

    def _end(self, stop: asyncio.Event, task: concurrent.futures.Future[None],
             server: psutil.Process | None, *, graceful: bool) -> None:
        """End a connection; a stdio server is killed by its PID (its group) unless
        ``graceful`` and it exits within ``STOP_S`` of its end of input."""
        if not graceful:
            _kill_group(server)
        self._loop.call_soon_threadsafe(stop.set)
        with contextlib.suppress(BaseException):
            task.result(STOP_S)
        _kill_group(server)
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                task.result(STOP_S)


def result_observation(result: CallToolResult) -> Observation:
    """The text blocks of a result, one per line (other blocks named by their type; a result
    with no content block its structured content as JSON); ``isError``: a "tool_error"."""
    parts = [b.text if isinstance(b, TextContent) else f"[{b.type} content]"
             for b in result.content]
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False, default=str))
    return Observation("\n".join(parts) or "(no output)",
                       "tool_error" if result.is_error else None)


async def _list_tools(session: ClientSession) -> list[Tool]:
    tools: list[Tool] = []
    cursor: str | None = None
    for _ in range(_MAX_PAGES):
        page = await session.list_tools(
            params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools
    raise ConnectionError(f"tools/list still paging after {_MAX_PAGES} pages")


def _usable(listed: list[Tool]) -> tuple[McpTool, ...]:
    """The tools a call can name (toolcall's name bound), first of each name, in listed order."""
    out: dict[str, McpTool] = {}
    for tool in listed:
        if not 1 <= len(tool.name) <= MAX_NAME_CHARS:
            log.warning("MCP tool %.80r skipped: a call names 1-%d characters", tool.name,
                        MAX_NAME_CHARS)
            continue
        out.setdefault(tool.name, McpTool(tool.name, tool.description or "",
                                          dict(tool.input_schema)))
    return tuple(out.values())


def _validator(schema: dict[str, Any]) -> Any:
    """A JSON-schema validator of a tool's arguments; None (the server checks) when the schema
    itself is not valid."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError:
        return None
    return cls(schema)


def _schema_error(validator: Any, arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` break the tool's input schema; None when they do not, or when the
    schema cannot be applied here (e.g. a ``$ref`` it cannot resolve: the server checks)."""
    if validator is None:
        return None
    try:
        error = next(iter(validator.iter_errors(arguments)), None)
    except Exception:
        return None
    return None if error is None else error.message[:_MESSAGE_CHARS]


def _new_session_leaders(before: set[int]) -> list[psutil.Process]:
    """Children started since ``before`` that lead a session of their own: the stdio server
    (the SDK starts it with ``start_new_session``; nothing else here does)."""
    out = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error, OSError):
            if child.pid not in before and os.getsid(child.pid) == child.pid:
                out.append(child)
    return out


def _kill_group(server: psutil.Process | None) -> None:
    """SIGKILL the server's process group (its PID: it leads its own session), if it runs."""
    if server is None:
        return
    with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
        if server.is_running():
            os.killpg(server.pid, signal.SIGKILL)


def _errlog(stack: contextlib.AsyncExitStack) -> TextIO:
    """Where the server's stderr goes: this process's (a worker's log), or nowhere when it has
    no file descriptor (the SDK hands it to the child as its stderr)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return stack.enter_context(open(os.devnull, "w"))  # noqa: SIM115 - closed by the stack


def _describe(exc: BaseException) -> str:
    """``Type: message`` of the first leaf of an exception group (anyio wraps errors in them)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {str(exc)[:_MESSAGE_CHARS]}".replace("\n", " ")
