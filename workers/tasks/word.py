"""Arithmetic word problems for instruct models, and chat-template prompts.

``WordProblemTask`` (the same contract as ``workers.tasks.arithmetic.ArithmeticTask``), ``chat_prompt_text``
/ ``chat_prompt_ids``, ``final_number`` and the reward ``last_number_match``
(docs/training.md "Tasks").
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from workers.tasks.heldout import is_held_out, word_key
from workers.tasks.problem import Problem, TrainingStream

KINDS = ("add", "sub", "mul", "div", "total")
NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Max", "Zoe", "Leo", "Ella")
ITEMS = ("apples", "books", "marbles", "pencils", "cookies", "stickers", "coins", "cards")
DEFAULT_INSTRUCTION = "Answer with the final number only."

_TEMPLATES = {
    "add": "{n} has {a} {i}. {n} buys {b} more {i}. How many {i} does {n} have now?",
    "sub": "{n} has {a} {i} and gives {b} of them to a friend. How many {i} does {n} have left?",
    "mul": "{n} buys {a} bags with {b} {i} in each bag. How many {i} does {n} buy in total?",
    "div": "{n} shares {a} {i} equally among {b} friends. How many {i} does each friend get?",
    "total": "There are {a} {i} on the table and {b} {i} in a box. How many {i} are there in all?",
}


_ANSWER = {"add": operator.add, "total": operator.add, "sub": operator.sub,
           "mul": operator.mul, "div": operator.floordiv}


@dataclass
class WordProblemTask(TrainingStream):
    """Word problems over operands 1..``max_value``; contract: docs/training.md "Tasks"."""

    max_value: int = 20
    kinds: tuple[str, ...] = ("add", "sub", "total")
    seed: int = 0
    held_out_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not 2 <= int(self.max_value) <= 10_000:
            raise ValueError(f"WordProblemTask.max_value must be in 2..10000, got {self.max_value}")
        self.kinds = tuple(self.kinds)
        bad = [k for k in self.kinds if k not in KINDS]
        if not self.kinds or bad:
            raise ValueError(
                f"WordProblemTask.kinds must be a non-empty subset of {KINDS}, got {bad}")
        self._check_fraction()

    def answer(self, kind: str, a: int, b: int) -> int:
        return _ANSWER[kind](a, b)  # div: make_problem guarantees b divides a

    def make_problem(self, kind: str, a: int, b: int) -> Problem:
        """The problem of one triple (for ``sub``, a >= b; for ``div``, b divides a)."""
        if kind not in _TEMPLATES:
            raise ValueError(f"unknown word-problem kind {kind!r}; kinds: {KINDS}")
        if (kind == "sub" and a < b) or (kind == "div" and (b == 0 or a % b)):
            raise ValueError(f"invalid operands for {kind!r}: a={a}, b={b}")
        rng = random.Random(f"word-surface|{kind}|{a}|{b}")
        text = _TEMPLATES[kind].format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b)
        return Problem(prompt=text, answer=str(self.answer(kind, a, b)))

    def _draw(self, rng: random.Random) -> tuple[str, int, int]:
        kind = self.kinds[rng.randrange(len(self.kinds))]
        a, b = rng.randint(1, self.max_value), rng.randint(1, self.max_value)
        if kind == "sub" and a < b:
            a, b = b, a
        if kind == "div":
            a = a * b  # the quotient is the first draw
        return kind, a, b

    def is_held_out(self, triple: tuple[str, int, int]) -> bool:
        """Whether a (kind, a, b) triple belongs to the evaluation split: the rule of
        ``workers.tasks.heldout`` on the arithmetic it re-words (add(a, b), add(b, a) and
        total(a, b) are one problem, on one side)."""
        return is_held_out(word_key(*triple), self.held_out_fraction)

    def _stream(self, seed: int, held_out: bool) -> Iterator[Problem]:
        rng = random.Random(f"word|{self.max_value}|{','.join(self.kinds)}|{seed}|{held_out}")
        while True:
            triple = self._draw(rng)
            if self.is_held_out(triple) == held_out:
                yield self.make_problem(*triple)

    def eval_problems(self, n: int) -> list[Problem]:
        """``n`` distinct held-out problems, the same list on every call (seed-independent)."""
        return self._distinct_held_out(n, 200 * max(n, 1))


# --------------------------------------------------------------------------- chat prompts
def chat_prompt_text(tokenizer: PreTrainedTokenizerBase, question: str, *,
                     instruction: str | None = DEFAULT_INSTRUCTION,
                     system: str | None = None,
                     tools: Sequence[dict[str, Any]] | None = None) -> str:
    """``question`` (plus ``instruction``) as one user turn in the tokenizer's chat template,
    ending with the assistant's turn opener (the model continues from there). ``tools``: the
    function schemas the template renders where its tool list goes (an environment's
    ``tool_schemas()``, e.g. ``workers.agent.mcp_tools.McpEnvironment``'s)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat template; use plain prompts for this model")
    content = f"{question} {instruction}" if instruction else question
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    extra = {"tools": list(tools)} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **extra)
    return str(text)


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str, *,
                    instruction: str | None = DEFAULT_INSTRUCTION,
                    system: str | None = None,
                    tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of ``chat_prompt_text``; no special token is added again (no second BOS)."""
    text = chat_prompt_text(tokenizer, question, instruction=instruction, system=system,
                            tools=tools)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------- reward
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number in ``text`` (thousands separators dropped), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def last_number_match(completion: str, answer: str) -> float:
    """1.0 if the last number of the completion equals the answer (a reward for chatty models:
    ``reward.fn: workers.tasks.word:last_number_match``)."""
    got = final_number(completion)
    if got is None:
        return 0.0
    try:
        return 1.0 if float(got) == float(answer.strip()) else 0.0
    except ValueError:
        return 0.0


def problems_as_rows(problems: Sequence[Problem],
                     tokenizer: PreTrainedTokenizerBase | None = None, *,
                     instruction: str | None = DEFAULT_INSTRUCTION) -> list[dict[str, str]]:
    """Rows ``{"prompt", "answer"}`` for a problem file (``data.task: file``); with a tokenizer
    the prompt is already rendered in its chat template."""

    def render(q: str) -> str:
        return q if tokenizer is None else chat_prompt_text(tokenizer, q, instruction=instruction)

    return [{"prompt": render(p.prompt), "answer": p.answer} for p in problems]


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.tasks.word OUT.jsonl [--model DIR]``: write a problem file for
    ``data.task: file`` (prompts rendered in the model's chat template when --model is given)."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m workers.tasks.word", description=main.__doc__)
    parser.add_argument("out", help="JSONL file to write")
    parser.add_argument("--model", help="HF model directory whose chat template renders prompts")
    parser.add_argument("--num", type=int, default=512, help="training problems to write")
    parser.add_argument("--max-value", type=int, default=10, help="largest operand")
    parser.add_argument("--kinds", default="add,sub,total", help=f"comma-separated, of {KINDS}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    kinds = tuple(args.kinds.split(","))
    task = WordProblemTask(max_value=args.max_value, kinds=kinds, seed=args.seed)
    tokenizer = None
    if args.model:
        from workers.models.local import load_tokenizer

        tokenizer = load_tokenizer(args.model)
    rows = problems_as_rows(task.train_problems(args.num), tokenizer)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} problems to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
