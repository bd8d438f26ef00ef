"""Test-only verifiers for the fault tests (imported by reward workers as "module:function").

``poison`` crashes on every sample whose answer is ``$STREAMFLOW_TEST_POISON_ANSWER`` (one prompt
of the run) and scores the rest like the built-in ``brevity``; ``always_fails`` crashes on every
sample (a systematic failure); ``slow`` is ``brevity`` taking 0.1 s per sample, so that a reward
worker holds each lease for a while and the trainer waits on its rows: the fault tests' tiny runs
otherwise pass an iteration in ~30 ms, faster than a test can catch a worker holding a lease.
"""

from __future__ import annotations

import os
import time

POISON_ENV = "STREAMFLOW_TEST_POISON_ANSWER"


def poison(completion: str, answer: str) -> float:
    if answer == os.environ.get(POISON_ENV):
        raise RuntimeError(f"poison sample (answer {answer})")
    return 1.0 / (1.0 + len(completion.strip()))


def always_fails(completion: str, answer: str) -> float:
    raise RuntimeError("this verifier is broken")


def slow(completion: str, answer: str) -> float:
    time.sleep(0.1)
    return 1.0 / (1.0 + len(completion.strip()))
