"""The agent role: runs a user's agent once per prompt (task ``agent``) against the gateway.

``agent.fn`` names ``fn(base_url, api_key, prompt, answer) -> float | None``: the user's own code,
written against the OpenAI API (the SDK, an agent framework, plain HTTP). Each episode is one row;
its ``api_key`` is the row's episode key (``workers.gateway.book.episode_key``), so every call the
agent makes lands in that row, whoever serves it. The agents run in one spawned child process, a
thread per episode (``AgentHost``; it dies with this worker); an episode past ``agent.timeout_s``
is ended with what it has. When
it returns, the worker tells the gateway (``POST /v1/streamflow/end``) with the reward: the
number it returned, or None (the run's verifier scores the trajectory). An agent that raised,
timed out or died ends the episode with what it has and reward 0.0; one that made no call at all
is run again, and its row goes DEAD after ``store.max_deliveries`` such runs (the gateway hands
the row's ``open`` delivery back as failed each time).

The lease of the ``agent`` rows is held (renewed by the loop's ``LeaseKeeper``) until every
episode of it has ended, then acked with no write. A worker SIGKILLed mid-episode loses its
children with it; the rows come back to an agent worker when the lease expires and the agents run
again from the start: the calls they repeat are answered from the row by the gateway (same
messages, same answers: nothing is generated twice), so a deterministic agent resumes exactly
where it was (docs/agents.md "When a process dies").
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import httpx

from storage.schema import ROW_ID, Lease
from workers.gateway.book import episode_key
from workers.runtime.child import START_TIMEOUT_S
from workers.runtime.leases import Parts

log = logging.getLogger(__name__)

AGENT_READS = ("group_id", "iteration", "agent_prompt", "answer")


def load_agent(spec: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function (ValueError naming ``agent.fn``)."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"agent.fn {spec!r} cannot be loaded: {exc}") from None
    if not callable(fn):
        raise ValueError(f"agent.fn {spec!r} is not callable")
    return fn


def _child_main(spec: str, conn: Connection, threads: int) -> None:
    """The agents' process: each request ``(episode, args)`` runs ``fn(*args)`` on a thread of
    its own; the answer ``(episode, kind, detail)`` goes back when it returns."""
    try:  # die with the agent worker, even when it is SIGKILLed
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass
    try:
        fn = load_agent(spec)
        conn.send(("ready", None))
    except Exception as exc:
        conn.send(("error", str(exc)))
        return
    lock = threading.Lock()

    def episode(n: int, args: tuple[Any, ...]) -> None:
        try:
            reward = fn(*args)
            ok = reward is None or (isinstance(reward, int | float) and not isinstance(
                reward, bool))
            answer = (("ok", None if reward is None else float(reward)) if ok else
                      ("raised", f"returned {type(reward).__name__}, not a number or None"))
        except Exception as exc:
            answer = ("raised", f"{type(exc).__name__}: {str(exc)[:300]}")
        with lock:
            conn.send((n, *answer))

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="agent") as pool:
        while (request := conn.recv()) is not None:
            pool.submit(episode, *request)


class AgentHost:
    """The spawned process the agents of one worker run in, one thread per episode (agents wait
    on HTTP: threads, not a process each, which on a small host would spend a second of CPU per
    episode importing the SDK). ``run`` blocks until the episode's agent answers, its deadline
    passes (its thread is left behind: its calls reach an ended episode) or the process dies (it
    is started again for the next episode)."""

    def __init__(self, spec: str, threads: int) -> None:
        self.spec, self.threads = spec, threads
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Connection | None = None
        self._waiting: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._next = 0

    def start(self) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_child_main, args=(self.spec, child, self.threads),
                                 daemon=True, name="agents")
        proc.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S):
            proc.kill()
            proc.join()
            raise ValueError(f"agent.fn {self.spec!r}: the agents' process did not start in "
                             f"{START_TIMEOUT_S:g} s")
        kind, detail = parent.recv()
        if kind != "ready":
            proc.join()
            raise ValueError(detail)
        self._proc, self._conn = proc, parent
        threading.Thread(target=self._read, args=(parent,), name="agent-answers",
                         daemon=True).start()

    def _read(self, conn: Connection) -> None:
        while True:
            try:
                n, kind, detail = conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                slot = self._waiting.pop(n, None)
            if slot is not None:
                slot[1].extend((kind, detail))
                slot[0].set()
        with self._lock:  # the process died: every episode in it failed
            waiting, self._waiting = self._waiting, {}
            if self._conn is conn:
                self._proc, self._conn = None, None
        for done, answer in waiting.values():
            answer.extend(("died", "the agents' process died"))
            done.set()

    def run(self, args: tuple[Any, ...], timeout_s: float) -> tuple[str, Any]:
        """("ok", reward) | ("raised", why) | ("died", why) | ("timeout", why)."""
        done, answer = threading.Event(), []
        with self._lock:
            if self._conn is None:
                self.start()
            assert self._conn is not None
            n = self._next = self._next + 1
            self._waiting[n] = (done, answer)
            self._conn.send((n, args))
        if not done.wait(timeout_s):
            with self._lock:
                self._waiting.pop(n, None)
            return "timeout", f"the agent did not return within {timeout_s:g}s"
        return answer[0], answer[1]

    def close(self) -> None:
        with self._lock:
            conn, proc = self._conn, self._proc
            self._conn = self._proc = None
        if conn is not None:
            try:
                conn.send(None)
            except OSError:
                pass
        if proc is not None:
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()


@dataclass(frozen=True)
class EpisodeResult:
    row_id: int
    reward: float | None
    error: str | None  # why the agent failed (None: it returned)
    state: str  # the gateway's answer to the end: "ended" | "gone" | "no_call"


class AgentStage:
    """Task ``agent``: see the module docstring. ``gateway_url``: the gateway's base, e.g.
    ``http://127.0.0.1:8000``; ``secret``: the run's episode-key secret."""

    task = "agent"
    columns = AGENT_READS
    whole_groups = False

    def __init__(self, spec: str, gateway_url: str, secret: bytes, *, episodes: int,
                 timeout_s: float, end_timeout_s: float, attempts: int = 3) -> None:
        self.spec, self.base_url = spec, gateway_url.rstrip("/") + "/v1"
        self.secret, self.timeout_s, self.end_timeout_s = secret, timeout_s, end_timeout_s
        self.max_rows = episodes
        self.attempts = attempts  # runs of an agent that makes no call (store.max_deliveries)
        self.last_tokens = 0
        self.last_results: list[EpisodeResult] = []
        self._agents = AgentHost(spec, episodes)
        self._agents.start()  # a bad agent.fn fails the worker at start (ValueError)
        self._pool = ThreadPoolExecutor(max_workers=episodes, thread_name_prefix="episode")
        self._http = httpx.Client(timeout=end_timeout_s)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per end

    def process(self, lease: Lease) -> Parts:
        self.last_results = list(self._pool.map(self._episode, lease.batch.to_pylist()))
        return Parts()  # nothing to write: the gateway wrote each episode's trajectory

    def _episode(self, row: dict[str, Any]) -> EpisodeResult:
        """Run the agent, then end the episode at the gateway; an agent that made no call is run
        again (its row's ``open`` delivery failed each time: DEAD after store.max_deliveries)."""
        key = episode_key(self.secret, row[ROW_ID])
        for _ in range(self.attempts):
            reward, error = self._run(key, row)
            if error is not None:
                log.warning("episode %x: %s", row[ROW_ID], error)
            result = EpisodeResult(row[ROW_ID], reward, error, self._end(key, reward))
            if result.state != "no_call":
                break
        return result

    def _run(self, key: str, row: dict[str, Any]) -> tuple[float | None, str | None]:
        try:
            kind, detail = self._agents.run((self.base_url, key, row["agent_prompt"],
                                             row["answer"]), self.timeout_s)
        except (OSError, ValueError) as exc:  # the process could not be (re)started
            return 0.0, f"the agents' process did not start: {exc}"
        return (detail, None) if kind == "ok" else (0.0, detail)

    def _end(self, key: str, reward: float | None) -> str:
        """The gateway's answer to the end; retried while it restarts (connection refused, 5xx)
        for up to ``end_timeout_s``."""
        deadline = time.monotonic() + self.end_timeout_s
        while True:
            try:
                reply = self._http.post(f"{self.base_url}/streamflow/end",
                                        json={"reward": reward},
                                        headers={"Authorization": f"Bearer {key}"})
                if reply.status_code < 500:
                    reply.raise_for_status()
                    return str(reply.json()["state"])
                why = f"{reply.status_code} {reply.text[:200]}"
            except httpx.TransportError as exc:
                why = str(exc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not take an episode's end: {why}")
            time.sleep(0.5)  # the gateway restarts: its supervisor brings it back in seconds

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._agents.close()
        self._http.close()
