"""Environments from a hub (workers.agent.hub) with the real verifiers package and a real local
taskset, tests/fixtures/hub_arith, written as the library's documentation and scaffold show a user
writing one: its tasks become the run's prompts and answers, its toolset answers a model's call
through a real EnvironmentStage (in the child process that isolates user environments), and its
rewards score completed trajectories through the reward role."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.schema import ROW_ID, Lease
from tests.workers.agent.test_env_stage import BOUND, batch_of, row_of
from tests.workers.agent.test_env_stage import chat_tokenizer as chat_tokenizer_of
from workers.agent.hub import hub_problems, hub_spec, trajectory_messages
from workers.agent.piece_rows import piece_reads
from workers.agent.pieces import model_piece, observation
from workers.agent.toolcall import ToolCall, format_observation, render_tool_call
from workers.checked import ConfigValueError
from workers.models.tokenizer import build_char_tokenizer
from workers.roles.environment import ENV_READS, environment_stages, make_environment
from workers.roles.reward import RewardStage, trajectory_reads
from workers.schema import REWARD_READS
from workers.settings import AgentSettings
from workers.tasks.problem import Problem

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
HUB = "verifiers:hub_arith"
# ChatML (SmolLM2's template): every message, a tool one too, is its own turn under its role
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOOL_TURN = ("<|im_end|>\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(autouse=True)
def fixtures_on_path(monkeypatch):
    """The fixture environment importable here and in the spawned children (they get this
    process's sys.path)."""
    monkeypatch.syspath_prepend(str(FIXTURES))


def chat_tokenizer(template: str = CHATML):  # noqa: ANN201
    return chat_tokenizer_of(template)  # test_env_stage's, with ChatML by default


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def call(name: str, **arguments: str) -> str:
    return render_tool_call(ToolCall(name, arguments))


def agent(**kw) -> AgentSettings:
    return AgentSettings(max_turns=3, max_total_tokens=1000, fn="hub", hub=HUB, format="hermes",
                         max_observation_tokens=200, **kw)


def test_the_tasks_become_the_runs_prompts_and_answers():
    from hub_arith.taskset import PAIRS

    want = [Problem(f"{a}+{b}=", str(a + b)) for a, b in PAIRS]
    assert hub_problems(HUB) == want  # no chat template: the prompt text itself
    # the module:attr form, a Taskset class made with its config's defaults
    assert hub_problems("verifiers:hub_arith.taskset:ArithTaskset") == want
    # a chat model: each prompt rendered in its template with the tools' schemas, ending at
    # the assistant's turn
    rendered = hub_problems(HUB, chat_tokenizer(
        "{% for t in tools or [] %}{{ t.function.name }}: {{ t.function.description }}\n"
        "{% endfor %}" + CHATML))
    assert [p.answer for p in rendered] == [p.answer for p in want]
    assert rendered[0].prompt == (
        'calculator: Evaluate an arithmetic expression of integers with +, - and *, e.g. "12*34".'
        f"\n<|im_start|>user\n{want[0].prompt}<|im_end|>\n<|im_start|>assistant\n")


def test_a_taskset_that_cannot_be_had_is_one_line_naming_env_hub():
    for hub, why in (("verifiers:no_such_taskset", "cannot load the taskset"),
                     ("verifiers:hub_arith.taskset:PAIRS", "not a verifiers Taskset")):
        with pytest.raises(ConfigValueError, match=f"^env.hub: .*{why}") as err:
            hub_problems(hub)
        assert "\n" not in str(err.value)


def lease(tok, turns: list[str], answer: str) -> Lease:
    """Rows of the 3-turn table whose turn 0 said ``turns[i]`` and ended in a tool call."""
    rows_ = [row_of(i, [model_piece(ids(tok, t), [-0.5] * len(ids(tok, t)), 0, "tool")],
                    group_id=i, iteration=0, prompt_ids=ids(tok, "10+11="), answer=answer)
             for i, t in enumerate(turns)]
    return Lease(1, "s", "env.1", 0, 0.0, batch_of(rows_, (*ENV_READS, *piece_reads(1))))


def test_a_tool_call_is_answered_by_the_hub_environment_through_the_stage():
    tok = chat_tokenizer()
    env = make_environment(agent())  # the child process of workers.agent.isolated
    try:
        assert env.tools() == ("calculator",)
        stage = environment_stages(env, tok, agent(), max_cuts=0, max_rows=8)[0]
        parts = stage.process(lease(tok, [call("calculator", expression="6*7"),
                                          call("calculator", expression="2**99"),
                                          call("search", query="x")], "21"))
        out = {r[ROW_ID]: r for b in parts.batches for r in b.to_pylist()}
        said = [tok.decode(out[i]["piece1_ids"], skip_special_tokens=False) for i in range(3)]
        # the tool's answer, in the template's tool-message turn
        assert said[0] == TOOL_TURN[0] + "42" + TOOL_TURN[1] and out[0]["piece1_error"] is None
        # the tool raised: the error, and the tool's own message, is the observation
        assert "only integers with + - * are supported" in said[1]
        assert out[1]["piece1_error"] == "tool_error"
        # a tool the environment does not serve never reaches it
        assert out[2]["piece1_error"] == "unknown_tool" and "calculator" in said[2]
        assert all(out[i].get("finish_reason") is None for i in range(3))  # they go on
    finally:
        env.close()


def reward_lease(tok, trajectories: list[tuple[list[str], list[str]]]) -> Lease:
    """Ended 3-turn trajectories (turns, observations) of the prompt 10+11=, as the piece tasks
    leave them for the reward role."""
    eos = [tok.eos_token_id]
    rows_ = []
    for i, (ts, os) in enumerate(trajectories):
        pieces = []
        for t, text in enumerate(ts):
            last = t == len(ts) - 1
            said = ids(tok, text) + (eos if last else [])
            pieces.append(model_piece(said, [-0.5] * len(said), 0, "stop" if last else "tool"))
            if t < len(os):
                pieces.append(observation(ids(tok, format_observation(os[t],
                                                                      wrapping=TOOL_TURN))))
        rows_.append(row_of(i, pieces, "stop", None, answer="21", iteration=0, group_id=0))
    return Lease(1, "s", "reward", 0, 0.0, batch_of(rows_, tuple(dict.fromkeys(
        (*REWARD_READS, *trajectory_reads(BOUND))))))


def test_the_tasks_rewards_score_a_completed_trajectory():
    tok = chat_tokenizer()
    asked = call("calculator", expression="10+11")
    trajectories = [([asked, "21"], ["21"]),  # called, then answered right
                    ([asked, "20"], ["21"]),  # called, then answered wrong
                    (["21"], []),  # answered right without a call
                    ([asked, asked, "the sum is 21"], ["21", "21"])]  # right, not alone
    # the fixture's rewards: 1.0 x correct + 0.1 x brevity, of the last reply
    want = [1 + 0.1 / 3, 0.1 / 3, 1 + 0.1 / 3, 0.1 / 14]
    stage = RewardStage(tok, hub_spec(HUB), timeout_s=10.0, max_rows=8, on_error="retry",
                        env_reward="replace", agent=agent())
    try:
        out = stage.process(reward_lease(tok, trajectories)).to_pylist()
    finally:
        stage.close()
    assert [r["reward_ok"] for r in out] == [True] * 4, out
    assert [r["reward"] for r in out] == pytest.approx(want, rel=1e-6)


def test_a_trajectory_becomes_the_messages_a_trace_holds():
    asked = ToolCall("calculator", {"expression": "10+11"})
    got = [m.model_dump(exclude_none=True) for m in trajectory_messages(
        [f"let me see {render_tool_call(asked)}", "21"], ["21"])]
    assert got == [
        {"role": "assistant", "content": "let me see ", "tool_calls": [
            {"id": "call_0", "type": "function", "name": "calculator",
             "arguments": '{"expression": "10+11"}'}]},
        {"role": "tool", "content": "21", "tool_call_id": "call_0"},
        {"role": "assistant", "content": "21"}]
    # the built-in model's plain form: (=expr=) is calculator(expression)
    plain = trajectory_messages(["(=10+11=)", "21"], ["21"])
    assert plain[0].tool_calls[0].arguments == '{"expression": "10+11"}'
    assert [m.role for m in plain] == ["assistant", "tool", "assistant"]
    # a call cut before its observation (the budget ended the trajectory): no tool message
    assert [m.role for m in trajectory_messages([render_tool_call(asked)], [])] == ["assistant"]


class CallingEngine:
    """The built-in model's plain form, scripted: turn 0 calls the calculator on its prompt,
    turn 1 answers with what the tool said (the prompts in ``right``) or with a wrong number."""

    def __init__(self, tok, right: set[str]) -> None:
        self.tok, self.right = tok, right

    def generate(self, prompts, n, params):
        from workers.engines.base import FINISH_STOP, Generation

        out = []
        for context in prompts:
            text = self.tok.decode(context, skip_special_tokens=True)
            if "=)" not in text:
                reply = ids(self.tok, f"(={text.rstrip('=')}=)")
            else:
                prompt, said = text.partition("(=")[0], text.rpartition("=)")[2]
                answer = said.strip() if prompt in self.right else "1"
                reply = ids(self.tok, answer) + [self.tok.eos_token_id]
            out.append([Generation(reply, [0.0] * len(reply), FINISH_STOP)] * n)
        return out


def test_held_out_accuracy_scores_each_greedy_trajectory_with_the_tasks_rewards():
    """The evaluator hands the reward the trajectory, turn by turn: the last reply is the
    answer after the tool's, which the task's ``trace.last_reply`` reads (the whole text as one
    turn would end in the call, and no problem would count as solved)."""
    from workers.tasks.evaluate import greedy_accuracy, reward_scorer

    tok = build_char_tokenizer()  # the built-in model's alphabet: digits, + - * = ( ) and space
    plain = AgentSettings(max_turns=2, max_total_tokens=32, max_observation_tokens=16, fn="hub",
                          hub=HUB, format="plain")
    problems = hub_problems(HUB)[:4]
    engine = CallingEngine(tok, right={p.prompt for p in problems[:3]})
    score = reward_scorer(hub_spec(HUB), success_threshold=1.0, timeout_s=10.0)
    assert greedy_accuracy(engine, tok, problems, max_new_tokens=12, agent=plain,
                           score=score) == 0.75
