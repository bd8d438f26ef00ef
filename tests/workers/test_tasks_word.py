"""Word problems (workers.tasks.word): determinism, held-out split, answers, chat prompts, reward."""

from __future__ import annotations

import re

import pytest

from workers.models.tokenizer import build_char_tokenizer
from workers.tasks.problem import Problem
from workers.tasks.word import (
    KINDS,
    WordProblemTask,
    chat_prompt_ids,
    chat_prompt_text,
    final_number,
    last_number_match,
    problems_as_rows,
)


def test_streams_are_deterministic_and_seeded():
    task = WordProblemTask(seed=3)
    assert task.train_problems(20) == WordProblemTask(seed=3).train_problems(20)
    assert task.train_problems(20) != WordProblemTask(seed=4).train_problems(20)
    assert task.train_problems(10, epoch_or_offset=1) == task.train_problems(20)[10:]


def test_held_out_split_is_disjoint_and_seed_independent():
    task = WordProblemTask(kinds=KINDS, max_value=12)
    evals = {p.prompt for p in task.eval_problems(40)}
    assert len(evals) == 40
    assert evals == {
        p.prompt for p in WordProblemTask(kinds=KINDS, max_value=12, seed=9).eval_problems(40)
    }
    train = {p.prompt for p in task.train_problems(2000)}
    assert not evals & train


@pytest.mark.parametrize("kind", KINDS)
def test_answers_are_right(kind):
    task = WordProblemTask(kinds=(kind,), max_value=30)
    for p in task.train_problems(50):
        a, b = (int(x) for x in re.findall(r"\d+", p.prompt)[:2])
        want = {"add": a + b, "total": a + b, "sub": a - b, "mul": a * b, "div": a // b}[kind]
        assert p.answer == str(want) and int(p.answer) >= 0
        if kind == "div":
            assert a % b == 0


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="kinds"):
        WordProblemTask(kinds=("pow",))
    with pytest.raises(ValueError, match="max_value"):
        WordProblemTask(max_value=1)
    with pytest.raises(ValueError, match="invalid operands"):
        WordProblemTask().make_problem("sub", 2, 5)


def test_final_number_and_reward():
    assert final_number("Tom has 3 + 4 = 7 apples.") == "7"
    assert final_number("It is 1,250.") == "1250"
    assert final_number("no digits") is None
    assert last_number_match("3 + 4 = 7", "7") == 1.0
    assert last_number_match("7 apples, wait, 8", "7") == 0.0
    assert last_number_match("", "7") == 0.0


def test_chat_prompts_use_the_tokenizers_template():
    tok = build_char_tokenizer(alphabet="0123456789+-*=()? abcdefghijklmnopqrstuvwxyz:\n")
    with pytest.raises(ValueError, match="no chat template"):
        chat_prompt_text(tok, "x")
    tok.chat_template = (
        "{% for m in messages %}<bos>{{ m['role'] }}:{{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant:{% endif %}"
    )
    text = chat_prompt_text(tok, "the 3+4?", instruction=None, system="be brief")
    assert text == "<bos>system:be brief<eos><bos>user:the 3+4?<eos><bos>assistant:"
    ids = chat_prompt_ids(tok, "what is 3+4?", instruction="answer")
    # The template's own <bos> tokens only: the tokenizer's post-processor adds no second one.
    assert ids.count(tok.bos_token_id) == 2 and ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "<bos>user:what is 3+4? answer<eos><bos>assistant:"
    rows = problems_as_rows([Problem("what is 3+4?", "7")], tok, instruction=None)
    assert rows == [{"prompt": "<bos>user:what is 3+4?<eos><bos>assistant:", "answer": "7"}]
    assert problems_as_rows([Problem("q", "1")]) == [{"prompt": "q", "answer": "1"}]
