"""Test-only verifiers for the fault tests (imported by reward workers as "module:function").

``poison`` crashes on every sample whose answer is ``$STREAMFLOW_TEST_POISON_ANSWER`` (one prompt
of the run) and scores the rest like the built-in ``brevity``; ``always_fails`` crashes on every
sample (a systematic failure).
"""

from __future__ import annotations

import os

POISON_ENV = "STREAMFLOW_TEST_POISON_ANSWER"


def poison(completion: str, answer: str) -> float:
    if answer == os.environ.get(POISON_ENV):
        raise RuntimeError(f"poison sample (answer {answer})")
    return 1.0 / (1.0 + len(completion.strip()))


def always_fails(completion: str, answer: str) -> float:
    raise RuntimeError("this verifier is broken")
