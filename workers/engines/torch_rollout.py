"""The in-process torch rollout engine: batched sampling with a KV cache over any HF causal LM.

Owns ``TorchRolloutEngine``, which implements ``RolloutEngine`` (see ``base`` for the log-prob,
stop-token and seeding contract). How one ``generate`` call runs:

1. The ``len(prompts) * n`` rows (prompt i repeated n times, in order) run as ONE batch, or in
   chunks of at most ``max_batch_size`` rows when that is set (``rollout.rows_per_generate``).
   Measured on a 4.2 M-parameter Qwen2 (docs/engines.md, ``streamflow bench generate``): 128 rows
   in one batch cost about half of two 64-row chunks, so the default is the whole call.
2. Each chunk is LEFT-padded; ``attention_mask`` marks real tokens and ``position_ids`` count real
   tokens only (``cumsum(mask) - 1``), so a padded row sees exactly what it would see alone.
3. One prefill forward fills a ``DynamicCache``; then one forward per new token ([B, 1] input, a
   view of a preallocated mask one column wider, positions advanced by one). Sampling
   (temperature, top-p, stop tokens) is vectorised over the chunk: no per-row Python work inside
   the loop.
4. Rows that have finished keep being fed a pad token (their outputs are ignored) until every row of
   the chunk has finished or ``max_new_tokens`` is reached; the cost is a few wasted rows, which is
   cheaper than re-packing the cache for the short responses this engine is used for.

Sampling is the Gumbel-max form of categorical sampling: ``argmax(log_softmax(logits / T) + g)``
with ``g = -log(E)``, ``E ~ Exp(1)`` per vocabulary entry, which draws exactly from the tempered
distribution (top-p: dropped entries are set to ``-inf`` first) and reuses the log-softmax the
behaviour log-prob needs anyway. Greedy: ``temperature <= GREEDY_TEMPERATURE`` means argmax
(temperature -> 0); its log-probs are those of the untempered distribution.

Reproducibility, per row: row j of prompt i draws its noise from its own ``torch.Generator``
seeded ``prompt_seed(i) + j``, where ``prompt_seed(i)`` is ``params.prompt_seeds[i]`` when given,
else ``params.seed + i * n`` (vLLM's convention: request seed s, child j seeded s + j). The noise
comes in fixed blocks of steps per row, so a row's samples depend only on its seed, its prompt,
the weights and the parameters: not on the other prompts of the call, the chunking or the order
(up to float rounding of the batched logits). With no seed the global torch RNG is used.

HF ``generate`` is not used: we need the exact full-vocabulary log-prob of every sampled token
before top-p truncation (the behaviour log-prob contract), which is one gather here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from workers.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    SamplingParams,
    prompt_seeds_of,
)

GREEDY_TEMPERATURE = 1e-5
# Noise is drawn per row in blocks of steps x vocabulary: big enough that one generator call
# serves many steps (per-step calls per row cost more than the model on small models), small
# enough to bound memory for large vocabularies (one step per block past 64 Ki entries).
NOISE_BLOCK_ENTRIES = 1 << 16


def row_seeds(params: SamplingParams, num_prompts: int, n: int) -> list[int] | None:
    """The seed of each of the ``num_prompts * n`` rows (None: unseeded, global RNG)."""
    bases = prompt_seeds_of(params, num_prompts, n)
    return None if bases is None else [b + j for b in bases for j in range(n)]


class _Noise:
    """Gumbel noise [B, V] per step, each row from its own generator in fixed-size blocks."""

    def __init__(
        self, seeds: list[int] | None, batch: int, vocab: int, max_new: int, device: torch.device
    ) -> None:
        self.block = max(1, min(max_new, NOISE_BLOCK_ENTRIES // max(vocab, 1)))
        self.gens = None
        if seeds is not None:
            self.gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.shape = (batch, self.block, vocab)
        self.device = device
        self.buf: torch.Tensor | None = None

    def step(self, t: int) -> torch.Tensor:
        k = t % self.block
        if k == 0:
            buf = torch.empty(self.shape, device=self.device)
            if self.gens is None:
                buf.exponential_()
            else:
                for row, gen in zip(buf, self.gens, strict=True):
                    row.exponential_(generator=gen)
            self.buf = buf.log_().neg_()  # Gumbel(0, 1) = -log(Exp(1))
        assert self.buf is not None
        return self.buf[:, k]


def _sample(
    logits: torch.Tensor, params: SamplingParams, noise: _Noise, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token [B] and its behaviour log-prob [B] from float32 logits [B, V]."""
    if params.temperature <= GREEDY_TEMPERATURE:
        logp = torch.log_softmax(logits, dim=-1)
        token = logp.argmax(dim=-1, keepdim=True)
        return token.squeeze(-1), logp.gather(-1, token).squeeze(-1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)  # [B, V], before truncation
    scores = logp + noise.step(step)
    if params.top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        probs = sorted_logp.exp()
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass BEFORE it is
        # below top_p (the most likely token always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
        scores.masked_fill_(torch.zeros_like(drop).scatter_(-1, order, drop), float("-inf"))
    token = scores.argmax(dim=-1, keepdim=True)
    return token.squeeze(-1), logp.gather(-1, token).squeeze(-1)


class TorchRolloutEngine:
    """``RolloutEngine`` over an HF causal LM held in this process (see module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer_or_eos_ids: PreTrainedTokenizerBase | Sequence[int],
        *,
        device: str | torch.device = "cpu",
        max_batch_size: int | None = None,
        pad_token_id: int | None = None,
        policy_version: int = 0,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be None or >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        if isinstance(tokenizer_or_eos_ids, PreTrainedTokenizerBase):
            tok = tokenizer_or_eos_ids
            eos = () if tok.eos_token_id is None else (int(tok.eos_token_id),)
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        else:
            eos = tuple(int(t) for t in tokenizer_or_eos_ids)
            pad = None
        self.eos_token_ids: tuple[int, ...] = eos
        if pad_token_id is not None:
            pad = pad_token_id
        self.pad_token_id = int(pad if pad is not None else (eos[0] if eos else 0))
        self.max_batch_size = max_batch_size  # rows per forward batch; None = the whole call
        self.policy_version = int(policy_version)
        # Running totals, read by the rollout worker for its metrics.
        self.generated_tokens_total = 0
        self.generate_seconds_total = 0.0

    # -- weights -------------------------------------------------------------------------------
    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy HF-named tensors into the model in place; unknown names or shapes are errors.

        Names absent from ``weights`` keep their current values (a partial update is allowed);
        tied weights (e.g. ``lm_head.weight``) may be sent or not.
        """
        targets = self.model.state_dict()
        unknown = sorted(k for k in weights if k not in targets)
        if unknown:
            raise KeyError(
                f"load_weights: unknown parameter names {unknown[:5]} (of {len(unknown)})"
            )
        with torch.no_grad():
            for name, value in weights.items():
                target = targets[name]
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(
                        f"load_weights: {name} has shape {tuple(value.shape)}, "
                        f"expected {tuple(target.shape)}"
                    )
                target.copy_(value.to(device=target.device, dtype=target.dtype))
        self.policy_version = int(version)

    # -- sampling ------------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Generation]]:
        """``n`` samples per prompt, in prompt order (see module docstring)."""
        if n < 1:
            raise ValueError(f"generate: n must be >= 1, got {n}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} is empty (needs at least one token)")
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        seeds = row_seeds(params, len(prompts), n)
        stop_ids = torch.tensor(
            sorted(set(self.eos_token_ids) | set(params.stop_token_ids)),
            dtype=torch.long,
            device=self.device,
        )
        t0 = time.perf_counter()
        flat: list[Generation] = []
        step = self.max_batch_size or max(len(rows), 1)
        for start in range(0, len(rows), step):
            chunk_seeds = None if seeds is None else seeds[start : start + step]
            flat.extend(self._generate_chunk(rows[start : start + step], params, stop_ids, chunk_seeds))
        self.generate_seconds_total += time.perf_counter() - t0
        self.generated_tokens_total += sum(len(g.token_ids) for g in flat)
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    @torch.inference_mode()
    def _generate_chunk(
        self,
        rows: list[list[int]],
        params: SamplingParams,
        stop_ids: torch.Tensor,
        seeds: list[int] | None,
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

        cache = DynamicCache()
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :].float()
        next_pos = position_ids[:, -1:] + 1  # [B, 1]
        noise = _Noise(seeds, batch, int(logits.shape[-1]), max_new, dev)

        tokens = torch.full((batch, max_new), self.pad_token_id, dtype=torch.long, device=dev)
        logps = torch.zeros((batch, max_new), dtype=torch.float32, device=dev)
        lengths = torch.full((batch,), max_new, dtype=torch.long, device=dev)
        finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        for step in range(max_new):
            token, logp = _sample(logits, params, noise, step)
            token = token.masked_fill(finished, self.pad_token_id)
            tokens[:, step] = token
            logps[:, step] = logp
            stopped = torch.isin(token, stop_ids) & ~finished
            lengths = torch.where(stopped, step + 1, lengths)
            finished |= stopped
            if step == max_new - 1 or bool(finished.all()):
                break
            out = self.model(
                input_ids=token[:, None],
                attention_mask=full_mask[:, : width + step + 1],
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1

        tokens_l, logps_l = tokens.tolist(), logps.tolist()
        lengths_l, finished_l = lengths.tolist(), finished.tolist()
        return [
            Generation(
                token_ids=tokens_l[i][: lengths_l[i]],
                logprobs=logps_l[i][: lengths_l[i]],
                finish_reason=FINISH_STOP if finished_l[i] else FINISH_LENGTH,
            )
            for i in range(batch)
        ]
