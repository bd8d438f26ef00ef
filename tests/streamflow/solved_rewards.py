"""Test-only verifiers for the dynamic sampling tests (imported as "module:function").

``half_solved`` scores every sample of a prompt whose answer is even 1.0 (a solved prompt: its
group has zero reward variance, deterministically) and the others like the built-in ``brevity``;
``all_solved`` scores everything 1.0 (no group ever has variance).
"""

from __future__ import annotations


def half_solved(completion: str, answer: str) -> float:
    if int(answer) % 2 == 0:
        return 1.0
    return 1.0 / (1.0 + len(completion.strip()))


def all_solved(completion: str, answer: str) -> float:
    return 1.0
