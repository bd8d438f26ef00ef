"""Long-tailed lengths and cut generations of the ``simulated`` rollout engine
(workers/engines/sim_cost.py ``drawn_lengths`` / ``CostModel.step_times``, and
``SimulatedRolloutEngine.generate_until`` in workers/engines/simulated.py). A fake clock moves only
when the engine sleeps or waits, so every cut lands at an exact simulated time."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from workers.config import SimulatedDevice
from workers.engines.base import FINISH_CUT, Interruptible, SamplingParams
from workers.engines.sim_cost import Workload, drawn_lengths, group_lengths, preset
from workers.engines.simulated import SimulatedRolloutEngine

COST = preset("7b-1acc")
SPEC = SimulatedDevice(cost="7b-1acc", time_scale=1.0, median_response_tokens=40, skew=0.5,
                       tail_fraction=0.25, tail_factor=10.0)


def test_tail_fraction_zero_draws_the_plain_lognormal_and_tails_replace_some_draws():
    """Breaks if tails shift the body's random stream (every documented figure of bench simulate
    depends on ``tail_fraction == 0`` drawing what it drew before), or if sample j's length depends
    on n (a resumed row redraws its own with n = j + 1)."""
    for seed in range(20):
        plain = np.clip(np.rint(np.random.default_rng(seed).lognormal(np.log(400), 0.25, 8)),
                        1, 8192).astype(int).tolist()
        assert drawn_lengths(seed, 8, 400, 0.25, 8192) == plain
        tailed = drawn_lengths(seed, 8, 400, 0.25, 8192, 0.2, 12.0)
        for j in range(8):
            assert tailed[j] == plain[j] or 12 * 400 * 0.6 < tailed[j] < 12 * 400 * 1.6
            assert drawn_lengths(seed, j + 1, 400, 0.25, 8192, 0.2, 12.0)[j] == tailed[j]
    many = drawn_lengths(1, 20_000, 400, 0.25, 3000, 0.05, 12.0)
    tails = sum(n >= 10 * 400 for n in drawn_lengths(1, 20_000, 400, 0.25, 10**6, 0.05, 12.0))
    assert tails / 20_000 == pytest.approx(0.05, rel=0.15) and max(many) == 3000  # capped
    w = Workload(median_response_tokens=400, skew=0.25, tail_fraction=0.05, tail_factor=12.0)
    assert group_lengths(w.replace(tail_fraction=0.0), 3) == group_lengths(Workload(
        median_response_tokens=400, skew=0.25), 3)
    assert any(n >= 4000 for g in range(200) for n in group_lengths(w, g))


def test_step_times_end_at_generate_s_and_charge_each_step_its_live_rows():
    lengths = [3, 5, 5, 1]
    t = COST.step_times(7, lengths)
    assert len(t) == 5 and t[-1] == pytest.approx(COST.generate_s(7, lengths))
    live = [4, 3, 3, 2, 2]
    expect = COST.prefill_s_per_token * 7 * 4 + np.cumsum(
        [COST.decode_base_s + COST.decode_per_seq_s * n for n in live])
    assert t == pytest.approx(expect.tolist())


class _Clock:
    """Real time for the engine: moves only when it sleeps or waits on ``cut``."""

    def __init__(self) -> None:
        self.now = 10.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


class _CutAt:
    """A ``threading.Event`` stand-in that becomes set at clock time ``at``."""

    def __init__(self, clock: _Clock, at: float) -> None:
        self.clock, self.at = clock, at

    def is_set(self) -> bool:
        return self.clock.now >= self.at

    def wait(self, timeout: float) -> bool:
        if self.clock.now + timeout >= self.at:
            self.clock.now = max(self.clock.now, self.at)
            return True
        self.clock.now += timeout
        return False


def test_a_cut_ends_the_step_in_progress_and_a_resume_reaches_the_uncut_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Breaks if the cut does not honour the cost model's step times, if ``busy_s`` counts more
    than was held, if a finished row is not reported, or if a resumed row's total length differs
    from the uncut draw (partial and plain runs would then face different workloads)."""
    clock = _Clock()
    monkeypatch.setattr("workers.engines.simulated.time", clock)
    prompts, n, cap = [[1, 2, 3], [4, 5, 6, 7]], 4, 1000
    params = SamplingParams(max_new_tokens=cap, prompt_seeds=(100, 200))
    engine = SimulatedRolloutEngine(SPEC, vocab_size=50, eos_ids=(7,))
    assert isinstance(engine, Interruptible)
    uncut = engine.lengths(2, n, params)
    assert max(uncut) >= 8 * 40 > 4 * sorted(uncut)[3]  # a tail beside short rows
    times = COST.step_times(4, uncut)  # the mean prompt (3.5 tokens) rounded up
    at = (times[sorted(uncut)[2] - 1] + times[sorted(uncut)[2]]) / 2  # mid-step, after 3 rows end
    done: list[int] = []
    out = engine.generate_until(prompts, n, params, _CutAt(clock, clock.now + at),
                                on_done=lambda i, g: done.append(i))
    steps = sorted(uncut)[2] + 1  # the step in progress at the cut ends first
    assert engine.device.busy_s == pytest.approx(times[steps - 1])
    assert clock.now - 10.0 == pytest.approx(times[steps - 1])  # held as long as it counts
    flat = [g for row in out for g in row]
    assert sorted(done) == [i for i, n_ in enumerate(uncut) if n_ <= steps]
    for i, g in enumerate(flat):
        if uncut[i] <= steps:
            assert len(g.token_ids) == uncut[i] and g.finish_reason != FINISH_CUT
        else:
            assert len(g.token_ids) == steps and g.finish_reason == FINISH_CUT
            assert len(g.logprobs) == steps
    # Resume every cut row with its own seed (base + j), its tokens appended to the prompt: each
    # one, never cut again, ends at its uncut length.
    cut_rows = [i for i, g in enumerate(flat) if g.finish_reason == FINISH_CUT]
    resumed = engine.generate_until(
        [prompts[i // n] + flat[i].token_ids for i in cut_rows], 1, SamplingParams(
            max_new_tokens=cap - steps, prompt_seeds=tuple(
                params.prompt_seeds[i // n] + i % n for i in cut_rows),
            done_tokens=(steps,) * len(cut_rows)), _CutAt(clock, float("inf")))
    assert [steps + len(r[0].token_ids) for r in resumed] == [uncut[i] for i in cut_rows]
    # A cut set before the call still gives every row one token (the first step's end).
    before = engine.device.busy_s
    first = engine.generate_until(prompts, n, params, _CutAt(clock, 0.0))
    assert {len(g.token_ids) for row in first for g in row} == {1}
    assert engine.device.busy_s - before == pytest.approx(times[0])


def test_never_cut_it_equals_generate_and_holds_generate_s():
    """Breaks if the interruptible path draws other responses than ``generate``."""
    spec = SimulatedDevice(cost="7b-1acc", time_scale=1e9, median_response_tokens=40, skew=1.0)
    params = SamplingParams(max_new_tokens=200, seed=5)
    a, b = SimulatedRolloutEngine(spec, 50, (7,)), SimulatedRolloutEngine(spec, 50, (7,))
    plain = a.generate([[1, 2], [3, 4]], 3, params)
    until = b.generate_until([[1, 2], [3, 4]], 3, params, threading.Event())
    assert until == plain and a.device.busy_s == pytest.approx(b.device.busy_s)
