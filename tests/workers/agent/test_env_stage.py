"""The environment role's observations with a chat model (workers.roles.environment,
workers.agent.toolcall.chat_wrapping): the tool-message turn taken from the tokenizer's own chat
template, the text cut but never the turn wrapping, env.tools narrowing the callable tools, and the
environment's final reward written with the ended row."""

from __future__ import annotations

import string

import pyarrow as pa
import pytest

from storage.schema import ROW_ID, Lease
from workers.agent.environments import CalculatorEnvironment, Observation, StepContext
from workers.agent.piece_rows import Step, piece_reads, piece_writes
from workers.agent.pieces import TO_ENV, TO_MODEL, History, model_piece, observation
from workers.agent.toolcall import (
    ToolCall,
    chat_wrapping,
    format_observation,
    observation_text,
    render_tool_call,
)
from workers.models.tokenizer import build_char_tokenizer
from workers.roles.environment import ENV_READS, environment_stages
from workers.schema import piece_bound, samples_table_spec
from workers.settings import AgentSettings

# The tool-message part of Qwen2.5's chat template (its tools and tool_calls branches left out).
QWEN = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role in ('user', 'assistant') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# SmolLM2's (ChatML): every message, a tool one too, is its own turn under its role.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
# A template that allows only user/assistant turns (as Mistral's does).
STRICT = ("{% for m in messages %}{% if m['role'] not in ('user', 'assistant') %}"
          "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}")
QWEN_TURN = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n",
             "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def chat_tokenizer(template: str | None):  # noqa: ANN201
    """A character-level tokenizer with ChatML's special tokens and ``template``."""
    alphabet = "".join(dict.fromkeys(string.ascii_letters + string.digits + string.punctuation
                                     + " \n"))
    tok = build_char_tokenizer(alphabet)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    return tok


def test_the_wrapping_is_the_templates_tool_message_turn():
    assert chat_wrapping(chat_tokenizer(QWEN)) == QWEN_TURN
    assert chat_wrapping(chat_tokenizer(CHATML)) == ("<|im_end|>\n<|im_start|>tool\n",
                                                     "<|im_end|>\n<|im_start|>assistant\n")
    # no template, or one that refuses a tool message: the bare <tool_response> block
    assert chat_wrapping(chat_tokenizer(None)) is None
    assert chat_wrapping(chat_tokenizer(STRICT)) is None
    assert format_observation("42", wrapping=QWEN_TURN) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert format_observation("42") == "<tool_response>\n42\n</tool_response>"
    for plain, wrapping in ((False, QWEN_TURN), (False, None), (True, None)):
        text = format_observation("4 2", plain, wrapping)
        assert observation_text(text, plain, wrapping) == "4 2"
    assert observation_text("cut <tool_response>", wrapping=QWEN_TURN) == "cut <tool_response>"


class Shouter:
    """Serves calculator and shout; shout "done" ends the trajectory with a reward."""

    def tools(self) -> tuple[str, ...]:
        return ("calculator", "shout")

    def step(self, call: ToolCall, context: StepContext) -> Observation:
        if call.name == "calculator":
            return CalculatorEnvironment().step(call, context)
        if call.arguments.get("text") == "done":
            return Observation("bye", done=True, reward=0.5)
        return Observation(str(call.arguments.get("text", "")).upper())


BOUND = piece_bound(3, 0)
SPEC = samples_table_spec("s", group_size=1, reference_worker=False, fsync="never", max_turns=3)


def row_of(row_id: int, pieces: list, end: str | None = None, reward: float | None = None,
           **cells) -> dict:  # noqa: ANN003
    """The cells a trajectory's tasks write for ``pieces`` (each going on; the last ends the
    row with ``end`` when given)."""
    out, hist = {**cells, ROW_ID: row_id}, History()
    for k, piece in enumerate(pieces):
        last = end is not None and k == len(pieces) - 1
        then = end if last else (TO_ENV if piece.model else TO_MODEL)
        for batch in piece_writes(k, BOUND, [Step(row_id, hist, piece, then, reward)]):
            out.update({c: v for c, v in batch.to_pylist()[0].items() if c != ROW_ID})
        hist = hist.then(piece)
    return out


def batch_of(rows: list[dict], names: tuple[str, ...]) -> pa.RecordBatch:
    arrays = {ROW_ID: pa.array([r[ROW_ID] for r in rows], pa.uint64())}
    arrays.update({k: pa.array([r[k] for r in rows], SPEC.schema.field(k).type) for k in names})
    return pa.RecordBatch.from_pydict(arrays)


def lease(tok, turns: list[str]) -> Lease:  # noqa: ANN001
    """Rows of the 3-turn table whose turn 0 said ``turns[i]`` and ended in a tool call."""
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows_ = [row_of(i, [model_piece(enc(t), [-0.5] * len(enc(t)), 0, "tool")], group_id=i,
                    iteration=0, prompt_ids=enc("q"), answer="7") for i, t in enumerate(turns)]
    return Lease(1, "s", "env.1", 0, 0.0, batch_of(rows_, (*ENV_READS, *piece_reads(1))))


def call(name: str, **arguments: str) -> str:
    return render_tool_call(ToolCall(name, arguments))


def stage(tok, *, max_observation_tokens: int = 200, tools: tuple[str, ...] = ()):  # noqa: ANN001, ANN201
    agent = AgentSettings(max_turns=3, max_total_tokens=1000, fn="pkg:Shouter", format="hermes",
                          max_observation_tokens=max_observation_tokens, tools=tools)
    return environment_stages(Shouter(), tok, agent, max_cuts=0, max_rows=8)[0]


def rows(parts) -> dict[int, dict]:  # noqa: ANN001
    return {r[ROW_ID]: r for batch in parts.batches for r in batch.to_pylist()}


def test_a_chat_models_observation_is_the_templates_tool_turn_and_only_its_text_is_cut():
    tok = chat_tokenizer(QWEN)
    full = rows(stage(tok).process(lease(tok, [call("calculator", expression="6*7")])))
    said = tok.decode(full[0]["piece1_ids"], skip_special_tokens=False)
    assert said == QWEN_TURN[0] + "42" + QWEN_TURN[1]  # the model goes on as the assistant
    wrap = sum(len(tok(w, add_special_tokens=False)["input_ids"]) for w in QWEN_TURN)
    cut = rows(stage(tok, max_observation_tokens=wrap + 3).process(
        lease(tok, [call("shout", text="abcdefgh")])))
    ids = cut[0]["piece1_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == QWEN_TURN[0] + "ABC" + QWEN_TURN[1]
    assert len(ids) == wrap + 3
    # without a template: the bare block, cut at the limit
    bare = chat_tokenizer(None)
    plain = rows(stage(bare, max_observation_tokens=20).process(
        lease(bare, [call("shout", text="abcdefgh")])))
    assert bare.decode(plain[0]["piece1_ids"]) == "<tool_response>\nABCD"


def test_env_tools_narrow_what_the_model_may_call():
    tok = chat_tokenizer(None)
    turns = [call("shout", text="hi"), call("calculator", expression="1+2")]
    narrowed = rows(stage(tok, tools=("calculator",)).process(lease(tok, turns)))
    assert narrowed[0]["piece1_error"] == "unknown_tool"
    assert "unknown tool 'shout'; the tools are calculator" in tok.decode(narrowed[0]["piece1_ids"])
    assert narrowed[1]["piece1_error"] is None and "3" in tok.decode(narrowed[1]["piece1_ids"])
    every = rows(stage(tok).process(lease(tok, turns)))  # empty: all the environment serves
    assert every[0]["piece1_error"] is None and "HI" in tok.decode(every[0]["piece1_ids"])


def test_each_calls_tool_latency_and_error_are_kept_for_the_trace():
    """``last_calls``: what the stage loop's trace writes per row (workers.runtime.trace). What
    breaks it: a row credited with another row's call, a call that is not timed."""
    tok = chat_tokenizer(None)
    env = stage(tok, tools=("calculator",))
    env.process(lease(tok, [call("shout", text="hi"), call("calculator", expression="1+2")]))
    assert {row: (tool, error) for row, (tool, _, error) in env.last_calls.items()} == {
        0: ("shout", "unknown_tool"), 1: ("calculator", None)}
    assert all(seconds >= 0.0 for _, seconds, _ in env.last_calls.values())


def test_the_environments_final_reward_is_written_when_it_ends_the_trajectory():
    tok = chat_tokenizer(QWEN)
    got = rows(stage(tok).process(lease(tok, [call("shout", text="done"),
                                              call("shout", text="go on")])))
    assert got[0]["finish_reason"] == "done" and got[0]["env_reward"] == pytest.approx(0.5)
    assert got[0]["piece1_ids"] is None and got[0]["piece2_ids"] is None
    assert "env_reward" not in got[1] and got[1]["piece1_ids"] is not None


REWARDS = '''
def last_turn(completion, answer, trajectory):
    return float(trajectory.turns[-1].strip() == answer) + 10 * trajectory.tool_calls
'''


def reward_lease(tok) -> Lease:  # noqa: ANN001
    """Three ended 3-turn trajectories, as the piece tasks leave them for the reward role: the
    environment ended 0 with a reward; 1 called once, then answered; 2 called an unknown tool,
    called again, then answered."""
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    obs = [enc(format_observation(t, wrapping=QWEN_TURN)) for t in ("42", "no such tool", "3")]
    eos = [tok.eos_token_id]

    def said(text: str, end: str = "tool", extra: list[int] = ()) -> object:  # noqa: B006
        ids = enc(text) + list(extra)
        return model_piece(ids, [-0.5] * len(ids), 0, end)

    trajectories = [
        ([said(call("shout", text="done")), observation([], None, "done")], "done", 0.5),
        ([said(call("calculator", expression="6*7")), observation(obs[0]),
          said("7", "stop", eos)], "stop", None),
        ([said(call("nope")), observation(obs[1], "unknown_tool"),
          said(call("calculator", expression="1+2")), observation(obs[2]),
          said("7", "stop", eos)], "stop", None)]
    rows_ = [row_of(i, pieces, end, reward, answer="7", iteration=0, group_id=0)
             for i, (pieces, end, reward) in enumerate(trajectories)]
    from workers.roles.reward import trajectory_reads
    from workers.schema import REWARD_READS

    return Lease(1, "s", "reward", 0, 0.0, batch_of(rows_, tuple(dict.fromkeys(
        (*REWARD_READS, *trajectory_reads(BOUND))))))


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "sf_trajectory_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "sf_trajectory_rewards"


def test_the_reward_role_reads_the_whole_trajectory_and_the_environments_reward(rewards_module):
    from workers.roles.reward import RewardStage, trajectory_reads
    from workers.schema import REWARD_READS
    from workers.tasks.verifiers import Trajectory

    tok = chat_tokenizer(QWEN)
    agent = AgentSettings(max_turns=3, format="hermes")
    lease_ = reward_lease(tok)
    assert set(lease_.batch.schema.names) == {ROW_ID, *REWARD_READS, *trajectory_reads(BOUND)}
    scores = {}
    for rule in ("replace", "add", "ignore"):
        stage = RewardStage(tok, f"{rewards_module}:last_turn", timeout_s=5.0, max_rows=8,
                            on_error="retry", agent=agent, env_reward=rule)
        try:
            assert stage.columns == (*REWARD_READS, *trajectory_reads(BOUND))
            out = stage.process(lease_).to_pylist()
            assert all(r["reward_ok"] for r in out)
            scores[rule] = [r["reward"] for r in out]
            if rule == "replace":
                rows_ = lease_.batch.to_pylist()
                assert stage.trajectory(rows_[2]) == Trajectory(
                    (call("nope"), call("calculator", expression="1+2"), "7"),
                    ("no such tool", "3"), ("unknown_tool", None), 2, None, "stop")
                assert stage.trajectory(rows_[0]) == Trajectory(
                    (call("shout", text="done"),), (), (None,), 1, 0.5, "done")
        finally:
            stage.close()
    # the environment's reward replaces the verifier's score, adds to it, or is ignored
    assert scores == {"replace": [0.5, 11.0, 21.0], "add": [10.5, 11.0, 21.0],
                      "ignore": [10.0, 11.0, 21.0]}


def test_a_classic_verifier_scores_a_trajectorys_whole_response():
    from workers.roles.reward import RewardStage

    tok = chat_tokenizer(QWEN)
    stage = RewardStage(tok, "brevity", timeout_s=5.0, max_rows=8,
                        on_error="retry", env_reward="ignore",
                        agent=AgentSettings(max_turns=3, format="hermes"))
    out = stage.process(reward_lease(tok)).to_pylist()
    texts = tok.batch_decode(reward_lease(tok).batch.column("response_ids").to_pylist(),
                             skip_special_tokens=True)
    assert [r["reward"] for r in out] == pytest.approx([1 / (1 + len(t.strip())) for t in texts])
