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
    """Breaks if time is counted twice (categories summing past the profiled time), if a store
    verb's (de)serialisation stays in the round trips, or if the model's busy work is lost."""
    wire = _functions_in("/x/storage/wire.py", "def decode(n):\n    return sum(range(n))\n")
    client = _functions_in("/x/storage/client.py", "def verb(decode, n):\n"
                           "    sum(range(n))\n    return decode(n)\n")
    model = _functions_in("/x/torch/nn/modules/module.py", "def forward(n):\n"
                          "    return sum(range(n))\n")
    n = 300_000
    with overhead.CategoryProfiler() as prof:
        client["verb"](wire["decode"], n)
        model["forward"](2 * n)
    got = {k: v for k, v in prof.seconds.items() if v > 0}
    assert {"store_round_trips", "serialisation", "model_compute"} <= set(got)
    # forward did twice the work of either half of the verb: it outweighs each of them
    assert got["model_compute"] > got["serialisation"]
    assert got["model_compute"] > got["store_round_trips"]
    assert sum(prof.seconds.values()) > 0


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
