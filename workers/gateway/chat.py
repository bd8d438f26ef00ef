"""OpenAI chat messages <-> the token ids a trajectory row holds: the gateway's only tokenizer path.

The chat template is applied once, here, and what it produces is stored: the first call's
``prompt_ids``, and for every later call only the ids its NEW messages add (an observation piece,
loss mask 0). Nothing is re-tokenised from text afterwards: the trainer reads the ids the engine
was fed and the ids it generated. Two forms, as ``workers.agent.toolcall``:

* **template** (a tokenizer with a chat template; hermes tool calls): messages are rendered with
  the template, ``tools`` included. Each message's content is rendered as a sentinel first, so the
  template's own markup becomes its control tokens (``encode_markers``) and the contents are
  encoded as ordinary text (``encode_text``): a tool's output or a user's message that spells
  ``<|im_end|>`` cannot forge a turn. A later call's piece is the assistant turn's closing that
  the model did not generate (the engine stops at the tool-call end marker) plus the new messages
  rendered after an assistant turn, plus the generation prompt.
* **plain** (the built-in character model, no template, no letters): the prompt is the user
  messages' text (``encode_prompt``), a tool message is the plain observation ``"{text} "``, a
  later user message its text; system messages and tool schemas are not rendered (the plain form
  knows one tool, the calculator).

``assistant_message`` turns a model turn into the OpenAI assistant message (``tool_calls`` when it
ends in a parsable call); ``same_assistant`` tells whether the message an agent sends back is the
one it was given, which is how a call is known to extend the episode (``docs/agents.md``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.agent.toolcall import (
    PLAIN_CALL_START,
    TOOL_CALL_START,
    ToolCall,
    format_observation,
    parse_tool_call,
)
from workers.models.tokenizer import decode_response, encode_prompt, encode_text

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 512  # per request: a bound on work, far above any turn budget


class RequestError(ValueError):
    """A request the gateway refuses: its HTTP status, OpenAI error type and code, one line."""

    def __init__(self, status: int, code: str, message: str,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code, self.kind = status, code, kind


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, a list of text parts, or None (empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise RequestError(400, "invalid_content",
                                   f"{where}.content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(400, "invalid_content", f"{where}.content must be a string or a list")


def canonical_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages reduced to what the conversation is (role, text content, tool calls by name
    and parsed arguments, tool_call_id): client libraries add fields (``refusal``,
    ``annotations``, ids of their own) that change nothing the model sees. Raises RequestError
    on anything malformed."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "invalid_messages", "messages must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(400, "invalid_messages", f"at most {MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(400, "invalid_messages",
                               f"{where}.role must be one of {list(ROLES)}")
        msg: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"), where)}
        if m["role"] == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]")
                                 for j, c in enumerate(m["tool_calls"])]
        if m["role"] == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id") or "")
        out.append(msg)
    return out


def _call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(400, "invalid_messages", f"{where}.function.name is missing")
    args = fn.get("arguments") or "{}"
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise RequestError(400, "invalid_messages",
                           f"{where}.function.arguments is not JSON") from None
    return {"name": fn["name"], "arguments": parsed}


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools`` (OpenAI function tools), checked; [] when absent."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError(400, "invalid_tools", "tools must be a list")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(400, "invalid_tools",
                               f"tools[{i}] must be {{'type': 'function', 'function': "
                               "{'name': ..., 'parameters': ...}}")
    return tools


def completion_prompt(prompt: Any) -> str:
    """A /v1/completions ``prompt``: one string (or a list of one)."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(400, "invalid_prompt", "prompt must be one non-empty string")
    return prompt


def dumps(obj: Any) -> str:
    """Canonical JSON (what the row stores, and what replays compare)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class Assistant:
    """A model turn as the OpenAI assistant message an agent is given."""

    content: str
    tool_call: ToolCall | None
    finish_reason: str  # "tool_calls" | "stop" | "length"

    def message(self, call_id: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_call is not None:
            msg["tool_calls"] = [{"id": call_id, "type": "function", "function": {
                "name": self.tool_call.name,
                "arguments": json.dumps(self.tool_call.arguments)}}]
        return msg


def assistant_message(tokenizer: Any, ids: Sequence[int], finish: str, *,
                      plain: bool) -> Assistant:
    """The assistant message of a model turn (its ids, its last piece's end)."""
    text = decode_response(tokenizer, ids)
    call = parse_tool_call(text, plain=plain)
    if isinstance(call, ToolCall):
        start = text.find(PLAIN_CALL_START if plain else TOOL_CALL_START)
        return Assistant(text[:max(start, 0)].strip(), call, "tool_calls")
    return Assistant(text, None, "stop" if finish == "stop" else "length")


def same_assistant(sent: dict[str, Any], given: Assistant) -> bool:
    """Whether an agent's (canonical) assistant message is the one ``given`` was returned as."""
    if sent.get("role") != "assistant":
        return False
    calls = sent.get("tool_calls") or []
    if given.tool_call is None:
        return not calls and sent["content"].strip() == given.content.strip()
    return (len(calls) == 1 and calls[0]["name"] == given.tool_call.name
            and calls[0]["arguments"] == given.tool_call.arguments
            and sent["content"].strip() == given.content.strip())


class ChatFormat:
    """How one run's tokenizer renders messages (see the module docstring)."""

    def __init__(self, tokenizer: Any, *, plain: bool) -> None:
        self.tokenizer, self.plain = tokenizer, plain
        if not plain and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the gateway's template form needs a tokenizer with a chat template")
        eos = tokenizer.eos_token_id
        self.eos_id = int(eos) if eos is not None else None
        self._close = "" if plain else self._assistant_close()

    # -- the first call ----------------------------------------------------------------------
    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """The ids of a first call: its messages (and tools) with the generation prompt."""
        if self.plain:
            return encode_prompt(self.tokenizer, "".join(
                m["content"] for m in messages if m["role"] == "user"))
        return self._render(messages, tools, first=0)

    # -- a later call ------------------------------------------------------------------------
    def piece_ids(self, new: list[dict[str, Any]], turn_ids: Sequence[int],
                  tools: list[dict[str, Any]]) -> list[int]:
        """The ids between the last model turn (``turn_ids``) and the next: what closes that
        turn and the ``new`` messages, with the generation prompt (loss mask 0)."""
        if not new or any(m["role"] == "assistant" for m in new):
            raise RequestError(400, "invalid_messages", "a call extends the episode by tool or "
                               "user messages after the last assistant message")
        if self.plain:
            ids: list[int] = []
            for m in new:
                if m["role"] == "tool":
                    ids += encode_text(self.tokenizer, format_observation(m["content"], True))
                elif m["role"] == "user":
                    ids += encode_text(self.tokenizer, m["content"])
            return ids
        close = self._close
        if self.eos_id is not None and list(turn_ids[-1:]) == [self.eos_id]:
            eos_text = self.tokenizer.convert_ids_to_tokens(self.eos_id)
            close = close[len(eos_text):] if close.startswith(eos_text) else close
        base = [{"role": "user", "content": "\x00"}, {"role": "assistant", "content": "\x00"}]
        return _markers(self.tokenizer, close) + self._render([*base, *new], tools,
                                                              first=len(base))

    # -- /v1/completions: the caller formats the text itself ------------------------------------
    def text_prompt_ids(self, text: str) -> list[int]:
        """A first completions call: the text as the tokenizer reads a prompt (its special
        tokens added; markup the caller wrote is the template's tokens)."""
        return encode_prompt(self.tokenizer, text)

    def text_ids(self, text: str) -> list[int]:
        """What a later completions call adds (the caller's own markup, so read as written)."""
        return _markers(self.tokenizer, text)

    # -- rendering ---------------------------------------------------------------------------
    def _template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                  generation: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=generation)
        except Exception as exc:  # a template that refuses this conversation
            raise RequestError(400, "invalid_messages",
                               f"the chat template refused the messages: {exc}") from None
        return str(text)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *,
                first: int) -> list[int]:
        """Ids of ``messages[first:]`` as the template renders them after ``messages[:first]``
        (and the generation prompt): markup as control tokens, contents as text."""
        marks = [f"\x00SF{i}\x00" for i in range(len(messages))]
        shown = [{**_template_message(m), "content": marks[i]} for i, m in enumerate(messages)]
        full = self._template(shown, tools, True)
        if first:
            head = self._template(shown[:first], tools, False)
            if not full.startswith(head):
                raise RequestError(400, "invalid_messages", "the chat template renders these "
                                   "messages differently after an assistant turn")
            full = full[len(head):]
        ids: list[int] = []
        for i in range(first, len(messages)):
            before, found, full = full.partition(marks[i])
            if not found:
                raise RequestError(400, "invalid_messages",
                                   f"the chat template dropped messages[{i}]")
            ids += _markers(self.tokenizer, before) + encode_text(self.tokenizer,
                                                                  messages[i]["content"])
        return ids + _markers(self.tokenizer, full)

    def _assistant_close(self) -> str:
        """What the template writes after an assistant message's text (e.g. ``<|im_end|>\\n``)."""
        mark = "\x00SFA\x00"
        text = self._template([{"role": "user", "content": "\x00"},
                               {"role": "assistant", "content": mark}], [], False)
        return text.split(mark, 1)[1] if mark in text else ""


def _template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A canonical message as chat templates take it (tool calls in OpenAI's nested form)."""
    out = {k: v for k, v in m.items() if k != "tool_calls"}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "function": c} for c in m["tool_calls"]]
    return out


def _markers(tokenizer: Any, text: str) -> list[int]:
    """The template's own markup: its control strings become its control tokens."""
    if not text:
        return []
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
