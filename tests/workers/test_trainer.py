"""The trainer over a real (embedded) store: order invariance, group integrity, ratio == 1,
several updates per batch (old policy = the iteration start), importance correction.

Every test drives the real stages in-process: prompts are put, the rollout stage generates, rewards
are written (in the order the test chooses), and the trainer claims whole groups as they complete.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from testkit import objective, wait_until

import storage
from storage.schema import TaskSpec
from workers.config import RolloutWorkerConfig, TrainerWorkerConfig, WorkerCommon
from workers.engines.torch_trainer import TorchTrainerEngine
from workers.models.local import TinyModelSpec, build_tiny_model, load_model, save_model
from workers.models.tokenizer import build_char_tokenizer, encode_prompt
from workers.rl.advantages import group_advantages
from workers.rl.objectives import LossSums, loss_sums
from workers.rl.tokens import build_token_batch, response_logprobs
from workers.roles.build import build_rollout, build_trainer
from workers.roles.loop import StageLoop
from workers.runtime.events import EventSender, StepReport
from workers.runtime.leases import LeaseKeeper
from workers.schema import prompt_rows, samples_table_spec

_RUNS = itertools.count()  # one weights directory per training run of a test
G = 4
PROMPTS = 4
ROWS = G * PROMPTS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                           intermediate_size=64), tok)
    path = tmp_path_factory.mktemp("model") / "tiny"
    save_model(model, tok, path)
    return path


def _configs(model_dir: Path, weights: Path, iterations: int, rows_per_claim: int,
             deterministic: bool = False, **trainer_over):
    common = WorkerCommon(name="t", role="t", store_addresses=[], table="samples", seed=3,
                          threads=1, trace_rows=False)
    cpu = dict(device="cpu", dtype="float32", reference_dtype="float32")
    rollout = RolloutWorkerConfig(
        common=replace(common, name="rollout-0", role="rollout"), model_path=str(model_dir),
        weights_dir=str(weights), weights_announce=None, group_size=G, groups_per_claim=1,
        engine="torch", max_new_tokens=4, agent_driven=False, **cpu,
    )
    trainer = TrainerWorkerConfig(
        common=replace(common, name="trainer-0", role="trainer"), model_path=str(model_dir),
        reference_path=None, weights_dir=str(weights), weights_bind=None,
        rows_per_iteration=ROWS, iterations=iterations, group_size=G, reference_in_store=False,
        lr=1e-2, kl_coef=0.0, rows_per_claim=rows_per_claim, checkpoint_dir=None,
        checkpoint_every=0, engine="torch", deterministic=deterministic, num_ranks=1,
        whole_iterations=False, max_response_tokens=4,  # the rollout's max_new_tokens
        zero_stage=2, **cpu,
    )
    return rollout, replace(trainer, **trainer_over)


def _spec(audit: bool):
    spec = samples_table_spec("samples", group_size=G, reference_worker=False, fsync="never")
    if audit:  # keeps rows alive after the trainer, so the test can read what it wrote
        spec = replace(spec, tasks=spec.tasks + (TaskSpec("audit", ("advantage",)),))
    return spec


def _put(client, k: int, min_policy_version: int | None = None) -> None:
    tok = build_char_tokenizer()
    problems = [(f"{a}+{a + k}=", str(2 * a + k)) for a in range(PROMPTS)]
    batch = prompt_rows(k, [encode_prompt(tok, p) for p, _ in problems], [a for _, a in problems],
                        group_size=G,
                        min_policy_version=k if min_policy_version is None else min_policy_version)
    client.put("samples", batch)


def _reward_rows(client, order_seed: int | None, reward_of=lambda resp: len(resp) % 3) -> None:
    """Claim every response, and write synthetic rewards row by row in a chosen order."""
    lease = client.claim("samples", "reward", ["response_ids", "group_id"], ROWS, timeout=0.0)
    ids = lease.row_ids
    rewards = {rid: float(reward_of(resp)) for rid, resp in
               zip(ids, lease.batch.column("response_ids").to_pylist(), strict=True)}
    order = list(ids)
    if order_seed is not None:
        random.Random(order_seed).shuffle(order)
    for rid in order:
        client.write("samples", [rid], pa.RecordBatch.from_pydict(
            {"reward": pa.array([rewards[rid]], pa.float32()),
             "reward_ok": [True], "reward_error": pa.array([None], pa.string())}))
        yield rid
    client.ack(lease)


class _ShiftedBehaviour:
    """The rollout stage, with every behaviour log-prob it writes lowered by ``shift``: as if the
    samples came from a stale policy that gave each token exp(-shift) of the probability."""

    def __init__(self, inner, shift: float) -> None:
        self.inner, self.shift = inner, shift

    def process(self, lease):  # noqa: ANN001, ANN201
        out = self.inner.process(lease)
        i = out.schema.get_field_index("response_logprobs")
        lowered = [[v - self.shift for v in row] for row in out.column(i).to_pylist()]
        return out.set_column(i, out.schema.field(i), pa.array(lowered, out.schema.field(i).type))

    def __getattr__(self, name: str):  # noqa: ANN204 - task, columns, max_rows, ...
        return getattr(self.inner, name)


def _train(model_dir: Path, tmp: Path, *, iterations: int, order_seed: int | None,
           rows_per_claim: int, audit: bool = False, deterministic: bool = False,
           behaviour_shift: float = 0.0, reward_of=lambda resp: len(resp) % 3,
           sent: list | None = None, wrap_rollout=None, **trainer_over):
    weights = tmp / f"w-{next(_RUNS)}"
    rollout_cfg, trainer_cfg = _configs(model_dir, weights, iterations, rows_per_claim,
                                        deterministic, **trainer_over)
    events = EventSender(None, trace=False)
    with storage.embedded(2) as store, closing(LeaseKeeper(store.client)) as keeper:
        client = store.client()
        client.create_table(_spec(audit))
        rollout = build_rollout(rollout_cfg, events)
        if behaviour_shift:
            rollout = _ShiftedBehaviour(rollout, behaviour_shift)
        if wrap_rollout is not None:  # a stage around the rollout's (test_loss_mask.py)
            rollout = wrap_rollout(rollout)
        trainer = build_trainer(trainer_cfg, client, events, keeper)
        trainer.publish_current()
        for k in range(iterations):
            _put(client, k)
            loop = StageLoop(client, "samples", rollout, worker="r", role="rollout", events=events)
            while loop.turn(0.0):  # the last, empty claim carries the last write+ack
                pass
            stepped = False
            for _ in _reward_rows(client, order_seed, reward_of):
                if order_seed is not None:  # streaming: train on whatever groups are complete
                    stepped = trainer.poll(0.0) or stepped
            while not stepped:
                stepped = trainer.poll(0.0)
        audit_batch = None
        if audit:
            parts = []
            while True:  # one claim serves one shard: claim until the table is drained
                lease = client.claim("samples", "audit", ["group_id", "prompt_ids",
                                                          "response_ids", "reward", "advantage",
                                                          "iteration"], 10_000, timeout=0.5)
                if not lease.num_rows:
                    break
                parts.append(lease.batch)
            audit_batch = pa.Table.from_batches(parts).combine_chunks().to_batches()[0]
        params = {k: v.detach().clone() for k, v in trainer.engine.model.state_dict().items()}
        reports = [r for r in events.sent if isinstance(r, StepReport)]
        if sent is not None:  # every event, for a test that reads spans too
            sent.extend(events.sent)
        client.close()
    return params, reports, audit_batch


def test_scoring_attention_is_configurable_and_sdpa_trains_like_eager(
    model_dir: Path, tmp_path: Path
) -> None:
    """trainer.attn_implementation loads the policy, the fused reference and the reference
    worker's model with that attention; on unpacked rows sdpa and eager train to the same
    parameters up to float rounding."""
    from workers.config import ReferenceWorkerConfig
    from workers.roles.build import build_reference
    from workers.settings import PackingSettings

    _, trainer_cfg = _configs(model_dir, tmp_path / "w-attn", 1, ROWS)
    common = WorkerCommon(name="reference-0", role="reference", store_addresses=[],
                          table="samples", seed=0, threads=1, trace_rows=False)
    for impl in ("eager", "sdpa"):
        pack = PackingSettings(attn_implementation=impl, packing=False)
        cfg = replace(trainer_cfg, pack=pack, reference_path=str(model_dir),
                      grpo=replace(trainer_cfg.grpo, kl_coef=0.1))
        with storage.embedded(1) as store, closing(LeaseKeeper(store.client)) as keeper:
            trainer = build_trainer(cfg, store.client(), EventSender(None, trace=False), keeper)
            assert trainer.tri.policy.config._attn_implementation == impl
            assert trainer.tri.reference.config._attn_implementation == impl
            # both re-take the host's thread share between layers (workers.runtime.cores)
            for m in (trainer.tri.policy, trainer.tri.reference):
                assert all(len(layer._forward_pre_hooks) == 1 for layer in m.model.layers)
        stage = build_reference(ReferenceWorkerConfig(
            common=common, model_path=str(model_dir), rows_per_claim=ROWS, dtype="float32",
            device="cpu", pack=pack))
        assert stage.scorer.model.config._attn_implementation == impl
    runs = {impl: _train(model_dir, tmp_path, iterations=2, order_seed=None, rows_per_claim=ROWS,
                         pack=PackingSettings(attn_implementation=impl, packing=False))[0]
            for impl in ("eager", "sdpa")}
    diff = torch.cat([(runs["eager"][k] - runs["sdpa"][k]).abs().flatten() for k in runs["eager"]])
    # Adam divides each step by the root of its own squared gradient, so a parameter whose
    # gradient is rounding noise in both runs moves by up to ~lr either way: the kernels' summation
    # orders may move a few such entries apart by a fraction of lr. Attention that differs moves
    # most entries apart (each by ~lr); rounding leaves almost all of them equal to 1e-5.
    lr = trainer_cfg.optim.lr
    far = float((diff > 1e-5).float().mean())
    assert float(diff.max()) < 0.5 * lr and far < 1e-3, (
        f"sdpa and eager trained apart: max abs diff {float(diff.max())}, {far:.2%} of the "
        "parameters differ by more than 1e-5")


def test_list_columns_are_padded_from_the_arrow_buffers_like_pad_sequence() -> None:
    from torch.nn.utils.rnn import pad_sequence

    from workers.roles.trainer import _padded

    column = pa.array([[0.5, -1.25, 3.0], [], None, [2.0], [1.0, 2.0, 3.0, 4.0]],
                      pa.list_(pa.float32()))
    for part in (column, column.slice(1), column.slice(3, 2), column.slice(0, 2)):
        want = pad_sequence([torch.tensor(v or [], dtype=torch.float32)
                             for v in part.to_pylist()], batch_first=True)
        assert torch.equal(_padded(part), want), part


def test_streamed_random_order_equals_whole_batch(model_dir: Path, tmp_path: Path) -> None:
    """periodic ≡ sync at the trainer: same parameters whatever order groups complete in."""
    base, _, _ = _train(model_dir, tmp_path, iterations=2, order_seed=None, rows_per_claim=ROWS)
    for seed in (1, 2):
        other, _, _ = _train(model_dir, tmp_path, iterations=2, order_seed=seed, rows_per_claim=G)
        worst = max(float((base[k] - other[k]).abs().max()) for k in base)
        # Float rounding only: a forward over one group sums in another order than one over the
        # batch, and AdamW's normalisation magnifies that on near-zero gradients (measured up to
        # 2e-6 depending on the sampled responses). The bitwise proof is deterministic mode below.
        assert worst <= 1e-5, f"order seed {seed}: max abs diff {worst}"
    # Deterministic mode (one group per forward, fp64 gradient sums): bitwise, in any order.
    exact, _, _ = _train(model_dir, tmp_path, iterations=2, order_seed=None, rows_per_claim=ROWS,
                         deterministic=True)
    for seed in (3, 4):
        other, _, _ = _train(model_dir, tmp_path, iterations=2, order_seed=seed, rows_per_claim=G,
                             deterministic=True)
        assert all(torch.equal(exact[k], other[k]) for k in exact), f"order seed {seed}"
    untouched = build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2,
                                               num_kv_heads=1, intermediate_size=64),
                                 build_char_tokenizer()).state_dict()
    assert any(float((base[k] - untouched[k]).abs().max()) > 1e-4 for k in base), "no learning"


def test_a_claim_over_the_token_budget_trains_in_several_forwards_to_the_same_step(
    model_dir: Path, tmp_path: Path
) -> None:
    """trainer.tokens_per_forward: a whole-iteration claim is trained in pieces of whole groups,
    each its own forward/backward into the same step (float rounding apart)."""
    from workers.runtime.events import Span
    from workers.settings import PackingSettings

    runs = {}
    for budget in (0, 1):  # 0: one forward per claim; 1: every group alone
        sent: list = []
        runs[budget], _, _ = _train(
            model_dir, tmp_path, iterations=2, order_seed=None, rows_per_claim=ROWS, sent=sent,
            pack=PackingSettings(packing=False, tokens_per_forward=budget))
        pieces = [s for s in sent if isinstance(s, Span) and s.role == "trainer" and s.rows]
        assert [s.rows for s in pieces] == ([ROWS] * 2 if budget == 0 else [G] * PROMPTS * 2)
    worst = max(float((runs[0][k] - runs[1][k]).abs().max()) for k in runs[0])
    assert worst <= 1e-5, f"pieces trained apart from one forward: max abs diff {worst}"


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "gspo", "cispo"])
def test_the_step_loss_and_gradient_norm_equal_a_hand_replica(
    model_dir: Path, tmp_path: Path, loss: str
) -> None:
    """Pins the global loss scale: on the first (on-policy) pass every objective's gradient is
    that of -sum_i A_i x (sum over i's tokens of log pi) / N, N its normaliser (the step's
    tokens; dr_grpo: rows x max_new_tokens; gspo: per-response token means over the rows). The
    reported loss and pre-clip grad norm must equal that written out here by hand on the unpacked
    batch; a wrong normaliser, sign or advantage scale moves them by a factor."""
    _, reports, batch = _train(model_dir, tmp_path, iterations=1, order_seed=5, rows_per_claim=G,
                               audit=True, loss=loss, max_grad_norm=0.0,
                               dynamic_sampling="off")  # dapo's default: its own tests
    (rep,) = reports
    assert batch is not None and rep.samples == ROWS and rep.staleness_max == 0
    rows = batch.to_pylist()
    model = load_model(model_dir, dtype=torch.float32, attn_implementation="eager")
    tb = build_token_batch([(r["prompt_ids"], r["response_ids"]) for r in rows])
    logp = response_logprobs(model, tb.input_ids, tb.attention_mask, tb.response_mask)
    adv = []
    for r in rows:  # by hand: (r - group mean) / (unbiased group std + 1e-6); dr_grpo: no std
        group = [o["reward"] for o in rows if o["group_id"] == r["group_id"]]
        mean = sum(group) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (G - 1))
        adv.append((r["reward"] - mean) / (1.0 if loss == "dr_grpo" else std + 1e-6))
    lengths = tb.response_mask.sum(1)
    per_row = (logp * tb.response_mask).sum(1)
    if loss == "gspo":
        total, norm = -(torch.tensor(adv) * per_row / lengths).sum(), ROWS
    else:
        norm = ROWS * 4 if loss == "dr_grpo" else int(lengths.sum())  # max_new_tokens=4
        total = -(torch.tensor(adv) * per_row).sum()
    (total / norm).backward()
    grad_norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in model.parameters()
                              if p.grad is not None))
    assert grad_norm > 1e-3  # a step with a signal
    assert rep.grad_norm == pytest.approx(grad_norm, rel=1e-4)
    # the value on the first pass: -sum_i A_i x (its tokens; gspo: 1) / N
    weight = torch.ones(ROWS) if loss == "gspo" else lengths
    assert rep.loss == pytest.approx(float(-(torch.tensor(adv) * weight).sum() / norm), abs=1e-5)
    assert (rep.ratio_mean, rep.clip_fraction, rep.importance_weight_mean) == (1.0, 0.0, 1.0)


def test_rows_claimed_ahead_are_trained_without_waiting_on_the_store(
    model_dir: Path, tmp_path: Path
) -> None:
    """Async: rows of the next iteration, claimed before the step, are parked; the next poll trains
    them at once, without first waiting (up to its timeout) on the store for rows still to come."""
    rollout_cfg, trainer_cfg = _configs(model_dir, tmp_path / "w", 2, rows_per_claim=2 * ROWS)
    events = EventSender(None, trace=False)
    with storage.embedded(1) as store, closing(LeaseKeeper(store.client)) as keeper:
        client = store.client()
        client.create_table(_spec(False))
        for k in range(2):  # both iterations generated by version 0 (staleness 1)
            _put(client, k, min_policy_version=0)
        rollout = StageLoop(client, "samples", build_rollout(rollout_cfg, events), worker="r",
                            role="rollout", events=events)
        while rollout.turn(0.0):
            pass
        for _ in range(2):  # one iteration per reward claim
            for _ in _reward_rows(client, None):
                pass
        trainer = build_trainer(trainer_cfg, client, events, keeper)
        trainer.publish_current()
        waits: list[float] = []
        claim = client.claim

        def recording_claim(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            waits.append(kwargs["timeout"])
            return claim(*args, **kwargs)

        client.claim = recording_claim
        assert trainer.poll(0.0)  # claims both iterations: trains 0 (and steps), parks 1
        assert trainer.poll(30.0)  # iteration 1 from the parked rows
        assert waits == [0.0, 0.0]  # the second claim only looked: the rows in hand came first
        reports = [r for r in events.sent if isinstance(r, StepReport)]
        assert [(r.iteration, r.samples) for r in reports] == [(0, ROWS), (1, ROWS)]
        assert reports[1].staleness_max == 1
        client.close()


@pytest.mark.parametrize("whole", [False, True])
def test_whole_iterations_trains_nothing_until_every_row_is_ready(
    model_dir: Path, tmp_path: Path, whole: bool
) -> None:
    """Streaming trains each group as it completes; ``whole_iterations`` (the separate-pools
    baseline) holds every row until the whole iteration is ready, then takes the same step."""
    rollout_cfg, trainer_cfg = _configs(model_dir, tmp_path / "w", 1, rows_per_claim=G,
                                        whole_iterations=whole)
    events = EventSender(None, trace=False)
    with storage.embedded(1) as store, closing(LeaseKeeper(store.client)) as keeper:
        client = store.client()
        client.create_table(_spec(False))
        _put(client, 0)
        rollout = StageLoop(client, "samples", build_rollout(rollout_cfg, events), worker="r",
                            role="rollout", events=events)
        while rollout.turn(0.0):
            pass
        trainer = build_trainer(trainer_cfg, client, events, keeper)
        trainer.publish_current()
        rewarded = _reward_rows(client, None)
        for _ in range(ROWS - G):  # every group but the last one complete
            next(rewarded)
        for _ in range(PROMPTS):  # a claim turn per complete group, and one more
            assert not trainer.poll(0.0)
        assert trainer._rows_in == (0 if whole else ROWS - G)
        for _ in rewarded:  # the last group completes
            pass
        assert trainer.poll(0.0)
        reports = [r for r in events.sent if isinstance(r, StepReport)]
        assert [(r.iteration, r.samples) for r in reports] == [(0, ROWS)]
        client.close()


class _CountingClient:
    """The keeper's client factory and client: connects on the keeper's thread, counts renewals."""

    def __init__(self, connect) -> None:  # noqa: ANN001 - store.client
        self.connect, self.client = connect, None
        self.extended: list[int] = []  # lease ids, one per renewal

    def __call__(self) -> _CountingClient:
        self.client = self.connect()
        return self

    def extend(self, lease):  # noqa: ANN001, ANN201
        deadline = self.client.extend(lease)
        self.extended.append(lease.lease_id)
        return deadline

    def close(self) -> None:
        self.client.close()


def test_leases_held_across_polls_are_renewed_until_the_step_acks_them(
    model_dir: Path, tmp_path: Path
) -> None:
    """A group's lease is held from its claim to the ack after the step, across polls: the keeper
    renews it, so rows that wait past their lease for the rest of the iteration are acked once,
    never redelivered."""
    rollout_cfg, trainer_cfg = _configs(model_dir, tmp_path / "w", 1, rows_per_claim=G)
    events = EventSender(None, trace=False)
    with storage.embedded(1) as store:
        renewals = _CountingClient(store.client)
        client = store.client()
        with closing(LeaseKeeper(renewals, tick_s=0.05)) as keeper:
            client.create_table(replace(_spec(False), lease_seconds=2.0))
            trainer = build_trainer(trainer_cfg, client, events, keeper)
            trainer.publish_current()
            _put(client, 0)
            rollout = StageLoop(client, "samples", build_rollout(rollout_cfg, events), worker="r",
                                role="rollout", events=events, keeper=keeper)
            while rollout.turn(0.0):
                pass
            for _ in _reward_rows(client, None):
                pass
            assert not trainer.poll(0.0)  # one group of the iteration: trained, its lease held
            (held,) = trainer._held.values()
            first = held.lease
            wait_until(lambda: time.time() > first.deadline + 0.5
                       and renewals.extended.count(first.lease_id) >= 2, timeout=30,
                       what="the held lease renewed past its first deadline")
            wait_until(lambda: trainer.poll(0.0), timeout=60, what="the step")
        stats = client.stats("samples").task_total("trainer")
        assert (stats.consumed, stats.redelivered_total) == (ROWS, 0)
        client.close()


def test_group_integrity_under_random_completion(model_dir: Path, tmp_path: Path) -> None:
    _, _, batch = _train(model_dir, tmp_path, iterations=1, order_seed=7, rows_per_claim=G,
                         audit=True)
    assert batch is not None and batch.num_rows == ROWS
    rows = batch.to_pylist()
    by_group: dict[int, list[dict]] = {}
    for row in rows:
        by_group.setdefault(row["group_id"], []).append(row)
    assert len(by_group) == PROMPTS
    for gid, members in by_group.items():
        assert len(members) == G
        assert len({tuple(m["prompt_ids"]) for m in members}) == 1, f"group {gid} mixes prompts"
        rewards = torch.tensor([m["reward"] for m in members])
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        got = torch.tensor([m["advantage"] for m in members])
        assert torch.allclose(got, expected, atol=1e-5), f"group {gid}: {got} vs {expected}"


@pytest.mark.parametrize("advantage", ["rloo", "reinforce_pp", "overlong"])
def test_advantage_estimators_write_their_hand_computed_advantages(
    model_dir: Path, tmp_path: Path, advantage: str
) -> None:
    """Groups complete one by one (streaming): rloo trains each as it comes; reinforce_pp's one
    scale is the std over the whole step's batch, so it must wait for the last group (a scale
    from the groups seen so far gives other advantages); "overlong": grpo advantages of rewards
    shaped by trainer.overlong_buffer 2 (of the 4-token budget) and overlong_penalty 0.5."""
    over = (dict(overlong_buffer=2, overlong_penalty=0.5) if advantage == "overlong"
            else dict(advantage=advantage))
    _, _, batch = _train(model_dir, tmp_path, iterations=1, order_seed=7, rows_per_claim=G,
                         audit=True, reward_of=lambda resp: sum(resp) % 3, **over)
    assert batch is not None
    rows = batch.to_pylist()
    for r in rows:  # by hand: 0 up to 2 tokens, then -0.25 per token, -0.5 at 4
        r["reward"] -= 0.5 * min(max(len(r["response_ids"]) - 2, 0), 2) / 2 if over.get(
            "overlong_buffer") else 0.0
    assert advantage != "overlong" or len({len(r["response_ids"]) for r in rows}) > 1
    centred = []
    for r in rows:
        group = [o["reward"] for o in rows if o["group_id"] == r["group_id"]]
        if advantage == "overlong":
            std = float(torch.tensor(group, dtype=torch.float64).std())
            centred.append((r["reward"] - sum(group) / G) / (std + 1e-6))
        elif advantage == "rloo":
            centred.append(r["reward"] - (sum(group) - r["reward"]) / (G - 1))
        else:
            centred.append(r["reward"] - sum(group) / G)
    if advantage == "reinforce_pp":
        std = float(torch.tensor(centred, dtype=torch.float64).std())
        centred = [c / (std + 1e-6) for c in centred]
    assert any(abs(c) > 0.1 for c in centred)
    assert [r["advantage"] for r in rows] == pytest.approx(centred, abs=1e-5)


def _replica(model_dir: Path, batch: pa.RecordBatch, iterations: int, lr: float,
             updates: int, refresh_old: bool = False,
             loss_mask_of=None) -> tuple[dict, list[LossSums]]:
    """GRPO with ``updates`` passes per batch written out with workers.rl alone (whole batch,
    unpacked): the old policy of every pass is the policy at the start of the iteration;
    ``loss_mask_of(response_ids)``: each row's loss mask (None: all ones)."""
    torch.manual_seed(3)
    engine = TorchTrainerEngine(load_model(model_dir, dtype=torch.float32,
                                           attn_implementation="eager"), lr=lr,
                                fp64_accumulation=False)
    rows = batch.to_pylist()
    per_pass: list[LossSums] = []
    for k in range(iterations):
        mine = [r for r in rows if r["iteration"] == k]
        masks = [loss_mask_of(r["response_ids"]) for r in mine] if loss_mask_of else None
        tb = build_token_batch([(r["prompt_ids"], r["response_ids"]) for r in mine],
                               loss_masks=masks)
        adv = group_advantages(torch.tensor([r["reward"] for r in mine]),
                               torch.tensor([r["group_id"] for r in mine]), group_size=G)
        old = None
        for _ in range(updates):
            logp = response_logprobs(engine.model, tb.input_ids, tb.attention_mask,
                                     tb.response_mask)
            if old is None or refresh_old:  # recorded once per iteration (mutant: every pass)
                old = logp.detach()
            loss, sums = loss_sums(objective(), logp, old, adv, tb.response_mask)
            engine.backward(loss)
            engine.step(1.0 / sums.num_tokens)
            per_pass.append(sums)
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}, per_pass


def test_two_updates_per_batch_score_the_second_pass_against_the_iteration_start(
    model_dir: Path, tmp_path: Path
) -> None:
    """trainer.updates_per_batch=2 through build_trainer: the second pass's ratio moves away from 1
    and clips, the report gives the first pass and each pass apart (never a mix), and the
    parameters equal a whole-batch replica whose old policy is the policy at the start of each
    iteration."""
    lr = 1e-2
    params, reports, batch = _train(model_dir, tmp_path, iterations=2, order_seed=11,
                                    rows_per_claim=G, audit=True, updates_per_batch=2, lr=lr,
                                    reward_of=lambda resp: sum(resp) % 3)  # varied in every group
    assert batch is not None and batch.num_rows == 2 * ROWS
    want, passes = _replica(model_dir, batch, iterations=2, lr=lr, updates=2)
    for k, rep in enumerate(reports):
        first, second = passes[2 * k], passes[2 * k + 1]
        assert first.clipped_low + first.clipped_high == 0
        assert first.ratio_max == pytest.approx(1.0, abs=1e-6)
        assert second.clipped_low + second.clipped_high > 0  # a real second pass
        assert second.ratio_max > 1.0 + 1e-3
        assert rep.response_tokens == first.num_tokens  # the batch's tokens, counted once
        assert (rep.clip_fraction, rep.ratio_max, rep.ratio_min) == (0.0, 1.0, 1.0)  # pass 1
        assert rep.loss == pytest.approx(first.loss_sum / first.num_tokens, rel=1e-4)
        assert len(rep.passes) == 2 and rep.passes[0]["loss"] == rep.loss
        two = rep.passes[1]
        assert two["clip_fraction"] == pytest.approx(second.means()["clip_fraction"], abs=0.02)
        assert two["clip_fraction"] > 0.0
        assert two["ratio_max"] == pytest.approx(second.ratio_max, rel=1e-3)
        assert two["ratio_min"] == pytest.approx(second.ratio_min, rel=1e-3) and two["ratio_min"] < 1
        assert two["ratio_mean"] == pytest.approx(second.means()["ratio_mean"], rel=1e-4)
        assert two["loss"] == pytest.approx(second.loss_sum / second.num_tokens, rel=1e-3)
        assert rep.grad_norm == rep.passes[0]["grad_norm"] != two["grad_norm"]
    # Parameters: Adam's first steps turn float noise in near-zero gradients (packed vs unpacked
    # forwards) into up to ~lr/100 per element, while a wrong old policy moves them by ~lr.
    worst = max(float((params[k] - want[k]).abs().max()) for k in want)
    assert worst <= lr / 20, worst
    # The mutant "old = the policy now" (a refreshed, one-step-stale copy) ends elsewhere.
    refreshed, _ = _replica(model_dir, batch, iterations=2, lr=lr, updates=2, refresh_old=True)
    assert max(float((params[k] - refreshed[k]).abs().max()) for k in want) > lr / 2


@pytest.mark.parametrize(("correction", "shift", "weight"), [
    ("tis", math.log(1.5), 1.5), ("tis", math.log(3.0), 2.0),  # truncated at the cap
    ("decoupled", math.log(1.5), 1.5), ("masked", math.log(3.0), 0.0)])  # past it: dropped
def test_importance_correction_weights_stale_samples(
    model_dir: Path, tmp_path: Path, correction: str, shift: float, weight: float
) -> None:
    """Behaviour log-probs lowered by ``shift`` (samples of a policy that gave each token
    exp(-shift) of the trainer's probability): trainer.importance_correction multiplies every
    token's term by its weight of q = exp(old - behaviour) = exp(shift), is_cap 2, so with ratio
    1 and no KL the loss and the pre-clip gradient norm scale by exactly that weight."""
    run = dict(iterations=1, order_seed=None, rows_per_claim=ROWS, behaviour_shift=shift,
               is_cap=2.0, max_grad_norm=0.0)
    _, off, _ = _train(model_dir, tmp_path, importance_correction="off", **run)
    _, on, _ = _train(model_dir, tmp_path, importance_correction=correction, **run)
    assert off[0].importance_weight_mean == 1.0
    assert on[0].importance_weight_mean == pytest.approx(weight, rel=1e-4)
    assert on[0].importance_capped_fraction == (1.0 if shift > math.log(2.0) else 0.0)
    assert abs(off[0].loss) > 1e-4  # a loss that can show the weight
    assert on[0].loss == pytest.approx(weight * off[0].loss, rel=1e-4, abs=1e-9)
    assert on[0].grad_norm == pytest.approx(weight * off[0].grad_norm, rel=1e-4, abs=1e-9)
    assert on[0].ratio_mean == off[0].ratio_mean == 1.0  # the ratio itself is untouched
