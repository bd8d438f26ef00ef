"""A user verifier for the network-cut test: the built-in ``brevity`` score, 0.25 s per sample,
so a reward worker holds its lease long enough for a cut to catch it mid-work."""

from __future__ import annotations

import time

from workers.rewards import brevity


def score(completion: str, answer: str) -> float:
    time.sleep(0.25)
    return brevity(completion, answer)
