"""A real MCP server for the tests of workers.agent.mcp_tools, written with the SDK's server
(``MCPServer``, FastMCP in mcp 1.x), run as ``python mcp_calculator.py [--log FILE] [--http PORT]``:
over stdio by default, or streamable HTTP on 127.0.0.1:PORT (path /mcp).

Tools: ``calculator(expression)``, the project's exact calculator (workers.agent.environments,
so the built-in character model's plain calls are answered as by the built-in tool; with
``--log`` each call appends a line to FILE: the server's PID and the
expression); ``fail(reason)`` raises; ``hang()`` never
answers."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

# the checkout's packages, whatever the environment (the SDK passes the server a minimal one)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from mcp.server.mcpserver import MCPServer  # noqa: E402
from mcp.server.mcpserver.exceptions import ToolError  # noqa: E402

from workers.agent.environments import CalculatorError, evaluate, format_number  # noqa: E402

server = MCPServer("calculator")
LOG: list[Path] = []


@server.tool()
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: numbers, + - * / and parentheses."""
    if LOG:
        with LOG[0].open("a") as log:
            log.write(f"{os.getpid()} {expression}".replace("\n", " ") + "\n")
    try:
        return format_number(evaluate(expression))
    except CalculatorError as err:
        raise ToolError(str(err)) from None


@server.tool()
def fail(reason: str) -> str:
    """Always raises."""
    raise RuntimeError(f"failed on purpose: {reason}")


@server.tool()
def hang() -> str:
    """Never answers."""
    threading.Event().wait()
    return "never"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", type=Path)
    parser.add_argument("--http", type=int)
    args = parser.parse_args()
    if args.log is not None:
        LOG.append(args.log)
    if args.http is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
