"""The one held-out rule of every task and of prompt files: a problem's canonical key, and the
stable hash of that key that puts it on the training side or the held-out side.

Invariants (docs/training.md "Tasks"):
- twins share one key, so they always land on the same side: ``a+b`` and ``b+a`` (``+`` and
  ``*``); the word problems "add" and "total" over the same operands, in either order, and the
  arithmetic problem they re-word; prompt-file rows that differ only in case, spacing or
  punctuation (``prompt_key``);
- the side depends on the key alone: no seed, no process (blake2b, not Python's salted
  ``hash()``), so every process and every resume sees the same split.
Standard library only: the ``--dry-run`` checks split a prompt file without torch or pyarrow.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Protocol, TypeVar

COMMUTATIVE_OPERATIONS = ("+", "*")
# word-problem kind -> the arithmetic it re-words ("total" is "add" in other words)
WORD_OPERATIONS = {"add": "+", "total": "+", "sub": "-", "mul": "*", "div": "/"}

# A prompt's tokens: numbers (a decimal part kept whole), runs of letters, and the symbols that
# change a problem's meaning; every other character (spaces, punctuation) only separates tokens.
_TOKEN = re.compile(r"\d+(?:\.\d+)?|[^\W\d_]+|[-+*/^%<>=]")
_NUMBER = re.compile(r"\d+")


def arithmetic_key(op: str, a: int, b: int) -> str:
    """The key of ``a op b``; for ``+`` and ``*`` of the unordered pair."""
    if op in COMMUTATIVE_OPERATIONS and a > b:
        a, b = b, a
    # This text is what the arithmetic split has always hashed: its held-out problems (and so the
    # demo's evaluation set and the cached built-in checkpoint) stay what they were.
    return f"{op}|{a}|{b}"


def word_key(kind: str, a: int, b: int) -> str:
    """The key of a word problem: the key of the arithmetic it re-words."""
    if kind not in WORD_OPERATIONS:
        raise ValueError(f"unknown word-problem kind {kind!r}; kinds: {tuple(WORD_OPERATIONS)}")
    return arithmetic_key(WORD_OPERATIONS[kind], a, b)


def prompt_key(prompt: str) -> str:
    """The near-duplicate key of a prompt-file row: its tokens (``_TOKEN``), lower-cased, joined by
    one space; a bare ``a op b`` (``=`` optional) is its arithmetic key instead."""
    tokens = _TOKEN.findall(prompt.lower())
    bare = tokens[:-1] if tokens[-1:] == ["="] else tokens
    if (len(bare) == 3 and bare[1] in ("+", "-", "*") and _NUMBER.fullmatch(bare[0])
            and _NUMBER.fullmatch(bare[2])):
        return arithmetic_key(bare[1], int(bare[0]), int(bare[2]))
    return " ".join(tokens)


def unit(key: str) -> float:
    """The key's stable hash as a number in [0, 1)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def is_held_out(key: str, fraction: float) -> bool:
    """Whether the problem of ``key`` belongs to the held-out side (about ``fraction`` of keys)."""
    return unit(key) < fraction


class HasPrompt(Protocol):
    @property
    def prompt(self) -> str: ...


P = TypeVar("P", bound=HasPrompt)


def split_prompt_file(rows: Sequence[P], n_eval: int, *,
                      source: str = "data.file") -> tuple[list[P], list[P]]:
    """(train, eval) of a prompt file. The ``n_eval`` keys (``prompt_key``) of smallest ``unit``
    are held out (the same rule as ``is_held_out``, with the fraction that holds out exactly
    ``n_eval`` keys); every row of a held-out key leaves training, the first row of each is its
    eval problem, and both lists keep the file's order. ``n_eval == 0`` trains on every row."""
    if n_eval == 0:
        return list(rows), []
    keys = [prompt_key(p.prompt) for p in rows]
    distinct = list(dict.fromkeys(keys))
    if n_eval >= len(distinct):
        raise ValueError(f"run.eval_prompts={n_eval} holds out every prompt of {source} "
                         f"({len(distinct)} distinct, near-duplicates merged): lower "
                         "run.eval_prompts or set run.eval_every=0")
    held = set(sorted(distinct, key=lambda k: (unit(k), k))[:n_eval])
    first: dict[str, P] = {}
    train: list[P] = []
    for key, p in zip(keys, rows, strict=True):
        if key in held:
            first.setdefault(key, p)
        else:
            train.append(p)
    return train, list(first.values())
