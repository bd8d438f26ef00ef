"""The one held-out rule (workers.tasks.heldout): twins on one side for every task and for prompt
files, the configured fraction, and a split that no seed moves."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.tasks.arithmetic import ArithmeticTask
from workers.tasks.heldout import (
    arithmetic_key,
    is_held_out,
    prompt_key,
    split_prompt_file,
    word_key,
)
from workers.tasks.problem import Problem
from workers.tasks.word import WordProblemTask

OPERANDS = st.integers(min_value=0, max_value=10**6)
# A fraction far from 0 and 1, so a rule that ignored twins would split many pairs.
FRACTION = 0.4


@settings(max_examples=500, deadline=None)
@given(op=st.sampled_from(["+", "*"]), a=OPERANDS, b=OPERANDS)
def test_commuted_arithmetic_twins_are_on_one_side(op, a, b):
    task = ArithmeticTask(digits=7, operations=("+", "*"), seed=0,
                          held_out_fraction=FRACTION)
    assert task.is_held_out((op, a, b)) == task.is_held_out((op, b, a))
    assert task.is_held_out(task.make_problem(op, a, b)) == task.is_held_out((op, b, a))


@settings(max_examples=500, deadline=None)
@given(a=st.integers(min_value=1, max_value=10**4), b=st.integers(min_value=1, max_value=10**4),
       kind=st.sampled_from(["add", "total", "mul"]))
def test_commuted_and_reworded_word_twins_are_on_one_side(a, b, kind):
    task = WordProblemTask(max_value=10**4, kinds=("add", "total", "mul"),
                           held_out_fraction=FRACTION)
    side = task.is_held_out((kind, a, b))
    assert task.is_held_out((kind, b, a)) == side
    if kind != "mul":  # "total" is "add" in other words
        twin = "total" if kind == "add" else "add"
        assert task.is_held_out((twin, a, b)) == task.is_held_out((twin, b, a)) == side
    # and the arithmetic problem it re-words
    op = "*" if kind == "mul" else "+"
    assert word_key(kind, a, b) == arithmetic_key(op, a, b)
    twin = ArithmeticTask(digits=5, operations=(op,), seed=0, held_out_fraction=FRACTION)
    assert twin.is_held_out((op, b, a)) == side


def test_the_rule_is_not_blind_to_order_where_order_matters():
    # a-b and b-a are different problems: some pairs fall on opposite sides.
    split = [(is_held_out(arithmetic_key("-", a, b), FRACTION),
              is_held_out(arithmetic_key("-", b, a), FRACTION)) for a in range(50)
             for b in range(a)]
    assert any(x != y for x, y in split)
    assert word_key("sub", 9, 4) != word_key("sub", 4, 9)


def test_the_arithmetic_split_is_the_one_it_always_was():
    # The demo's evaluation set (and the cached built-in checkpoint's manifest) rest on it.
    def before(op: str, a: int, b: int) -> bool:
        if op in "+*" and a > b:
            a, b = b, a
        digest = hashlib.blake2b(f"{op}|{a}|{b}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64 < 0.1

    task = ArithmeticTask(digits=2, operations=("+", "-", "*"), seed=0)
    assert all(task.is_held_out((op, a, b)) == before(op, a, b)
               for op in "+-*" for a in range(100) for b in range(100))


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.3])
def test_the_held_out_fraction_is_the_configured_one(fraction):
    keys = {arithmetic_key(op, a, b) for op in "+-*" for a in range(200) for b in range(200)}
    held = sum(is_held_out(k, fraction) for k in keys) / len(keys)
    assert abs(held - fraction) < 0.01, (held, fraction)
    task = WordProblemTask(max_value=60, kinds=("add", "sub", "mul"), held_out_fraction=fraction)
    triples = [(k, a, b) for k in task.kinds for a in range(1, 61) for b in range(1, 61)]
    distinct = {word_key(*t): task.is_held_out(t) for t in triples}
    assert abs(sum(distinct.values()) / len(distinct) - fraction) < 0.02


def test_the_split_does_not_depend_on_the_seed():
    for seed in (1, 7, 123):
        assert (ArithmeticTask(digits=2, operations=("+",), seed=seed).eval_problems(50)
                == ArithmeticTask(digits=2, operations=("+",), seed=0).eval_problems(50))
        assert (WordProblemTask(max_value=30, seed=seed).eval_problems(30)
                == WordProblemTask(max_value=30).eval_problems(30))


# -- prompt files -------------------------------------------------------------------------------
WORDS = st.lists(st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=6),
                 min_size=1, max_size=6)
NUMBERS = st.lists(st.integers(min_value=0, max_value=999), min_size=0, max_size=3)
SEPARATORS = st.sampled_from([" ", "  ", "\t", ", ", "! ", " ... ", "; ", "\n", " ? "])


@st.composite
def prompt_twins(draw) -> tuple[str, str]:
    """A prompt and a twin differing only in case, spacing and punctuation."""
    tokens = [*draw(WORDS), *map(str, draw(NUMBERS))]
    tokens = draw(st.permutations(tokens))

    def render() -> str:
        cased = [t.upper() if draw(st.booleans()) else t for t in tokens]
        text = "".join(t + draw(SEPARATORS) for t in cased)
        return draw(st.sampled_from(["", " ", "\""])) + text + draw(st.sampled_from(["", "?", "."]))

    return render(), render()


@settings(max_examples=300, deadline=None)
@given(twins=prompt_twins())
def test_prompt_file_twins_share_a_key(twins):
    a, b = twins
    assert prompt_key(a) == prompt_key(b), (a, b)


def test_prompt_keys_keep_numbers_and_operators():
    assert prompt_key("What is 12 + 34?") != prompt_key("What is 12 - 34?")
    assert prompt_key("Tom has 3.5 kg") != prompt_key("Tom has 35 kg")
    assert prompt_key("Tom has 3 apples.") != prompt_key("Tom has 4 apples.")
    # a bare sum in a file is the arithmetic task's problem: commuted, spaced or not
    assert prompt_key("12+34=") == prompt_key(" 34 + 12 = ") == arithmetic_key("+", 12, 34)
    assert prompt_key("12-34=") != prompt_key("34-12=")


def test_prompt_file_twins_land_on_one_side_and_the_split_keeps_its_count():
    rows = []
    for i in range(60):  # each prompt three times: as is, shouted, re-punctuated
        rows += [Problem(f"How many apples does Tom have after {i} days?", str(i)),
                 Problem(f"HOW MANY APPLES DOES TOM HAVE AFTER {i} DAYS", str(i)),
                 Problem(f"how many apples,  does tom have after {i} days ?!", str(i))]
    rows += [Problem(f"{i}+{i + 3}=", str(2 * i + 3)) for i in range(20)]
    rows += [Problem(f"{i + 3} + {i}", str(2 * i + 3)) for i in range(20)]
    train, evals = split_prompt_file(rows, 15, source="f.jsonl")
    held = {prompt_key(p.prompt) for p in evals}
    assert len(evals) == len(held) == 15  # one eval problem per held-out key
    assert not held & {prompt_key(p.prompt) for p in train}  # no twin of one in training
    assert len(train) + sum(prompt_key(p.prompt) in held for p in rows) == len(rows)
    assert [p for p in rows if p in train] == train  # file order kept
    assert all(evals[i] == next(p for p in rows if prompt_key(p.prompt) == prompt_key(e.prompt))
               for i, e in enumerate(evals))  # the first row of each held-out key
    assert split_prompt_file(rows, 0) == (rows, [])
    with pytest.raises(ValueError, match=r"run.eval_prompts=80 holds out every prompt of f.jsonl "
                                         r"\(80 distinct"):
        split_prompt_file(rows, 80, source="f.jsonl")
