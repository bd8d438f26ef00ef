"""Shared-prompt packing: a group's responses scored with ONE copy of its prompt.

Owns the attention that makes the packed layout (``workers.rl.packing_layout``, re-exported here)
exact for HF causal LMs, the packing decision (``choose_layout``) and
``packed_response_logprobs(..., pack=True|False)``. Layout,
invariants and when packing pays: docs/engines.md, "Shared-prompt packing".

Every response token is scored, environment tokens of a multi-turn response too (they are context
for the tokens after them); the ``response_loss_mask`` never shapes a layout. The loss lays it on
the per-response log-probs ``[L_i]`` that both layouts return in the same order, so a packed
group's masked tokens drop out of the loss exactly as the unpacked rows' do.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from workers.rl.packing_layout import (
    PackChunk,
    PackedBatch,
    PackGroup,
    PackingError,
    PackingFallbackWarning,
    PackingUnsupportedError,
    pack_groups,
    should_pack,
    token_saving,
    unpacked_rows,
)
from workers.settings import SamplingSettings

# the layout's names are part of this module's API (callers import them from here)
__all__ = [
    "PackChunk", "PackGroup", "PackedBatch", "PackingError",
    "PackingFallbackWarning", "PackingUnsupportedError", "batch_logprobs", "choose_layout",
    "pack_groups",
    "packed_response_logprobs", "packing_unsupported_reason", "should_pack", "token_saving",
    "unpacked_rows",
]

ATTENTION_NAME = "streamflow_shared_prompt"
LAYOUT_KWARG = "shared_prompt_layout"
# Architectures whose attention is plain RoPE softmax attention through the transformers attention
# interface, with a ``model`` decoder and a plain ``lm_head``. Others use unpacked rows.
PACKABLE_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama"})
AttentionKind = Literal["segments", "mask"]


# --------------------------------------------------------------------------- attention
@dataclass
class SharedPromptLayout:
    """What the attention function needs: the chunks of each row, and a mask cache."""

    rows: list[list[PackChunk]]
    seq_len: int
    _masks: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict)
    _index: dict[tuple[tuple[int, ...], int, str], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, batch: PackedBatch) -> SharedPromptLayout:
        rows: list[list[PackChunk]] = [[] for _ in range(batch.num_rows)]
        for c in batch.chunks:
            rows[c.row].append(c)
        for r in rows:
            r.sort(key=lambda c: c.prompt_start)
        return cls(rows=rows, seq_len=batch.seq_len)

    def gather_index(self, starts: tuple[int, ...], n: int, device: torch.device) -> torch.Tensor:
        """[len(starts) * n] long: the columns of ``n`` tokens from each start, in order."""
        key = (starts, n, str(device))
        if key not in self._index:
            cols = [torch.arange(s, s + n) for s in starts]
            self._index[key] = torch.cat(cols).to(device)
        return self._index[key]

    def response_mask(self, prompt_len: int, n: int, device: torch.device) -> torch.Tensor:
        """[n, P + n] bool: all of the prompt, causal over the response (lower-right causal)."""
        key = (prompt_len, n, str(device))
        if key not in self._masks:
            ones = torch.ones(n, prompt_len + n, dtype=torch.bool, device=device)
            self._masks[key] = ones.tril(diagonal=prompt_len)
        return self._masks[key]


def shared_prompt_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [R, H, T, d]
    key: torch.Tensor,  # [R, Hkv, T, d]
    value: torch.Tensor,  # [R, Hkv, T, d]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function for the packed layout; plain SDPA when no layout is given."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    layout: SharedPromptLayout | None = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if sliding_window is not None:
        raise PackingUnsupportedError("shared-prompt attention does not support sliding windows")
    key = repeat_kv(key, query.shape[1] // key.shape[1])
    value = repeat_kv(value, query.shape[1] // value.shape[1])
    heads, width, dim = query.shape[1], query.shape[2], value.shape[-1]
    sdpa_args: dict[str, Any] = {"dropout_p": dropout, "scale": scaling}
    out_rows = []
    for r, chunks in enumerate(layout.rows):
        q, k, v = query[r], key[r], value[r]  # [H, T, d]
        pieces, used = [], 0
        for c in chunks:  # chunks and their responses tile the row left to right
            pieces.extend(_chunk_attention(q, k, v, c, layout, sdpa_args))
            used = c.response_starts[-1] + c.response_lens[-1]
        if used < width:  # padding: its output is never read
            pieces.append(query.new_zeros(heads, width - used, dim))
        out_rows.append(torch.cat(pieces, dim=1))
    return torch.stack(out_rows).transpose(1, 2).contiguous(), None


def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: PackChunk,
                     layout: SharedPromptLayout, sdpa_args: dict[str, Any]) -> list[torch.Tensor]:
    """Attention outputs of one chunk of a row (q, k, v: [H, T, d]), in row order: [H, P, d],
    then [H, L_i, d] per response."""
    ps, pe = c.prompt_start, c.prompt_start + c.prompt_len
    kp, vp = k[None, :, ps:pe], v[None, :, ps:pe]  # [1, H, P, d]
    prompt = F.scaled_dot_product_attention(q[None, :, ps:pe], kp, vp, is_causal=True, **sdpa_args)
    by_len: dict[int, list[int]] = {}
    for s, n in zip(c.response_starts, c.response_lens, strict=True):
        by_len.setdefault(n, []).append(s)
    outs: dict[int, torch.Tensor] = {}
    # Responses of equal length run as one SDPA batch. They are gathered with ONE index_select
    # per tensor: slicing each response out separately would make autograd allocate and add a
    # full [H, T, d] gradient buffer per slice, which costs more than the attention itself.
    for n, starts in by_len.items():
        m = len(starts)
        idx = layout.gather_index(tuple(starts), n, q.device)

        def take(t: torch.Tensor, idx: torch.Tensor = idx, m: int = m, n: int = n) -> torch.Tensor:
            return t.index_select(1, idx).view(t.shape[0], m, n, -1).transpose(0, 1)  # [m, H, n, d]

        ks = torch.cat([kp.expand(m, -1, -1, -1), take(k)], dim=2)  # [m, H, P + n, d]
        vs = torch.cat([vp.expand(m, -1, -1, -1), take(v)], dim=2)
        # The kernel cannot skip the masked upper-right blocks (n^2 / 2 scores per response);
        # splitting prompt and own keys into two mask-free calls merged by log-sum-exp was no
        # faster on a CPU (docs/engines.md, "Shared-prompt packing"), so the simple masked call stays.
        mask = layout.response_mask(c.prompt_len, n, q.device)
        o = F.scaled_dot_product_attention(take(q), ks, vs, attn_mask=mask, **sdpa_args)
        outs.update({s: o[i] for i, s in enumerate(starts)})
    return [prompt[0], *(outs[s] for s in sorted(outs))]


def register_attention() -> None:
    """Register ``shared_prompt_attention`` with transformers under ``ATTENTION_NAME`` (once;
    here rather than at import, so a process that never loads a model, a reward or simulated
    worker, does not import the transformers modeling stack)."""
    from transformers import AttentionInterface

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, shared_prompt_attention)


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Switch the model's attention function for one call (the config is read at every forward)."""
    if name == ATTENTION_NAME:
        register_attention()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


# --------------------------------------------------------------------------- forward
def _model_name(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    return f"{type(model).__name__}(model_type={getattr(config, 'model_type', None)!r})"


def _is_packable_type(model: torch.nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) in PACKABLE_MODEL_TYPES


def _scored_logits(model: torch.nn.Module, score_mask: torch.Tensor, **inputs: Any) -> torch.Tensor:
    """[K, V] logits at the True positions of ``score_mask`` (row-major order). Whitelisted
    architectures (no logit scaling) run the decoder alone and ``lm_head`` on those positions only:
    the vocabulary projection is the largest matmul per token, and prompts need none."""
    decoder, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if _is_packable_type(model) and decoder is not None and head is not None:
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        return head(hidden[score_mask])
    return model(**inputs, use_cache=False).logits[score_mask]


def batch_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    temperature: float = SamplingSettings.temperature,
    attention: AttentionKind = "segments",
) -> list[list[torch.Tensor]]:
    """Per group and response, float32 ``log_softmax(logits / temperature)`` token log-probs
    ``[L_i]``; ``PackingUnsupportedError`` for a packed batch on a model outside the whitelist."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if batch.packed and not _is_packable_type(model):
        raise PackingUnsupportedError(f"{_model_name(model)} cannot take a packed batch")
    vocab = int(model.config.vocab_size)
    if int(batch.input_ids.max()) >= vocab:
        raise PackingError(f"token id {int(batch.input_ids.max())} >= vocab_size {vocab}")
    device = next(model.parameters()).device
    ids, score_mask = batch.input_ids.to(device), batch.score_mask.to(device)
    if not batch.packed:
        # Attention is causal, so columns after the last scored one feed no scored logit: the
        # last token of the longest rows is an input nowhere and is not computed (one column in
        # 70 of a 6-token prompt and a 64-token response). The row-major order of the scored
        # positions, which ``target_keep_index`` indexes, is unchanged.
        width = batch.scored_width
        ids, score_mask = ids[:, :width], score_mask[:, :width]
        mask2d = batch.token_mask[:, :width].long().to(device)
        logits = _scored_logits(model, score_mask, input_ids=ids, attention_mask=mask2d)
    elif attention == "segments":
        layout = SharedPromptLayout.of(batch)
        with attention_implementation(model, ATTENTION_NAME):
            logits = _scored_logits(model, score_mask, input_ids=ids,
                                    position_ids=batch.position_ids.to(device),
                                    **{LAYOUT_KWARG: layout})
    elif attention == "mask":
        logits = _scored_logits(model, score_mask, input_ids=ids,
                                position_ids=batch.position_ids.to(device),
                                attention_mask=_dense_mask_for(model, batch))
    else:
        raise ValueError(f"attention must be 'segments' or 'mask', got {attention!r}")
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [K, V]
    flat = logp[batch.target_keep_index.to(device), batch.target_token.to(device)]  # [N]
    sizes = [n for lens in batch.response_lengths for n in lens]
    pieces = iter(torch.split(flat, sizes))
    return [[next(pieces) for _ in lens] for lens in batch.response_lengths]


def _dense_mask_for(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    impl = model.config._attn_implementation
    device = next(model.parameters()).device
    mask = batch.attention_mask.to(device)
    if impl == "sdpa":
        return mask
    if impl == "eager":  # eager ADDS the mask to the scores
        dtype = next(model.parameters()).dtype
        additive = torch.zeros(mask.shape, dtype=dtype, device=device)
        return additive.masked_fill(~mask, torch.finfo(dtype).min)
    raise PackingUnsupportedError(f"dense packed mask needs sdpa or eager attention, not {impl!r}")


# model -> None when packing works, else the reason it does not
_SUPPORT: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


def packing_unsupported_reason(model: torch.nn.Module) -> str | None:
    """None if ``model`` runs packed batches exactly (whitelist, then a tiny self-check; once per
    model); else why not, with a ``PackingFallbackWarning``."""
    if model in _SUPPORT:
        return _SUPPORT[model]
    config = getattr(model, "config", None)
    reason: str | None = None
    if getattr(config, "model_type", None) not in PACKABLE_MODEL_TYPES:
        reason = f"model_type not in {sorted(PACKABLE_MODEL_TYPES)}"
    elif any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        reason = "sliding-window layers"
    else:
        reason = _self_check(model)
    _SUPPORT[model] = reason
    if reason is not None:
        warnings.warn(f"shared-prompt packing is off for {_model_name(model)}: {reason}; "
                      "falling back to unpacked rows", PackingFallbackWarning, stacklevel=3)
    return reason


def _self_check(model: torch.nn.Module) -> str | None:
    vocab = int(model.config.vocab_size)
    tok = [1 + i % max(vocab - 1, 1) for i in range(16)]
    groups = [
        PackGroup(0, tok[0:3], [tok[3:6], tok[6:7], tok[7:9]]),
        PackGroup(1, tok[9:11], [tok[11:12], tok[12:16]]),
    ]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            got = batch_logprobs(model, pack_groups(groups, token_budget=64))
            want = batch_logprobs(model, unpacked_rows(groups))
    except Exception as exc:  # any failure means: do not pack this model
        return f"self-check raised {type(exc).__name__}: {exc}"
    finally:
        model.train(was_training)
    dtype = next(model.parameters()).dtype
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for g_got, g_want in zip(got, want, strict=True):
        for a, b in zip(g_got, g_want, strict=True):
            diff = float((a - b).abs().max())
            if not diff <= tol:
                return f"self-check: packed log-probs differ from unpacked by {diff:.2e}"
    return None


def choose_layout(
    groups: Sequence[PackGroup], models: Sequence[torch.nn.Module], *, pack: bool,
    min_saving: float, token_budget: int, max_responses_per_row: int | None = None,
    pad_id: int = 0,
) -> PackedBatch:
    """The one packing decision: the layout every model in ``models`` runs ``groups`` on, packed
    when ``pack``, the token saving reaches ``min_saving`` (0: always) and each model runs packed
    batches exactly; else unpacked rows."""
    if (pack and should_pack(groups, min_saving)
            and all(packing_unsupported_reason(m) is None for m in models)):
        return pack_groups(groups, token_budget=token_budget, pad_id=pad_id,
                           max_responses_per_row=max_responses_per_row)
    return unpacked_rows(groups, pad_id=pad_id)


def packed_response_logprobs(
    model: torch.nn.Module,
    groups: Sequence[PackGroup],
    *,
    temperature: float = SamplingSettings.temperature,
    token_budget: int,
    min_saving: float,
    pack: bool = True,
    max_responses_per_row: int | None = None,
    pad_id: int = 0,
) -> list[list[torch.Tensor]]:
    """Per group, per response: token log-probs ``[L_i]`` on ``choose_layout``'s layout."""
    batch = choose_layout(groups, [model], pack=pack, min_saving=min_saving,
                          token_budget=token_budget, max_responses_per_row=max_responses_per_row,
                          pad_id=pad_id)
    return batch_logprobs(model, batch, temperature=temperature)
