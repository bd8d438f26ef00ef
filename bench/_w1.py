"""Workload W1 of the store benchmark, defined once: the columns, table spec and rows that the
benchmark's processes (``bench.store``) and the null node (``bench._store_ceiling``) share.

W1 is RL-shaped on purpose (the store must carry these columns well), which is why it lives with
the benchmarks and not in ``storage``, which knows tables and tasks but no RL. A row:
``prompt_ids`` int32[128], ``response_ids`` int32[512], ``response_logprobs`` float32[512], later
``reward`` float32 (written by the reward task) and ``ref_logprobs`` float32[512] (reference task).
The consumers write each row's first response token as its ``reward`` and as every entry of its
``ref_logprobs``, so the trainer can check that each row arrives with its own upstream values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

PROMPT_LEN, RESPONSE_LEN, MICRO = 128, 512, 64
W1_TASKS = {"reward": ("response_ids",), "reference": ("prompt_ids", "response_ids")}
ALL_COLUMNS = ["prompt_ids", "response_ids", "response_logprobs", "reward", "ref_logprobs"]


def w1_schema() -> pa.Schema:
    return pa.schema(
        [
            ("prompt_ids", pa.list_(pa.int32())),
            ("response_ids", pa.list_(pa.int32())),
            ("response_logprobs", pa.list_(pa.float32())),
            ("reward", pa.float32()),
            ("ref_logprobs", pa.list_(pa.float32())),
        ]
    )


def w1_spec(name: str = "w1") -> Any:
    from storage.schema import TableSpec, TaskSpec

    tasks = (
        TaskSpec("reward", W1_TASKS["reward"]),
        TaskSpec("reference", W1_TASKS["reference"]),
        TaskSpec("trainer", tuple(ALL_COLUMNS)),
    )
    return TableSpec(name, w1_schema(), tasks, lease_seconds=60.0)


def lists(values: np.ndarray, width: int, typ: pa.DataType) -> pa.Array:
    """``values`` cut into fixed-``width`` list cells (zero-copy offsets)."""
    n = len(values) // width
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * width)
    return pa.ListArray.from_arrays(offsets, pa.array(values, type=typ))


def w1_batch(start: int, n: int, rng: np.random.Generator) -> pa.RecordBatch:
    """n producer rows; response_ids[i][0] = start + i so the trainer can check values."""
    resp = rng.integers(0, 32000, size=(n, RESPONSE_LEN), dtype=np.int32)
    resp[:, 0] = np.arange(start, start + n, dtype=np.int32)
    return pa.RecordBatch.from_arrays(
        [
            lists(
                rng.integers(0, 32000, size=n * PROMPT_LEN, dtype=np.int32), PROMPT_LEN, pa.int32()
            ),
            lists(resp.ravel(), RESPONSE_LEN, pa.int32()),
            lists(
                rng.standard_normal(n * RESPONSE_LEN, dtype=np.float32), RESPONSE_LEN, pa.float32()
            ),
        ],
        names=["prompt_ids", "response_ids", "response_logprobs"],
    )


def first_token(batch: pa.RecordBatch) -> np.ndarray:
    """Each row's first response token: the value its reward and reference consumers write."""
    col = batch.column("response_ids")
    return col.values.to_numpy()[col.offsets.to_numpy()[:-1]]


def reward_column(first: np.ndarray) -> pa.Array:
    return pa.array(first.astype(np.float32))


def ref_logprobs_column(first: np.ndarray) -> pa.Array:
    return lists(np.repeat(first.astype(np.float32), RESPONSE_LEN), RESPONSE_LEN, pa.float32())


def w1_full_batch(start: int, n: int, rng: np.random.Generator) -> pa.RecordBatch:
    """n rows with all five columns, ``reward``/``ref_logprobs`` as the consumers write them."""
    base = w1_batch(start, n, rng)
    first = first_token(base)
    return base.append_column("reward", reward_column(first)).append_column(
        "ref_logprobs", ref_logprobs_column(first)
    )
