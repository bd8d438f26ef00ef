"""Shared-prompt packing: a group's responses scored with ONE copy of its prompt.

Owns the packed layout (``pack_groups`` -> ``PackedBatch``), the attention that makes it exact for
Hugging Face causal LMs, and the switch between packed and unpacked forwards
(``packed_response_logprobs(..., pack=True|False)``) so callers flip one flag.

Layout of a packed row (``T`` columns, several chunks, padding at the end)::

    | prompt A | A.r1 | A.r2 | prompt B | B.r1 | B.r2 | B.r3 | pad ... |
      pos 0..P   P..     P..    0..P'      P'..   P'..   P'..   0

Invariants:
- A chunk is one prompt copy followed by some of its group's responses. Position ids restart at the
  prompt length for every response; each response attends to its prompt and causally to itself,
  never to a sibling or to another chunk. Token ``j`` of a response is scored from the logits of
  the position before it; for ``j = 0`` that is the prompt's last position.
- A group bigger than ``token_budget`` (or ``max_responses_per_row``) is split into several chunks,
  each with its own prompt copy. Chunks never straddle rows; several chunks share a row while
  their sum fits the budget. Padding is masked out (a pad position attends only to itself, so no
  softmax row is empty and no NaN can reach a gradient).
- Every result is indexed by the group's position in the input list, never by arrival order, and
  ``PackedBatch.group_ids`` carries each group's identity.

How the attention is done (exact, checked by tests against unpacked forwards):
- ``attention="segments"`` (default): a transformers attention function, registered as
  ``"streamflow_shared_prompt"`` and switched on only for the packed call, runs SDPA per chunk:
  causal over the prompt, then each response's queries against [prompt keys; own keys] with a small
  lower-right causal mask. A response of n tokens costs n * (P + n) scores (the unpacked causal
  row costs (P + n)^2 / 2) and the prompt's P^2 / 2 is paid once per chunk instead of once per
  response. A dense [T, T] mask instead costs T^2 per row: measured ~9x slower attention at
  T = 4608, enough to defeat the saving for long packed rows.
- ``attention="mask"``: the dense ``[R, 1, T, T]`` mask (``PackedBatch.attention_mask``), which
  transformers 5 passes through untouched (bool for ``sdpa``, additive float for ``eager``).
  Kept as a generic, independent implementation of the same pattern (tests check both).
- In both, only the positions that score a response token go through ``lm_head``.
Models outside ``PACKABLE_MODEL_TYPES`` or failing a one-time self-check on a tiny input fall back
to unpacked rows with a ``PackingFallbackWarning`` naming the model.

When packing pays (``should_pack``): packing saves tokens but its attention runs per chunk, so for
short prompts (little saved) it is slower than plain rows. Callers decide per batch from the token
saving ``1 - packed / unpacked`` real tokens (``token_saving``): pack only when it reaches
``min_saving`` (``trainer.packing_min_saving``; default ``DEFAULT_MIN_SAVING``, measured with
``streamflow bench packing`` so that the auto choice is never more than 3 % slower than unpacked
rows; docs/engines.md has the table). Flex attention is not used:
on CPU it needs ``torch.compile`` per shape, and the segment path is already exact and cheap.
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
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

ATTENTION_NAME = "streamflow_shared_prompt"
LAYOUT_KWARG = "shared_prompt_layout"
# Architectures whose attention is plain RoPE softmax attention through the transformers attention
# interface, with a ``model`` decoder and a plain ``lm_head``. Others use unpacked rows.
PACKABLE_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama"})
AttentionKind = Literal["segments", "mask"]
# Token saving at or above which a batch is packed (see the module docstring; docs/engines.md).
DEFAULT_MIN_SAVING = 0.25


class PackingError(ValueError):
    """The groups or packing parameters are invalid (the message names what and where)."""


class PackingUnsupportedError(RuntimeError):
    """A packed batch was given to a model that cannot run the shared-prompt layout."""


class PackingFallbackWarning(UserWarning):
    """Packing was requested for a model that cannot take it; unpacked rows are used instead."""


@dataclass
class PackGroup:
    """One prompt and the responses sampled from it (token ids, no padding)."""

    group_id: int
    prompt_ids: list[int]
    responses: list[list[int]]


@dataclass(frozen=True)
class PackChunk:
    """One prompt copy and the responses that follow it inside one row."""

    group_index: int  # index of the group in the input list
    row: int
    prompt_start: int
    prompt_len: int
    response_indices: tuple[int, ...]  # indices into the group's responses
    response_starts: tuple[int, ...]
    response_lens: tuple[int, ...]


@dataclass
class PackedBatch:
    """Model inputs for a list of groups plus the map from logits back to response tokens.

    ``target_*`` are flat over (group, response, token) in input order; ``response_lengths`` splits
    them back. Logits of ``(target_row[n], target_pos[n])`` score token ``target_token[n]``.
    """

    input_ids: torch.Tensor  # [R, T] long
    position_ids: torch.Tensor  # [R, T] long
    token_mask: torch.Tensor  # [R, T] bool, real (non-pad) tokens
    score_mask: torch.Tensor  # [R, T] bool, positions whose logits score some response token
    target_row: torch.Tensor  # [N] long
    target_pos: torch.Tensor  # [N] long
    target_token: torch.Tensor  # [N] long
    target_keep_index: torch.Tensor  # [N] long, index into the row-major True entries of score_mask
    response_lengths: list[list[int]]  # per group, per response
    group_ids: list[int]
    chunks: list[PackChunk]
    packed: bool  # False: one prompt+response per row, plain causal attention
    _dense_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_tokens(self) -> int:
        """Real tokens that go through the model (what the linear layers pay for)."""
        return int(self.token_mask.sum())

    def target_index(self, group: int, response: int) -> torch.Tensor:
        """[L, 2] (row, position) of the logits that score each token of one response."""
        lens = self.response_lengths
        offset = sum(sum(g) for g in lens[:group]) + sum(lens[group][:response])
        n = lens[group][response]
        rows = self.target_row[offset : offset + n]
        return torch.stack([rows, self.target_pos[offset : offset + n]], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """The dense ``[R, 1, T, T]`` bool mask of the layout (True = may attend); built on demand."""
        if self._dense_mask is None:
            rows, width = self.num_rows, self.seq_len
            mask = torch.zeros(rows, 1, width, width, dtype=torch.bool)
            idx = torch.arange(width)
            mask[:, 0, idx, idx] = True  # pads see themselves only
            for c in self.chunks:
                ps, pl = c.prompt_start, c.prompt_len
                mask[c.row, 0, ps : ps + pl, ps : ps + pl] = torch.ones(pl, pl).tril().bool()
                for s, n in zip(c.response_starts, c.response_lens, strict=True):
                    mask[c.row, 0, s : s + n, ps : ps + pl] = True
                    mask[c.row, 0, s : s + n, s : s + n] = torch.ones(n, n).tril().bool()
            self._dense_mask = mask
        return self._dense_mask


def token_saving(groups: Sequence[PackGroup]) -> float:
    """``1 - packed / unpacked`` real tokens of ``groups`` (one prompt copy per group packed).

    Unpacked, every non-empty response carries its own prompt copy; packed, a group pays for its
    prompt once (a group split over several rows pays a copy per chunk: ignored here, it only
    happens for groups larger than the token budget).
    """
    unpacked = packed = 0
    for g in groups:
        responses = [len(r) for r in g.responses if len(r) > 0]
        if not responses:
            continue
        unpacked += len(responses) * len(g.prompt_ids) + sum(responses)
        packed += len(g.prompt_ids) + sum(responses)
    return 1.0 - packed / unpacked if unpacked else 0.0


def should_pack(groups: Sequence[PackGroup], min_saving: float = DEFAULT_MIN_SAVING) -> bool:
    """Whether packing ``groups`` pays: their token saving reaches ``min_saving`` (0: always)."""
    return min_saving <= 0.0 or token_saving(groups) >= min_saving


def _validate(groups: Sequence[PackGroup], token_budget: int, max_per_row: int | None) -> None:
    if not groups:
        raise PackingError("no groups to pack")
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 2:
        raise PackingError(f"token_budget must be an int >= 2, got {token_budget!r}")
    if max_per_row is not None and (not isinstance(max_per_row, int) or max_per_row < 1):
        raise PackingError(
            f"max_responses_per_row must be None or an int >= 1, got {max_per_row!r}"
        )
    seen: set[int] = set()
    for g in groups:
        if g.group_id in seen:
            raise PackingError(f"group_id {g.group_id} appears twice in one batch")
        seen.add(g.group_id)
        if len(g.prompt_ids) == 0:
            raise PackingError(f"group {g.group_id}: empty prompt (nothing to score token 0 from)")
        for i, r in enumerate(g.responses):
            if len(g.prompt_ids) + len(r) > token_budget:
                raise PackingError(
                    f"group {g.group_id} response {i}: prompt ({len(g.prompt_ids)}) + response "
                    f"({len(r)}) tokens exceed token_budget={token_budget}"
                )
        for ids in [g.prompt_ids, *g.responses]:
            if any(int(t) < 0 for t in ids):
                raise PackingError(f"group {g.group_id}: negative token id")


def _plan_chunks(
    groups: Sequence[PackGroup], token_budget: int, max_per_row: int | None
) -> list[tuple[int, list[int]]]:
    """Split each group into (group index, response indices) chunks that fit one row."""
    plan: list[tuple[int, list[int]]] = []
    for gi, g in enumerate(groups):
        cur: list[int] = []
        used = len(g.prompt_ids)
        for ri, r in enumerate(g.responses):
            if len(r) == 0:
                continue  # nothing to score; it gets an empty tensor
            full = max_per_row is not None and len(cur) >= max_per_row
            if cur and (full or used + len(r) > token_budget):
                plan.append((gi, cur))
                cur, used = [], len(g.prompt_ids)
            cur.append(ri)
            used += len(r)
        if cur:
            plan.append((gi, cur))
    return plan


def pack_groups(
    groups: Sequence[PackGroup],
    *,
    token_budget: int,
    max_responses_per_row: int | None = None,
    pad_id: int = 0,
) -> PackedBatch:
    """Pack groups as ``prompt + r1 + r2 + ...`` chunks into rows of at most ``token_budget``."""
    _validate(groups, token_budget, max_responses_per_row)
    rows_used: list[int] = []
    placed: list[tuple[int, list[int], int, int]] = []  # (group, responses, row, start)
    for gi, resp in _plan_chunks(groups, token_budget, max_responses_per_row):
        g = groups[gi]
        size = len(g.prompt_ids) + sum(len(g.responses[i]) for i in resp)
        # First fit: the earliest row with room keeps the layout deterministic.
        row = next((r for r, u in enumerate(rows_used) if u + size <= token_budget), None)
        if row is None:
            row = len(rows_used)
            rows_used.append(0)
        placed.append((gi, resp, row, rows_used[row]))
        rows_used[row] += size
    return _assemble(groups, placed, max(rows_used, default=1), pad_id, packed=True)


def unpacked_rows(groups: Sequence[PackGroup], *, pad_id: int = 0) -> PackedBatch:
    """One right-padded ``prompt + response`` row per response: the reference layout."""
    budget = max(len(g.prompt_ids) + max((len(r) for r in g.responses), default=0) for g in groups)
    _validate(groups, max(budget, 2), None)
    placed: list[tuple[int, list[int], int, int]] = []
    for gi, g in enumerate(groups):
        for ri, r in enumerate(g.responses):
            if len(r) > 0:
                placed.append((gi, [ri], len(placed), 0))
    return _assemble(groups, placed, budget, pad_id, packed=False)


def _assemble(
    groups: Sequence[PackGroup],
    placed: list[tuple[int, list[int], int, int]],
    width: int,
    pad_id: int,
    *,
    packed: bool,
) -> PackedBatch:
    num_rows = max((row for _, _, row, _ in placed), default=-1) + 1
    num_rows = max(num_rows, 1)
    input_ids = torch.full((num_rows, width), int(pad_id), dtype=torch.long)
    position_ids = torch.zeros((num_rows, width), dtype=torch.long)
    token_mask = torch.zeros((num_rows, width), dtype=torch.bool)
    score_mask = torch.zeros((num_rows, width), dtype=torch.bool)
    where: dict[tuple[int, int], tuple[int, int, int]] = {}  # (g, r) -> (row, start, prompt_end)
    chunks: list[PackChunk] = []
    for gi, resp, row, start in placed:
        g = groups[gi]
        plen = len(g.prompt_ids)
        input_ids[row, start : start + plen] = torch.tensor(g.prompt_ids, dtype=torch.long)
        position_ids[row, start : start + plen] = torch.arange(plen)
        cursor, starts, lens = start + plen, [], []
        for ri in resp:
            r = g.responses[ri]
            n = len(r)
            input_ids[row, cursor : cursor + n] = torch.tensor(r, dtype=torch.long)
            position_ids[row, cursor : cursor + n] = torch.arange(plen, plen + n)
            where[(gi, ri)] = (row, cursor, start + plen)
            starts.append(cursor)
            lens.append(n)
            cursor += n
        token_mask[row, start:cursor] = True
        chunks.append(PackChunk(gi, row, start, plen, tuple(resp), tuple(starts), tuple(lens)))
    t_row: list[int] = []
    t_pos: list[int] = []
    t_tok: list[int] = []
    for gi, g in enumerate(groups):
        for ri, r in enumerate(g.responses):
            if not r:
                continue
            row, s, prompt_end = where[(gi, ri)]
            # token 0 from the prompt's last position, token j from the response's token j - 1
            t_pos += [prompt_end - 1] + list(range(s, s + len(r) - 1))
            t_row += [row] * len(r)
            t_tok += [int(t) for t in r]
    target_row = torch.tensor(t_row, dtype=torch.long)
    target_pos = torch.tensor(t_pos, dtype=torch.long)
    score_mask[target_row, target_pos] = True
    keep_rank = torch.cumsum(score_mask.flatten().long(), 0) - 1
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        token_mask=token_mask,
        score_mask=score_mask,
        target_row=target_row,
        target_pos=target_pos,
        target_token=torch.tensor(t_tok, dtype=torch.long),
        target_keep_index=keep_rank[target_row * width + target_pos],
        response_lengths=[[len(r) for r in g.responses] for g in groups],
        group_ids=[g.group_id for g in groups],
        chunks=chunks,
        packed=packed,
    )


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
    layout: SharedPromptLayout | None = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
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


def _chunk_attention(
    q: torch.Tensor,  # [H, T, d], one row
    k: torch.Tensor,
    v: torch.Tensor,
    c: PackChunk,
    layout: SharedPromptLayout,
    sdpa_args: dict[str, Any],
) -> list[torch.Tensor]:
    """Attention outputs of one chunk, in row order: [H, P, d], then [H, L_i, d] per response."""
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
        # splitting prompt and own keys into two mask-free calls merged by log-sum-exp was
        # measured no faster on CPU, so the simple masked call stays.
        mask = layout.response_mask(c.prompt_len, n, q.device)
        o = F.scaled_dot_product_attention(take(q), ks, vs, attn_mask=mask, **sdpa_args)
        outs.update({s: o[i] for i, s in enumerate(starts)})
    return [prompt[0], *(outs[s] for s in sorted(outs))]


AttentionInterface.register(ATTENTION_NAME, shared_prompt_attention)


@contextlib.contextmanager
def _attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Switch the model's attention function for one call (the config is read at every forward)."""
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
    """[K, V] logits at the True positions of ``score_mask`` (row-major order).

    For the whitelisted architectures the decoder runs alone and ``lm_head`` only sees the scored
    positions (the vocabulary projection is the largest matmul per token, and prompts need none);
    these have no logit scaling or soft-capping, so this equals ``model(...).logits``. Done by
    hand rather than with ``logits_to_keep``, whose boolean-mask form only exists in recent
    transformers.
    """
    decoder, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if _is_packable_type(model) and decoder is not None and head is not None:
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        return head(hidden[score_mask])
    return model(**inputs, use_cache=False).logits[score_mask]


def batch_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    temperature: float = 1.0,
    attention: AttentionKind = "segments",
) -> list[list[torch.Tensor]]:
    """Token log-probs ``log_softmax(logits / temperature)`` of every response in ``batch``.

    Returns, per group and per response, a float32 tensor ``[L_i]`` (differentiable when grad is
    enabled). Raises ``PackingUnsupportedError`` for a packed batch on a model outside
    ``PACKABLE_MODEL_TYPES``; use ``packed_response_logprobs`` for the automatic fallback.
    """
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
        mask2d = batch.token_mask.long().to(device)
        logits = _scored_logits(model, score_mask, input_ids=ids, attention_mask=mask2d)
    elif attention == "segments":
        layout = SharedPromptLayout.of(batch)
        with _attention_implementation(model, ATTENTION_NAME):
            logits = _scored_logits(
                model,
                score_mask,
                input_ids=ids,
                position_ids=batch.position_ids.to(device),
                **{LAYOUT_KWARG: layout},
            )
    elif attention == "mask":
        logits = _scored_logits(
            model,
            score_mask,
            input_ids=ids,
            position_ids=batch.position_ids.to(device),
            attention_mask=_dense_mask_for(model, batch),
        )
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
    """None if ``model`` can run packed batches exactly; else why not (checked once per model).

    The check is a model-type whitelist, then packed vs unpacked log-probs on a tiny input.
    """
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
        warnings.warn(
            f"shared-prompt packing is off for {_model_name(model)}: {reason}; "
            "falling back to unpacked rows",
            PackingFallbackWarning,
            stacklevel=3,
        )
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


def packed_response_logprobs(
    model: torch.nn.Module,
    groups: Sequence[PackGroup],
    *,
    temperature: float = 1.0,
    token_budget: int,
    pack: bool = True,
    max_responses_per_row: int | None = None,
    pad_id: int = 0,
    min_saving: float = 0.0,
) -> list[list[torch.Tensor]]:
    """Per group, per response: token log-probs ``[L_i]``; packed or as unpacked rows.

    ``pack=True`` uses shared-prompt packing when the model supports it (else warns once and uses
    unpacked rows) and the batch's token saving reaches ``min_saving`` (``should_pack``; 0 packs
    every batch); ``pack=False`` always uses unpacked right-padded ``prompt + response`` rows.
    """
    pack = pack and should_pack(groups, min_saving)
    if pack and packing_unsupported_reason(model) is None:
        batch = pack_groups(
            groups,
            token_budget=token_budget,
            max_responses_per_row=max_responses_per_row,
            pad_id=pad_id,
        )
    else:
        batch = unpacked_rows(groups, pad_id=pad_id)
    return batch_logprobs(model, batch, temperature=temperature)
