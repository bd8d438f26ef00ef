"""The tool-call format: hand-picked cases for every error kind, hostile near-misses, and fuzzing
that the parser never raises and that rendered calls parse back to themselves."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.agent.toolcall import (
    ERROR_KINDS,
    MAX_CALL_CHARS,
    MAX_DEPTH,
    PLAIN_CALL_END,
    TOOL_CALL_END,
    ToolCall,
    ToolCallError,
    format_observation,
    parse_tool_call,
    render_tool_call,
)
from workers.models.tokenizer import DEFAULT_ALPHABET

FUZZ = settings(max_examples=200, deadline=None)


def call_text(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


def check_result(result: object) -> None:
    """The parser's contract for any input."""
    if isinstance(result, ToolCallError):
        assert result.kind in ERROR_KINDS
        assert isinstance(result.message, str) and "\n" not in result.message
    elif isinstance(result, ToolCall):
        assert isinstance(result.name, str) and result.name
        assert isinstance(result.arguments, dict)
    else:
        assert result is None


def test_hermes_call_parses_after_reasoning_text():
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": '
            '{"expression": "123*45"}}</tool_call>')
    assert parse_tool_call(text) == ToolCall("calculator", {"expression": "123*45"})
    assert text.endswith(TOOL_CALL_END)


def test_missing_arguments_mean_no_arguments():
    assert parse_tool_call(call_text('{"name": "now"}')) == ToolCall("now", {})


def test_only_the_first_call_counts():
    first = render_tool_call(ToolCall("a", {"x": 1}))
    assert parse_tool_call(first + render_tool_call(ToolCall("b", {}))) == ToolCall("a", {"x": 1})


@pytest.mark.parametrize("text", ["5535", "", "the answer is 7", "(=1+2", "{\"name\": \"a\"}"])
def test_a_turn_without_a_call_is_none(text):
    assert parse_tool_call(text) is None


DEEP = "[" * 10_000
ERROR_CASES = {
    "unterminated": '<tool_call>{"name": "calculator", "arguments": {}}',
    "bad_tags": 'I am done.</tool_call>',
    "too_large": call_text(json.dumps({"name": "python", "arguments": {"code": "x" * 1_000_000}})),
    "too_deep": call_text(DEEP),
    "bad_json": call_text('{"name": "a", "arguments": {"x": NaN}}'),
    "duplicate_key": call_text('{"name": "a", "name": "b", "arguments": {}}'),
    "not_object": call_text('["calculator", {"expression": "1"}]'),
    "missing_name": call_text('{"arguments": {}}'),
    "bad_name": call_text('{"name": 7, "arguments": {}}'),
    "bad_arguments": call_text('{"name": "a", "arguments": [1, 2]}'),
    "unexpected_key": call_text('{"name": "a", "arguments": {}, "id": 3}'),
}


@pytest.mark.parametrize("kind", sorted(ERROR_CASES))
def test_each_malformed_call_gets_its_error_kind(kind):
    result = parse_tool_call(ERROR_CASES[kind])
    assert isinstance(result, ToolCallError) and result.kind == kind, result


def test_error_cases_cover_every_kind():
    assert set(ERROR_CASES) == set(ERROR_KINDS)


@pytest.mark.parametrize("body, kind", [
    ('{"name": "a", "arguments": {"x": Infinity}}', "bad_json"),
    ('{"name": "a", "arguments": {"x": -Infinity}}', "bad_json"),
    ('{"name": "a", "arguments": {"x": 1e999}}', "bad_json"),  # a float literal that is inf
    ('{"name": "a", "arguments": {"x": ' + "9" * 9000 + "}}", "bad_json"),  # int digit limit
    ('{"name": "a", "arguments": {"x": {"y": 1, "y": 2}}}', "duplicate_key"),
    ('{"name": "", "arguments": {}}', "bad_name"),
    ('{"name": null}', "bad_name"),
    ('{"name": ["calculator"]}', "bad_name"),
    ('{"name": "' + "n" * 65 + '"}', "bad_name"),
    ("<tool_call>{\"name\": \"a\"}", "bad_json"),  # nested start tag
    ('{"name": "a", "arguments": ' + "{\"k\": " * 40 + "1" + "}" * 41, "too_deep"),
    ('{"name": "a", "arguments": {"x": "unterminated string ' + "[" * 10_000, "bad_json"),
    ("", "bad_json"),
    ("\ud800", "bad_json"),
])
def test_near_misses(body, kind):
    result = parse_tool_call(call_text(body))
    assert isinstance(result, ToolCallError) and result.kind == kind, result


def test_brackets_inside_strings_do_not_count_as_depth():
    code = "[" * (MAX_DEPTH * 4) + "\\\"{{"
    call = ToolCall("python", {"code": code})
    assert parse_tool_call(render_tool_call(call)) == call


def test_largest_call_fits_and_one_more_character_does_not():
    pad = MAX_CALL_CHARS - len(json.dumps({"name": "p", "arguments": {"c": ""}}))
    body = json.dumps({"name": "p", "arguments": {"c": "x" * pad}})
    assert parse_tool_call(call_text(body)) == ToolCall("p", {"c": "x" * pad})
    body = json.dumps({"name": "p", "arguments": {"c": "x" * (pad + 1)}})
    assert parse_tool_call(call_text(body)).kind == "too_large"


def test_end_tag_inside_an_argument_round_trips():
    call = ToolCall("python", {"code": 'print("</tool_call>")  # </tool_response>'})
    assert parse_tool_call(render_tool_call(call)) == call


def test_plain_form_is_the_calculator_in_the_char_alphabet():
    call = ToolCall("calculator", {"expression": "123*45"})
    text = render_tool_call(call, plain=True)
    assert text == "(=123*45=)" and text.endswith(PLAIN_CALL_END)
    assert parse_tool_call("12*34+5=" + text, plain=True) == call
    assert set(text) <= set(DEFAULT_ALPHABET)
    assert set(format_observation("5535", plain=True)) <= set(DEFAULT_ALPHABET)
    assert parse_tool_call(text) is None  # the forms do not read each other
    assert parse_tool_call(render_tool_call(call), plain=True) is None


@pytest.mark.parametrize("text, kind", [("(=1+2", "unterminated"), ("(=)", "unterminated"),
                                        ("1+2=)", "bad_tags")])
def test_plain_malformed(text, kind):
    result = parse_tool_call(text, plain=True)
    assert isinstance(result, ToolCallError) and result.kind == kind


@pytest.mark.parametrize("call, plain", [
    (ToolCall("python", {"expression": "1"}), True),
    (ToolCall("calculator", {"expression": "1=1"}), True),
    (ToolCall("calculator", {"expression": 1}), True),
    (ToolCall("calculator", {"expression": "1", "x": "2"}), True),
    (ToolCall("a", {"x": float("nan")}), False),
    (ToolCall("a", {"x": (1, 2)}), False),  # reads back as a list
    (ToolCall("a", {1: "x"}), False),  # reads back with a string key
    (ToolCall("", {}), False),
    (ToolCall("a", {"x": "y" * MAX_CALL_CHARS}), False),
])
def test_render_refuses_what_would_not_read_back(call, plain):
    with pytest.raises(ValueError):
        render_tool_call(call, plain=plain)


def test_observation_forms():
    assert format_observation("5535") == "<tool_response>\n5535\n</tool_response>"
    assert format_observation("  4\n08\t", plain=True) == "4 08 "


# --------------------------------------------------------------------------- fuzzing
JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.text() | st.floats(
    allow_nan=False, allow_infinity=False)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)
CALLS = st.builds(ToolCall, st.text(min_size=1, max_size=64),
                  st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4))
EXPRESSIONS = st.text(alphabet="0123456789+-*() ", max_size=40)
MARKERS = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', "\\", ":",
                           ",", "NaN", "(=", "=)", '"name"', '"arguments"', "\ud800", "1e999"])


@FUZZ
@given(st.text(), st.booleans())
def test_random_text_never_raises(text, plain):
    check_result(parse_tool_call(text, plain=plain))


@FUZZ
@given(st.lists(MARKERS | st.text(max_size=4), max_size=30), st.booleans())
def test_marker_soup_never_raises(pieces, plain):
    check_result(parse_tool_call("".join(pieces), plain=plain))


@FUZZ
@given(CALLS)
def test_generated_calls_round_trip(call):
    assert parse_tool_call(render_tool_call(call)) == call


@FUZZ
@given(EXPRESSIONS)
def test_plain_calls_round_trip(expression):
    call = ToolCall("calculator", {"expression": expression})
    assert parse_tool_call(render_tool_call(call, plain=True), plain=True) == call


@FUZZ
@given(CALLS, st.data())
def test_mutated_calls_never_raise(call, data):
    text = render_tool_call(call)
    cut = data.draw(st.integers(0, len(text)))
    insert = data.draw(MARKERS | st.text(max_size=3))
    drop = data.draw(st.integers(0, 3))
    check_result(parse_tool_call(text[:cut] + insert + text[cut + drop:]))
