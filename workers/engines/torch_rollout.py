"""The in-process torch rollout engine: batched sampling with a KV cache over any HF causal LM.

Owns ``TorchRolloutEngine``, which implements ``RolloutEngine`` (see ``base`` for the log-prob,
stop-token and seeding contract). How one ``generate`` call runs:

1. The ``len(prompts) * n`` rows (prompt i repeated n times, in order) are cut into chunks of at
   most ``max_batch_size`` rows.
2. Each chunk is LEFT-padded; ``attention_mask`` marks real tokens and ``position_ids`` count real
   tokens only (``cumsum(mask) - 1``), so a padded row sees exactly what it would see alone.
3. One prefill forward fills a ``DynamicCache``; then one forward per new token ([B, 1] input, the
   mask grown by one column, positions advanced by one). Sampling (temperature, top-p, stop
   tokens) is vectorised over the chunk: no per-row Python work inside the loop.
4. Rows that have finished keep being fed a pad token (their outputs are ignored) until every row of
   the chunk has finished or ``max_new_tokens`` is reached; the cost is a few wasted rows, which is
   cheaper than re-packing the cache for the short responses this engine is used for.

Greedy: ``temperature <= GREEDY_TEMPERATURE`` means argmax (temperature -> 0); its log-probs are
those of the untempered distribution. Reproducibility: each call with ``params.seed`` set uses its
own ``torch.Generator`` seeded with it, so same seed + weights + prompts + ``max_batch_size`` ->
same outputs; with ``seed=None`` the global torch RNG is used.

HF ``generate`` is not used: we need the exact full-vocabulary log-prob of every sampled token
before top-p truncation (the behaviour log-prob contract), which is one gather here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from workers.engines.base import FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams

GREEDY_TEMPERATURE = 1e-5


def _sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token [B] and its behaviour log-prob [B] from float32 logits [B, V]."""
    if params.temperature <= GREEDY_TEMPERATURE:
        logp = torch.log_softmax(logits, dim=-1)
        token = logp.argmax(dim=-1, keepdim=True)
        return token.squeeze(-1), logp.gather(-1, token).squeeze(-1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)  # [B, V], before truncation
    if params.top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        probs = sorted_logp.exp()
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass BEFORE it is
        # below top_p (the most likely token always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
        kept = probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(kept, 1, generator=generator)
        token = order.gather(-1, choice)
    else:
        token = torch.multinomial(logp.exp(), 1, generator=generator)
    return token.squeeze(-1), logp.gather(-1, token).squeeze(-1)


class TorchRolloutEngine:
    """``RolloutEngine`` over an HF causal LM held in this process (see module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer_or_eos_ids: PreTrainedTokenizerBase | Sequence[int],
        *,
        device: str | torch.device = "cpu",
        max_batch_size: int = 64,
        pad_token_id: int | None = None,
        policy_version: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
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
        self.max_batch_size = int(max_batch_size)
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

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The live tensors by HF name: collective sync copies a broadcast version into them."""
        return self.model.state_dict()

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
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(int(params.seed))
        stop_ids = torch.tensor(
            sorted(set(self.eos_token_ids) | set(params.stop_token_ids)),
            dtype=torch.long,
            device=self.device,
        )
        t0 = time.perf_counter()
        flat: list[Generation] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            flat.extend(self._generate_chunk(chunk, params, stop_ids, generator))
        self.generate_seconds_total += time.perf_counter() - t0
        self.generated_tokens_total += sum(len(g.token_ids) for g in flat)
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    @torch.inference_mode()
    def _generate_chunk(
        self,
        rows: list[list[int]],
        params: SamplingParams,
        stop_ids: torch.Tensor,
        generator: torch.Generator | None,
    ) -> list[Generation]:
        dev = self.device
        batch = len(rows)
        width = max(len(r) for r in rows)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, width - len(r) :] = 1
        input_ids, attention_mask = input_ids.to(dev), attention_mask.to(dev)
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

        max_new = params.max_new_tokens
        tokens = torch.full((batch, max_new), self.pad_token_id, dtype=torch.long, device=dev)
        logps = torch.zeros((batch, max_new), dtype=torch.float32, device=dev)
        lengths = torch.full((batch,), max_new, dtype=torch.long, device=dev)
        finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        ones = torch.ones((batch, 1), dtype=attention_mask.dtype, device=dev)
        for step in range(max_new):
            token, logp = _sample(logits, params, generator)
            token = token.masked_fill(finished, self.pad_token_id)
            tokens[:, step] = token
            logps[:, step] = logp
            stopped = torch.isin(token, stop_ids) & ~finished
            lengths = torch.where(stopped, step + 1, lengths)
            finished |= stopped
            if step == max_new - 1 or bool(finished.all()):
                break
            attention_mask = torch.cat([attention_mask, ones], dim=1)
            out = self.model(
                input_ids=token[:, None],
                attention_mask=attention_mask,
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
