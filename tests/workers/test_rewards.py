"""Reward registry and RewardRunner: built-ins, import paths, timeouts and crashes never escape."""

from __future__ import annotations

import textwrap

import pytest

from workers.tasks.verifiers import (
    RewardError,
    RewardRunner,
    Trajectory,
    available_rewards,
    exact_match,
    numeric_close,
    register_reward,
    resolve_reward,
    takes_trajectory,
)

USER_MODULE = textwrap.dedent(
    """
    import os
    import time

    def length_reward(completion, answer):
        return float(len(completion))

    def picky(completion, answer):
        if completion == "hang":
            time.sleep(60)  # a verifier that hangs: what the timeout is tested against
        if completion == "boom":
            raise RuntimeError("user bug")
        if completion == "die":
            os._exit(3)
        if completion == "text":
            return "not a number"
        return 1.0 if completion.strip() == answer else 0.0

    def tool_thrift(completion, answer, trajectory):
        # the answer counts only when the last turn says it, less 0.25 per tool call
        said = trajectory.turns[-1].strip() == answer
        return float(said) - 0.25 * trajectory.tool_calls
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "sf_user_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "sf_user_rewards"


def test_builtins():
    assert exact_match(" 46 \n", "46") == 1.0 and exact_match("45", "46") == 0.0
    assert numeric_close("the answer is 46.0", "46") == 1.0
    assert numeric_close("no number", "46") == 0.0
    assert {"exact_match", "numeric_close"} <= set(available_rewards())
    assert resolve_reward("exact_match") is exact_match


def test_resolve_errors_name_the_problem(user_module):
    with pytest.raises(RewardError, match="unknown reward 'nope'"):
        resolve_reward("nope")
    with pytest.raises(RewardError, match="cannot import module 'no_such_mod_xyz'"):
        resolve_reward("no_such_mod_xyz:f")
    with pytest.raises(RewardError, match="has no attribute 'missing'"):
        resolve_reward(f"{user_module}:missing")
    assert resolve_reward(f"{user_module}:length_reward")("abc", "") == 3.0


def test_a_moved_module_points_at_its_new_path():
    with pytest.raises(RewardError, match="moved; use 'workers.tasks.word:last_number_match'"):
        resolve_reward("workers.tasks_word:last_number_match")
    assert resolve_reward("workers.tasks.word:last_number_match")("it is 12", "12") == 1.0


def test_register_reward_decorator(monkeypatch):
    from workers.tasks import verifiers

    # the registry is the process's: this test's name goes with it (the built-ins' range check
    # in tests/streamflow/test_rundir.py reads the same registry)
    monkeypatch.setattr(verifiers, "_REGISTRY", dict(verifiers._REGISTRY))

    @register_reward("test_always_half")
    def half(completion: str, answer: str) -> float:
        return 0.5

    assert resolve_reward("test_always_half") is half
    with pytest.raises(RewardError, match="already registered"):
        register_reward("test_always_half")(lambda c, a: 0.0)


def test_builtin_runs_in_process():
    runner = RewardRunner("exact_match", timeout_s=1.0)
    assert not runner.isolated
    res = runner.score(["46", "4 6"], ["46", "46"])
    assert [(r.score, r.ok) for r in res] == [(1.0, True), (0.0, True)]
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        runner.score(["a", "b"], ["a"])


def test_isolated_user_function_survives_hang_crash_and_bad_values(user_module):
    with RewardRunner(f"{user_module}:picky", timeout_s=1.0) as runner:
        assert runner.isolated
        completions = ["7", "boom", "hang", "7", "text", "die", "8"]
        res = runner.score(completions, ["7"] * len(completions))
        assert [r.score for r in res] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
        assert [r.ok for r in res] == [True, False, False, True, False, False, True]
        assert "RuntimeError: user bug" in res[1].error
        assert res[2].error.startswith("timeout after 1s")
        assert "expected a float" in res[4].error
        assert "died" in res[5].error
        assert runner.restarts == 2
        # Still usable afterwards.
        assert runner.score(["7"], ["7"])[0].score == 1.0


def test_isolation_needs_an_import_path():
    def local_fn(completion: str, answer: str) -> float:
        return 1.0

    with pytest.raises(RewardError, match="no import path"):
        RewardRunner(local_fn, timeout_s=1.0)
    assert RewardRunner(local_fn, timeout_s=1.0, isolate=False).score(["x"], ["y"])[0].score == 1.0


def test_child_load_error_is_reported(user_module):
    runner = RewardRunner(f"{user_module}:length_reward", timeout_s=1.0)
    runner.import_path = f"{user_module}:gone"  # simulate a module changed under our feet
    with pytest.raises(RewardError, match="failed to load in the child"):
        runner.score(["x"], ["y"])


def test_brevity_prefers_short_completions() -> None:
    from workers.tasks.verifiers import resolve_reward

    fn = resolve_reward("brevity")
    assert fn("", "ignored") == 1.0
    assert fn("12", "x") > fn("1234", "x") > 0.0


def test_the_form_of_a_reward_function_is_read_from_its_signature(user_module):
    def two(completion, answer):  # noqa: ANN001, ANN202
        return 0.0

    def three(completion, answer, trajectory=None):  # noqa: ANN001, ANN202
        return 0.0

    def one(completion):  # noqa: ANN001, ANN202
        return 0.0

    assert not takes_trajectory(two) and not takes_trajectory(exact_match)
    assert takes_trajectory(three) and takes_trajectory(resolve_reward(f"{user_module}:tool_thrift"))
    assert takes_trajectory(lambda *args: 0.0)
    with pytest.raises(RewardError, match=r"must take \(completion, answer\) or \(completion, "
                                          r"answer, trajectory\), not \(completion\)"):
        takes_trajectory(one)
    with pytest.raises(RewardError, match="must take"):
        RewardRunner(one, timeout_s=1.0, isolate=False)


def test_a_trajectory_reward_gets_the_trajectory_and_a_classic_one_does_not(user_module):
    traj = Trajectory(("(=7*8=)", "56"), ("56",), (None,), 1, None, "stop")
    seen = []

    def classic(completion, answer):  # noqa: ANN001, ANN202
        seen.append((completion, answer))
        return 1.0

    runner = RewardRunner(classic, timeout_s=1.0, isolate=False)
    assert runner.score(["(=7*8=)56 56"], ["56"], [traj])[0].score == 1.0
    assert seen == [("(=7*8=)56 56", "56")]
    # in the child: the record crosses the pipe; a single-turn sample is a trajectory of one turn
    with RewardRunner(f"{user_module}:tool_thrift", timeout_s=5.0) as aware:
        assert aware.isolated and aware.takes_trajectory
        res = aware.score(["(=7*8=)56 56", "56"], ["56", "56"], [traj, traj])
        assert [r.score for r in res] == [0.75, 0.75] and all(r.ok for r in res)
        assert aware.score(["56"], ["56"])[0].score == 1.0
