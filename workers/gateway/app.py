"""The gateway's HTTP face: an OpenAI-compatible endpoint whose every call is a piece of a row.

``POST /v1/chat/completions`` (``tools`` / ``tool_calls``; ``stream: true`` sends the whole
answer as one chunk then ``[DONE]``: the answer exists only once its turn is written),
``POST /v1/completions`` (a text prompt the caller formats itself; not streamed), and
``POST /v1/streamflow/end`` (the agent worker's "this episode returned, with this reward"). The
episode is the ``api_key`` (``Authorization: Bearer``), so any client that takes a ``base_url``
and an ``api_key`` works unmodified. Each call blocks a worker thread of the server while its
turn is generated (``EpisodeBook``): the thread pool is sized for the concurrent episodes.
Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``) with the status of
``RequestError``, and one line in the log; a refused call writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from storage.errors import StoreError
from workers.gateway.book import EpisodeBook
from workers.gateway.chat import RequestError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # a request past this is refused before it is parsed
# calls served at once: each blocks a thread while its turn is generated (far above what a run's
# agent workers open; a call past it waits for a thread)
MAX_CALLS = 1024


def error_response(exc: RequestError) -> JSONResponse:
    log.warning("gateway %d %s: %s", exc.status, exc.code, exc)
    return JSONResponse({"error": {"message": str(exc), "type": exc.kind, "param": None,
                                   "code": exc.code}}, status_code=exc.status)


def _key(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    if not auth.lower().startswith("bearer "):
        raise RequestError(401, "invalid_api_key", "no api_key (Authorization: Bearer)",
                           "authentication_error")
    return auth[7:].strip()


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(413, "request_too_large", f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw)
    except ValueError:
        raise RequestError(400, "invalid_json", "the body is not JSON") from None
    if not isinstance(body, dict):
        raise RequestError(400, "invalid_json", "the body must be a JSON object")
    return body


def make_app(book: EpisodeBook, *, max_calls: int) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # one blocked thread per call being generated
        anyio.to_thread.current_default_thread_limiter().total_tokens = max_calls
        yield

    app = FastAPI(title="StreamFlow gateway", docs_url=None, redoc_url=None, lifespan=lifespan)

    async def guarded(request: Request, fn: Any) -> Any:
        try:
            return await fn(_key(request), await _body(request))
        except RequestError as exc:
            return error_response(exc)
        except StoreError as exc:  # the store lost the lease or is restarting: retry
            return error_response(RequestError(503, "store_unavailable", str(exc), "api_error"))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        async def serve(key: str, body: dict[str, Any]) -> Any:
            answer = await anyio.to_thread.run_sync(book.chat, key, body)
            return _stream(answer) if body.get("stream") else answer
        return await guarded(request, serve)

    @app.post("/v1/completions")
    async def complete(request: Request) -> Any:
        async def serve(key: str, body: dict[str, Any]) -> Any:
            if body.get("stream"):
                raise RequestError(400, "unsupported", "stream is not supported on "
                                   "/v1/completions (chat completions stream)")
            return await anyio.to_thread.run_sync(book.complete, key, body)
        return await guarded(request, serve)

    @app.post("/v1/streamflow/end")
    async def end(request: Request) -> Any:
        async def serve(key: str, body: dict[str, Any]) -> Any:
            reward = body.get("reward")
            if reward is not None and not isinstance(reward, int | float):
                raise RequestError(400, "invalid_reward", "reward must be a number or null")
            state = await anyio.to_thread.run_sync(book.end, key, reward)
            return {"state": state}
        return await guarded(request, serve)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def _stream(answer: dict[str, Any]) -> StreamingResponse:
    """The answer as one SSE chunk (OpenAI's ``chat.completion.chunk``) and ``[DONE]``."""
    choice = answer["choices"][0]
    delta = dict(choice["message"])
    for i, call in enumerate(delta.get("tool_calls") or []):
        call["index"] = i
    chunk = {**answer, "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": delta, "finish_reason": choice["finish_reason"]}]}

    def lines() -> Any:
        yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(lines(), media_type="text/event-stream")


class GatewayServer:
    """uvicorn serving ``make_app(book)`` from a thread; ``port`` 0 picks one (``port`` after
    ``start``)."""

    def __init__(self, book: EpisodeBook, host: str, port: int, *,
                 max_calls: int = MAX_CALLS) -> None:
        self.book = book
        config = uvicorn.Config(make_app(book, max_calls=max_calls), host=host, port=port,
                                log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="gateway-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 30.0) -> int:
        self._thread.start()
        for _ in range(int(timeout / 0.05)):
            if self.server.started:
                break
            if not self._thread.is_alive():
                raise RuntimeError("the gateway's HTTP server did not start (port in use?)")
            threading.Event().wait(0.05)
        else:
            raise RuntimeError(f"the gateway's HTTP server did not start in {timeout:.0f} s")
        return self.port

    @property
    def port(self) -> int:
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10.0)
