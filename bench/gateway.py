"""Benchmark: the OpenAI-compatible gateway's cost per call, its throughput, and exact tokens.

Setup, in one invocation, as a run places them: a store node process on 127.0.0.1, a rollout
process (the turn stages, ``serve_stages`` over the torch engine on the built-in character model,
4 layers x 128, the demo's), and the gateway (``EpisodeBook`` + its uvicorn server) in this
process, with agents that are plain HTTP clients (``httpx``, keep-alive; in this process too)
speaking the OpenAI chat API with the calculator tool. Episodes are the calculator agent's: a first call, then, whatever the model
said, a second call after a tool or user message (every episode is two calls).

- ``overhead_ms_p50`` / ``_p99``: one episode at a time (no queueing), each call's wall time
  through the gateway less the wall time of a direct ``engine.generate`` of the same context
  (the ids the gateway fed) on this process's twin of the rollout's engine, measured right
  after, over ``--calls`` calls. What is
  left is the gateway's whole path: HTTP, rendering, the store writes and claims, the rollout
  stage's claim and write, the leases.
- ``calls_per_s``: ``--episodes`` concurrent episodes (64 by default), calls answered per second
  of wall time, over ``--rounds`` rounds of them.
- ``token_mismatch``: calls whose trained ids differ from the served ids: every row is read back
  the way the trainer reads it (the reward task's claim of ``prompt_ids``, ``response_ids``,
  ``response_loss_mask``) and compared with what each call fed the model and answered. Must be 0.

Output: a table, then one JSON line (``--json``: the table goes to stderr).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import httpx
import torch

import storage
from bench._store_node import spawn_store
from storage.schema import ROW_ID
from workers.agent.pieces import Rules
from workers.agent.toolcall import marker_ids
from workers.engines.base import SamplingParams
from workers.engines.torch_rollout import TorchRolloutEngine
from workers.gateway.app import GatewayServer
from workers.gateway.book import EpisodeBook, Served, episode_key
from workers.gateway.chat import ChatFormat
from workers.gateway.worker import SWITCH_INTERVAL_S
from workers.models.local import build_tiny_model
from workers.models.spec import TinyModelSpec
from workers.models.tokenizer import build_char_tokenizer
from workers.roles.continuation import rollout_stages
from workers.roles.loop import serve_stages
from workers.roles.rollout import RolloutStage
from workers.runtime.events import EventSender
from workers.runtime.leases import LeaseKeeper
from workers.schema import agent_prompt_rows, samples_table_spec

TABLE, SECRET, TURNS, MAX_NEW, BUDGET = "samples", b"bench-gateway", 2, 12, 40
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]


class NoWeights:
    def newest(self) -> None:
        return None


class InstantEngine:
    """``--engine instant``: answers every context with the same call at once (no model), so a
    call's whole time is the gateway's and the store's."""

    policy_version = 0

    def __init__(self, tok: Any) -> None:
        self.ids = list(tok("(=12*34=)", add_special_tokens=False)["input_ids"])

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Any]:
        from workers.engines.base import FINISH_STOP, Generation

        return [[Generation(list(self.ids), [-0.5] * len(self.ids), FINISH_STOP)] * n
                for _ in prompts]


def _engine(kind: str) -> tuple[Any, Any, SamplingParams]:
    """The built-in model (seeded: every process builds the same weights) and its engine."""
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    engine = (InstantEngine(tok) if kind == "instant" else
              TorchRolloutEngine(build_tiny_model(TinyModelSpec(), tok).eval(), tok))
    return tok, engine, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW,
                                       stop_token_ids=(tok.eos_token_id,))


def _rollout_main(addresses: list[str], stop: Any, threads: int, kind: str) -> None:
    """A rollout worker's turn stages in a process of their own, as in a run."""
    torch.set_num_threads(threads)
    tok, engine, params = _engine(kind)
    rules = Rules(TURNS, MAX_NEW, BUDGET, marker_ids(tok, "plain"), agent_driven=True)
    first = RolloutStage(engine, NoWeights(), params, worker="r", group_size=1,
                         groups_per_claim=64, seed=0, weight_wait_s=1.0, rules=rules,
                         tail_cut=False)
    serve_stages(storage.connect(addresses), TABLE, rollout_stages(first),
                 stop, worker="r", role="rollout", timeout_s=0.2,
                 events=EventSender(None, trace=False))


class Rig:
    """Store node, rollout process and gateway; ``close`` stops them all. The engine here is the
    rollout's twin (same seed, same weights): the direct calls run on it."""

    def __init__(self, log_dir: str, rows: int, threads: int, kind: str) -> None:
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # as the gateway worker's process sets it
        self.tok, self.engine, self.params = _engine(kind)
        self.proc, addresses = spawn_store(1, log_dir)

        def connect() -> Any:
            return storage.connect(addresses)
        self.client = connect()
        self.client.create_table(samples_table_spec(
            TABLE, group_size=1, reference_worker=False, fsync="never", max_turns=TURNS,
            gateway=True, capacity_rows=rows + 16))
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.rollout = ctx.Process(target=_rollout_main, args=(addresses, self.stop, threads, kind),
                                   daemon=True)
        self.rollout.start()
        self.keeper = LeaseKeeper(connect)
        self.served: list[Served] = []
        self.book = EpisodeBook(connect, TABLE, ChatFormat(self.tok, plain=True),
                                max_turns=TURNS, max_total_tokens=BUDGET, secret=SECRET,
                                keeper=self.keeper, wait_s=120.0, lease_seconds=30.0,
                                on_served=self.served.append)
        self.book.start()
        self.server = GatewayServer(self.book, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.start()}/v1"

    def put(self, n: int, first: int) -> list[tuple[int, str]]:
        """``n`` episodes (one row each); their (row id, prompt)."""
        prompts = [f"{100 + (first + i) * 37 % 900}*{100 + (first + i) * 91 % 900}="
                   for i in range(n)]
        ids = self.client.put(TABLE, agent_prompt_rows(first, prompts, ["0"] * n, group_size=1,
                                                       min_policy_version=0))
        return list(zip((int(i) for i in ids), prompts, strict=True))

    def direct(self, context: list[int]) -> float:
        """Seconds of the engine's own generate of ``context`` (what a call costs without us)."""
        start = time.perf_counter()
        self.engine.generate([context], 1, self.params)
        return time.perf_counter() - start

    def close(self) -> None:
        self.server.stop()
        self.book.close()
        self.stop.set()
        self.rollout.join(timeout=10)
        if self.rollout.is_alive():
            self.rollout.kill()
        self.keeper.close()
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=10)


def episode(http: httpx.Client, url: str, row_id: int, prompt: str,
            times: list[float] | None = None) -> int:
    """The calculator agent's two calls (HTTP), then its end; returns the calls made."""
    key = episode_key(SECRET, row_id)
    headers = {"Authorization": f"Bearer {key}"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    calls = 0
    for _ in range(TURNS):
        start = time.perf_counter()
        reply = http.post(f"{url}/chat/completions", headers=headers,
                          json={"model": "policy", "messages": messages, "tools": TOOLS})
        if times is not None:
            times.append(time.perf_counter() - start)
        if reply.status_code == 400:  # out of tokens: the episode ends here
            break
        reply.raise_for_status()
        calls += 1
        message = reply.json()["choices"][0]["message"]
        messages.append(message)
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "7"})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": " "})
    http.post(f"{url}/streamflow/end", headers=headers, json={"reward": 0.0}).raise_for_status()
    return calls


def mismatches(rig: Rig) -> tuple[int, int]:
    """(calls whose trained ids differ from the served ones, calls checked)."""
    lease = rig.client.claim(TABLE, "reward", ("prompt_ids", "response_ids",
                                               "response_loss_mask"), 1 << 20, timeout=5.0)
    rig.client.ack(lease)
    by_row: dict[int, dict[int, Served]] = {}
    for s in rig.served:
        by_row.setdefault(s.row_id, {})[s.call] = s
    bad = checked = 0
    for row in lease.batch.to_pylist():
        calls = by_row.get(row[ROW_ID], {})
        fed = [calls[c].fed for c in sorted(calls)]
        turns = [calls[c].turn for c in sorted(calls)]
        want_response: list[int] = []
        want_mask: list[int] = []
        for i, turn in enumerate(turns):
            if i:
                want_response += fed[i]
                want_mask += [0] * len(fed[i])
            want_response += turn
            want_mask += [1] * len(turn)
        checked += len(calls)
        if not calls or row["prompt_ids"] != fed[0] or row["response_ids"] != want_response \
                or row["response_loss_mask"] != want_mask:
            bad += max(len(calls), 1)
    return bad, checked


def measure(calls: int, episodes: int, rounds: int, log_dir: str, threads: int,
            kind: str) -> dict[str, Any]:
    total = calls // TURNS + episodes * rounds + 2
    rig = Rig(log_dir, total, threads, kind)
    try:
        http = httpx.Client(timeout=120)
        for row_id, prompt in rig.put(2, 90_000):  # untimed: the rollout process starts
            episode(http, rig.url, row_id, prompt)
        overhead: list[float] = []
        for row_id, prompt in rig.put(calls // TURNS, 0):
            times: list[float] = []
            episode(http, rig.url, row_id, prompt, times)
            served = [s for s in rig.served if s.row_id == row_id]
            context: list[int] = []
            for s, t in zip(sorted(served, key=lambda s: s.call), times, strict=False):
                context = context + s.fed if s.call else list(s.fed)
                overhead.append(t - rig.direct(context))
                context += s.turn
        wall = answered = 0.0
        for r in range(rounds):
            batch = rig.put(episodes, 10_000 + r * episodes)
            start = time.perf_counter()
            got: list[int] = []

            def one(row_id: int, prompt: str, got: list[int] = got) -> None:
                with httpx.Client(timeout=120) as own:
                    got.append(episode(own, rig.url, row_id, prompt))
            threads = [threading.Thread(target=one, args=e) for e in batch]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            wall += time.perf_counter() - start
            answered += sum(got)
        bad, checked = mismatches(rig)
    finally:
        rig.close()
    ms = sorted(1000 * x for x in overhead)
    return {
        "bench": "gateway",
        "overhead_ms_p50": statistics.median(ms),
        "overhead_ms_p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "overhead_calls": len(ms),
        "calls_per_s": answered / wall, "concurrent_episodes": episodes,
        "token_mismatch": bad, "calls_checked": checked,
        "target_overhead_ms_p50": 5.0, "threads": torch.get_num_threads(), "engine": kind,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamflow bench gateway", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200, help="sequential calls timed")
    parser.add_argument("--episodes", type=int, default=64, help="concurrent episodes")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of concurrent episodes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--engine", choices=("torch", "instant"), default="torch",
                        help="the built-in model, or a canned answer (the gateway's cost alone)")
    parser.add_argument("--json", action="store_true", help="table to stderr, JSON to stdout")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as log_dir:
        result = measure(args.calls, args.episodes, args.rounds, log_dir, args.threads,
                         args.engine)
    table = sys.stderr if args.json else sys.stdout
    for key, value in result.items():
        if key == "bench":
            continue
        print(f"{key:24} {value:.3f}" if isinstance(value, float) else f"{key:24} {value}",
              file=table)
    if args.json:
        print(json.dumps(result))
    return 0 if result["token_mismatch"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
