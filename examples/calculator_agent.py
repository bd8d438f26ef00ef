"""A calculator agent written with the OpenAI Python SDK, as a user would write it.

StreamFlow calls ``run`` once per prompt (``agent.fn: examples.calculator_agent:run``) with the
gateway's ``base_url`` and this episode's ``api_key``; every call the agent makes is a turn of the
trajectory the run trains on. Nothing here knows about StreamFlow.
"""

from __future__ import annotations

import ast
import json
import operator

from openai import BadRequestError, OpenAI

CALCULATOR = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression of integers, + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("unsupported expression")

    try:
        return str(value(ast.parse(expression[:64], mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "error"


def run(base_url: str, api_key: str, prompt: str, answer: str) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key)
    messages: list[dict] = [{"role": "user", "content": prompt}]
    final = ""
    for _ in range(8):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages,
                                                   tools=[CALCULATOR])
        except BadRequestError:  # out of turns or tokens: the episode ends here
            break
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        final = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments).get("expression", "")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(str(expression))})
    return 1.0 if final.strip() == answer else 0.0
