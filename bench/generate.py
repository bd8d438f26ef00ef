"""Benchmark: the torch rollout engine against transformers ``generate`` on the same batch.

Workload (defaults, "G1"): a 4.2 M-parameter Qwen2 (hidden 256, 4 layers, 4 heads, 2 KV heads,
intermediate 1024, tied embeddings, vocabulary 1024, random weights, fp32), 16 prompts of 4-7
tokens (so rows are left-padded), G = 8 samples each, 64 new tokens per sample (no stop token:
every row runs the full length on every side), temperature 1, top-p 1.

Sides, run interleaved in ONE process after one warm-up each (load from other processes then hits
all sides alike); best wall and process CPU seconds of ``--repeats`` runs:

- ``engine``: ``TorchRolloutEngine`` as the rollout worker builds it by default (sdpa attention,
  the whole call as one batch);
- ``engine_eager_64``: the same engine with eager attention in 64-row chunks (the former default);
- ``hf_generate``: ``model.generate(do_sample=True)`` with sdpa on the same left-padded batch.

``generate_seconds(...)`` times one configuration and is importable by other benchmarks.

Output: a table, then one JSON line ``{"bench": "generate", ...}`` with ``engine_vs_hf`` (HF
seconds / engine seconds; > 1 means the engine is faster). With ``--json`` the table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from bench._g1 import G1, G1Shape

# One definition of the G1 workload's sizes, shared with `bench phases`.
Workload = G1Shape
QUICK = G1Shape(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=64, prompts=2,
                group_size=2, new_tokens=4)
SIDES = ("engine", "engine_eager_64", "hf_generate")


def build_model(w: Workload, attn: str) -> Any:
    """The workload's Qwen2 with random weights (seed 0), in eval mode."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=w.vocab, hidden_size=w.hidden, intermediate_size=w.intermediate,
        num_hidden_layers=w.layers, num_attention_heads=w.heads, num_key_value_heads=w.kv_heads,
        max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_implementation=attn,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).eval()


def prompts_of(w: Workload) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(4, 8, (w.prompts,), generator=gen).tolist()
    return [torch.randint(4, w.vocab, (n,), generator=gen).tolist() for n in lengths]


def make_side(side: str, w: Workload) -> Callable[[], int]:
    """A callable that generates the workload once with ``side``; returns the tokens generated."""
    import torch

    from workers.engines.base import SamplingParams
    from workers.engines.torch_rollout import TorchRolloutEngine

    prompts = prompts_of(w)
    if side in ("engine", "engine_eager_64"):
        eager = side == "engine_eager_64"
        engine = TorchRolloutEngine(
            build_model(w, "eager" if eager else "sdpa"), [], pad_token_id=0,
            max_batch_size=64 if eager else None,
        )  # no eos ids: every row generates new_tokens tokens
        params = SamplingParams(temperature=1.0, max_new_tokens=w.new_tokens, seed=3)

        def run_engine() -> int:
            out = engine.generate(prompts, w.group_size, params)
            return sum(len(g.token_ids) for group in out for g in group)

        return run_engine
    if side != "hf_generate":
        raise ValueError(f"unknown side {side!r}; sides: {list(SIDES)}")
    model = build_model(w, "sdpa")
    rows = [p for p in prompts for _ in range(w.group_size)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = (ids != 0).long()
    for i, r in enumerate(rows):  # (a real token may be 0 in principle: mark by length)
        mask[i] = torch.tensor([0] * (width - len(r)) + [1] * len(r))

    @torch.inference_mode()
    def run_hf() -> int:
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=w.new_tokens,
            min_new_tokens=w.new_tokens, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0,
            eos_token_id=None,
        )
        return int(out.shape[0] * (out.shape[1] - width))

    return run_hf


def generate_seconds(
    sides: tuple[str, ...] = SIDES, *, workload: Workload = G1, repeats: int = 3,
    threads: int = 2,
) -> dict[str, dict[str, float]]:
    """Best wall/CPU seconds per side, interleaved after one warm-up round."""
    import torch

    torch.set_num_threads(threads)
    runs = {s: make_side(s, workload) for s in sides}
    wall: dict[str, list[float]] = {s: [] for s in sides}
    cpu: dict[str, list[float]] = {s: [] for s in sides}
    tokens: dict[str, int] = {}
    for r in range(repeats + 1):
        for s in sides:
            w0, c0 = time.perf_counter(), time.process_time()
            tokens[s] = runs[s]()
            if r > 0 or repeats == 0:  # round 0 is the warm-up
                wall[s].append(time.perf_counter() - w0)
                cpu[s].append(time.process_time() - c0)
    return {
        s: {"seconds": min(wall[s]), "cpu_seconds": min(cpu[s]), "tokens": tokens[s]}
        for s in sides
    }


def main(argv: list[str]) -> int:
    """Run the benchmark; prints a table then one JSON line. Returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="streamflow bench generate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--json", action="store_true", help="stdout holds only the JSON line")
    parser.add_argument("--quick", action="store_true", help="tiny model and batch (for tests)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    if args.repeats < 0 or args.threads < 1:
        parser.error("--repeats must be >= 0 and --threads >= 1")
    w = QUICK if args.quick else G1
    result = generate_seconds(workload=w, repeats=args.repeats, threads=args.threads)
    out = sys.stderr if args.json else sys.stdout
    print(f"generation: {w.prompts} prompts x {w.group_size} samples x {w.new_tokens} tokens, Qwen2 "
          f"hidden={w.hidden} layers={w.layers} vocab={w.vocab}, fp32, {args.threads} threads",
          file=out)
    print(f"{'side':>16} | {'wall s':>7} | {'cpu s':>7} | {'tokens':>6}", file=out)
    for side, r in result.items():
        print(f"{side:>16} | {r['seconds']:>7.3f} | {r['cpu_seconds']:>7.3f} | {r['tokens']:>6}",
              file=out)
    hf = result["hf_generate"]["seconds"]
    report = {
        "bench": "generate", "workload": asdict(w), "threads": args.threads,
        "sides": {s: {k: round(v, 4) for k, v in r.items()} for s, r in result.items()},
        "engine_vs_hf": round(hf / result["engine"]["seconds"], 4),
        "engine_vs_eager_64": round(
            result["engine_eager_64"]["seconds"] / result["engine"]["seconds"], 4),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
