"""`streamflow bench phases --quick`: both sides and three real runs end to end, one JSON line.

Also the pieces the figures rest on: the G1 workload's tokenizer and model directory (exact
vocabulary, no eos, loadable by the run path), the steady-state rule and the ratios' direction.
"""

from __future__ import annotations

import json
import math

import pytest

from bench import _g1
from bench import phases as bench


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.slow  # three `streamflow run` jobs: minutes on a loaded 2-core machine
@pytest.mark.timeout(1200)
def test_quick_run_prints_one_json_line_with_consistent_figures(capsys):
    # One thread: tiny shapes are all synchronisation, which a second thread only slows.
    assert bench.main(["--quick", "--json", "--iterations", "1", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    # --json: the table on stderr, the JSON object as stdout's last line (a library that logs to
    # stdout from an earlier test of the session may add a line above it)
    assert "target every phase" in captured.err and "target every phase" not in captured.out
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert set(report) == {"phases", "modes", "plain_seconds_per_iteration", "worst_phase_ratio",
                           "best_ratio_to_plain", "best_streaming_ratio_to_sync",
                           "plain_in_process_seconds_per_iteration", "fixed_threads"}
    assert report["fixed_threads"] is None  # one thread: nothing to share
    # the plain loop alone in its own process, the one the modes are compared with
    assert "plain loop (own process):" in captured.err
    assert _positive(report["plain_in_process_seconds_per_iteration"])
    assert set(report["phases"]) == set(bench.PHASES)
    for phase in report["phases"].values():
        assert set(phase) == {"streamflow_s", "baseline_s", "ratio"}
        assert all(_positive(v) for v in phase.values()), phase
        assert phase["ratio"] == pytest.approx(phase["baseline_s"] / phase["streamflow_s"],
                                               abs=1e-4)
    plain = report["plain_seconds_per_iteration"]
    assert _positive(plain)
    assert set(report["modes"]) == set(bench.MODES)
    for mode in report["modes"].values():
        assert set(mode) == {"seconds_per_iteration", "ratio_to_plain"}
        assert all(_positive(v) for v in mode.values()), mode
        assert mode["ratio_to_plain"] == pytest.approx(plain / mode["seconds_per_iteration"],
                                                       abs=1e-4)
    assert report["worst_phase_ratio"] == min(p["ratio"] for p in report["phases"].values())
    assert report["best_ratio_to_plain"] == max(
        m["ratio_to_plain"] for m in report["modes"].values())
    spi = {name: m["seconds_per_iteration"] for name, m in report["modes"].items()}
    assert report["best_streaming_ratio_to_sync"] == pytest.approx(
        spi["sync"] / min(spi["periodic"], spi["async"]), abs=1e-4)


def test_g1_model_directory_loads_with_exact_vocabulary_and_no_eos(tmp_path):
    import torch

    from workers.models.local import load_model, load_tokenizer
    from workers.models.tokenizer import encode_prompt

    path = _g1.build_model_dir(tmp_path / "g1", _g1.QUICK)
    tok = load_tokenizer(path)  # as the run path loads it (transformers picks Qwen2Tokenizer)
    assert len(tok) == _g1.QUICK.vocab
    assert tok.eos_token_id is None and tok.pad_token_id is not None
    ids = encode_prompt(tok, "12+34=")
    assert tok.decode(ids) == "12+34="
    model = load_model(path, dtype=torch.float32, attn_implementation="eager")
    assert model.config.vocab_size == _g1.QUICK.vocab and model.config.tie_word_embeddings
    assert model.generation_config.eos_token_id is None
    assert max(ids) < model.config.vocab_size


def test_full_g1_has_the_specified_shape():
    assert (_g1.G1.hidden, _g1.G1.layers, _g1.G1.heads, _g1.G1.kv_heads) == (256, 4, 4, 2)
    assert (_g1.G1.intermediate, _g1.G1.vocab) == (1024, 1024)
    assert (_g1.G1.prompts, _g1.G1.group_size, _g1.G1.new_tokens) == (16, 8, 64)
    assert _g1.KL_COEF == 0.04


def test_run_config_gives_each_mode_its_layout_and_is_a_valid_config(tmp_path):
    from streamflow.config import config_from_dict

    for mode in ("sync", "periodic", "async"):
        cfg = config_from_dict(_g1.run_config(_g1.G1, tmp_path, tmp_path, mode=mode, iterations=3,
                                              threads=2, device="cpu"))
        assert cfg.trainer.kl_coef == 0.04 and cfg.rollout.max_new_tokens == 64
        assert cfg.data.prompts_per_iteration * cfg.data.group_size == 128
        if mode == "sync":  # one process with every thread, the whole iteration per claim
            assert cfg.reference.placement == "worker"  # its forward is a phase of its own
            assert cfg.run.host_threads == 0 and cfg.rollout.threads == cfg.trainer.threads == 2
            assert cfg.rollout.groups_per_claim == 16
            assert cfg.trainer.rows_per_claim == cfg.reference.rows_per_claim == 128
        else:  # the budget shared by phase, the rollout capped at half
            assert cfg.run.host_threads == 2 and cfg.rollout.threads == 1
            # two processes share the cores, not three: the reference rides in one of them
            assert cfg.reference.placement == {"periodic": "trainer", "async": "rollout"}[mode]
            # periodic: half an iteration a claim, so training starts while the rest generates;
            # async runs an iteration ahead: a whole one a claim (one larger decode batch)
            assert cfg.rollout.groups_per_claim == {"periodic": 8, "async": 16}[mode]
            assert cfg.trainer.rows_per_claim == 32
            fixed = config_from_dict(_g1.run_config(
                _g1.G1, tmp_path, tmp_path, mode=mode, iterations=3, threads=2, device="cpu",
                shared_threads=False))  # what bench phases compares the shared default with
            assert fixed.run.host_threads == 0
            assert fixed.rollout.threads == fixed.trainer.threads == 1


def test_summary_ratios_are_plain_over_streamflow():
    phases = {"generation": bench._pair(2.0, 1.0), "reference": bench._pair(0.5, 1.0),
              "train_step": bench._pair(1.0, 1.0)}
    assert [p["ratio"] for p in phases.values()] == [0.5, 2.0, 1.0]
    report = bench.summarize(phases, {"sync": 4.0, "periodic": 2.0, "async": 5.0}, plain_s=3.0)
    assert report["worst_phase_ratio"] == 0.5
    assert report["modes"]["periodic"]["ratio_to_plain"] == 1.5
    assert report["best_ratio_to_plain"] == 1.5
    assert report["best_streaming_ratio_to_sync"] == 2.0  # sync 4.0 s / periodic 2.0 s


def test_rounds_combine_into_medians_with_each_round_listed():
    def one(gen_sf, sync_s, plain_s):
        phases = {"generation": bench._pair(gen_sf, 1.0), "reference": bench._pair(1.0, 1.0),
                  "train_step": bench._pair(1.0, 1.0)}
        modes = {"sync": sync_s, "periodic": 4.0, "async": 2.0}
        return phases, modes, plain_s, {"streamflow_reward_s": gen_sf}

    report, extras = bench.combine([one(2.0, 4.0, 3.0), one(0.5, 3.0, 6.0), one(1.0, 5.0, 4.0)])
    assert report["phases"]["generation"] == bench._pair(1.0, 1.0)  # medians, ratio recomputed
    assert report["modes"]["sync"]["seconds_per_iteration"] == 4.0
    assert report["plain_seconds_per_iteration"] == 4.0
    assert report["best_ratio_to_plain"] == 2.0  # async 2.0 s against the median plain 4.0 s
    assert extras == {"streamflow_reward_s": 1.0}
    assert [r["worst_phase_ratio"] for r in report["rounds"]] == [0.5, 1.0, 1.0]
    assert [r["best_streaming_ratio_to_sync"] for r in report["rounds"]] == [2.0, 1.5, 2.5]
    single, _ = bench.combine([one(2.0, 4.0, 3.0)])
    assert "rounds" not in single


def test_bad_flags_fail_fast_with_one_line(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--threads", "0"])
    assert "--iterations, --threads and --rounds must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    assert "--rounds must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--device", "tpu"])
    assert "--device must be cpu or cuda" in capsys.readouterr().err


def test_device_is_placed_on_every_role_or_refused(capsys, tmp_path):
    from streamflow.config import RolloutSection

    if "device" in RolloutSection.__dataclass_fields__:  # a build with per-role devices
        tree = _g1.run_config(_g1.QUICK, tmp_path, tmp_path, mode="periodic", iterations=2,
                              threads=2, device="cuda")
        assert [tree[s]["device"] for s in ("rollout", "reference", "trainer")] == ["cuda"] * 3
        return
    with pytest.raises(SystemExit):  # all on the CPU: a cuda baseline would be a false compare
        bench.main(["--quick", "--device", "cuda"])
    assert "no per-role device" in capsys.readouterr().err


def test_the_plain_loop_runs_alone_beside_the_modes_first_then_last(monkeypatch, capsys):
    """Each round times the plain loop in its own process next to the three modes (before them
    in odd rounds, after them in even ones); the modes' ratios are to that figure, and the
    in-process one of the phase measurement is reported beside it."""
    calls: list[str] = []
    phases = {name: bench._pair(1.0, 1.0) for name in bench.PHASES}
    extras = {"streamflow_reward_s": 0.1, "baseline_reward_s": 0.1,
              "streamflow_weight_sync_s": 0.1, "streamflow_sync_iteration_s": 1.0}
    plain_by_round = iter([4.0, 6.0, 5.0])

    def fake_phases(*args, **kwargs):
        calls.append("phases")
        return phases, 9.0, dict(extras)

    def fake_mode(*args, mode, shared_threads=True, **kwargs):
        calls.append(mode if shared_threads else f"{mode}-fixed")
        return {"sync": 4.0, "periodic": 5.0, "async": 2.5}[mode] * (1 if shared_threads else 2)

    def fake_plain(*args, **kwargs):
        calls.append("plain")
        return next(plain_by_round)

    monkeypatch.setattr(bench, "build_model_dir", lambda path, shape: path)
    monkeypatch.setattr(bench, "measure_phases", fake_phases)
    monkeypatch.setattr(bench, "run_mode", fake_mode)
    monkeypatch.setattr(bench, "run_plain", fake_plain)
    assert bench.main(["--quick", "--json", "--iterations", "1", "--rounds", "3"]) == 0
    # two threads (the default): the streaming modes once more with fixed threads, each round
    fixed = ["periodic-fixed", "async-fixed"]
    round_ = ["phases", "plain", "sync", "periodic", "async", *fixed]
    flipped = ["phases", "sync", "periodic", "async", *fixed, "plain"]
    assert calls == round_ + flipped + round_
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["plain_seconds_per_iteration"] == 5.0  # the median of the lone runs
    assert report["plain_in_process_seconds_per_iteration"] == 9.0  # not the one compared with
    assert report["modes"]["async"]["ratio_to_plain"] == 2.0
    assert [r["plain_seconds_per_iteration"] for r in report["rounds"]] == [4.0, 6.0, 5.0]
    assert report["fixed_threads"] == {
        "periodic": {"seconds_per_iteration": 10.0, "shared_speedup": 2.0},
        "async": {"seconds_per_iteration": 5.0, "shared_speedup": 2.0}}


@pytest.mark.slow
def test_streamflow_side_times_the_controllers_own_colocated_loop(tmp_path, monkeypatch):
    """No second copy of the sync loop: each timed iteration is one ``ColocatedLoop.iteration``
    (the loop ``streamflow run`` runs in sync), and the phases are that iteration's stages."""
    from streamflow.config import config_from_dict
    from streamflow.controller import ColocatedLoop

    calls = []
    real = ColocatedLoop.iteration

    def counted(self, k, staleness=0):
        calls.append(k)
        return real(self, k, staleness)

    monkeypatch.setattr(ColocatedLoop, "iteration", counted)
    model = _g1.build_model_dir(tmp_path / "g1", _g1.QUICK)
    cfg = config_from_dict(_g1.run_config(_g1.QUICK, model, tmp_path / "runs", mode="sync",
                                          iterations=100, threads=1, device="cpu"))
    sf = bench.StreamFlowSync(cfg, tmp_path / "runs" / "phases")
    try:
        times = [sf.iteration(k) for k in range(2)]
    finally:
        sf.close()
    assert calls == [0, 1]
    for t in times:
        parts = (t.generation, t.reward, t.reference, t.train_step, t.weight_sync)
        assert all(p > 0 for p in parts), t
        assert sum(parts) <= t.total
