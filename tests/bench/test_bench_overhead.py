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
