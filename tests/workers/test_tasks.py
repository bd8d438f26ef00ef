"""Arithmetic task streams, held-out split, and problem files (JSONL/Parquet)."""

from __future__ import annotations

import itertools
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workers.tasks.arithmetic import ArithmeticTask
from workers.tasks.problem import Problem
from workers.tasks.prompt_file import ProblemFileError, load_problem_file

COLUMNS = ("prompt", "answer")  # the prompt and answer columns of the files written here


def test_problems_are_correct_and_deterministic():
    task = ArithmeticTask(digits=2, operations=("+", "-", "*"), seed=3)
    probs = task.train_problems(50, epoch_or_offset=2)
    assert probs == ArithmeticTask(digits=2, operations=("+", "-", "*"), seed=3).train_problems(
        50, epoch_or_offset=2
    )
    assert probs != task.train_problems(50, epoch_or_offset=1)
    for p in probs:
        assert p.prompt.endswith("=")
        assert int(p.answer) == eval(p.prompt[:-1])  # noqa: S307 - digits and one operator only


def test_offset_blocks_tile_the_stream():
    task = ArithmeticTask(digits=2, operations=("+",), seed=0)
    it = task.iterate()
    first = [next(it) for _ in range(20)]
    assert (
        task.train_problems(10, epoch_or_offset=0) + task.train_problems(10, epoch_or_offset=1)
        == first
    )
    assert list(itertools.islice(task.iterate(seed=5), 20)) != first


def test_eval_is_disjoint_from_training_by_construction():
    task = ArithmeticTask(digits=2, operations=("+",), seed=0)
    held = task.eval_problems(100)
    assert len({p.prompt for p in held}) == 100
    assert all(task.is_held_out(p) for p in held)
    train = {p.prompt for p in task.train_problems(5000)}
    assert not train & {p.prompt for p in held}
    assert held == ArithmeticTask(digits=2, operations=("+",),
                                  seed=9).eval_problems(100)  # seed-independent


def test_no_held_out_sum_has_its_commuted_twin_in_training():
    # a+b and b+a are the same problem to a learner: both must sit on the same side of the split.
    task = ArithmeticTask(digits=2, operations=("+", "*", "-"), seed=0)
    held = task.eval_problems(200)
    twins = 0
    for p in held:
        op = "+" if "+" in p.prompt else "*" if "*" in p.prompt else "-"
        a, b = p.prompt.rstrip("=").split(op)
        if op != "-":
            assert task.is_held_out((op, int(b), int(a))), p.prompt
            twins += a != b
    assert twins > 50  # the check above really ran over many non-symmetric problems
    train = {p.prompt for p in task.train_problems(20_000)}
    for p in held:
        if "+" in p.prompt:
            a, b = p.prompt.rstrip("=").split("+")
            assert f"{b}+{a}=" not in train


def test_bad_task_arguments_name_the_field():
    with pytest.raises(ValueError, match="operations"):
        ArithmeticTask(digits=2, operations=("/",), seed=0)
    with pytest.raises(ValueError, match="digits"):
        ArithmeticTask(digits=0, operations=("+",), seed=0)


def test_load_jsonl_and_parquet(tmp_path):
    rows = [{"q": "1+1=", "a": 2}, {"q": "2+2=", "a": "4"}]
    jl = tmp_path / "p.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    expect = [Problem("1+1=", "2"), Problem("2+2=", "4")]
    assert load_problem_file(jl, prompt_column="q", answer_column="a") == expect
    pqf = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}), pqf)
    assert load_problem_file(pqf, *COLUMNS) == expect


def test_problem_file_errors_name_the_problem(tmp_path):
    with pytest.raises(ProblemFileError, match="does not exist"):
        load_problem_file(tmp_path / "missing.jsonl", *COLUMNS)
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    with pytest.raises(ProblemFileError, match="missing column 'answer'"):
        load_problem_file(f, *COLUMNS)
    bad = tmp_path / "p.csv"
    bad.write_text("a,b\n")
    with pytest.raises(ProblemFileError, match="unsupported"):
        load_problem_file(bad, *COLUMNS)
