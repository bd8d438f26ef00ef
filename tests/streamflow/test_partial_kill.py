"""A cut trajectory survives the death of the rollout worker resuming it (docs/partial.md).

Real store node and ``workers.main`` rollout processes; this test plays the controller and the
trainer, so every step is a condition, not a race: it writes piece 0 itself (its own
``RolloutStage``, cut after 2 tokens under weights it holds as version 1, written and acked under
a real lease), then starts worker A. A claims ``rollout.1`` and waits, lease held, for version 1
(a resume never uses weights older than the previous piece's) until SIGKILLed. The test then
publishes version 2 and starts worker B, which takes the rows when A's lease expires.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from testkit import wait_until, worker_plan

import storage
from streamflow.plan import resolve_model
from workers.agent.piece_rows import piece_reads
from workers.agent.pieces import Rules
from workers.config import to_json
from workers.engines.base import SamplingParams
from workers.engines.torch_rollout import TorchRolloutEngine
from workers.models.local import load_model, load_tokenizer
from workers.models.tokenizer import encode_prompt
from workers.roles.rollout import RolloutStage
from workers.runtime.leases import write_parts
from workers.schema import ROLLOUT_READS, prompt_rows, samples_table_spec
from workers.weights.file_sync import WeightPublisher, WeightSubscriber

ROOT = Path(__file__).resolve().parents[2]
TABLE, K, MAX_NEW = "samples", 2, 16


class _CutAfterK:
    """The watch of the test's own stage: every generation is cut after K tokens."""

    def arm(self, version: int) -> threading.Event:
        class Cut(threading.Event):
            looks = 0

            def is_set(self) -> bool:
                Cut.looks += 1
                return Cut.looks >= K
        return Cut()

    def close(self) -> None:
        pass


def _perturbed(state: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
            for k, v in state.items()}


def _worker(cfg_record, name: str, tmp_path: Path) -> subprocess.Popen:
    path = tmp_path / f"{name}.json"
    path.write_text(to_json(dataclasses.replace(
        cfg_record, common=dataclasses.replace(cfg_record.common, name=name))))
    return subprocess.Popen([sys.executable, "-m", "workers.main", "--role", "rollout",
                             "--config", str(path)], cwd=ROOT)


@pytest.mark.slow
def test_a_resume_killed_mid_lease_loses_no_acknowledged_token(tiny_config, store_serve,
                                                                tmp_path) -> None:
    # Breaks if a resumer regenerates or drops acked tokens, attributes them to the wrong
    # version, leaves a row unfinished after the kill, or the kill happened outside the lease.
    # no tail cuts: the resume after the kill must end its row (piece 1 is the last one)
    cfg = tiny_config("run.mode=async", "rollout.partial=true", "rollout.partial_max_cuts=2",
                      "rollout.partial_tail_cut=false",
                      f"rollout.max_new_tokens={MAX_NEW}", "rollout.temperature=2.0")
    model_path = resolve_model(cfg, Path(cfg.run.output_dir).parent / ".cache")
    address, _ = store_serve(1)
    client = storage.connect([address])
    procs: list[subprocess.Popen] = []
    try:
        client.create_table(samples_table_spec(TABLE, group_size=2, reference_worker=False,
                                               fsync="never", lease_seconds=1.0, partial_cuts=2))
        tok = load_tokenizer(str(model_path))
        prompts = [encode_prompt(tok, p) for p in ("12+34=", "7+5=")]
        client.put(TABLE, prompt_rows(0, prompts, ["46", "12"], group_size=2,
                                      min_policy_version=0))
        # piece 0, by the test: version 1 = perturbed weights, cut after K tokens
        model = load_model(str(model_path), dtype=torch.float32, attn_implementation="eager")
        engine = TorchRolloutEngine(model, tok, cut_live_fraction=1.0)  # every cut honoured
        engine.load_weights(_perturbed(engine.model.state_dict(), 1), 1)
        weights = tmp_path / "weights"
        stage = RolloutStage(
            engine, WeightSubscriber(weights), SamplingParams(
                temperature=2.0, max_new_tokens=MAX_NEW, stop_token_ids=(tok.eos_token_id,)),
            worker="test", group_size=2, groups_per_claim=2, seed=0, weight_wait_s=1.0,
            rules=Rules(1, MAX_NEW, MAX_NEW, max_cuts=2),
            watch=_CutAfterK(), tail_cut=False)  # type: ignore[arg-type]
        lease = client.claim(TABLE, "rollout", list(ROLLOUT_READS), 4, whole_groups=True,
                             timeout=5.0)
        assert lease.num_rows == 4
        write_parts(client, TABLE, lease, stage.process(lease))
        client.ack(lease)
        # what was acked: piece 0 as rollout.1 reads it (claimed, handed back cleanly)
        seen = client.claim(TABLE, "rollout.1", [*ROLLOUT_READS, *piece_reads(1)], 4,
                            timeout=5.0)
        acked = {r["row_id"]: r for r in seen.batch.to_pylist()}
        client.release(seen)
        assert acked and all(len(r["piece0_ids"]) == K and r["piece0_version"] == 1
                             and r["piece0_end"] == "cut" for r in acked.values())

        record = worker_plan(cfg, tmp_path).rollout
        record = dataclasses.replace(
            record, common=dataclasses.replace(record.common, store_addresses=[address],
                                               table=TABLE, claim_timeout_s=0.2),
            model_path=str(model_path), weights_dir=str(weights), weights_announce=None,
            weight_wait_s=60.0)
        a = _worker(record, "rollout-a", tmp_path)
        procs.append(a)
        wait_until(lambda: client.stats(TABLE).task_total("rollout.1").in_flight > 0,
                   timeout=60, what="worker A holds rollout.1 (waiting for version 1)")
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=10)
        WeightPublisher(weights).publish(_perturbed(engine.model.state_dict(), 2), 2)
        procs.append(_worker(record, "rollout-b", tmp_path))
        wait_until(lambda: client.stats(TABLE).task_total("reward").ready == 4, timeout=60,
                   what="every row's response written")
        stats = client.stats(TABLE)
        assert stats.task_total("rollout.1").redelivered_total >= 1  # A died holding them
        assert all(stats.task_total(t).dead == 0 for t in ("rollout", "rollout.1", "rollout.2"))
        done = client.claim(TABLE, "reward", ["response_ids", "response_logprobs",
                                              "response_version_runs", "policy_version",
                                              "piece0_ids", "piece1_ids", "piece2_ids"], 4,
                            timeout=5.0)
        assert done.num_rows == 4
        for row in done.batch.to_pylist():
            first = acked.get(row["row_id"])
            if first is None:  # ended in piece 0: one version
                assert row["response_version_runs"] == [{"start": 0, "version": 1}]
                continue
            assert row["response_ids"][:K] == first["piece0_ids"] == row["piece0_ids"]
            assert row["response_logprobs"][:K] == first["piece0_logprobs"]
            assert row["response_version_runs"] == [{"start": 0, "version": 1},
                                                     {"start": K, "version": 2}]
            assert row["policy_version"] == 1 and row["piece2_ids"] is None
            assert row["piece1_ids"] == row["response_ids"][K:]
            assert K < len(row["response_ids"]) <= MAX_NEW
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        client.close()
