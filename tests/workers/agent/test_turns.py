"""Multi-turn trajectories over a real (embedded) store: the turn tasks in order, the assembled
response, a turn written and never acked (the lease expires; the successor keeps the written
cells), ended trajectories passing through the later tasks until every row is freed, and the
torch engine generating a later turn from its context."""

from __future__ import annotations

import threading
from contextlib import closing
from dataclasses import replace

import pyarrow as pa
import pytest
import torch
from testkit import wait_until

import storage
from storage.schema import ROW_ID
from workers.agent.environments import CalculatorEnvironment
from workers.agent.pieces import History, Rules, model_piece, observation
from workers.agent.toolcall import marker_ids
from workers.engines.base import FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams
from workers.models.local import TinyModelSpec, build_tiny_model
from workers.models.tokenizer import build_char_tokenizer, encode_prompt
from workers.roles.continuation import rollout_stages as stages_of
from workers.roles.environment import environment_stages
from workers.roles.loop import StageLoop, serve_stages
from workers.roles.rollout import RolloutStage, turn_seed
from workers.runtime.events import EventSender
from workers.runtime.leases import write_parts
from workers.schema import prompt_rows, samples_table_spec
from workers.settings import AgentSettings

TABLE = "samples"
G = 2
TOK = build_char_tokenizer()
EOS = TOK.eos_token_id
# What the scripted model says in each turn of a prompt ("$": the eos token; without one it repeats
# its last token up to its limit, so it runs past the two-token end marker "=)" as a real engine
# that cannot stop on it does).
SCRIPTS = {"12*34+5=": ["(=12*34=)55", "(=408+5=)", "413$"], "1+1=": ["2$"],
           "7*8=": ["(=7*8=)", "(=56=)", "(=56=)"], "9-9=": ["(=1+1+1+1+1+1+1+1+1+1+1+1=)", "555"],
           "8-8=": ["(=" + "1+" * 17 + "1=)"]}
AGENT = AgentSettings(max_turns=3, max_total_tokens=40, max_observation_tokens=8,
                      fn="calculator", format="plain")


def ids(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"])


def logprobs(n: int, version: int) -> list[float]:
    return [-(k + 1) / 64 - version for k in range(n)]  # exact in float32


class ScriptedEngine:
    """A RolloutEngine that says its prompt's script, one entry per turn (the turn = the tool
    calls in the context so far); the log-prob of token k is -(k+1)/64 - policy_version."""

    def __init__(self) -> None:
        self.policy_version = 0
        self.calls = 0

    def generate(self, prompts, n, params):  # noqa: ANN001, ANN201
        self.calls += 1
        out = []
        for context in prompts:
            text = TOK.decode(context, skip_special_tokens=True)
            prompt = next(p for p in SCRIPTS if text.startswith(p))
            line = SCRIPTS[prompt][text.count("=)")]
            tokens = ids(line.rstrip("$")) + ([EOS] if line.endswith("$") else [])
            if not line.endswith("$"):  # no stop token: it babbles on to its limit
                tokens += tokens[-1:] * (params.max_new_tokens - len(tokens))
            stop = next((k for k, t in enumerate(tokens) if t in params.stop_token_ids), None)
            keep = min(params.max_new_tokens, len(tokens) if stop is None else stop + 1)
            finish = FINISH_STOP if stop is not None and stop < keep else FINISH_LENGTH
            sample = Generation(tokens[:keep], logprobs(keep, self.policy_version), finish)
            out.append([sample] * n)
        return out

    def load_weights(self, weights, version):  # noqa: ANN001, ANN201
        raise AssertionError("no weights are published in these tests")


class NoWeights:
    def newest(self) -> None:
        return None


def rollout_stages(engine, *, max_new_tokens: int = 40):  # noqa: ANN001, ANN201
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(EOS,))
    rules = Rules(AGENT.max_turns, max_new_tokens, AGENT.max_total_tokens,
                  marker_ids(TOK, "plain"))
    first = RolloutStage(engine, NoWeights(), params, worker="r", group_size=G,
                         groups_per_claim=4, seed=3, weight_wait_s=1.0, rules=rules,
                         tail_cut=False)
    return stages_of(first)


def env_stages():  # noqa: ANN201
    return environment_stages(CalculatorEnvironment(), TOK, AGENT, max_cuts=0, max_rows=8)


def put(client, prompts: list[str]) -> None:  # noqa: ANN001
    client.put(TABLE, prompt_rows(0, [encode_prompt(TOK, p) for p in prompts], ["0"] * len(prompts),
                                  group_size=G, min_policy_version=0))


def loop(client, stage) -> StageLoop:  # noqa: ANN001
    return StageLoop(client, TABLE, stage, worker="w", role="agent",
                     events=EventSender(None, trace=False))


def run(loops: list[StageLoop]) -> int:
    """One turn of each loop, then a flush (its write+ack): the rows processed."""
    done = sum(max(lp.turn(0.0), 0) for lp in loops)
    for lp in loops:
        lp.flush()
    return done


RESULT = ["prompt_ids", "response_ids", "response_logprobs", "response_loss_mask",
          "policy_version", "finish_reason", "piece0_version", "piece2_version", "piece4_version",
          "response_version_runs"]


def results(client) -> list[dict]:  # noqa: ANN001
    lease = client.claim(TABLE, "reward", RESULT, 64, timeout=0.0)
    client.ack(lease)
    return lease.batch.to_pylist()


def expected_three_turns(versions: tuple[int, int, int]) -> dict:
    turns = [ids("(=12*34=)"), ids("(=408+5=)"), ids("413") + [EOS]]
    obs = [ids("408 "), ids("413 ")]
    response, lps, mask = [], [], []
    for t, (turn, version) in enumerate(zip(turns, versions, strict=True)):
        response += turn
        lps += logprobs(len(turn), version)
        mask += [1] * len(turn)
        if t < 2:
            response += obs[t]
            lps += [0.0] * len(obs[t])
            mask += [0] * len(obs[t])
    return {"response_ids": response, "response_logprobs": lps, "response_loss_mask": mask,
            "policy_version": versions[0], "finish_reason": "stop"}


def test_three_calculator_turns_assemble_exactly() -> None:
    engine = ScriptedEngine()
    with storage.embedded(2) as store:
        client = store.client()
        client.create_table(samples_table_spec(TABLE, group_size=G, reference_worker=False,
                                               fsync="never",
                                               max_turns=3))
        put(client, ["12*34+5="])
        r0, r1, r2 = (loop(client, s) for s in rollout_stages(engine))
        e0, e1 = (loop(client, s) for s in env_stages())
        for step, version in ((r0, 0), (e0, None), (r1, 1), (e1, None), (r2, 2)):
            if version is not None:
                engine.policy_version = version  # each turn on a newer policy
            assert run([step]) == G
        rows = results(client)
        assert len(rows) == G
        want = expected_three_turns((0, 1, 2))
        for row in rows:
            assert {k: row[k] for k in want} == want
            assert (row["piece0_version"], row["piece2_version"], row["piece4_version"]) == (
                0, 1, 2)
            assert [r["version"] for r in row["response_version_runs"]] == [0, 1, 2]


def test_a_turn_written_but_never_acked_is_kept_once() -> None:
    """The worker of turn 1 writes and dies before its ack; its lease expires, and the next
    worker's write is refused cell by cell: the predecessor's turn stands, written once."""
    engine = ScriptedEngine()
    spec = replace(samples_table_spec(TABLE, group_size=G, reference_worker=False, fsync="never",
                                      max_turns=3),
                   lease_seconds=1.0)
    with storage.embedded(1) as store:
        client = store.client()
        client.create_table(spec)
        put(client, ["12*34+5="])
        r0, r1, r2 = rollout_stages(engine)
        e0, e1 = env_stages()
        assert run([loop(client, r0)]) == G and run([loop(client, e0)]) == G
        engine.policy_version = 1
        lease = client.claim(TABLE, r1.task, list(r1.columns), 8, timeout=5.0)
        assert lease.num_rows == G
        assert write_parts(client, TABLE, lease, r1.process(lease)) == 0  # ... and dies
        wait_until(lambda: client.stats(TABLE).task_total(r1.task).ready == G, timeout=30,
                   what="the dead worker's rows claimable again")
        engine.policy_version = 2  # the successor's turn would differ: it must not be written
        calls = engine.calls
        assert run([loop(client, r1)]) == G
        assert engine.calls == calls + 1  # (it cannot see the written cells before writing)
        stats = client.stats(TABLE).task_total(r1.task)
        assert (stats.consumed, stats.redelivered_total, stats.ready) == (G, G, 0)
        assert run([loop(client, e1)]) == G
        engine.policy_version = 3
        assert run([loop(client, r2)]) == G
        for row in results(client):
            want = expected_three_turns((0, 1, 3))
            assert {k: row[k] for k in want} == want
            assert row["response_ids"].count(ids("(")[0]) == 2  # turn 1's call once, not twice


def test_ended_trajectories_pass_through_and_every_row_is_freed() -> None:
    engine = ScriptedEngine()
    prompts = ["12*34+5=", "1+1=", "7*8=", "9-9=", "8-8="]
    with storage.embedded(2) as store:
        client = store.client()
        client.create_table(samples_table_spec(TABLE, group_size=G, reference_worker=False,
                                               fsync="never",
                                               max_turns=3))
        put(client, prompts)
        stop = threading.Event()

        def worker(stages) -> None:  # noqa: ANN001
            with closing(store.client()) as own:  # a client per thread
                serve_stages(own, TABLE, stages, stop, worker="w", role="agent",
                             events=EventSender(None, trace=False), timeout_s=0.2)

        threads = [threading.Thread(target=worker, args=(s,))
                   for s in (rollout_stages(engine), env_stages())]
        for th in threads:
            th.start()
        try:
            # An ended row is ready for ``reward`` before the later turn tasks ack its NULL
            # cells, so wait for both: every trajectory ended, every turn task drained.
            chain = ("rollout", "env.1", "rollout.2", "env.3", "rollout.4")

            def drained() -> bool:
                stats = client.stats(TABLE)
                return (stats.task_total("reward").ready == G * len(prompts)
                        and all(stats.task_total(t).consumed == G * len(prompts) for t in chain))

            wait_until(drained, timeout=30, what="every trajectory ended and every turn acked")
        finally:
            stop.set()
            for th in threads:
                th.join(timeout=30)
        stats = client.stats(TABLE)
        for task in chain:
            t = stats.task_total(task)
            assert (t.consumed, t.ready, t.in_flight, t.pending) == (G * len(prompts), 0, 0, 0), task
        by_prompt = {}
        lease = client.claim(TABLE, "reward", RESULT, 64, timeout=0.0)
        for row in lease.batch.to_pylist():
            text = TOK.decode(row["prompt_ids"], skip_special_tokens=True)
            response = TOK.decode(row["response_ids"], skip_special_tokens=True)
            by_prompt[text] = (row["finish_reason"], response, row["response_loss_mask"])
        budget = "(=1+1+1+1+1+1+1+1+1+1+1+1=)12 " + "5" * 10  # 27 + 3 tokens: 10 of 40 left
        assert by_prompt == {
            "12*34+5=": ("stop", "(=12*34=)408 (=408+5=)413 413", [1] * 9 + [0] * 4 + [1] * 9
                         + [0] * 4 + [1] * 4),
            "1+1=": ("stop", "2", None),  # ended at turn 0 (its eos is not shown): all model
            "7*8=": ("tool", "(=7*8=)56 (=56=)56 (=56=)", [1] * 7 + [0] * 3 + [1] * 6 + [0] * 3
                     + [1] * 6),  # out of turns
            "9-9=": ("budget", budget, [1] * 27 + [0] * 3 + [1] * 10),
            # 39 tokens + "18 " would pass 40: the environment ends it, nothing appended
            "8-8=": ("budget", "(=" + "1+" * 17 + "1=)", None),
        }
        reward = pa.RecordBatch.from_pydict({
            "reward": pa.array([1.0] * lease.num_rows, pa.float32()),
            "reward_ok": [True] * lease.num_rows,
            "reward_error": pa.array([None] * lease.num_rows, pa.string())})
        client.write(TABLE, lease, reward, ack=True)
        trainer = client.claim(TABLE, "trainer", ["group_id"], 64, whole_groups=True, timeout=0.0)
        assert trainer.num_rows == G * len(prompts)
        assert sum(s.rows for s in client.stats(TABLE).shards) == G * len(prompts)
        client.write(TABLE, trainer, pa.RecordBatch.from_pydict(
            {"advantage": pa.array([0.0] * trainer.num_rows, pa.float32())}), ack=True)
        assert sum(s.rows for s in client.stats(TABLE).shards) == 0  # every row freed


@pytest.fixture(scope="module")
def char_model():  # noqa: ANN201
    torch.set_num_threads(1)
    return build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2,
                                          num_kv_heads=1, intermediate_size=64), TOK)


class FirstTurnScripted:
    """The torch engine, except that turn 0 is the scripted tool call (the untrained model would
    not emit one): later turns are the real engine's, generated from the row's context."""

    def __init__(self, real) -> None:  # noqa: ANN001
        self.real, self.script = real, ScriptedEngine()
        self.policy_version = 0

    def generate(self, prompts, n, params):  # noqa: ANN001, ANN201
        first = all(TOK.decode(p, skip_special_tokens=True).count("=)") == 0 for p in prompts)
        return (self.script if first else self.real).generate(prompts, n, params)


def test_the_torch_engine_generates_turn_one_from_the_context(char_model) -> None:  # noqa: ANN001
    from workers.engines.torch_rollout import TorchRolloutEngine

    real = TorchRolloutEngine(char_model, TOK)
    agent = replace(AGENT, max_turns=2)
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(EOS,))
    rules = Rules(2, 12, agent.max_total_tokens, marker_ids(TOK, "plain"))
    r0 = RolloutStage(FirstTurnScripted(real), NoWeights(), params, worker="r", group_size=G,
                      groups_per_claim=1, seed=3, weight_wait_s=1.0, rules=rules,
                      tail_cut=False)
    (_, r1) = stages_of(r0)
    (e0,) = environment_stages(CalculatorEnvironment(), TOK, agent, max_cuts=0, max_rows=8)
    with storage.embedded(1) as store:
        client = store.client()
        client.create_table(samples_table_spec(TABLE, group_size=G, reference_worker=False,
                                               fsync="never",
                                               max_turns=2))
        put(client, ["7*8="])
        for stage in (r0, e0, r1):
            assert run([loop(client, stage)]) == G
        lease = client.claim(TABLE, "reward", [*RESULT[:6], "group_id", "piece2_ids"], 8,
                             timeout=0.0)
        turn0, obs = ids("(=7*8=)"), ids("56 ")
        hist = History((model_piece(turn0, logprobs(7, 0), 0, "tool"), observation(obs)))
        seeds = set()
        for row in lease.batch.to_pylist():
            assert row["response_ids"][:10] == turn0 + obs
            turn1 = row["response_ids"][10:]
            assert turn1 == row["piece2_ids"] and len(turn1) >= 1
            assert row["response_loss_mask"] == [1] * 7 + [0] * 3 + [1] * len(turn1)
            # the real engine, asked directly with the row's context and seed, says the same
            seed = turn_seed(3, row["group_id"], 1, 0, row[ROW_ID])
            seeds.add(seed)
            direct = real.generate([encode_prompt(TOK, "7*8=") + turn0 + obs], 1, replace(
                rules.params(params, [hist]), seed=seed, prompt_seeds=(seed,)))[0][0]
            want = rules.close(direct, hist, version=0, seed=seed)
            assert turn1 == list(want.ids)  # (log-probs to float rounding: a batch of two pads)
            assert row["response_logprobs"][10:] == pytest.approx(want.logprobs, abs=1e-5)
            assert row["finish_reason"] == want.end
        assert len(seeds) == G  # each row of the group draws its own tokens


def test_the_environment_record_round_trips_and_builds_a_stage_per_turn(tmp_path) -> None:  # noqa: ANN001
    from workers.config import EnvironmentWorkerConfig, WorkerCommon, from_json, to_json
    from workers.roles.environment import build_environment

    TOK.save_pretrained(tmp_path)
    common = WorkerCommon(name="env-0", role="environment", store_addresses=[], table=TABLE,
                          seed=3, threads=1, trace_rows=False)
    cfg = EnvironmentWorkerConfig(common=common, model_path=str(tmp_path), rows_per_claim=8,
                                  agent=AGENT)
    back = from_json("environment", to_json(cfg))
    assert back == cfg and isinstance(back.agent, AgentSettings)
    assert [s.task for s in build_environment(back)] == ["env.1", "env.3"]
    with pytest.raises(ValueError, match="max_turns >= 2"):
        build_environment(replace(cfg, agent=replace(AGENT, max_turns=1)))
