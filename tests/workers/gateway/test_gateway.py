"""The gateway over a real (embedded) store and a real HTTP server, driven by the official
``openai`` SDK: a calculator agent's episode is two calls whose answers come from the rollout
stages' written turns; the trajectory the trainer reads is exactly the ids the gateway fed and the
engine generated; a repeated call is answered from the row without generating; bad requests get
OpenAI's error JSON with the right status and write nothing; the agent's end writes the reward."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

import storage
from storage.schema import ROW_ID
from tests.workers.gateway.gateway_rig import CALCULATOR, SECRET, TABLE, TOK, G, Rig, T
from workers.gateway.app import GatewayServer
from workers.gateway.book import EpisodeBook, Served, episode_key
from workers.gateway.chat import ChatFormat
from workers.runtime.leases import LeaseKeeper
from workers.schema import samples_table_spec


def calc_agent(base_url: str, api_key: str, prompt: str) -> tuple[str, int]:
    """What a user writes: the OpenAI SDK, a tool loop; (final answer, tool calls)."""
    llm = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": prompt}]
    calls = 0
    for _ in range(4):
        reply = llm.chat.completions.create(model="policy", messages=messages,
                                            tools=CALCULATOR)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content or "", calls
        for call in msg.tool_calls:
            calls += 1
            expr = json.loads(call.function.arguments)["expression"]
            a, b = expr.split("*")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(int(a) * int(b))})
    return "", calls


def end(rig: Rig, key: str, reward: float | None) -> str:
    r = httpx.post(f"{rig.url()}/streamflow/end", json={"reward": reward},
                   headers={"Authorization": f"Bearer {key}"}, timeout=30)
    r.raise_for_status()
    return r.json()["state"]


def test_an_openai_sdk_agent_trains_on_exactly_the_served_tokens(rig: Rig) -> None:
    rows = rig.episodes()
    assert len(rows) == 2 * G
    results = {}

    def episode(row: dict) -> None:
        key = episode_key(SECRET, row[ROW_ID])
        answer, calls = calc_agent(rig.url(), key, row["agent_prompt"])
        results[row[ROW_ID]] = (answer, calls, end(rig, key, float(answer == row["answer"])))

    threads = [threading.Thread(target=episode, args=(row,)) for row in rows]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert {r[ROW_ID]: r["answer"] for r in rows} == {k: v[0] for k, v in results.items()}
    assert all(v[1] == 1 and v[2] == "ended" for v in results.values())

    reward_rows = rig.client.claim(TABLE, "reward", ("prompt_ids", "response_ids",
                                                     "response_loss_mask", "env_reward",
                                                     "finish_reason"), 64, timeout=5.0)
    got = {r[ROW_ID]: r for r in reward_rows.batch.to_pylist()}
    assert len(got) == 2 * G
    by_row: dict[int, dict[int, Served]] = {}
    for s in rig.served:
        by_row.setdefault(s.row_id, {})[s.call] = s
    for row_id, row in got.items():
        calls = by_row[row_id]
        assert sorted(calls) == [0, 1]
        assert row["prompt_ids"] == calls[0].fed
        response = calls[0].turn + calls[1].fed + calls[1].turn
        assert row["response_ids"] == response
        assert row["response_loss_mask"] == ([1] * len(calls[0].turn) + [0] * len(calls[1].fed)
                                             + [1] * len(calls[1].turn))
        assert row["env_reward"] == 1.0 and row["finish_reason"] == "stop"
    # the engine was fed exactly the stored contexts: the prompt, then prompt + turn + piece
    fed = sorted(tuple(c) for c in rig.engine.contexts)
    want = sorted([tuple(r["prompt_ids"]) for r in got.values()] + [
        tuple(r["prompt_ids"] + by_row[i][0].turn + by_row[i][1].fed) for i, r in got.items()])
    assert fed == want


def test_a_repeated_call_is_answered_from_the_row(rig: Rig) -> None:
    row = rig.episodes()[0]
    key = episode_key(SECRET, row[ROW_ID])
    llm = openai.OpenAI(base_url=rig.url(), api_key=key, max_retries=0)
    messages = [{"role": "user", "content": row["agent_prompt"]}]
    first = llm.chat.completions.create(model="m", messages=messages, tools=CALCULATOR)
    generated = len(rig.engine.contexts)
    again = llm.chat.completions.create(model="m", messages=messages, tools=CALCULATOR)
    assert again.choices[0].message == first.choices[0].message
    assert len(rig.engine.contexts) == generated  # nothing generated for the repeat


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"messages": []}, 400, "invalid_messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_messages"),
    ({"messages": [{"role": "user", "content": "1"}], "tools": [{"type": "x"}]}, 400,
     "invalid_tools"),
])
def test_malformed_requests_get_openai_errors_and_write_nothing(rig: Rig, body: dict,
                                                                status: int, code: str) -> None:
    row = rig.episodes()[0]
    key = episode_key(SECRET, row[ROW_ID])
    r = httpx.post(f"{rig.url()}/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == status and r.json()["error"]["code"] == code
    # the row still waits for its first call: a good call now opens it
    llm = openai.OpenAI(base_url=rig.url(), api_key=key, max_retries=0)
    ok = llm.chat.completions.create(model="m", messages=[{"role": "user",
                                                           "content": row["agent_prompt"]}])
    assert ok.choices[0].finish_reason == "tool_calls"


def test_an_unknown_key_is_401() -> None:
    with storage.embedded(1) as store:
        client = store.client()
        client.create_table(samples_table_spec(TABLE, group_size=G, reference_worker=False,
                                               fsync="never", max_turns=T, gateway=True))
        keeper = LeaseKeeper(store.client)
        book = EpisodeBook(store.client, TABLE, ChatFormat(TOK, plain=True), max_turns=T,
                           max_total_tokens=64, secret=SECRET, keeper=keeper, wait_s=1.0,
                           lease_seconds=5.0)
        book.start()
        server = GatewayServer(book, "127.0.0.1", 0)
        port = server.start()
        try:
            llm = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sf-1-bad",
                                max_retries=0)
            with pytest.raises(openai.AuthenticationError) as err:
                llm.chat.completions.create(model="m", messages=[{"role": "user",
                                                                  "content": "1"}])
            assert err.value.status_code == 401
        finally:
            server.stop()
            book.close()
            keeper.close()
            client.close()


def test_completions_extend_the_text_and_a_rewrite_is_refused(rig: Rig) -> None:
    row = rig.episodes()[0]
    llm = openai.OpenAI(base_url=rig.url(), api_key=episode_key(SECRET, row[ROW_ID]),
                        max_retries=0)
    prompt = row["agent_prompt"]
    first = llm.completions.create(model="m", prompt=prompt).choices[0]
    assert first.text.startswith("(=") and first.finish_reason == "stop"
    expr = first.text[2:-2]
    a, b = expr.split("*")
    with pytest.raises(openai.BadRequestError) as err:  # not what it was answered
        llm.completions.create(model="m", prompt=prompt + "(=1*1=)1 ")
    assert err.value.body["code"] == "context_rewritten"
    second = llm.completions.create(model="m", prompt=f"{prompt}{first.text}{int(a) * int(b)} ")
    assert second.choices[0].text == row["answer"]
    (call0, call1) = sorted((s for s in rig.served if s.row_id == row[ROW_ID]),
                            key=lambda s: s.call)
    assert TOK.decode(call0.fed + call0.turn + call1.fed, skip_special_tokens=True) == \
        f"{prompt}{first.text}{row['answer']} "


def test_a_streamed_chat_answer_is_one_chunk(rig: Rig) -> None:
    row = rig.episodes()[0]
    llm = openai.OpenAI(base_url=rig.url(), api_key=episode_key(SECRET, row[ROW_ID]),
                        max_retries=0)
    chunks = list(llm.chat.completions.create(
        model="m", messages=[{"role": "user", "content": row["agent_prompt"]}],
        tools=CALCULATOR, stream=True))
    assert len(chunks) == 1 and chunks[0].choices[0].finish_reason == "tool_calls"
    call = chunks[0].choices[0].delta.tool_calls[0]
    assert call.function.name == "calculator" and call.index == 0


def test_a_call_past_the_turn_budget_is_400_in_one_log_line_and_the_episode_keeps_its_turns(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    row = rig.episodes()[0]
    key = episode_key(SECRET, row[ROW_ID])
    llm = openai.OpenAI(base_url=rig.url(), api_key=key, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": row["agent_prompt"]}]
    for _ in range(T):  # T calls: a tool call, then answers (a user message after each)
        reply = llm.chat.completions.create(model="m", messages=messages, tools=CALCULATOR)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        messages += ([{"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "1"}]
                     if msg.tool_calls else [{"role": "user", "content": "="}])
    with caplog.at_level("WARNING", logger="workers.gateway.app"):
        with pytest.raises(openai.BadRequestError) as err:
            llm.chat.completions.create(model="m", messages=messages, tools=CALCULATOR)
    assert err.value.status_code == 400 and err.value.body["code"] == "turn_budget"
    assert [r.getMessage() for r in caplog.records] == [
        "gateway 400 turn_budget: the episode has had its 3 model turns (rollout.max_turns)"]
    assert end(rig, key, 0.5) == "ended"
    lease = rig.client.claim(TABLE, "reward", ("response_ids", "env_reward"), 64, timeout=5.0)
    (got,) = [r for r in lease.batch.to_pylist() if r[ROW_ID] == row[ROW_ID]]
    served = sorted((s for s in rig.served if s.row_id == row[ROW_ID]), key=lambda s: s.call)
    assert [s.call for s in served] == [0, 1, 2]
    assert got["response_ids"] == [i for s in served for i in (s.fed if s.call else []) + s.turn]
    assert got["env_reward"] == 0.5
