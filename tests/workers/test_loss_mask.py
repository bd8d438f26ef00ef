"""The per-token loss mask (``response_loss_mask``): environment tokens of a multi-turn response
get no gradient, model tokens do, the packed layout masks exactly as unpacked rows do, and the
trainer over the real store trains on (and counts) model tokens only."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch
from testkit import objective
from torch.nn.utils.rnn import pad_sequence

from tests.workers.test_trainer import ROWS as STORE_ROWS
from tests.workers.test_trainer import _replica, _train
from workers.models.local import TinyModelSpec, build_tiny_model, save_model
from workers.models.tokenizer import build_char_tokenizer
from workers.rl.objectives import loss_sums
from workers.rl.packing import PackGroup, batch_logprobs, pack_groups, unpacked_rows
from workers.rl.tokens import (
    apply_loss_masks,
    build_token_batch,
    response_logprobs,
    to_token_tensor,
)
from workers.runtime.events import StepReport
from workers.schema import SAMPLES_SCHEMA
from workers.settings import PackingSettings

torch.set_num_threads(1)
SPEC = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=64)
# (prompt, response, loss mask): zeros in the middle of responses (a tool's answer between two
# model turns), one response all model tokens, one ending on environment tokens
ROWS = [  # token ids within the char tokenizer's vocabulary (21)
    ([1, 5, 6], [7, 8, 9, 10, 11, 12], [1, 1, 0, 0, 1, 1]),
    ([1, 9], [13, 14, 15, 16], [1, 0, 1, 1]),
    ([1, 5, 6], [17, 18, 19], [1, 1, 1]),
    ([1, 9], [20, 4, 8, 12, 16], [1, 1, 0, 0, 0]),
]


def _model() -> torch.nn.Module:
    return build_tiny_model(SPEC, build_char_tokenizer()).train()


def _capture_logits(model: torch.nn.Module) -> list[torch.Tensor]:
    """The lm_head's outputs (the logits) of the next forward, their gradients retained."""
    seen: list[torch.Tensor] = []

    def hook(module, args, output):  # noqa: ANN001, ANN202
        output.retain_grad()
        seen.append(output)

    model.lm_head.register_forward_hook(hook)
    return seen


def _loss(logp: torch.Tensor, mask: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    """Every term of the loss on: ratio != 1 (clipping live), k3 KL, truncated IS weights."""
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])
    loss, _ = loss_sums(objective(kl_coef=0.05, correction="tis"), logp, logp.detach() - 0.05,
                        adv, mask, ref_logp=logp.detach() + 0.1, behaviour_logp=behaviour)
    return loss


def _logit_grads(loss_masks: list[list[int]] | None) -> tuple[torch.Tensor, list[int]]:
    """The loss's gradient with respect to the logits [B, T, V], and each row's prompt length."""
    model = _model()
    logits = _capture_logits(model)
    batch = build_token_batch([(p, r) for p, r, _ in ROWS], loss_masks=loss_masks)
    logp = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask)
    # behaviour log-probs: 0.0 at environment tokens by the column's convention
    behaviour = to_token_tensor(
        [[(lp - 0.02) * m for lp, m in zip(row, mask, strict=True)]
         for row, (_, _, mask) in zip(
             [logp[i, batch.response_positions[i].bool()].tolist() for i in range(len(ROWS))],
             ROWS, strict=True)],
        batch.response_positions)
    _loss(logp, batch.response_mask, behaviour).backward()
    (out,) = logits
    assert out.grad is not None
    return out.grad, [len(p) for p, _, _ in ROWS]


def test_environment_tokens_get_no_gradient_and_model_tokens_do() -> None:
    """The logits that score an environment token (position p - 1 scores the token at p) get a
    gradient of exactly zero; those that score a model token get one; without the masks the
    same logits do get one (so the zeros are the mask's doing)."""
    grad, prompt_lens = _logit_grads([m for _, _, m in ROWS])
    unmasked, _ = _logit_grads(None)
    env = model = 0
    for i, ((_, response, mask), n_p) in enumerate(zip(ROWS, prompt_lens, strict=True)):
        for j in range(len(response)):
            at = n_p + j - 1  # the logits that score response token j
            if mask[j]:
                model += 1
                assert float(grad[i, at].abs().max()) > 0.0, (i, j)
            else:
                env += 1
                assert torch.equal(grad[i, at], torch.zeros_like(grad[i, at])), (i, j)
                assert float(unmasked[i, at].abs().max()) > 0.0, (i, j)
    assert env == 6 and model == 12


def test_token_count_and_sums_cover_model_tokens_only() -> None:
    batch = build_token_batch([(p, r) for p, r, _ in ROWS], loss_masks=[m for _, _, m in ROWS])
    assert torch.equal(batch.response_positions.sum(1), torch.tensor([6.0, 4.0, 3.0, 5.0]))
    logp = -torch.rand(batch.response_mask.shape) * batch.response_positions
    _, sums = loss_sums(objective(kl_coef=0.1, correction="tis"), logp, logp - 0.3,
                        torch.ones(4), batch.response_mask, ref_logp=logp + 0.2,
                        behaviour_logp=logp - 5.0)
    assert sums.num_tokens == 12
    assert sums.is_capped_tokens == 12  # exp(5) > is_cap at every model token, and only there
    assert sums.ratio_sum == pytest.approx(12 * torch.exp(torch.tensor(0.3)).item(), rel=1e-5)


def test_a_mask_must_hold_one_bit_per_response_token() -> None:
    pairs = [([1, 2], [3, 4, 5])]
    with pytest.raises(ValueError, match="row 0 has 2 mask values for 3 response tokens"):
        build_token_batch(pairs, loss_masks=[[1, 0]])
    with pytest.raises(ValueError, match="other than 0 and 1"):
        build_token_batch(pairs, loss_masks=[[1, 2, 1]])
    same = build_token_batch(pairs, loss_masks=[None])
    assert torch.equal(same.response_mask, same.response_positions)


def _layout_loss(model: torch.nn.Module, packed: bool):  # noqa: ANN202
    """The trainer's recipe on one layout: per-response log-probs, padded per row, the loss mask
    laid on that grid; returns (loss, logits grad, the layout)."""
    groups = [PackGroup(0, ROWS[0][0], [ROWS[0][1], ROWS[2][1]]),
              PackGroup(1, ROWS[1][0], [ROWS[1][1], ROWS[3][1]])]
    masks = [ROWS[0][2], ROWS[2][2], ROWS[1][2], ROWS[3][2]]  # row order: group, then response
    layout = pack_groups(groups, token_budget=32) if packed else unpacked_rows(groups)
    logits = _capture_logits(model)
    rows = [lp for g in batch_logprobs(model, layout) for lp in g]
    logp = pad_sequence(rows, batch_first=True)
    lengths = torch.tensor([len(r) for r in rows])
    positions = (torch.arange(logp.shape[1]) < lengths[:, None]).float()
    mask = apply_loss_masks(positions, masks)
    behaviour = (logp.detach() - 0.02) * mask
    loss = _loss(logp, mask, behaviour)
    loss.backward()
    (out,) = logits
    return loss.detach(), out.grad, layout, torch.tensor([b for m in masks for b in m])


def test_packed_and_unpacked_give_the_same_masked_loss_and_gradients() -> None:
    """Zeros in the middle of responses: the packed layout (one prompt copy per group) gives the
    unpacked rows' loss and parameter gradients, and its logits that score an environment token
    get exactly no gradient."""
    grads = {}
    for packed in (True, False):
        model = _model()
        loss, logit_grad, layout, flat_mask = _layout_loss(model, packed)
        assert layout.packed == packed and layout.num_rows == (1 if packed else 4)
        env = layout.target_keep_index[flat_mask == 0]
        model_tok = layout.target_keep_index[flat_mask == 1]
        assert torch.equal(logit_grad[env], torch.zeros_like(logit_grad[env]))
        assert bool((logit_grad[model_tok].abs().amax(dim=1) > 0).all())
        grads[packed] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()
                                if p.grad is not None})
    (loss_p, g_p), (loss_u, g_u) = grads[True], grads[False]
    assert float(loss_p) == pytest.approx(float(loss_u), abs=1e-5)
    assert g_p.keys() == g_u.keys()
    worst = max(float((g_p[n] - g_u[n]).abs().max()) for n in g_u)
    scale = max(float(g_u[n].abs().max()) for n in g_u)
    assert scale > 1e-3 and worst <= 1e-5 * scale, (worst, scale)


class _MaskedResponses:
    """The rollout stage, writing ``response_loss_mask = mask_of(response_ids)`` in place of its
    NULL: as if the environment had appended the tokens at 0 (their behaviour log-probs 0.0)."""

    def __init__(self, inner, mask_of) -> None:  # noqa: ANN001
        self.inner, self.mask_of = inner, mask_of

    def process(self, lease):  # noqa: ANN001, ANN201
        out = self.inner.process(lease)
        masks = [self.mask_of(r) for r in out.column("response_ids").to_pylist()]
        i = out.schema.get_field_index("response_logprobs")
        logps = [[v * m for v, m in zip(row, mask, strict=True)]
                 for row, mask in zip(out.column(i).to_pylist(), masks, strict=True)]
        out = out.set_column(i, out.schema.field(i), pa.array(logps, out.schema.field(i).type))
        j = out.schema.get_field_index("response_loss_mask")
        field = SAMPLES_SCHEMA.field("response_loss_mask")
        return out.set_column(j, field, pa.array(masks, field.type))

    def __getattr__(self, name: str):  # noqa: ANN204 - task, columns, max_rows, ...
        return getattr(self.inner, name)


def _masked(mask_of):  # noqa: ANN001, ANN202
    return lambda rollout: _MaskedResponses(rollout, mask_of)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The store tests' tiny policy (tests/workers/test_trainer.py), saved for the workers."""
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=64), tok)
    path = tmp_path_factory.mktemp("model") / "tiny"
    save_model(model, tok, path)
    return path


def _model_turns(response: list[int]) -> list[int]:
    """A loss mask with environment tokens in the middle: only the first and last tokens are the
    model's."""
    return [1 if j in (0, len(response) - 1) else 0 for j in range(len(response))]


@pytest.mark.parametrize("packing", [True, False])
def test_loss_mask_trains_on_model_tokens_only(model_dir: Path, tmp_path: Path,
                                               packing: bool) -> None:
    """``response_loss_mask`` through the store and the trainer: all ones takes exactly the step
    of NULL masks; with zeros the report counts mask-1 tokens only and the parameters equal a
    whole-batch replica that masks the same tokens (and differ from one that does not)."""
    lr = 1e-2
    run = dict(iterations=1, order_seed=None, rows_per_claim=STORE_ROWS, audit=True, lr=lr,
               reward_of=lambda resp: sum(resp) % 3,  # varied in every group
               pack=PackingSettings(packing=packing, packing_min_saving=0.0))
    null_params, null_reports, _ = _train(model_dir, tmp_path, **run)
    ones_params, ones_reports, _ = _train(model_dir, tmp_path,
                                          wrap_rollout=_masked(lambda r: [1] * len(r)), **run)
    assert all(torch.equal(ones_params[k], null_params[k]) for k in null_params)

    def step(r: StepReport) -> tuple:
        return (r.response_tokens, r.loss, r.grad_norm, r.ratio_mean, r.importance_weight_mean)

    assert [step(r) for r in ones_reports] == [step(r) for r in null_reports]
    params, reports, batch = _train(model_dir, tmp_path, wrap_rollout=_masked(_model_turns),
                                    **run)
    assert batch is not None and batch.num_rows == STORE_ROWS
    responses = batch.column("response_ids").to_pylist()
    assert reports[0].response_tokens == sum(sum(_model_turns(r)) for r in responses)
    assert reports[0].response_tokens < null_reports[0].response_tokens  # some tokens are 0
    want, _ = _replica(model_dir, batch, iterations=1, lr=lr, updates=1, loss_mask_of=_model_turns)
    assert max(float((params[k] - want[k]).abs().max()) for k in want) <= lr / 20
    unmasked, _ = _replica(model_dir, batch, iterations=1, lr=lr, updates=1)
    assert max(float((params[k] - unmasked[k]).abs().max()) for k in want) > lr / 2
