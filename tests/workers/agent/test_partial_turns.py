"""Partial rollout of multi-turn trajectories over a real (embedded) store: a newer policy
version cuts a turn in the middle (the engine honours the cut event at a token boundary, as
``Interruptible`` engines do), the row is continued with the newer weights, and the assembled
response's ids, loss mask, log-probs and per-token versions are exact; then every task of a
rollout worker (riders, early writes) and an environment worker, run as threads, leave exactly
the uncut trajectories with consistent versions and free every row."""

from __future__ import annotations

import threading
from contextlib import closing

import pyarrow as pa
from test_turns import AGENT, EOS, SCRIPTS, TABLE, TOK, G, ids, put, run
from testkit import CutAfter, ScriptedWatch, wait_until

import storage
from workers.agent.environments import CalculatorEnvironment
from workers.agent.pieces import Rules
from workers.agent.toolcall import marker_ids
from workers.engines.base import (
    FINISH_CUT,
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    Interruptible,
    SamplingParams,
)
from workers.roles.continuation import rollout_stages
from workers.roles.environment import environment_stages
from workers.roles.loop import StageLoop, serve_stages
from workers.roles.rollout import RolloutStage
from workers.runtime.events import EventSender
from workers.schema import samples_table_spec

R = 2  # rollout.partial_max_cuts
RESULT = ["prompt_ids", "response_ids", "response_logprobs", "response_loss_mask",
          "policy_version", "finish_reason", "response_version_runs",
          *(f"piece{k}_{c}" for k in range(7) for c in ("ids", "version", "end"))]


def lp(position: int, version: int) -> float:
    return -(position + 1) / 64 - version  # exact in float32


class CuttableScript:
    """A RolloutEngine that says its prompt's script, one entry per turn, and can be cut: the
    turn is read from the context without the used draws (``done_tokens``), a continuation goes
    on from its ``done``-th token, and token k of a turn has log-prob -(k+1)/64 - version.
    ``generate_until`` looks at ``cut`` once per step while rows are live, and cuts them there."""

    def __init__(self) -> None:
        self.policy_version = 0

    def _rows(self, prompts, n, params):  # noqa: ANN001, ANN202
        out = []
        done = params.done_tokens or (0,) * len(prompts)
        for context, d in zip(prompts, done, strict=True):
            text = TOK.decode(context[:len(context) - d], skip_special_tokens=True)
            line = SCRIPTS[next(p for p in SCRIPTS if text.startswith(p))][text.count("=)")]
            tokens = ids(line.rstrip("$")) + ([EOS] if line.endswith("$") else [])
            if not line.endswith("$"):  # no stop token: it babbles on to its limit
                tokens += tokens[-1:] * (d + params.max_new_tokens - len(tokens))
            tokens = tokens[d:]
            stop = next((k for k, t in enumerate(tokens) if t in params.stop_token_ids), None)
            keep = min(params.max_new_tokens, len(tokens) if stop is None else stop + 1)
            finish = FINISH_STOP if stop is not None and stop < keep else FINISH_LENGTH
            gen = Generation(tokens[:keep], [lp(d + k, self.policy_version)
                                             for k in range(keep)], finish)
            out += [gen] * n
        return out

    def generate(self, prompts, n, params):  # noqa: ANN001, ANN201
        flat = self._rows(prompts, n, params)
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]

    def generate_until(self, prompts, n, params, cut, on_done=None):  # noqa: ANN001, ANN201
        flat = self._rows(prompts, n, params)
        for step in range(1, max(len(g.token_ids) for g in flat) + 1):
            for i, g in enumerate(flat):
                if len(g.token_ids) == step and on_done is not None:
                    on_done(i, g)
            live = [i for i, g in enumerate(flat) if len(g.token_ids) > step]
            if live and cut.is_set():
                for i in live:
                    g = flat[i]
                    flat[i] = Generation(g.token_ids[:step], g.logprobs[:step], FINISH_CUT)
                break
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]

    def load_weights(self, weights, version):  # noqa: ANN001, ANN201
        self.policy_version = version


class Published:
    """A WeightSubscriber: ``version`` is the newest published."""

    directory = "/nonexistent"

    def __init__(self) -> None:
        self.version = 0

    def newest(self) -> int:
        return self.version

    def load(self, version: int):  # noqa: ANN201
        return {}, 0


def stages(engine, weights, watch):  # noqa: ANN001, ANN201
    rules = Rules(AGENT.max_turns, 40, AGENT.max_total_tokens, marker_ids(TOK, "plain"),
                  max_cuts=R)
    first = RolloutStage(engine, weights, SamplingParams(max_new_tokens=40, stop_token_ids=(EOS,)),
                         worker="r", group_size=G, groups_per_claim=4, seed=3, weight_wait_s=1.0,
                         rules=rules, watch=watch, tail_cut=False)
    return {s.task: s for s in [*rollout_stages(first), *environment_stages(
        CalculatorEnvironment(), TOK, AGENT, max_cuts=R, max_rows=8)]}


def table():  # noqa: ANN201
    return samples_table_spec(TABLE, group_size=G, reference_worker=False, fsync="never",
                              max_turns=AGENT.max_turns, partial_cuts=R)


def test_a_turn_cut_mid_marker_resumes_with_newer_weights_and_assembles_exactly() -> None:
    """Turn 0 is cut after 8 tokens, between the two tokens of its end marker ("=)"), and goes
    on under version 1: the continuation is the one token ")" (the marker found across the cut).
    Turn 1 is cut after 4 tokens and goes on under version 2. Turn 2's call is cut too, but the
    trajectory has had its R cuts: the stage continues it at once, uncut. Breaks if a piece is
    attributed to the wrong version, a continuation redraws used tokens, the marker split by a
    cut is missed, or the runs do not say which version sampled which token."""
    engine, weights = CuttableScript(), Published()
    by_task = stages(engine, weights, ScriptedWatch(CutAfter(8), threading.Event(), CutAfter(4),
                                          threading.Event(), CutAfter(2)))
    with storage.embedded(1) as store:
        client = store.client()
        client.create_table(table())
        put(client, ["12*34+5="])
        for task, version in (("rollout", 0), ("rollout.1", 1), ("env.2", None),
                              ("rollout.3", None), ("rollout.4", 2), ("env.5", None),
                              ("rollout.6", None)):
            if version is not None:
                weights.version = version  # published: the next call loads it
            assert run([StageLoop(client, TABLE, by_task[task], worker="w", role="r",
                                  events=EventSender(None, trace=False))]) == G, task
        lease = client.claim(TABLE, "reward", RESULT, 8, timeout=0.0)
        stats = client.stats(TABLE)
    assert lease.num_rows == G
    turns = [ids("(=12*34=)"), ids("(=408+5=)"), ids("413") + [EOS]]
    obs = [ids("408 "), ids("413 ")]
    versions = [[0] * 8 + [1], [1] * 4 + [2] * 5, [2] * 4]  # per token of each turn
    response, logprobs, mask = [], [], []
    for t, turn in enumerate(turns):
        response += turn
        logprobs += [lp(p, versions[t][p]) for p in range(len(turn))]
        mask += [1] * len(turn)
        if t < 2:
            response += obs[t]
            logprobs += [0.0] * len(obs[t])
            mask += [0] * len(obs[t])
    for row in lease.batch.to_pylist():
        assert row["response_ids"] == response
        assert row["response_logprobs"] == logprobs
        assert row["response_loss_mask"] == mask
        assert (row["policy_version"], row["finish_reason"]) == (0, "stop")
        assert row["response_version_runs"] == [{"start": 0, "version": 0},
                                                {"start": 8, "version": 1},
                                                {"start": 17, "version": 2}]
        pieces = [(row[f"piece{k}_ids"], row[f"piece{k}_version"], row[f"piece{k}_end"])
                  for k in range(7)]
        assert pieces == [
            (turns[0][:8], 0, "cut"), (turns[0][8:], 1, "tool"), (obs[0], None, "observation"),
            (turns[1][:4], 1, "cut"), (turns[1][4:], 2, "tool"), (obs[1], None, "observation"),
            (turns[2], 2, "stop")]  # turn 2's cut past the bound never stands
    for task in ("env.1", "rollout.2", "env.3", "env.4", "rollout.5"):  # skipped: never claimed
        t = stats.task_total(task)
        assert (t.consumed, t.redelivered_total, t.in_flight) == (G, 0, 0), task


class EveryCall:
    """A VersionWatch that cuts every call after ``k`` looks."""

    def __init__(self, k: int) -> None:
        self.k = k

    def arm(self, version: int) -> threading.Event:
        return CutAfter(self.k)

    def close(self) -> None:
        pass


class Publishing(Published):
    """Each look finds a newer version, up to ``last``: every call runs on newer weights."""

    def __init__(self, last: int) -> None:
        super().__init__()
        self.last = last

    def newest(self) -> int:
        self.version = min(self.version + 1, self.last)
        return self.version


def test_workers_cut_every_call_and_leave_exact_trajectories_and_no_row_behind() -> None:
    """A rollout worker (its stages, riders and early writes through ``serve_stages``) and an
    environment worker, as threads: every call is cut after 3 tokens and every call loads a
    newer version. Each trajectory is the uncut one (the script's), its log-probs are those of
    the version its runs name for each token, and every row is freed. Breaks if a cut loses or
    repeats tokens, a row is continued past its bound, or a trajectory never ends."""
    engine, weights = CuttableScript(), Publishing(last=9)
    by_task = stages(engine, weights, EveryCall(3))
    prompts = ["12*34+5=", "1+1=", "7*8=", "9-9=", "8-8="]
    rows = G * len(prompts)
    rollout = [s for s in by_task.values() if s.task.startswith("rollout")]
    env = [s for s in by_task.values() if s.task.startswith("env")]
    with storage.embedded(2) as store:
        client = store.client()
        client.create_table(table())
        put(client, prompts)
        stop = threading.Event()

        def worker(served) -> None:  # noqa: ANN001
            with closing(store.client()) as own:  # a client per thread
                serve_stages(own, TABLE, served, stop, worker="w", role="r",
                             events=EventSender(None, trace=False), timeout_s=0.2)

        threads = [threading.Thread(target=worker, args=(s,)) for s in (rollout, env)]
        for th in threads:
            th.start()
        tasks = [t.name for t in table().tasks if t.name.startswith(("rollout", "env"))]
        try:
            def drained() -> bool:
                stats = client.stats(TABLE)
                return (stats.task_total("reward").ready == rows
                        and all(stats.task_total(t).consumed == rows for t in tasks))

            wait_until(drained, timeout=60, what="every trajectory ended, every task drained")
        finally:
            stop.set()
            for th in threads:
                th.join(timeout=30)
        assert isinstance(engine, Interruptible) and by_task["rollout"].cuts_total > 0
        lease = client.claim(TABLE, "reward", RESULT, 64, timeout=0.0)
        uncut = {  # the texts and masks of tests/workers/agent/test_turns.py
            "12*34+5=": ("stop", "(=12*34=)408 (=408+5=)413 413"),
            "1+1=": ("stop", "2"), "7*8=": ("tool", "(=7*8=)56 (=56=)56 (=56=)"),
            "9-9=": ("budget", "(=1+1+1+1+1+1+1+1+1+1+1+1=)12 " + "5" * 10),
            "8-8=": ("budget", "(=" + "1+" * 17 + "1=)")}
        for row in lease.batch.to_pylist():
            prompt = TOK.decode(row["prompt_ids"], skip_special_tokens=True)
            said = TOK.decode(row["response_ids"], skip_special_tokens=True)
            assert (row["finish_reason"], said) == uncut[prompt], prompt
            runs = row["response_version_runs"]
            assert runs[0] == {"start": 0, "version": row["policy_version"]}
            assert [r["version"] for r in runs] == sorted({r["version"] for r in runs})
            starts = [r["start"] for r in runs] + [len(row["response_ids"])]
            version = [r["version"] for i, r in enumerate(runs)
                       for _ in range(starts[i], starts[i + 1])]
            mask = row["response_loss_mask"] or [1] * len(row["response_ids"])
            position = 0  # the token's place in its turn
            for i, (m, got) in enumerate(zip(mask, row["response_logprobs"], strict=True)):
                if not m:
                    assert got == 0.0
                    position = 0
                    continue
                assert got == lp(position, version[i]), (prompt, i)
                position += 1
            cuts = sum(row[f"piece{k}_end"] == "cut" for k in range(7))
            assert cuts <= R
        client.write(TABLE, lease, pa.RecordBatch.from_pydict({
            "reward": pa.array([1.0] * lease.num_rows, pa.float32()),
            "reward_ok": [True] * lease.num_rows,
            "reward_error": pa.array([None] * lease.num_rows, pa.string())}), ack=True)
        trainer = client.claim(TABLE, "trainer", ["group_id"], 64, whole_groups=True, timeout=0.0)
        assert trainer.num_rows == rows
        client.write(TABLE, trainer, pa.RecordBatch.from_pydict(
            {"advantage": pa.array([0.0] * trainer.num_rows, pa.float32())}), ack=True)
        assert sum(s.rows for s in client.stats(TABLE).shards) == 0  # every row freed
