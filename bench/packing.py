"""Benchmark: shared-prompt packing vs unpacked rows, forward+backward of one group.

For each (P, L, G) a group of G responses of L tokens after a P-token prompt is scored (log-probs
of every response token, summed and back-propagated) by a small Qwen2-style model, once as G
unpacked ``prompt + response`` rows and once packed as ``prompt + r1 + ... + rG``. Reported beside
the theoretical token ratio (G*P + sum L) / (P + sum L):

- tokens: real tokens through the model (``PackedBatch.num_tokens``);
- time: building the layout + forward + backward, the best of ``--repeats`` runs after one
  warm-up; both sides run interleaved in ONE process so that load from other processes on a shared
  machine hits both alike (wall time; process CPU time is reported beside it);
- peak memory: the first fwd+bwd's resident-set high-water mark minus the resident set just before
  it (Linux ``VmHWM`` after a reset through ``/proc/self/clear_refs``): activations, gradients and
  temporaries. Each side runs in a fresh child process (``--isolate``, the default except with
  ``--quick``) so that the allocator's cache of one side never hides the other's peak.

Target: where the token saving is large, the time saving (1 - 1/time_ratio) reaches at least
80 % of the token saving (1 - 1/token_ratio); ``target_met`` says so per case.

The auto rule (``workers.rl.packing.should_pack``, what ``trainer.packing: true`` does per micro-batch):
each case reports its token saving, whether the rule packs it (``auto_packs``, at ``--min-saving``,
default the trainer's), the time of what it chose against unpacked rows (``auto_vs_unpacked``) and
``auto_within_3pct``; the JSON's ``auto_never_over_3pct_slower`` holds over all cases. The short
cases (P = 6, 16, 32 with L = 64, G = 8) bracket the threshold.

Output: a table, then one JSON line ``{"bench": "packing", "cases": [...]}`` (with ``--json`` the
table goes to stderr and stdout holds only the JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

FULL_CASES = [(512, 512, 8), (2048, 256, 16), (64, 512, 8), (6, 64, 8), (16, 64, 8), (32, 64, 8)]
QUICK_CASES = [(64, 16, 4), (8, 48, 2)]
LARGE_SAVING = 0.3  # token saving above which the 80 % target applies
AUTO_SLOWDOWN_LIMIT = 1.03  # the auto rule's choice may cost at most 3 % more than unpacked rows


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


FULL_MODEL = ModelShape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=1024, vocab=4096)
QUICK_MODEL = ModelShape(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, vocab=64)


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _group(P: int, L: int, G: int) -> Any:
    """The benchmark's group shape (token ids only matter for the model, not for the decision)."""
    from workers.rl.packing import PackGroup

    return PackGroup(0, [1] * P, [[1] * L for _ in range(G)])


def should_pack(groups: Any, min_saving: float) -> bool:
    from workers.rl.packing import should_pack as rule

    return rule(groups, min_saving)


def _setup(P: int, L: int, G: int, shape: ModelShape, threads: int, attention: str) -> Any:
    """Build the model and the group; returns ``step(packed) -> tokens`` (fwd + bwd of one group)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from workers.rl.packing import PackGroup, batch_logprobs, pack_groups, unpacked_rows

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max(P + L, 64),
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, shape.vocab, (P + G * L,), generator=gen).tolist()
    group = PackGroup(0, ids[:P], [ids[P + i * L : P + (i + 1) * L] for i in range(G)])

    def step(packed: bool) -> int:
        # Timed as a trainer pays it: build the layout, forward, backward.
        if packed:
            batch = pack_groups([group], token_budget=P + G * L)
        else:
            batch = unpacked_rows([group])
        logp = batch_logprobs(model, batch, attention=attention)
        loss = -torch.cat([t for g in logp for t in g]).sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return batch.num_tokens

    return step


def measure_memory(
    P: int, L: int, G: int, *, packed: bool, shape: ModelShape, threads: int, attention: str
) -> dict[str, Any]:
    """One side's first fwd+bwd in THIS (fresh) process: tokens and peak bytes above the start."""
    step = _setup(P, L, G, shape, threads, attention)
    base = _rss_bytes("VmRSS")
    exact = _reset_peak()
    tokens = step(packed)
    peak = _rss_bytes("VmHWM") - base if exact else -1
    return {"tokens": tokens, "peak_bytes": peak}


def measure_time(
    P: int, L: int, G: int, *, shape: ModelShape, repeats: int, threads: int, attention: str
) -> dict[str, Any]:
    """Both sides in one process, interleaved, after one warm-up each: best wall and CPU seconds.

    Interleaving matters on a shared machine: load from other processes then hits both sides
    alike instead of whichever side ran during a busy minute.
    """
    step = _setup(P, L, G, shape, threads, attention)
    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for r in range(repeats + 1):
        for packed in (False, True):
            w0, c0 = time.perf_counter(), time.process_time()
            step(packed)
            if r > 0 or repeats == 0:  # round 0 is the warm-up
                wall[packed].append(time.perf_counter() - w0)
                cpu[packed].append(time.process_time() - c0)
    return {
        "seconds_unpacked": min(wall[False]),
        "seconds_packed": min(wall[True]),
        "cpu_seconds_unpacked": min(cpu[False]),
        "cpu_seconds_packed": min(cpu[True]),
    }


def _run(kind: str, spec: dict[str, Any], isolate: bool) -> dict[str, Any]:
    if not isolate:
        fn = measure_memory if kind == "memory" else measure_time
        return fn(**{k: v for k, v in spec.items()})
    payload = json.dumps({"kind": kind, **spec, "shape": asdict(spec["shape"])})
    cmd = [sys.executable, "-m", "bench.packing", "--child", payload]
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child(payload: str) -> dict[str, Any]:
    spec = json.loads(payload)
    kind = spec.pop("kind")
    spec["shape"] = ModelShape(**spec["shape"])
    return measure_memory(**spec) if kind == "memory" else measure_time(**spec)


def _case(P: int, L: int, G: int, shape: ModelShape, args: argparse.Namespace) -> dict[str, Any]:
    common = {"P": P, "L": L, "G": G, "shape": shape, "threads": args.threads}
    common["attention"] = args.attention
    mem = {
        packed: _run("memory", {**common, "packed": packed}, args.isolate)
        for packed in (False, True)
    }
    t = _run("time", {**common, "repeats": args.repeats}, args.isolate)
    unp, pk = mem[False], mem[True]
    theory = (G * P + G * L) / (P + G * L)
    token_ratio = unp["tokens"] / pk["tokens"]
    time_ratio = t["seconds_unpacked"] / t["seconds_packed"]
    # None when a peak could not be measured (no /proc reset, or in-process with a warm allocator)
    mem_ok = unp["peak_bytes"] > 0 and pk["peak_bytes"] > 0
    mem_ratio = round(unp["peak_bytes"] / pk["peak_bytes"], 4) if mem_ok else None
    token_saving = 1 - 1 / token_ratio
    share = (1 - 1 / time_ratio) / token_saving if token_saving > 0 else float("nan")
    auto_packs = should_pack([_group(P, L, G)], args.min_saving)
    auto_seconds = t["seconds_packed"] if auto_packs else t["seconds_unpacked"]
    auto_vs_unpacked = auto_seconds / t["seconds_unpacked"]
    return {
        "P": P,
        "L": L,
        "G": G,
        "theoretical_token_ratio": round(theory, 4),
        "tokens_unpacked": unp["tokens"],
        "tokens_packed": pk["tokens"],
        "token_ratio": round(token_ratio, 4),
        # seconds to 6 significant digits: a quick case runs in milliseconds, where 4 decimals
        # would lose more than the ratios below carry
        **{k: float(f"{v:.6g}") for k, v in t.items()},
        "time_ratio": round(time_ratio, 4),
        "cpu_time_ratio": round(t["cpu_seconds_unpacked"] / t["cpu_seconds_packed"], 4),
        "peak_bytes_unpacked": unp["peak_bytes"],
        "peak_bytes_packed": pk["peak_bytes"],
        "peak_memory_ratio": mem_ratio,
        "time_saving_share_of_token_saving": round(share, 4),
        "target_applies": token_saving >= LARGE_SAVING,
        "target_met": bool(token_saving < LARGE_SAVING or share >= 0.8),
        "token_saving": round(token_saving, 4),
        "auto_packs": auto_packs,
        "auto_vs_unpacked": round(auto_vs_unpacked, 4),
        "auto_within_3pct": bool(auto_vs_unpacked <= AUTO_SLOWDOWN_LIMIT),
    }


def _table(cases: list[dict[str, Any]]) -> str:
    head = (
        f"{'P':>5} {'L':>4} {'G':>3} | {'tokens unp/pk':>15} {'ratio':>5} {'theory':>6} | "
        f"{'fwd+bwd s unp/pk':>17} {'ratio':>5} {'cpu':>5} | {'peak MiB unp/pk':>16} "
        f"{'ratio':>5} | {'saving share':>12} | {'auto':>6} {'auto/unp':>8}"
    )
    lines = [head, "-" * len(head)]
    mib = 1024 * 1024
    for c in cases:
        lines.append(
            f"{c['P']:>5} {c['L']:>4} {c['G']:>3} | "
            f"{c['tokens_unpacked']:>7}/{c['tokens_packed']:<7} {c['token_ratio']:>5.2f} "
            f"{c['theoretical_token_ratio']:>6.2f} | "
            f"{c['seconds_unpacked']:>8.3f}/{c['seconds_packed']:<8.3f} {c['time_ratio']:>5.2f} "
            f"{c['cpu_time_ratio']:>5.2f} | "
            f"{c['peak_bytes_unpacked'] / mib:>7.0f}/{c['peak_bytes_packed'] / mib:<8.0f} "
            f"{_fmt(c['peak_memory_ratio'])} | {_share(c)} | "
            f"{'pack' if c['auto_packs'] else 'rows':>6} {c['auto_vs_unpacked']:>8.3f}"
        )
    return "\n".join(lines)


def _fmt(ratio: float | None) -> str:
    return "  n/a" if ratio is None else f"{ratio:>5.2f}"


def _share(case: dict[str, Any]) -> str:
    if not case["target_applies"]:
        return f"{'(small saving)':>12}"
    mark = "" if case["target_met"] else " (below 80 %)"
    return f"{case['time_saving_share_of_token_saving']:>11.0%}{mark}"


def main(argv: list[str]) -> int:
    """Run the benchmark; prints the table then one JSON line. Returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="streamflow bench packing", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--json", action="store_true", help="stdout holds only the JSON line")
    parser.add_argument("--quick", action="store_true", help="tiny model and cases (for tests)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs after the first")
    # One thread by default: on a shared 2-core machine, a second OpenMP thread that waits for a
    # core held by another process made timings swing by up to 4x; one thread is steady.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--attention", choices=["segments", "mask"], default="segments")
    parser.add_argument(
        "--min-saving", type=float, default=None,
        help="the auto rule's token-saving threshold (default: the trainer's default)",
    )
    parser.add_argument(
        "--cases", default=None, help="P,L,G triples separated by ';' instead of the built-in cases"
    )
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each side in a fresh child process (default: on, off with --quick)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child)))
        return 0
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.isolate is None:
        args.isolate = not args.quick
    if args.repeats < 0 or args.threads < 1:
        parser.error("--repeats must be >= 0 and --threads >= 1")
    if args.min_saving is None:
        from workers.settings import PackingSettings

        args.min_saving = PackingSettings.packing_min_saving
    specs = QUICK_CASES if args.quick else FULL_CASES
    if args.cases:
        try:
            specs = [tuple(int(x) for x in c.split(",")) for c in args.cases.split(";") if c]
            if any(len(c) != 3 or min(c) < 1 for c in specs):
                raise ValueError
        except ValueError:
            parser.error(f"--cases must be P,L,G triples of ints >= 1 separated by ';', got {args.cases!r}")
    shape = QUICK_MODEL if args.quick else FULL_MODEL
    cases = [_case(P, L, G, shape, args) for P, L, G in specs]
    out = sys.stderr if args.json else sys.stdout
    print(
        f"shared-prompt packing, Qwen2 hidden={shape.hidden} layers={shape.layers} "
        f"vocab={shape.vocab}, fp32, {args.threads} threads, attention={args.attention}",
        file=out,
    )
    print(_table(cases), file=out)
    report = {
        "bench": "packing", "model": asdict(shape), "threads": args.threads,
        "min_saving": args.min_saving, "cases": cases,
        "auto_never_over_3pct_slower": all(c["auto_within_3pct"] for c in cases),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
