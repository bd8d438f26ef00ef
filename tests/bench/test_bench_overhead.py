"""`streamflow bench overhead`'s parts: the category profiler's attribution, the ratios'
direction, the flags. (The whole bench runs end to end, breakdown only, in test_bench_gpu.py.)"""

from __future__ import annotations

import pytest

from bench import overhead


def _functions_in(filename: str, source: str) -> dict:
    """Functions whose code claims to live in ``filename`` (what the profiler classifies by)."""
    scope: dict = {}
    exec(compile(source, filename, "exec"), scope)
    return scope


def test_classify_by_module_and_builtin_name():
    assert overhead.classify("/x/storage/client.py:claim") == "store_round_trips"
    assert overhead.classify("/x/storage/wire.py:read_batch") == "serialisation"
    assert overhead.classify("/x/torch/optim/adamw.py:step") == "optimizer"
    assert overhead.classify("/x/workers/weights/file_sync.py:publish") == "weight_publication"
    assert overhead.classify("None.Tensor.to") == "host_device_copies"
    assert overhead.classify("torch._VariableFunctionsClass.from_numpy") == "tensor_conversion"
    assert overhead.classify("/x/workers/roles/trainer.py:step") is None


def test_profiler_attributes_each_interval_once_to_the_innermost_category_allowed():
    """A clock that ticks once per reading makes every interval between two events one unit:
    each category then counts the events inside it, independent of the machine's load. Breaks
    if a store verb's (de)serialisation stays in the round trips, or if a wait inside a verb
    leaves the verb (it is the round trip's)."""
    import itertools
    import select

    ticks = itertools.count()
    wire = _functions_in("/x/storage/wire.py", "def decode():\n    return len('ab')\n")
    client = _functions_in("/x/storage/client.py", "def verb(decode, wait):\n"
                           "    wait([], [], [], 0)\n    return decode()\n")
    model = _functions_in("/x/torch/nn/modules/module.py", "def forward():\n"
                          "    return len('ab')\n")
    with overhead.CategoryProfiler(clock=lambda: float(next(ticks))) as prof:
        client["verb"](wire["decode"], select.select)
        model["forward"]()
    got = {k: v for k, v in prof.seconds.items() if v > 0}
    assert set(got) >= {"store_round_trips", "serialisation", "model_compute"}
    assert "waits" not in got  # select() inside the verb is the verb's round trip
    with overhead.CategoryProfiler(clock=lambda: float(next(ticks))) as alone:
        select.select([], [], [], 0)  # the same wait outside any verb
    assert alone.seconds.get("waits", 0) > 0


def test_summary_ratios_are_plain_over_mode():
    report = overhead.summarize({"sync": 4.0, "periodic": 2.0, "async": 8.0}, plain_s=3.0)
    assert report["modes"]["sync"]["ratio_to_plain"] == 0.75
    assert report["sync_ratio_to_plain"] == 0.75
    assert report["best_ratio_to_plain"] == 1.5  # periodic, 2.0 s against 3.0 s


def test_bad_flags_fail_with_one_line(capsys):
    with pytest.raises(SystemExit):
        overhead.main(["--modes", "periodic"])
    assert "--modes must include sync" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        overhead.main(["--rounds", "0"])
    assert "--rounds must be >= 1" in capsys.readouterr().err


def test_report_has_every_part_and_the_table_prints_it(monkeypatch, tmp_path):
    """The JSON's shape from ``measure_model`` with its measurements stubbed (the real ones run
    in test_bench_gpu.py): breaks when a part is dropped or overwritten (the interleaved figures
    were once lost to the modes' summary) or the table no longer reads one."""
    from bench import phases

    pair = {"streamflow_s": 1.0, "baseline_s": 2.0, "ratio": 2.0}
    monkeypatch.setattr(overhead, "measure_phases", lambda *a, **k: (
        {n: pair for n in phases.PHASES}, 4.0, {"streamflow_sync_iteration_s": 2.0}))
    monkeypatch.setattr(overhead, "run_plain", lambda *a, **k: 3.0)
    monkeypatch.setattr(overhead, "run_mode", lambda *a, mode, **k: {
        "sync": 4.0, "periodic": 2.0, "async": 3.0}[mode])
    monkeypatch.setattr(overhead, "breakdown", lambda *a, **k: {
        "instrumented": {"iteration_s": 1.0}, "profiled_iteration_s": 1.0, "attributed_s": 1.0,
        "categories": {"other": {"seconds": 1.0, "fraction": 1.0}}, "other_top": []})
    report = overhead.measure_model(_g1_quick(), tmp_path, tmp_path, iterations=1, threads=1,
                                    device="cpu", rounds=2)
    assert {"modes", "plain_seconds_per_iteration", "sync_ratio_to_plain", "best_ratio_to_plain",
            "interleaved", "breakdown", "rounds"} <= set(report)
    assert report["interleaved"]["sync_ratio_to_plain"] == 2.0  # plain 4.0 s / sync 2.0 s
    assert report["rounds"] == [{"plain": 3.0, "sync": 4.0, "periodic": 2.0, "async": 3.0}] * 2
    text = overhead.table(report, "header")
    assert "interleaved in one process" in text and "target sync >= 0.9x" in text


def _g1_quick():
    from bench import _g1

    return _g1.QUICK
