"""What the gateway tests share: a real (embedded) store with a gateway table, the rollout's turn
stages over a scripted calculator engine in a thread, and the gateway's book and HTTP server
(``rig`` fixture in conftest.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import storage
from storage.schema import ROW_ID
from workers.agent.pieces import Rules
from workers.agent.toolcall import marker_ids
from workers.engines.base import FINISH_STOP, Generation, SamplingParams
from workers.gateway.app import GatewayServer
from workers.gateway.book import EpisodeBook, Served
from workers.gateway.chat import ChatFormat
from workers.models.tokenizer import build_char_tokenizer
from workers.roles.continuation import rollout_stages
from workers.roles.loop import serve_stages
from workers.roles.rollout import RolloutStage
from workers.runtime.events import EventSender
from workers.runtime.leases import LeaseKeeper
from workers.schema import agent_prompt_rows, samples_table_spec

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id
TABLE, G, T, SECRET = "samples", 2, 3, b"test-secret"
CALCULATOR = [{"type": "function", "function": {
    "name": "calculator", "description": "evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


class CalcEngine:
    """Calls the calculator on a fresh problem, then answers with the tool's result."""

    policy_version = 0

    def __init__(self) -> None:
        self.contexts: list[list[int]] = []

    def generate(self, prompts, n, params):  # noqa: ANN001, ANN201
        out = []
        for context in prompts:
            self.contexts.append(list(context))
            text = TOK.decode(context, skip_special_tokens=True)
            if "=)" not in text:
                ids = list(TOK("(=" + text.rstrip("=") + "=)", add_special_tokens=False)[
                    "input_ids"])
            else:
                ids = list(TOK(text.rsplit("=)", 1)[1].strip(), add_special_tokens=False)[
                    "input_ids"]) + [EOS]
            out.append([Generation(ids, [-0.5] * len(ids), FINISH_STOP)] * n)
        return out

    def load_weights(self, weights, version):  # noqa: ANN001, ANN201
        raise AssertionError("no weights in this test")


class NoWeights:
    def newest(self) -> None:
        return None


@dataclass
class Rig:
    client: object
    book: EpisodeBook
    port: int
    engine: CalcEngine
    served: list[Served] = field(default_factory=list)

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def episodes(self) -> list[dict]:
        """What an agent worker gets: the rows of task ``agent`` (acked here)."""
        lease = self.client.claim(TABLE, "agent", ("agent_prompt", "answer"), 64, timeout=0.0)
        self.client.ack(lease)
        return lease.batch.to_pylist()

    def trained(self) -> dict[int, dict]:
        lease = self.client.claim(TABLE, "trainer", (
            "prompt_ids", "response_ids", "response_loss_mask", "reward", "finish_reason"),
            64, timeout=0.0)
        self.client.ack(lease)
        return {r[ROW_ID]: r for r in lease.batch.to_pylist()}


def make_rig() -> Iterator[Rig]:
    with storage.embedded(1) as store:
        client = store.client()
        client.create_table(samples_table_spec(TABLE, group_size=G, reference_worker=False,
                                               fsync="never", max_turns=T, gateway=True,
                                               lease_seconds=5.0))
        client.put(TABLE, agent_prompt_rows(0, ["12*34=", "7*8="], ["408", "56"],
                                            group_size=G, min_policy_version=0))
        engine = CalcEngine()
        rules = Rules(T, 16, 64, marker_ids(TOK, "plain"), agent_driven=True)
        first = RolloutStage(engine, NoWeights(), SamplingParams(max_new_tokens=16,
                             stop_token_ids=(EOS,)), worker="r", group_size=G,
                             groups_per_claim=4, seed=3, weight_wait_s=1.0, rules=rules,
                             tail_cut=False)
        stages = rollout_stages(first)
        stop = threading.Event()
        keeper = LeaseKeeper(store.client)
        rollout = threading.Thread(target=serve_stages, args=(store.client(), TABLE, stages, stop),
                                   kwargs=dict(worker="r", role="rollout", timeout_s=0.2,
                                               events=EventSender(None, trace=False)))
        rollout.start()
        served: list[Served] = []
        book = EpisodeBook(store.client, TABLE, ChatFormat(TOK, plain=True), max_turns=T,
                           max_total_tokens=64, secret=SECRET, keeper=keeper, wait_s=20.0,
                           lease_seconds=5.0, on_served=served.append)
        book.start()
        server = GatewayServer(book, "127.0.0.1", 0)
        port = server.start()
        try:
            yield Rig(client, book, port, engine, served)
        finally:
            server.stop()
            book.close()
            stop.set()
            rollout.join(timeout=10)
            keeper.close()
            client.close()


