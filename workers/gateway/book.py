"""The gateway's side of the store: the episodes it holds, and what a call writes into its row.

An episode is one row of the samples table (``workers.schema.samples_table_spec(gateway=True)``).
The gateway is the only consumer of two kinds of tasks, one row per lease, held (renewed by a
``LeaseKeeper``) until the agent's next move:

* ``open``: the episode has not called yet. Its first call writes ``prompt_ids`` (its rendered
  messages) and ``call0_messages`` and acks, which makes the row ready for ``rollout``.
* ``env.{k}``: model turn t, piece k-1, is written. The next call either repeats an earlier one
  (the same canonical messages: an agent's retry, or an agent re-run after its worker died) and
  is answered from the row, or extends call t by the messages after the assistant message it was
  given: those are rendered once (``ChatFormat.piece_ids``) and written as the observation piece
  k with ``call{t+1}_messages``, acked, which makes the row ready for ``rollout.{k+1}``; the
  answer is turn t+1, once the gateway holds ``env.{k+2}``. The agent's end writes the assembled
  trajectory (``workers.agent.piece_rows.piece_writes``, no piece) under the held lease. A
  gateway run is not cut: model turn t is piece 2t.

Crash safety comes from the store: every answer is read from a written turn, so a rollout worker
killed mid-call leaves its lease to expire and another worker generates the turn once; a gateway
killed at any point loses only leases, which come back to its restart, where a client's retry
finds the row (a call already written is answered from it, never generated twice). The calls of
one episode are served one at a time. Invariant: a row is in ``_held`` only while this process
holds its lease, and a write under that lease is always also its ack.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from storage.errors import StoreError
from storage.schema import ROW_ID, Lease
from workers.agent.piece_rows import Step, piece_reads, piece_writes, read_history
from workers.agent.pieces import TO_MODEL, History, Turn, observation
from workers.gateway.chat import (
    Assistant,
    ChatFormat,
    RequestError,
    assistant_message,
    canonical_messages,
    check_tools,
    completion_prompt,
    dumps,
    same_assistant,
)
from workers.models.tokenizer import decode_response
from workers.runtime.faults import failure_reason
from workers.runtime.trace import Tracer
from workers.schema import call_columns, piece_bound

log = logging.getLogger(__name__)

OPEN = "open"
MAX_ENDED = 1 << 16  # ended rows remembered (a late call of one is refused at once)
OPEN_READS = ("group_id", "iteration", "agent_prompt", "answer")


def episode_key(secret: bytes, row_id: int) -> str:
    """The api_key of row ``row_id``'s episode: the row and a MAC only this run can make."""
    mac = hmac.new(secret, str(int(row_id)).encode(), hashlib.sha256).hexdigest()[:20]
    return f"sf-{int(row_id):x}-{mac}"


def key_row(secret: bytes, key: str) -> int:
    """The row of an episode key; RequestError 401 for a key this run did not make."""
    parts = key.split("-") if isinstance(key, str) else []
    try:
        row_id = int(parts[1], 16) if len(parts) == 3 and parts[0] == "sf" else -1
    except ValueError:
        row_id = -1
    if row_id < 0 or not hmac.compare_digest(episode_key(secret, row_id), key):
        raise RequestError(401, "invalid_api_key", "unknown episode key", "authentication_error")
    return row_id


@dataclass
class Held:
    """A row whose lease this gateway holds: ``piece`` -1 (``open``) or k (``env.{k}``: pieces
    0..k-1 written, the last one turn ``turn``)."""

    lease: Lease
    piece: int
    row: dict[str, Any]
    since: float = 0.0  # monotonic time of the claim: the agent's time until its next call

    def hist(self) -> History:
        got = read_history(self.row, self.piece)
        assert got is not None  # env.{k} is never delivered for an ended row (skip_null)
        return got

    @property
    def turn(self) -> int:
        """The last model turn written; -1 before the first."""
        return (self.piece - 1) // 2 if self.piece > 0 else -1

    def turns(self) -> list[Turn]:
        return self.hist().turns()

    def calls(self) -> list[str]:
        return [self.row[f"call{j}_messages"] for j in range(self.turn + 1)]


@dataclass(frozen=True)
class Served:
    """What one call fed the model and what it answered (the exact-token check reads these)."""

    row_id: int
    call: int
    fed: list[int]  # prompt_ids (call 0) or the observation piece before this turn
    turn: list[int]  # the model turn it answered with


class EpisodeBook:
    """See the module docstring. ``connect()`` gives a store client (one per thread that needs
    one); ``keeper``: a ``workers.runtime.leases.LeaseKeeper``; ``wait_s``: how long a call waits for
    its row (the model's turn being generated) before a 504."""

    def __init__(self, connect: Callable[[], Any], table: str, fmt: ChatFormat, *,
                 max_turns: int, max_total_tokens: int, secret: bytes, keeper: Any,
                 wait_s: float, lease_seconds: float,
                 on_served: Callable[[Served], None] | None = None,
                 tracer: Tracer | None = None) -> None:
        self.table, self.fmt, self.secret, self.keeper = table, fmt, secret, keeper
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.wait_s, self.lease_seconds = wait_s, lease_seconds
        self.on_served = on_served or (lambda served: None)
        # the row trace: the gateway's claims, its writes (tool "agent": the agent's seconds
        # between an answer and its next call) and acks
        self.tracer = tracer or Tracer(None, "gateway", enabled=False)
        self._connect = connect
        self._writer = connect()
        self._write_lock = threading.Lock()
        self._cond = threading.Condition()
        self._held: dict[int, Held] = {}
        self._busy: set[int] = set()  # rows with a call being served (one at a time)
        # rows this process ended (bounded, oldest forgotten): their calls are refused at once
        self._ended: OrderedDict[int, None] = OrderedDict()
        # calls waiting per task: the claim loop waits on the most wanted one, so the row a call
        # waits for comes back in the wait's own reply (not a wake, then a claim)
        self._wanted: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._claim_loop, name="gateway-claims",
                                        daemon=True)
        self.bound = piece_bound(max_turns, 0)  # a gateway run is not cut: turn t is piece 2t
        self.tasks = (OPEN, *(f"env.{k}" for k in range(1, self.bound + 1, 2)))

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop claiming and hand every held lease back (the next gateway gets them at once)."""
        self._stop.set()
        self._thread.join(timeout=10.0)
        with self._cond:
            held, self._held = list(self._held.values()), {}
        for h in held:
            self.keeper.drop(h.lease.lease_id)
            try:
                with self._write_lock:
                    self._writer.release(h.lease)
            except StoreError:
                pass  # expired or the store is gone: it comes back by itself
        self._writer.close()

    # -- claiming ----------------------------------------------------------------------------
    def _columns(self, task: str) -> tuple[str, ...]:
        if task == OPEN:
            return OPEN_READS
        k = int(task.split(".")[1])
        return ("group_id", "prompt_ids", *piece_reads(k),
                *(f.name for f in call_columns((k + 1) // 2)))

    def _claim_loop(self) -> None:
        client = self._connect()
        try:
            while not self._stop.is_set():
                with self._cond:
                    order = sorted(self.tasks, key=lambda t: -self._wanted[t])
                found = False
                for task in order:
                    found |= self._claim(client, task, 0.0)
                if not found:  # wait on the most wanted task, woken by any other's rows
                    self._claim(client, order[0], 0.5, wake=tuple(order[1:]))
        except Exception:  # the store is gone for good: calls time out with 504
            log.exception("the gateway stopped claiming")
        finally:
            client.close()

    def _claim(self, client: Any, task: str, timeout: float, wake: tuple[str, ...] = ()) -> bool:
        try:
            lease = client.claim(self.table, task, self._columns(task), 1, timeout=timeout,
                                 wake=wake)
        except StoreError as exc:
            log.warning("claim %s: %s", task, exc)
            self._stop.wait(0.2)
            return False
        if not lease.num_rows:
            return False
        row = lease.batch.to_pylist()[0]
        piece = -1 if task == OPEN else int(task.split(".")[1])
        self.keeper.hold(lease)
        self.tracer.claim(lease)
        with self._cond:
            self._held[int(row[ROW_ID])] = Held(lease, piece, row, time.monotonic())
            self._cond.notify_all()
        return True

    @contextmanager
    def _episode(self, row_id: int) -> Iterator[None]:
        """One call of an episode at a time (a retry waits for the call it repeats)."""
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while row_id in self._busy:
                if not self._cond.wait(max(deadline - time.monotonic(), 0.0)):
                    raise RequestError(504, "timeout", "an earlier call of this episode is "
                                       "still being served", "timeout_error")
            self._busy.add(row_id)
        try:
            yield
        finally:
            with self._cond:
                self._busy.discard(row_id)
                self._cond.notify_all()

    def _wait_held(self, row_id: int, at_least: int, wait_s: float) -> Held | None:
        """The row's held lease once its turn is ``at_least`` (-1: any), or None after
        ``wait_s``."""
        deadline = time.monotonic() + wait_s
        task = OPEN if at_least < 0 else f"env.{2 * at_least + 1}"
        with self._cond:
            self._wanted[task] += 1
            try:
                while True:
                    held = self._held.get(row_id)
                    if held is not None and held.turn >= at_least:
                        return held
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stop.is_set():
                        return None
                    self._cond.wait(min(left, 1.0))
            finally:
                self._wanted[task] -= 1

    def _write(self, row_id: int, held: Held, batches: list[pa.RecordBatch]) -> None:
        """Write ``batches`` under the row's lease and ack it; the row leaves ``_held``."""
        with self._cond:
            self._held.pop(row_id, None)
        self.keeper.drop(held.lease.lease_id)
        waited = time.monotonic() - held.since
        with self._write_lock:
            for i, batch in enumerate(batches):
                self._writer.write(self.table, held.lease, batch, ack=i == len(batches) - 1)
        for batch in batches:
            self.tracer.write(held.lease, batch, calls={row_id: ("agent", waited, None)})
        self.tracer.lease_event("ack", held.lease)

    # -- calls -------------------------------------------------------------------------------
    def chat(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        """One /v1/chat/completions call: the response JSON, or RequestError."""
        messages = canonical_messages(body.get("messages"))
        tools = check_tools(body.get("tools"))

        def extension(prev: dict[str, Any], held: Held) -> list[int]:
            n = len(prev["messages"])
            given = self._assistant(held, held.turn)
            if (prev.get("tools") != tools or prev.get("messages") != messages[:n]
                    or len(messages) <= n + 1 or not same_assistant(messages[n], given)):
                raise RequestError(400, "context_rewritten", "the messages do not extend the "
                                   "episode's last call and the answer it was given")
            return self.fmt.piece_ids(messages[n + 1:], held.turns()[-1].ids, tools)

        return self._serve(key, body, Call(
            dumps({"messages": messages, "tools": tools}),
            lambda: self.fmt.prompt_ids(messages, tools), extension, self._chat_answer))

    def complete(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        """One /v1/completions call (the text is the whole context so far, the caller's own
        format): the response JSON, or RequestError."""
        prompt = completion_prompt(body.get("prompt"))

        def extension(prev: dict[str, Any], held: Held) -> list[int]:
            said = prev["prompt"] + self._text(held, held.turn)
            if not prompt.startswith(said) or len(prompt) == len(said):
                raise RequestError(400, "context_rewritten", "the prompt does not extend the "
                                   "episode's last prompt and the text it was given")
            return self.fmt.text_ids(prompt[len(said):])

        return self._serve(key, body, Call(
            dumps({"prompt": prompt}), lambda: self.fmt.text_prompt_ids(prompt), extension,
            self._text_answer))

    def _serve(self, key: str, body: dict[str, Any], call: Call) -> dict[str, Any]:
        """A call of either API: the first of its episode (writes ``prompt_ids``), a repeat
        (answered from the row), or the next (writes the observation piece)."""
        row_id = key_row(self.secret, key)
        with self._episode(row_id):
            if row_id in self._ended:
                raise RequestError(409, "episode_ended", "this episode has ended")
            held = self._wait_held(row_id, -1, self.wait_s)
            if held is None:
                raise RequestError(504, "timeout", "the episode's row did not come back in "
                                   f"{self.wait_s:.0f} s", "timeout_error")
            if held.piece < 0:  # the first call
                fed = call.first()
                self._write(row_id, held, [_cells(row_id, {
                    "prompt_ids": (fed, pa.list_(pa.int32())),
                    "call0_messages": (call.record, pa.string())})])
                return self._answer(row_id, 0, body, fed, call)
            calls = held.calls()
            if call.record in calls:  # a repeat: answered from the row, nothing generated
                return call.respond(held, calls.index(call.record), body)
            t, hist = held.turn, held.hist()
            fed = call.extension(json.loads(calls[t]), held)
            if t + 1 >= self.max_turns:
                raise RequestError(400, "turn_budget", f"the episode has had its {self.max_turns}"
                                   " model turns (rollout.max_turns)")
            if hist.length() + len(fed) >= self.max_total_tokens:
                raise RequestError(400, "context_length_exceeded",
                                   f"the episode would pass rollout.max_total_tokens "
                                   f"({self.max_total_tokens}) with this call")
            (piece,) = piece_writes(held.piece, self.bound, [
                Step(row_id, hist, observation(fed), TO_MODEL)])
            self._write(row_id, held, [piece.append_column(
                f"call{t + 1}_messages", pa.array([call.record], pa.string()))])
            return self._answer(row_id, t + 1, body, fed, call)

    def _answer(self, row_id: int, turn: int, body: dict[str, Any], fed: list[int],
                call: Call) -> dict[str, Any]:
        held = self._wait_held(row_id, turn, self.wait_s)
        if held is None:
            raise RequestError(504, "timeout", f"turn {turn} was not generated in "
                               f"{self.wait_s:.0f} s", "timeout_error")
        self.on_served(Served(row_id, turn, fed, list(held.turns()[turn].ids)))
        return call.respond(held, turn, body)

    def _assistant(self, held: Held, turn: int) -> Assistant:
        t = held.turns()[turn]
        return assistant_message(self.fmt.tokenizer, t.ids, t.end, plain=self.fmt.plain)

    def _text(self, held: Held, turn: int) -> str:
        return decode_response(self.fmt.tokenizer, held.turns()[turn].ids)

    def _chat_answer(self, held: Held, turn: int, body: dict[str, Any]) -> dict[str, Any]:
        given, row_id = self._assistant(held, turn), int(held.row[ROW_ID])
        return {**_envelope(held, turn, body, "chat.completion"), "choices": [{
            "index": 0, "message": given.message(f"call_{row_id:x}_{turn}"),
            "finish_reason": given.finish_reason, "logprobs": None}]}

    def _text_answer(self, held: Held, turn: int, body: dict[str, Any]) -> dict[str, Any]:
        finish = "stop" if held.turns()[turn].end in ("stop", "tool") else "length"
        return {**_envelope(held, turn, body, "text_completion"), "choices": [{
            "index": 0, "text": self._text(held, turn), "finish_reason": finish,
            "logprobs": None}]}

    def end(self, key: str, reward: float | None) -> str:
        """The agent returned: "ended" (the trajectory is written), "gone" (the row is not
        held within a lease's lifetime: it ended before) or "no_call" (the agent never called:
        the row is handed back as a failed delivery)."""
        row_id = key_row(self.secret, key)
        with self._episode(row_id):
            if row_id in self._ended:
                return "gone"
            held = self._wait_held(row_id, -1, self.lease_seconds + 5.0)
            if held is None:
                return "gone"
            if held.piece < 0:
                with self._cond:
                    self._held.pop(row_id, None)
                self.keeper.drop(held.lease.lease_id)
                reason = failure_reason(held.lease.batch, "the agent made no call")
                with self._write_lock:
                    self._writer.release(held.lease, error=reason)
                self.tracer.lease_event("fail", held.lease, error=reason)
                return "no_call"
            hist = held.hist()  # its finish_reason: the last turn's
            self._write(row_id, held, piece_writes(held.piece, self.bound, [
                Step(row_id, hist, None, hist.turns()[-1].end, reward)]))
            with self._cond:
                self._ended[row_id] = None
                while len(self._ended) > MAX_ENDED:
                    self._ended.popitem(last=False)
            return "ended"


@dataclass(frozen=True)
class Call:
    """One call as the API it came through shapes it: its canonical ``record`` (what
    ``call{t}_messages`` stores and a repeat matches), the ids of a first call, the ids it adds
    after the last turn (RequestError when it does not extend the episode), its response."""

    record: str
    first: Callable[[], list[int]]
    extension: Callable[[dict[str, Any], Held], list[int]]
    respond: Callable[[Held, int, dict[str, Any]], dict[str, Any]]


def _envelope(held: Held, turn: int, body: dict[str, Any], kind: str) -> dict[str, Any]:
    """What both APIs' responses share: ids, the model's name as asked, token usage."""
    pieces, row_id = held.hist().pieces, int(held.row[ROW_ID])  # (not cut: turn t is piece 2t)
    before = len(held.row["prompt_ids"]) + sum(len(p.ids) for p in pieces[:2 * turn])
    done = len(pieces[2 * turn].ids)
    return {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{row_id:x}-{turn}",
            "object": kind, "created": int(time.time()),
            "model": str(body.get("model") or "streamflow"),
            "usage": {"prompt_tokens": before, "completion_tokens": done,
                      "total_tokens": before + done}}


def _cells(row_id: int, cells: dict[str, tuple[Any, pa.DataType]]) -> pa.RecordBatch:
    arrays = {ROW_ID: pa.array([row_id], pa.uint64())}
    arrays.update({name: pa.array([value], typ) for name, (value, typ) in cells.items()})
    return pa.RecordBatch.from_pydict(arrays)
