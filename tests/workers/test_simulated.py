"""The simulated engine's cost model (workers/engines/sim_cost.py): its formulas by hand, the
7b-1acc preset against its sources, the response lengths; and the admission rule it runs under."""

from __future__ import annotations

import pytest

from streamflow.admission import admissible, min_policy_version
from workers.engines.sim_cost import CostModel, Workload, group_lengths, iteration_lengths, preset


def test_cost_formulas_by_hand() -> None:
    c = CostModel(  # round numbers, so that every figure below is computed by hand
        name="toy",
        params=1.0,
        prefill_s_per_token=0.01,
        decode_base_s=1.0,
        decode_per_seq_s=0.1,
        reward_s_per_sample=3.0,
        ref_s_per_token=0.2,
        train_s_per_token=0.5,
        optimizer_s=4.0,
        allreduce_bandwidth=1.0,
        sync_bandwidth=1e30,
        sync_latency_s=2.0,
    )
    # prefill 0.01 * 10 * 2 + longest 5 * 1.0 + all tokens 8 * 0.1
    assert c.generate_s(10, [3, 5]) == pytest.approx(0.2 + 5.0 + 0.8)
    assert c.train_s(10, [3, 5]) == pytest.approx(0.5 * 28)
    assert c.reference_s(10, [3, 5]) == pytest.approx(0.2 * 28)
    assert c.reward_s(4) == pytest.approx(12.0)
    assert c.allreduce_s(1) == 0.0
    assert c.allreduce_s(4) == pytest.approx(2 * 3 / 4 * 2.0 / 1.0)  # 2 bytes per parameter
    assert c.step_s(4) == pytest.approx(3.0 + 4.0 / 4)
    assert c.sync_s() == pytest.approx(2.0)


def test_preset_7b_matches_its_sources() -> None:
    c = preset("7b-1acc")
    # A full batch of 256 sequences decodes at ~12.5 k tokens/s on one H100 (the cited figure).
    assert 256 / (c.decode_base_s + 256 * c.decode_per_seq_s) == pytest.approx(12_500, rel=1e-6)
    assert c.train_s_per_token == pytest.approx(6 * 7.6e9 / (0.4 * 989e12))
    assert c.sync_s() == pytest.approx(15.2e9 / 50e9 + 1.0)
    with pytest.raises(ValueError, match="unknown cost preset"):
        preset("70b")


def test_lengths_are_bounded_deterministic_and_skewed() -> None:
    w = Workload(median_response_tokens=600, max_response_tokens=4096)
    for skew in (0.5, 1.5, 3.0):
        ws = w.replace(skew=skew)
        lengths = iteration_lengths(ws, 0)
        assert len(lengths) == ws.rows_per_iteration
        assert all(1 <= n <= 4096 and isinstance(n, int) for n in lengths)
        assert lengths == iteration_lengths(ws, 0)  # a pure function of (seed, group, index)
    assert set(group_lengths(w.replace(skew=0.0), 5)) == {600}
    spread = {s: max(iteration_lengths(w.replace(skew=s), 0)) for s in (0.25, 1.5)}
    assert spread[1.5] > spread[0.25]  # a larger skew, a longer tail
    with pytest.raises(ValueError, match="rows_per_trainer_batch"):
        Workload(group_size=8, rows_per_trainer_batch=12)
    with pytest.raises(ValueError, match="skew"):
        Workload(skew=-1)


def test_admission_rule() -> None:
    # min_policy_version = k - s (never negative); k is admitted once version >= k - s.
    assert [min_policy_version(k, 0) for k in range(3)] == [0, 1, 2]
    assert [min_policy_version(k, 2) for k in range(4)] == [0, 0, 0, 1]
    assert admissible(3, 0, 3) and not admissible(3, 0, 2)  # periodic: version k exists
    assert admissible(3, 1, 2) and not admissible(3, 1, 1)  # async s=1: one version ahead
    assert admissible(0, 0, 0)
