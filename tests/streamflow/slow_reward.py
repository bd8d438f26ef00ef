"""A user verifier for the network-cut test: the built-in ``brevity`` score, 0.25 s per sample,
so a reward worker holds its lease long enough for a cut to catch it mid-work.

With ``STREAMFLOW_TEST_SCORING_DIR`` set, each score first appends its start time (``time.time()``)
to a file in that directory named after the scoring process's network namespace (``net:[inode]``,
as ``/proc/<pid>/ns/net`` shows it): how the test sees that a worker in a namespace is scoring."""

from __future__ import annotations

import os
import time
from pathlib import Path

from workers.tasks.verifiers import brevity

SCORING_DIR_ENV = "STREAMFLOW_TEST_SCORING_DIR"


def score(completion: str, answer: str) -> float:
    marks = os.environ.get(SCORING_DIR_ENV)
    if marks:
        with open(Path(marks) / os.readlink("/proc/self/ns/net"), "a") as f:
            f.write(f"{time.time()}\n")
    time.sleep(0.25)  # the slowness is the behaviour: a lease held while the work goes on
    return brevity(completion, answer)
