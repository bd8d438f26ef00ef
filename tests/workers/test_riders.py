"""workers.roles.riding: cut rows continued inside the next rollout call, claimed by the loop,
through a real store."""

from __future__ import annotations

import torch
from testkit import CutAfter, NoNewerFiles, ScriptedWatch

import storage
from workers.agent.pieces import Rules
from workers.engines.base import SamplingParams
from workers.runtime.leases import write_parts
from workers.schema import prompt_rows, samples_table_spec

R = 3


def test_cut_rows_ride_the_next_rollout_call_and_end_as_if_never_cut():
    """Group 0 is cut after 3 tokens; the next rollout call (group 1) takes its rows along
    (``rollout.1`` claimed and acked by the loop's ``Riding``, never by its own stage). Every
    response, the riders' and the new group's, equals what an uncut stage generates. Breaks if
    a rider loses its seed or used draws, if the merged call changes the new rows' seeds, or if
    a rider lease is not written and acked."""
    from workers.engines.torch_rollout import TorchRolloutEngine
    from workers.models.local import TinyModelSpec, build_tiny_model
    from workers.models.tokenizer import build_char_tokenizer, encode_prompt
    from workers.roles.continuation import rollout_stages
    from workers.roles.riding import Riding
    from workers.roles.rollout import RolloutStage

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=32), tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    prompts = [encode_prompt(tok, "1+2="), encode_prompt(tok, "3+4=")]

    def stage(max_cuts: int, watch=None) -> RolloutStage:
        engine = TorchRolloutEngine(model, [], cut_live_fraction=1.0)  # every cut honoured
        rules = Rules(1, 12, 12, max_cuts=max_cuts) if max_cuts else None
        return RolloutStage(engine, NoNewerFiles(), params, worker="r",
                            group_size=2, groups_per_claim=1, seed=1, weight_wait_s=1.0,
                            rules=rules, watch=watch, tail_cut=False)

    with storage.embedded() as store:
        client = store.client()
        client.create_table(samples_table_spec("t", group_size=2, reference_worker=False,
                                               fsync="never",
                                               partial_cuts=R))
        client.put("t", prompt_rows(0, prompts, ["3", "7"], group_size=2, min_policy_version=0))
        cols = list(RolloutStage.columns)
        first, second = (client.claim("t", "rollout", cols, 2, whole_groups=True)
                         for _ in range(2))
        plain = {lease.batch.column("group_id")[0].as_py(): stage(0).process(lease).to_pylist()
                 for lease in (first, second)}
        partial = stage(R, ScriptedWatch(CutAfter(3)))
        write_parts(client, "t", first, partial.process(first))  # cut: segment 0 only
        client.ack(first)
        assert partial.cuts_total == 2
        stages = rollout_stages(partial)
        riding = Riding(client, "t", {s.task: s.columns for s in stages[1:]}, max_rows=4,
                        early_s=None)
        parts = riding.process(partial, second)  # group 0's rows ride along
        write_parts(client, "t", second, parts)
        client.ack(second)
        assert riding.rows_total == 2
        stats = client.stats("t")
        assert stats.task_total("rollout.1").consumed == 4  # 2 rode, 2 skipped (ended uncut)
        assert stats.task_total("rollout.1").in_flight == 0
        lease = client.claim("t", "reward", ["group_id", "response_ids", "response_logprobs"], 8)
    got: dict[int, list] = {}
    for row in lease.batch.to_pylist():
        got.setdefault(row["group_id"], []).append(row)
    assert sorted(got) == [0, 1]
    for gid, rows in got.items():
        expect = sorted(r["response_ids"] for r in plain[gid])
        assert sorted(r["response_ids"] for r in rows) == expect
