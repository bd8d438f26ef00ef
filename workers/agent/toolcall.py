"""The tool-call format: how a model asks for a tool, how the call is parsed, and how the answer
is written back into the conversation.

Two forms of the one format, chosen per run by ``plain`` (a run knows whether its model has a
chat template or is the embedded character-level model):

* **Hermes/Qwen** (``plain=False``), the form chat templates of Qwen2.5/Hermes models use::

      <tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>

  A JSON object with a non-empty string ``name`` and an object ``arguments`` (may be left out:
  ``{}``), no other keys, between the tags. The model's turn ENDS at ``TOOL_CALL_END``: engines
  stop generation there and keep the marker in the text (the parser needs it to tell a finished
  call from one cut off by the token budget). The observation goes back as
  ``<tool_response>\\n{text}\\n</tool_response>`` (the block Qwen2.5's template writes for a
  ``tool`` message) when the tokenizer has no chat template; with one, the observation is the
  template's own tool-message turn (``chat_wrapping``: for Qwen2.5 ``<|im_end|>\\n<|im_start|>user
  \\n<tool_response>\\n{text}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``), so the
  model's turn is closed and the model goes on as the assistant.
* **Plain** (``plain=True``) for the character model, whose default alphabet is only
  ``0123456789+-*=() `` (no letters, ``<``, ``{``, quotes, ``[`` or ``:``): ``(=123*45=)`` is
  ``calculator`` with ``expression`` = ``123*45``. It is the only tool the plain form names.
  The turn ends at ``PLAIN_CALL_END`` (``=)``); an expression never holds ``=``, so the first
  ``=)`` after ``(=`` closes the call. The observation is the answer with whitespace runs
  folded to one space and one space after it, so a solved tape reads
  ``12*34+5=(=12*34=)408 (=408+5=)413 413``.

Invariants: ``parse_tool_call`` never raises, whatever the text (it returns ``None`` when there
is no call, a ``ToolCall``, or a ``ToolCallError`` whose ``kind`` is one of ``ERROR_KINDS``);
only the first call of a turn counts (the engine stops at its end marker). The JSON body is
bounded by ``MAX_CALL_CHARS`` and its nesting by ``MAX_DEPTH`` before ``json`` reads it, so the
decoder's recursion stays far below Python's limit. ``render_tool_call`` only returns text that
parses back to the same call.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
PLAIN_CALL_START = "(="
PLAIN_CALL_END = "=)"
PLAIN_TOOL = "calculator"  # the one tool the plain form names
PLAIN_ARGUMENT = "expression"

MAX_CALL_CHARS = 16 * 1024  # characters between the tags
MAX_DEPTH = 32  # nesting of JSON objects/arrays, the outer object included
MAX_NAME_CHARS = 64
_ECHO_CHARS = 40  # how much of a bad value an error message quotes back to the model

ERROR_KINDS = ("unterminated", "bad_tags", "too_large", "too_deep", "bad_json", "duplicate_key",
               "not_object", "missing_name", "bad_name", "bad_arguments", "unexpected_key")


def marker_ids(tokenizer: Any, tool_format: str) -> tuple[int, ...]:
    """The token ids of the tool-call end marker of ``tool_format`` ("plain" | "hermes"): a
    model piece that holds it ends there (``workers.agent.pieces.Rules.close``)."""
    text = PLAIN_CALL_END if tool_format == "plain" else TOOL_CALL_END
    ids = tuple(int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"the tokenizer encodes the tool-call end marker {text!r} as nothing")
    return ids


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: the tool's name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A malformed call; ``message`` is short and meant to be shown to the model."""

    kind: str  # one of ERROR_KINDS
    message: str


class _DuplicateKey(ValueError):
    pass


def parse_tool_call(text: str, *, plain: bool = False) -> ToolCall | ToolCallError | None:
    """The first tool call in a model turn; ``None`` when the turn holds none (it answered)."""
    start_tag, end_tag = (PLAIN_CALL_START, PLAIN_CALL_END) if plain else (TOOL_CALL_START,
                                                                          TOOL_CALL_END)
    start = text.find(start_tag)
    if start < 0:
        if end_tag in text:
            return ToolCallError("bad_tags", f"{end_tag} without {start_tag} before it")
        return None
    body_start = start + len(start_tag)
    end = text.find(end_tag, body_start)
    if end < 0:
        return ToolCallError("unterminated", f"{start_tag} is never closed by {end_tag}")
    body = text[body_start:end]
    if len(body) > MAX_CALL_CHARS:
        return ToolCallError("too_large", f"tool call over {MAX_CALL_CHARS} characters")
    if plain:
        return ToolCall(PLAIN_TOOL, {PLAIN_ARGUMENT: body})
    return _parse_json_call(body)


def _parse_json_call(body: str) -> ToolCall | ToolCallError:
    if _depth(body) > MAX_DEPTH:
        return ToolCallError("too_deep", f"tool call nested deeper than {MAX_DEPTH} levels")
    try:
        obj = json.loads(body, object_pairs_hook=_unique_keys, parse_constant=_reject_constant,
                         parse_float=_finite_float)
    except _DuplicateKey as err:
        return ToolCallError("duplicate_key", str(err))
    except (ValueError, RecursionError) as err:  # JSONDecodeError, int digit limit, NaN
        return ToolCallError("bad_json", f"tool call is not valid JSON: {str(err)[:80]}")
    if not isinstance(obj, dict):
        return ToolCallError("not_object", 'tool call must be a JSON object {"name": ..., '
                             '"arguments": {...}}')
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return ToolCallError("unexpected_key", f"unexpected key {extra[0][:_ECHO_CHARS]!r}; "
                             "a tool call has only 'name' and 'arguments'")
    if "name" not in obj:
        return ToolCallError("missing_name", "tool call has no 'name'")
    name = obj["name"]
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        return ToolCallError("bad_name", f"'name' must be a string of 1-{MAX_NAME_CHARS} "
                             "characters")
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCallError("bad_arguments", "'arguments' must be a JSON object")
    return ToolCall(name, arguments)


def _depth(body: str) -> int:
    """Deepest nesting of ``[``/``{`` outside JSON strings (a prefix of invalid JSON is read the
    way ``json`` reads it up to its first error, so the bound holds for what it decodes)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in body:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:  # stop early on hostile input
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"key {key[:_ECHO_CHARS]!r} appears twice in the tool call")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"number {literal[:_ECHO_CHARS]} is out of range")
    return value


def render_tool_call(call: ToolCall, plain: bool = False) -> str:
    """The text a model emits for ``call``; ValueError when the form cannot carry it (a plain
    call other than ``calculator(expression)``, NaN, non-string keys, tuples, too large/deep)."""
    if plain:
        expression = call.arguments.get(PLAIN_ARGUMENT)
        if call.name != PLAIN_TOOL or set(call.arguments) != {PLAIN_ARGUMENT} or not isinstance(
                expression, str) or "=" in expression:
            raise ValueError(f"the plain form only carries {PLAIN_TOOL} with one string "
                             f"{PLAIN_ARGUMENT!r} without '=', got {call.name!r}")
        text = f"{PLAIN_CALL_START}{expression}{PLAIN_CALL_END}"
    else:
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False,
                          allow_nan=False)
        # "</" occurs only inside JSON strings; "<\/" reads back the same and cannot close a tag
        body = body.replace("</", "<\\/")
        text = f"{TOOL_CALL_START}{body}{TOOL_CALL_END}"
    parsed = parse_tool_call(text, plain=plain)
    if parsed != call:
        why = parsed.message if isinstance(parsed, ToolCallError) else "reads back differently"
        raise ValueError(f"tool call {call.name[:_ECHO_CHARS]!r} cannot be rendered: {why}")
    return text


_WHITESPACE = re.compile(r"\s+")


def observation_markers(plain: bool = False,
                        wrapping: tuple[str, str] | None = None) -> tuple[str, str]:
    """(before, after) an observation's text: the chat template's tool-message turn when
    ``wrapping`` (``chat_wrapping``) is given, else the bare ``<tool_response>`` block; in the
    plain form nothing before and one space after (the text's whitespace is folded too)."""
    if plain:
        return "", " "
    if wrapping is not None:
        return wrapping
    return f"{TOOL_RESPONSE_START}\n", f"\n{TOOL_RESPONSE_END}"


def format_observation(text: str, plain: bool = False,
                       wrapping: tuple[str, str] | None = None) -> str:
    """An environment's answer as it is appended to the conversation (loss mask 0), as text.
    Its ids are ``workers.roles.environment.observation_ids``: the markers as the template's
    tokens, the text as ordinary text (``workers.models.tokenizer.encode_text``)."""
    before, after = observation_markers(plain, wrapping)
    return before + (_WHITESPACE.sub(" ", text).strip() if plain else text) + after


def observation_text(formatted: str, plain: bool = False,
                     wrapping: tuple[str, str] | None = None) -> str:
    """The text of an observation read back (decoded with its special tokens) from what
    ``format_observation`` appended: its wrapping removed where it is found whole."""
    before, after = observation_markers(plain, wrapping)
    if formatted.startswith(before) and formatted.endswith(after) and (
            len(formatted) >= len(before) + len(after)):
        return formatted[len(before):len(formatted) - len(after)]
    return formatted


_SENT_TURN, _SENT_OBS = "\x00TURN\x00", "\x00OBSERVATION\x00"


def chat_wrapping(tokenizer: Any) -> tuple[str, str] | None:
    """(before, after) an observation's text: the tokenizer's chat template rendering [user,
    assistant turn, tool message] + the generation prompt, from just after the assistant's text.
    None when it has no template, or the template fails or drops the tool message (then the
    bare ``<tool_response>`` block is used)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENT_TURN},
                {"role": "tool", "content": _SENT_OBS}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that refuses a tool message (e.g. strict role alternation)
        return None
    if not isinstance(text, str) or text.count(_SENT_TURN) != 1:
        return None
    tail = text[text.index(_SENT_TURN) + len(_SENT_TURN):]
    if tail.count(_SENT_OBS) != 1:
        return None
    before, _, after = tail.partition(_SENT_OBS)
    return before, after
