"""Dynamic sampling's controller side (streamflow.provision): how many prompts each put holds, when
a short iteration is topped up, the all-solved stop, and the bad input of its keys."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from streamflow.cli import main as cli_main
from streamflow.config import load_config
from streamflow.provision import RATE_WEIGHT, PromptsSolved, Provisioner
from workers.runtime.events import SamplingReport, StepReport

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


class _Plan:
    """The two things a Provisioner reads of a plan: its config and prompt_rows (recorded)."""

    def __init__(self, *overrides: str) -> None:
        self.cfg = load_config(TINY, ["data.prompts_per_iteration=4", *overrides])
        self.start_iteration = 0
        self.puts: list[tuple] = []

    def prompt_rows(self, iteration: int, staleness: int, first: int | None = None,
                    count: int | None = None) -> tuple:
        self.puts.append((iteration, first, count))
        return (iteration, first, count)


def _step(iteration: int, rate: float) -> StepReport:
    return StepReport(iteration, iteration + 1, 8, 1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0, 0,
                      1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0, 0.0, zero_variance_rate=rate)


def test_off_puts_each_iteration_block_once() -> None:
    plan = _Plan("trainer.dynamic_sampling=off")
    p = Provisioner(plan)
    assert p.first_put(0, 0) == (0, None, None)  # the iteration's own block, as before
    p.observe([SamplingReport(0, 0, 4, 0)])  # (a trainer never sends these with it off)
    assert p.top_ups(0) == []
    assert p.step_fields(0) == {"oversample_factor": 1.0, "prompts_put": 4}


def test_on_tops_up_short_iterations_and_adapts_the_factor() -> None:
    """P = 4. Iteration 0 puts 4 (no evidence yet); 2 have variance, 2 not: once all 4 are back,
    a top-up of ceil(2 / (1 - 0.5)) = 4, with fresh group ids (the cursor). Nothing while a
    batch is still out or once the trainer has enough. The step's rate moves the estimate, so
    iteration 1 puts ceil(4 x factor). Broken by topping up early, by sizing without the rate,
    by reusing prompts, or by a factor that ignores the cap."""
    plan = _Plan("trainer.dynamic_sampling=on", "trainer.oversample_cap=3")
    p = Provisioner(plan)
    assert p.first_put(0, 0) == (0, 0, 4)
    p.observe([SamplingReport(0, 2, 1, 0)])
    assert p.top_ups(0) == []  # one group still out
    p.observe([SamplingReport(0, 2, 2, 0)])
    assert p.top_ups(0) == [(0, 4, 4)]
    assert p.top_ups(0) == []  # the top-up is out now
    p.observe([SamplingReport(0, 4, 3, 1)])  # enough: the trainer steps
    assert p.top_ups(0) == []
    assert p.step_fields(0) == {"oversample_factor": 1.0, "prompts_put": 8}
    p.observe([_step(0, 0.5), _step(0, 0.5)])  # (the same report twice counts once)
    assert p.rate == pytest.approx(RATE_WEIGHT * 0.5)
    assert p.first_put(1, 0) == (1, 8, math.ceil(4 / (1 - RATE_WEIGHT * 0.5)))
    p.rate = 0.99
    assert p.factor == 3  # the cap, never 1 / (1 - rate) near rate 1
    p.rate = 1.0
    assert p.factor == 3


def test_dead_groups_count_as_back_and_lower_the_need() -> None:
    plan = _Plan("trainer.dynamic_sampling=on")
    p = Provisioner(plan)
    p.first_put(0, 0)
    p.observe([SamplingReport(0, 2, 1, 0)])
    assert p.top_ups(0) == []  # 3 of 4 back
    p.observe_dead({0: {1}})
    assert p.top_ups(0) == [(0, 4, 2)]  # all back, 4 - 1 dead - 2 = 1 short: x 1 / (1 - 1/3)
    p.observe([SamplingReport(0, 3, 1, 0)])
    p.observe_dead({0: {1, 5}})  # one of the top-up has variance, one died: it steps on 3
    assert p.top_ups(0) == []


def test_all_solved_stops_after_patience_prompts_without_variance() -> None:
    """Patience 2 = 8 prompts (P = 4) in a row without variance. The first put's 4 are not
    enough; a top-up with one group with variance resets the count; the next 16 are. Broken by
    counting puts instead of prompts (a small put without variance is common at a high rate),
    by never resetting, or by stopping at the first empty put."""
    plan = _Plan("trainer.dynamic_sampling=on", "trainer.solved_patience=2")
    p = Provisioner(plan)
    p.first_put(0, 0)
    p.observe([SamplingReport(0, 0, 4, 0)])
    assert p.top_ups(0) == [(0, 4, 16)]  # 4 < 8; rate 1: the cap (4 x 4)
    p.observe([SamplingReport(0, 1, 19, 0)])
    assert p.top_ups(0) == [(0, 20, 16)]  # it had variance: reset; 3 short at 19/20: the cap
    p.observe([SamplingReport(0, 1, 35, 0)])
    with pytest.raises(PromptsSolved, match=r"last 16 prompts put \(in 1 put, through "
                       r"iteration 0\).*trainer.solved_patience") as err:
        p.top_ups(0)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("overrides", "key"), [
    (["trainer.dynamic_sampling=on", "data.group_size=1"], "data.group_size"),
    (["trainer.loss=dapo", "store.capacity_rows=16"], "trainer.oversample_cap")])
def test_dry_run_refuses_dynamic_sampling_without_a_group_or_room(capsys, overrides,
                                                                  key) -> None:
    """Bad input at --dry-run: one line naming the key, exit 2 (group_size 1 has no variance;
    a put over the store's capacity would be refused mid-run). The second passes without
    dynamic sampling (loss dapo turns it on)."""
    assert cli_main(["run", str(TINY), *overrides, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key}:") and err.count("\n") == 1, err
    assert cli_main(["run", str(TINY), "store.capacity_rows=16", "--dry-run"]) == 0


def test_a_resumed_run_goes_on_from_its_records() -> None:
    """Resumed at iteration 2 from records of 0 and 1: the cursor past the 7 + 5 prompts they
    put, the rate as their steps moved it; without whole records (or with dynamic sampling off)
    iteration 2's own block and no evidence. Broken by reusing group ids or forgetting the rate."""
    on = _Plan("trainer.dynamic_sampling=on").cfg
    records = [SimpleNamespace(iteration=0, zero_variance_rate=0.5, prompts_put=7),
               SimpleNamespace(iteration=1, zero_variance_rate=0.0, prompts_put=5)]
    p = Provisioner(SimpleNamespace(cfg=on, start_iteration=2), records)
    assert p.cursor == 12 and p.rate == pytest.approx(RATE_WEIGHT * 0.5 * (1 - RATE_WEIGHT))
    for cfg, kept in ((on, records[1:]), (_Plan().cfg, records)):
        p = Provisioner(SimpleNamespace(cfg=cfg, start_iteration=2), kept)
        assert (p.cursor, p.rate) == (2 * 4, 0.0)
