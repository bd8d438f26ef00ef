"""The in-process torch rollout engine: batched sampling with a KV cache over any HF causal LM.

Owns ``TorchRolloutEngine`` (left-padded chunks, a preallocated KV cache, inverse-CDF sampling with
one seeded uniform per row and step). How a call runs and why: docs/engines.md, "The torch rollout
engine: how one generate call runs".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from workers.engines.base import (
    FINISH_CUT,
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    SamplingParams,
    check_generate,
    prompt_seeds_of,
)
from workers.rl.packing import attention_implementation
from workers.settings import PartialSettings

GREEDY_TEMPERATURE = 1e-5
DECODE_ATTENTION = "streamflow_decode_sdpa"


class _PreallocatedLayer(DynamicLayer):
    """A full-attention KV-cache layer preallocated for the whole generation: each step is written
    in place (``DynamicLayer`` copies the whole cache with ``torch.cat`` per token per layer)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            b, h, _, d = key_states.shape
            self.k_buf = key_states.new_empty((b, h, self.capacity, d))
            self.v_buf = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]))
            self.is_initialized = True
        if self.length + new > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions is full")
        self.k_buf[:, :, self.length : self.length + new] = key_states
        self.v_buf[:, :, self.length : self.length + new] = value_states
        self.length += new
        self.keys = self.k_buf[:, :, : self.length]
        self.values = self.v_buf[:, :, : self.length]
        return self.keys, self.values


def _cache_for(model: PreTrainedModel, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` whose plain full-attention layers are preallocated to ``capacity``."""
    cache = DynamicCache(config=model.config)
    cache.layers = [_PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache


def decode_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, q, d]
    key: torch.Tensor,  # [B, Hkv, T, d]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA that, for one new token, views the H query heads as ``H / Hkv`` queries of each KV head
    instead of copying the grouped KV heads (docs/engines.md); prefill (q > 1) is plain SDPA."""
    groups = getattr(module, "num_key_value_groups", 1)
    b, h, q, d = query.shape
    if q != 1 or groups == 1 or dropout or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    mask = attention_mask
    if mask is not None:
        mask = mask[:, :, :, : key.shape[-2]]  # [B, 1, 1, T]: the same for every query head
    out = F.scaled_dot_product_attention(
        query.view(b, h // groups, groups, d), key, value, attn_mask=mask, scale=scaling
    )  # [B, Hkv, groups, d]
    return out.reshape(b, h, 1, d).transpose(1, 2), None


AttentionInterface.register(DECODE_ATTENTION, decode_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, sdpa_mask)


def row_seeds(params: SamplingParams, num_prompts: int, n: int) -> list[int] | None:
    """The seed of each of the ``num_prompts * n`` rows (None: unseeded, global RNG)."""
    bases = prompt_seeds_of(params, num_prompts, n)
    return None if bases is None else [b + j for b in bases for j in range(n)]


def _uniforms(seeds: list[int] | None, batch: int, max_new: int, dev: torch.device,
              skip: Sequence[int] = ()) -> torch.Tensor:
    """One uniform in [0, 1) per row and step, each row from its own generator. ``skip``: per
    row, draws to drop first (a resumed row: the tokens it already has), so the row goes on
    where its stream stopped. Exact on the CPU generator (a longer draw starts with a shorter
    one's values); on CUDA when skip + max_new is the original call's max_new_tokens."""
    if seeds is None:
        return torch.rand((batch, max_new), device=dev)
    skip = list(skip) or [0] * batch
    if not any(skip):
        u = torch.empty((batch, max_new), device=dev)
        for row, seed in zip(u, seeds, strict=True):
            row.uniform_(generator=torch.Generator(device=dev).manual_seed(seed))
        return u
    rows = []
    for seed, done in zip(seeds, skip, strict=True):
        full = torch.empty(done + max_new, device=dev)
        full.uniform_(generator=torch.Generator(device=dev).manual_seed(seed))
        rows.append(full[done:])
    return torch.stack(rows)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B, 1] index drawn from the (unnormalised) rows of ``probs`` [B, V] with uniforms u [B]."""
    return _draw(probs.cumsum(dim=-1), u)


def _draw(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B, 1] index drawn with uniforms u [B] from the running sums ``cdf`` [B, V] of unnormalised
    weights."""
    # right=True: the first entry whose cdf exceeds u * mass, so a zero-probability entry (flat
    # cdf) is never picked; the clamp guards u * mass rounding up to the mass itself.
    idx = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)
    return idx.clamp_(max=cdf.shape[-1] - 1)


def _sample(
    logits: torch.Tensor, params: SamplingParams, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token [B] and its behaviour log-prob [B] from float32 logits [B, V], uniforms u [B]."""
    if params.temperature <= GREEDY_TEMPERATURE:
        token = logits.argmax(dim=-1, keepdim=True)
        logz = torch.logsumexp(logits, dim=-1, keepdim=True)
        return token.squeeze(-1), (logits.gather(-1, token) - logz).squeeze(-1)
    z = logits if params.temperature == 1.0 else logits / params.temperature
    if params.top_p >= 1.0:
        # The whole distribution: one exp pass and its running sum, no [B, V] log-softmax. The
        # draw is the inverse cdf of the unnormalised weights (u scaled by their mass), and the
        # behaviour log-prob z - max - log(mass) is log_softmax's own formula at the token.
        peak = z.amax(dim=-1, keepdim=True)
        cdf = (z - peak).exp_().cumsum_(dim=-1)
        token = _draw(cdf, u)
        return token.squeeze(-1), (z.gather(-1, token) - peak - cdf[:, -1:].log()).squeeze(-1)
    logp = torch.log_softmax(z, dim=-1)  # [B, V], before truncation
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    probs = sorted_logp.exp()
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass BEFORE it is
    # below top_p (the most likely token always stays).
    drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
    token = order.gather(-1, _inverse_cdf(probs.masked_fill(drop, 0.0), u))
    return token.squeeze(-1), logp.gather(-1, token).squeeze(-1)


class TorchRolloutEngine:
    """``RolloutEngine`` over an HF causal LM held in this process (docs/engines.md)."""

    def __init__(
        self, model: PreTrainedModel, tokenizer_or_eos_ids: PreTrainedTokenizerBase | Sequence[int],
        *, device: str | torch.device | None = None, max_batch_size: int | None = None,
        pad_token_id: int | None = None, policy_version: int = 0,
        cut_live_fraction: float = PartialSettings.partial_cut_live_fraction,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be None or >= 1, got {max_batch_size}")
        if not 0 < cut_live_fraction <= 1:
            raise ValueError(f"cut_live_fraction must be in (0, 1], got {cut_live_fraction}")
        # ``generate_until`` honours a set ``cut`` only at a step where the unfinished rows are
        # at most this fraction of the chunk's rows (rollout.partial_cut_live_fraction)
        self.cut_live_fraction = cut_live_fraction
        # rollout.device resolved by the plan; None: where the model already is
        self.device = next(model.parameters()).device if device is None else torch.device(device)
        self.model = model.to(self.device).eval()
        if isinstance(tokenizer_or_eos_ids, PreTrainedTokenizerBase):
            tok = tokenizer_or_eos_ids
            eos = () if tok.eos_token_id is None else (int(tok.eos_token_id),)
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        else:
            eos = tuple(int(t) for t in tokenizer_or_eos_ids)
            pad = None
        self.eos_token_ids: tuple[int, ...] = eos
        pad = pad_token_id if pad_token_id is not None else pad
        self.pad_token_id = int(pad if pad is not None else (eos[0] if eos else 0))
        self.max_batch_size = max_batch_size  # rows per forward batch; None = the whole call
        self.policy_version = int(policy_version)
        # Running totals, read by the rollout worker for its metrics.
        self.generated_tokens_total = 0
        self.generate_seconds_total = 0.0

    # -- weights -------------------------------------------------------------------------------
    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy HF-named tensors into the model in place; unknown names or shapes are errors.
        Names absent from ``weights`` (e.g. a tied ``lm_head.weight``) keep their values."""
        targets = self.model.state_dict()
        unknown = sorted(k for k in weights if k not in targets)
        if unknown:
            raise KeyError(
                f"load_weights: unknown parameter names {unknown[:5]} (of {len(unknown)})")
        with torch.no_grad():
            for name, value in weights.items():
                target = targets[name]
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"load_weights: {name} has shape {tuple(value.shape)}, "
                                     f"expected {tuple(target.shape)}")
                target.copy_(value.to(device=target.device, dtype=target.dtype))
        self.policy_version = int(version)

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live tensors by HF name: collective sync copies a broadcast version into them."""
        return self.model.state_dict()

    # -- sampling ------------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Generation]]:
        """``n`` samples per prompt, in prompt order (docs/engines.md)."""
        return self.generate_until(prompts, n, params, None)

    def generate_until(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams,
        cut: threading.Event | None, on_done: Callable[[int, Generation], None] | None = None,
    ) -> list[list[Generation]]:
        """``generate`` that ``cut`` stops at the next decode step (``Interruptible``,
        docs/partial.md): each chunk checks it after sampling a step, so every unfinished row
        has at least one new token, and honours it at the first such step where its unfinished
        rows are at most ``cut_live_fraction`` of its rows (1.0: the next step);
        ``params.done_tokens`` skips each row's draws already used."""
        check_generate(prompts, n)
        done = list(params.done_tokens)
        if done and (n != 1 or len(done) != len(prompts)):
            raise ValueError(f"generate: done_tokens needs n == 1 and one entry per prompt, got "
                             f"n={n} and {len(done)} entries for {len(prompts)} prompts")
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        seeds = row_seeds(params, len(prompts), n)
        stop_ids = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)),
                                dtype=torch.long, device=self.device)
        t0 = time.perf_counter()
        flat: list[Generation] = []
        step = self.max_batch_size or max(len(rows), 1)
        impl = self.model.config._attn_implementation  # sdpa: one-token steps skip the KV copy
        with attention_implementation(self.model, DECODE_ATTENTION if impl == "sdpa" else impl):
            for start in range(0, len(rows), step):
                chunk = rows[start : start + step]
                chunk_seeds = None if seeds is None else seeds[start : start + step]
                report = None if on_done is None else (
                    lambda i, g, base=start: on_done(base + i, g))
                flat.extend(self._generate_chunk(chunk, params, stop_ids, chunk_seeds, cut=cut,
                                                 skip=done[start : start + step],
                                                 on_done=report))
        self.generate_seconds_total += time.perf_counter() - t0
        self.generated_tokens_total += sum(len(g.token_ids) for g in flat)
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _cut_pays(self, live: int, batch: int) -> bool:
        """Whether a set cut is honoured now: the chunk's ``live`` unfinished rows are at most
        ``cut_live_fraction`` of its ``batch`` rows (every row is decoded each step, finished or
        not)."""
        return self.cut_live_fraction >= 1.0 or live <= self.cut_live_fraction * batch

    @torch.inference_mode()
    def _generate_chunk(self, rows: list[list[int]], params: SamplingParams, stop_ids: torch.Tensor,
                        seeds: list[int] | None, *, cut: threading.Event | None = None,
                        skip: Sequence[int] = (),
                        on_done: Callable[[int, Generation], None] | None = None
                        ) -> list[Generation]:
        dev = self.device
        batch = len(rows)
        width = max(len(r) for r in rows)
        max_new = params.max_new_tokens
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        # The mask of the whole generation, allocated once: step t passes a view of its first
        # width + t + 1 columns (growing it with a cat per step copies it every step).
        full_mask = torch.ones((batch, width + max_new), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            full_mask[i, : width - len(r)] = 0
        input_ids, full_mask = input_ids.to(dev), full_mask.to(dev)
        attention_mask = full_mask[:, :width]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

        cache = _cache_for(self.model, width + max_new)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        logits = out.logits[:, -1, :].float()
        next_pos = position_ids[:, -1:] + 1  # [B, 1]
        uniforms = _uniforms(seeds, batch, max_new, dev, skip)

        tokens = torch.full((batch, max_new), self.pad_token_id, dtype=torch.long, device=dev)
        logps = torch.zeros((batch, max_new), dtype=torch.float32, device=dev)
        lengths = torch.full((batch,), max_new, dtype=torch.long, device=dev)
        finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        live = batch  # rows not finished, counted on the host
        was_cut = False
        for step in range(max_new):
            token, logp = _sample(logits, params, uniforms[:, step])
            token = token.masked_fill(finished, self.pad_token_id)
            tokens[:, step] = token
            logps[:, step] = logp
            stopped = torch.isin(token, stop_ids) & ~finished
            lengths = torch.where(stopped, step + 1, lengths)
            finished |= stopped
            # The step's one wait for the device: which rows stopped. The host's count of live
            # rows then answers "all finished?" and the cut's gate without another.
            done_rows = stopped.nonzero().flatten().tolist()
            live -= len(done_rows)
            if on_done is not None:
                for i in done_rows:
                    on_done(i, Generation(tokens[i, : step + 1].tolist(),
                                          logps[i, : step + 1].tolist(), FINISH_STOP))
            if step == max_new - 1 or live == 0:
                break
            if cut is not None and cut.is_set() and self._cut_pays(live, batch):
                # a token boundary: every live row has one
                lengths = torch.where(finished, lengths, step + 1)
                was_cut = True
                break
            out = self.model(input_ids=token[:, None], position_ids=next_pos, use_cache=True,
                             attention_mask=full_mask[:, : width + step + 1], past_key_values=cache)
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1

        tokens_l, logps_l = tokens.tolist(), logps.tolist()
        lengths_l, finished_l = lengths.tolist(), finished.tolist()
        unfinished = FINISH_CUT if was_cut else FINISH_LENGTH
        out = [Generation(tokens_l[i][: lengths_l[i]], logps_l[i][: lengths_l[i]],
                          FINISH_STOP if finished_l[i] else unfinished) for i in range(batch)]
        if on_done is not None and not was_cut:  # rows that ran to max_new_tokens
            for i in range(batch):
                if not finished_l[i]:
                    on_done(i, out[i])
        return out
