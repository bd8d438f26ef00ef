"""``streamflow bench calibrate``: measure the cost model's per-device figures on a real accelerator.

The simulated cluster (``streamflow bench simulate``) holds its devices for times from the cost
preset ``7b-1acc`` (``workers/engines/sim_cost.py``), whose numbers come from datasheets and published
benchmarks. This bench checks them on the accelerator it runs on: it builds a model of the
preset's shape (Qwen2.5-7B: 28 layers, width 3584, MLP 18944, 28 query / 4 key-value heads, vocab
152064; random bf16 weights — timing does not depend on their values, and nothing is downloaded)
and times, each the median of several runs after warm-ups (CUDA events):

- ``ref_s_per_token`` / ``prefill_s_per_token``: a forward with every token's logits (the
  reference log-probs; prefill is the same compute-bound forward), B x T tokens;
- ``train_s_per_token``: forward + backward of a log-prob loss over every token (no activation
  checkpointing), the trainer's micro-batch work;
- ``decode step``: one decode step of B live sequences with L tokens of context each, the
  model's own weights and a bf16 KV cache, captured in a CUDA graph so that kernel launches do
  not count (a serving engine's floor: it adds sampling and scheduling) — against the preset's
  ``decode_base_s + B * decode_per_seq_s`` at B = 1 and 256;
- ``optimizer_s``: a fused AdamW step over a slice of fp32 parameters, scaled to N parameters;
- device -> host copy bandwidth into pinned memory (the first hop of a weight sync; the preset's
  ``sync_bandwidth`` is the network's, so this is reported, not compared).

``--tiny`` runs the same code on a tiny model and tiny shapes on whatever device there is (the
CPU here): a smoke test of the bench, not a measurement. Output: a table, then one JSON line
``{"device", "model", "rows": [{"name", "preset", "measured", "unit", "ratio", "how"}]}``;
``ratio`` = measured / preset (above 1: the preset is optimistic for this device).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from workers.engines.sim_cost import preset

# The preset's model: Qwen2.5-7B's architecture (its config.json), built locally from these.
QWEN25_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    rope_theta=1e6,
    tie_word_embeddings=False,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


@dataclass
class Shapes:
    forward_batch: tuple[int, int]  # (sequences, tokens each) of the reference forward
    train_batch: tuple[int, int]  # the same for forward + backward
    context: int  # L: tokens of context per live sequence in a decode step
    decode_batches: tuple[int, ...]  # B values
    optimizer_params: int  # fp32 parameters in the timed AdamW slice
    copy_bytes: int  # bytes per device -> host copy
    repeats: int


FULL = Shapes((8, 1024), (2, 1024), 856, (1, 256), 1_000_000_000, 2 << 30, 5)
TINY_SHAPES = Shapes((2, 32), (2, 32), 48, (1, 4), 100_000, 1 << 20, 2)


@dataclass
class Row:
    name: str
    preset: float | None  # the preset's value (None: reported only)
    measured: float
    unit: str
    how: str

    @property
    def ratio(self) -> float | None:
        return self.measured / self.preset if self.preset else None


class Timer:
    """Median wall time of a callable: CUDA events on a GPU, perf_counter elsewhere."""

    def __init__(self, torch: Any, device: Any, repeats: int) -> None:
        self.torch, self.device, self.repeats = torch, device, repeats
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any], warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.cuda:
                start = self.torch.cuda.Event(enable_timing=True)
                end = self.torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)


def build_model(torch: Any, device: Any, arch: dict[str, Any]) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**arch)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg)
    return model.to(torch.bfloat16).eval()


def decode_step(torch: Any, model: Any, batch: int, context: int) -> Callable[[], Any]:
    """One decode step of ``batch`` sequences over ``context`` cached tokens, by hand from the
    model's weights (projections, GQA attention over the KV cache, MLP, final norm and logits);
    rotary embeddings are left out (elementwise, negligible)."""
    cfg, dev = model.config, model.device
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // heads
    bf16 = torch.bfloat16
    x = torch.randn(batch, 1, cfg.hidden_size, device=dev, dtype=bf16)
    caches = [
        (
            torch.randn(batch, kv, context, hd, device=dev, dtype=bf16),
            torch.randn(batch, kv, context, hd, device=dev, dtype=bf16),
        )
        for _ in model.model.layers
    ]

    def step() -> Any:
        h = x
        for layer, (k_cache, v_cache) in zip(model.model.layers, caches, strict=True):
            a, m = layer.self_attn, layer.mlp
            r = layer.input_layernorm(h)
            q = a.q_proj(r).view(batch, kv, heads // kv, hd)  # query heads grouped per KV head
            k_cache[:, :, -1] = a.k_proj(r).view(batch, kv, hd)  # this token's K/V into the cache
            v_cache[:, :, -1] = a.v_proj(r).view(batch, kv, hd)
            scores = torch.matmul(q, k_cache.transpose(-1, -2)) * hd**-0.5  # [B, kv, g, L]
            o = torch.matmul(scores.softmax(-1), v_cache)  # [B, kv, g, hd]
            h = h + a.o_proj(o.reshape(batch, 1, heads * hd))
            r = layer.post_attention_layernorm(h)
            h = h + m.down_proj(torch.nn.functional.silu(m.gate_proj(r)) * m.up_proj(r))
        return model.lm_head(model.model.norm(h)).argmax(-1)

    if dev.type != "cuda":
        return step
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def measure(tiny: bool, repeats: int | None = None) -> tuple[dict[str, Any], list[Row]]:
    import torch

    if not tiny and not torch.cuda.is_available():
        raise RuntimeError("streamflow bench calibrate needs a CUDA device (or --tiny)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = TINY_SHAPES if tiny else FULL
    timer = Timer(torch, device, repeats or shapes.repeats)
    cost = preset("7b-1acc")
    model = build_model(torch, device, TINY if tiny else QWEN25_7B)
    n = sum(p.numel() for p in model.parameters())
    cfg = model.config
    rows: list[Row] = []

    def logprob_sum(ids: Any) -> Any:
        logits = model(input_ids=ids).logits.float()
        return logits.log_softmax(-1).gather(-1, ids[..., None]).sum()

    b, t = shapes.forward_batch
    ids = torch.randint(cfg.vocab_size, (b, t), device=device)
    with torch.no_grad():
        seconds = timer(lambda: logprob_sum(ids))
    how = f"forward + log-probs of {b}x{t} tokens"
    rows.append(Row("ref_s_per_token", cost.ref_s_per_token, seconds / (b * t), "s/token", how))

    b, t = shapes.train_batch
    ids = torch.randint(cfg.vocab_size, (b, t), device=device)
    for p in model.parameters():
        p.requires_grad_(True)

    def train() -> None:
        logprob_sum(ids).backward()

    seconds = timer(train)
    how = f"forward + backward of {b}x{t} tokens, bf16, no checkpointing"
    rows.append(Row("train_s_per_token", cost.train_s_per_token, seconds / (b * t), "s/token", how))
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.requires_grad_(False)

    with torch.no_grad():
        for batch in shapes.decode_batches:
            seconds = timer(decode_step(torch, model, batch, shapes.context), warmup=3)
            expected = cost.decode_base_s + batch * cost.decode_per_seq_s
            how = f"{batch} sequences x {shapes.context} context tokens" + (
                ", CUDA graph" if device.type == "cuda" else ""
            )
            rows.append(Row(f"decode_step_s(B={batch})", expected, seconds, "s/step", how))
            if device.type == "cuda":
                torch.cuda.empty_cache()

    k = shapes.optimizer_params
    param = torch.nn.Parameter(torch.zeros(k, device=device))
    param.grad = torch.randn(k, device=device)
    opt = torch.optim.AdamW([param], lr=1e-6, fused=device.type == "cuda")
    seconds = timer(opt.step) * cost.params / k
    how = f"fused AdamW over {k:.0e} fp32 parameters, scaled to {cost.params:.2g}"
    rows.append(Row("optimizer_s", cost.optimizer_s, seconds, "s", how))
    del param, opt

    src = torch.empty(shapes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty(shapes.copy_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    seconds = timer(lambda: dst.copy_(src, non_blocking=True))
    how = f"{shapes.copy_bytes >> 20} MiB device -> pinned host (the preset's 50 GB/s is network)"
    rows.append(Row("device_to_host_bytes_per_s", None, shapes.copy_bytes / seconds, "B/s", how))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    info = {
        "device": name,
        "torch": torch.__version__,
        "model": {"params": n, "tiny": tiny, **({} if tiny else {"shape": "Qwen2.5-7B"})},
    }
    return info, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="streamflow bench calibrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model and shapes (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per figure")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    try:
        info, rows = measure(args.tiny, args.repeats)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.json:
        print(f"{info['device']} (torch {info['torch']}), {info['model']['params'] / 1e9:.3g} B")
        print(f"{'figure':<28} {'preset':>12} {'measured':>12} {'ratio':>7}  how")
        for r in rows:
            preset_s = f"{r.preset:.4g}" if r.preset is not None else "-"
            ratio = f"{r.ratio:.2f}" if r.ratio is not None else "-"
            print(f"{r.name:<28} {preset_s:>12} {r.measured:>12.4g} {ratio:>7}  {r.how}")
    out = {**info, "rows": [{**asdict(r), "ratio": r.ratio} for r in rows]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
