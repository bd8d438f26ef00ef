"""The reference stage (workers/reference.py): each row's log-probs land on that row, as float32
lists, whatever the order and lengths of the rows in the claim."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from storage.schema import Lease
from workers.models import TinyModelSpec, build_tiny_model
from workers.packing import PackGroup, packed_response_logprobs
from workers.reference import ReferenceStage
from workers.settings import PackingSettings
from workers.tokenizer import build_char_tokenizer, encode_prompt


@pytest.mark.parametrize("packing", [False, True])
def test_each_row_gets_its_own_log_probs(packing: bool) -> None:
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=64), tok)
    prompts = {7: encode_prompt(tok, "12+34="), 3: encode_prompt(tok, "5+6="),
               9: encode_prompt(tok, "70+8=")}
    # groups interleaved, responses of different lengths, one of them empty
    rows = [(7, [5, 6, 7]), (3, [8]), (7, []), (9, [4, 4, 4, 4, 4]), (3, [9, 2]), (7, [1])]
    batch = pa.RecordBatch.from_pydict({
        "row_id": pa.array(list(range(100, 100 + len(rows))), pa.int64()),
        "group_id": pa.array([g for g, _ in rows], pa.int64()),
        "prompt_ids": pa.array([prompts[g] for g, _ in rows], pa.list_(pa.int32())),
        "response_ids": pa.array([r for _, r in rows], pa.list_(pa.int32())),
    })
    stage = ReferenceStage(model, temperature=1.0, max_rows=64,
                           pack=PackingSettings(packing=packing, packing_min_saving=0.0))
    out = stage.process(Lease(1, "samples", "reference", 0, 0.0, batch))
    assert out.column("row_id").to_pylist() == batch.column("row_id").to_pylist()
    assert out.schema.field("ref_logprobs").type == pa.list_(pa.float32())
    got = out.column("ref_logprobs").to_pylist()
    assert [len(x) for x in got] == [len(r) for _, r in rows]
    assert stage.last_tokens == sum(len(r) for _, r in rows)
    for (gid, response), values in zip(rows, got, strict=True):  # each row scored on its own
        alone = packed_response_logprobs(model, [PackGroup(gid, prompts[gid], [response])],
                                         token_budget=256, pack=False)[0][0]
        assert torch.allclose(torch.tensor(values), alone.float(), atol=1e-5), (gid, response)
