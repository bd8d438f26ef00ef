"""End to end: `streamflow run` through real worker processes and a real store node, in each mode."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file
from testkit import no_children_left, wait_until

import storage
from streamflow.controller import run

ROOT = Path(__file__).resolve().parents[2]
SUMMARY_FIELDS = {
    "mode", "iterations", "samples", "generated_tokens", "wall_seconds", "samples_per_second",
    "tokens_per_second", "reward_mean_first", "reward_mean_last", "max_staleness_observed",
}


def _final_params(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


def _check_run_dir(run_dir: Path, iterations: int) -> dict:
    assert (run_dir / "config.yaml").is_file()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == list(range(iterations))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_FIELDS <= set(summary), SUMMARY_FIELDS - set(summary)
    assert summary["status"] == "ok" and summary["iterations"] == iterations
    for png in ("rewards.png", "timeline.png"):
        assert (run_dir / "plots" / png).stat().st_size > 1000
    assert (run_dir / "checkpoints" / f"step-{iterations:06d}" / "config.json").is_file()
    return summary


def _wait_for_iterations(proc: subprocess.Popen, metrics: Path, n: int, timeout: float) -> None:
    """Until the run ``proc`` recorded ``n`` iterations in ``metrics``; fails at once, with its
    stderr, if the run ended first."""

    def recorded() -> bool:
        assert proc.poll() is None, proc.stderr.read()
        return metrics.exists() and len(metrics.read_text().splitlines()) >= n

    wait_until(recorded, timeout=timeout, what=f"{n} iteration(s) in {metrics}")


@pytest.mark.slow
def test_periodic_equals_sync_through_processes(tiny_config, periodic_run) -> None:
    """Same seed and config: the streaming on-policy mode gives the sync mode's parameters (the
    periodic run, two rollout workers, is the session's: test_weight_sync_run.py's file run)."""
    common = ("run.iterations=2", "rollout.groups_per_claim=1", "run.eval_every=0")
    sync = tiny_config("run.mode=sync", "run.name=sync", *common, "run.plots=true")
    periodic, s2 = periodic_run.cfg, periodic_run.summary
    s1 = run(sync)
    no_children_left()
    for cfg, s in ((sync, s1), (periodic, s2)):
        summary = _check_run_dir(Path(cfg.run.output_dir), 2)
        assert summary["mode"] == s.mode
        assert summary["max_staleness_observed"] == 0
    a = _final_params(Path(sync.run.output_dir), 2)
    b = _final_params(Path(periodic.run.output_dir), 2)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-6, worst
    # async with max_staleness=0 reduces to on-policy: the same parameters again. With partial
    # rollout on, too: s = 0 never has an update in flight while rollout generates (k + 1 is
    # admitted once version k + 1 is out), so nothing is cut and every sample is what a run
    # without it generates (broken by a cut with no newer version, an uncut sample that differs
    # in seed, tokens, log-probs or version, or a trainer claim that partial changes).
    on_policy_async = tiny_config("run.mode=async", "run.max_staleness=0", *common,
                                  "rollout.partial=true",
                                  f"run.output_dir={Path(sync.run.output_dir).parent / 'async0'}")
    s3 = run(on_policy_async)
    assert s3.max_staleness_observed == 0
    c = _final_params(Path(on_policy_async.run.output_dir), 2)
    assert max(float((a[k] - c[k]).abs().max()) for k in a) <= 1e-6
    records = [json.loads(x) for x in (Path(on_policy_async.run.output_dir) / "metrics.jsonl")
               .read_text().splitlines()]
    assert [r["partial_resumes"] for r in records] == [0, 0]
    assert [r["staleness_token_mean"] for r in records] == [0, 0]
    _assert_trained(sync, a)


def _assert_trained(cfg, params: dict) -> None:
    """Guards the equivalence tests against comparing parameters that never moved."""
    from streamflow.plan import resolve_model

    initial = load_file(str(resolve_model(cfg, Path(cfg.run.output_dir).parent / ".cache")
                            / "model.safetensors"))
    assert max(float((params[k] - initial[k]).abs().max()) for k in params) > 1e-4, "no update"


@pytest.mark.slow
def test_async_respects_staleness_bound(tiny_config) -> None:
    """Staleness stays within max_staleness AND reaches it: with rollout running ahead, some
    iteration trains samples generated max_staleness versions back (else the bound is untested)."""
    cfg = tiny_config("run.mode=async", "run.max_staleness=1", "run.iterations=5",
                      "run.eval_every=0", "run.plots=true")
    summary = run(cfg)
    no_children_left()
    on_disk = _check_run_dir(Path(cfg.run.output_dir), 5)
    assert on_disk["max_staleness_observed"] == summary.max_staleness_observed == 1
    lines = [json.loads(x) for x in (Path(cfg.run.output_dir) / "metrics.jsonl").read_text()
             .splitlines()]
    assert max(r["staleness_max"] for r in lines) == 1
    assert all(r["staleness_max"] <= 1 for r in lines)
    # Corrected by default in async (trainer.importance_correction auto = tis): a stale sample's
    # tokens are weighted by min(pi_old / behaviour, is_cap), never exactly 1 on every token.
    stale = [r for r in lines if r["staleness_max"] == 1]
    assert any(r["importance_weight_mean"] != 1.0 for r in stale), stale
    assert all(0.0 < r["importance_weight_mean"] <= 2.0 for r in lines)
    _assert_traced(Path(cfg.run.output_dir), iterations=5, rows_per_iteration=4 * 2)


def _assert_traced(run_dir: Path, iterations: int, rows_per_iteration: int) -> None:
    """RUN/trace of a finished run (run.trace defaults on): pyarrow's readers load the directory
    with TRACE_SCHEMA; every trained row was put, claimed and written by the rollout and the
    reward, claimed and consumed (into the version after its iteration's step) by the trainer;
    `streamflow trace` tells a row's, a group's and the slowest rows' stories. What breaks it: a
    hook that sends nothing, a record the controller drops or writes late, a schema drift."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from streamflow.cli import main as cli
    from streamflow.tracefile import TRACE_SCHEMA

    trace = run_dir / "trace"
    assert ds.dataset(trace).schema == TRACE_SCHEMA
    table = pq.read_table(trace)  # = pandas.read_parquet(trace) without the pandas frame
    assert table.schema == TRACE_SCHEMA
    events: dict[int, set[tuple[str, str]]] = {}
    consumed: dict[int, tuple[int, int]] = {}
    for e in table.to_pylist():
        events.setdefault(e["row_id"], set()).add((e["task"], e["event"]))
        if e["event"] == "consume":
            consumed[e["row_id"]] = (e["iteration"], e["policy_version"])
    assert len(consumed) == iterations * rows_per_iteration
    needed = {("put", "put"), ("rollout", "claim"), ("rollout", "write"), ("reward", "claim"),
              ("reward", "write"), ("trainer", "claim"), ("trainer", "consume")}
    for row, (iteration, version) in consumed.items():
        assert needed <= events[row], (row, needed - events[row])
        assert version == iteration + 1, (row, iteration, version)
    row = next(iter(consumed))
    group = next(e["group_id"] for e in table.to_pylist() if e["row_id"] == row)
    for args, shown in ((["--row", str(row)], f"row {row}: iteration"),
                        (["--group", str(group)], f"group {group}, put->consumed"),
                        (["--slowest", "3"], "rows by put -> consumed")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli(["trace", str(run_dir), *args]) == 0
        assert shown in out.getvalue(), out.getvalue()


def test_updates_per_batch_reach_the_trainer_and_the_run_records(tiny_config) -> None:
    """trainer.updates_per_batch=2 from the run config: every iteration's record shows each pass
    apart, the second one with its ratio off 1 and some tokens clipped; with the default 1 the
    record has no passes and the ratio is exactly 1."""
    common = ("run.mode=sync", "run.iterations=2", "run.eval_every=0", "trainer.lr=0.01")
    two = tiny_config(*common, "trainer.updates_per_batch=2")
    run(two)
    for line in (Path(two.run.output_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        first, second = rec["passes"]
        assert first["ratio_min"] == first["ratio_max"] == rec["ratio_max"] == 1.0, rec
        assert second["ratio_min"] < 1.0 < second["ratio_max"], rec
        assert second["clip_fraction"] > 0.0, rec
    one = tiny_config(*common, f"run.output_dir={Path(two.run.output_dir).parent / 'one'}")
    run(one)
    for line in (Path(one.run.output_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert rec["ratio_min"] == rec["ratio_mean"] == rec["ratio_max"] == 1.0
        assert rec["clip_fraction"] == 0.0 and rec["passes"] == []


@pytest.mark.slow
def test_killed_worker_fails_the_run_fast(tiny_config, tmp_path: Path) -> None:
    """With no restart budget (run.max_restarts=0) a killed worker fails the run at once, with
    its name and log; restarts within a budget are tested in test_run_faults.py."""
    cfg = tiny_config()
    out = Path(cfg.run.output_dir).parent / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamflow", "run", str(ROOT / "configs" / "tiny.yaml"),
         "run.iterations=1000", f"run.output_dir={out}", "run.progress=false",
         "run.max_restarts=0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        def reward_worker() -> psutil.Process | None:
            assert proc.poll() is None, proc.stderr.read()
            if not (out / "metrics.jsonl").exists():
                return None
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if "reward" in child.cmdline():
                        return child
                except psutil.NoSuchProcess:
                    continue
            return None

        victim = wait_until(reward_worker, timeout=120, what="the reward worker, once running")
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert time.monotonic() - killed_at < 30
        assert "reward-0" in stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["status"] == "failed" and "reward-0" in summary["error"]
        assert "run.max_restarts=0" in summary["error"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_packing_on_equals_packing_off_in_a_full_run(tiny_config) -> None:
    """Shared-prompt packing changes the computation's layout, not the result (issue 5)."""
    common = ("run.mode=sync", "run.iterations=2", "run.eval_every=0", "trainer.kl_coef=0.05",
              "reference.placement=trainer", "data.group_size=4", "reward.fn=brevity",
              "trainer.lr=0.01")
    packed = tiny_config(*common, "trainer.packing=true")
    run(packed)
    unpacked = tiny_config(*common, "trainer.packing=false",
                           f"run.output_dir={Path(packed.run.output_dir).parent / 'unpacked'}")
    run(unpacked)
    a = _final_params(Path(packed.run.output_dir), 2)
    b = _final_params(Path(unpacked.run.output_dir), 2)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-5, worst
    _assert_trained(packed, a)


def test_the_reference_in_the_rollout_gives_the_reference_workers_parameters(tiny_config) -> None:
    """``reference.placement=rollout`` moves the reference forward, not the result: a periodic
    run whose rollout writes ref_logprobs ends with the parameters of a sync run with a reference
    worker (the KL term's gradient is nonzero from the second step on, when policy and reference
    differ), and its trainer holds no reference copy."""
    common = ("run.iterations=2", "run.eval_every=0", "trainer.kl_coef=0.5", "trainer.lr=0.01")
    worker = tiny_config("run.mode=sync", "reference.placement=worker", *common)
    run(worker)
    in_rollout = tiny_config("run.mode=periodic", "reference.placement=rollout", *common,
                             f"run.output_dir={Path(worker.run.output_dir).parent / 'rollout'}")
    summary = run(in_rollout)
    no_children_left()
    assert summary.status == "ok" and summary.iterations == 2
    out = Path(in_rollout.run.output_dir)
    trainer = json.loads((out / "workers" / "trainer-0.json").read_text())
    rollout = json.loads((out / "workers" / "rollout-0.json").read_text())
    assert trainer["reference_path"] is None and trainer["reference_in_store"] is True
    assert rollout["reference_path"] is not None
    assert not (out / "workers" / "reference-0.json").exists()
    a = _final_params(Path(worker.run.output_dir), 2)
    b = _final_params(out, 2)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    # ... and the KL term mattered: without it the parameters differ
    no_kl = tiny_config("run.mode=sync", *common[:-2], "trainer.kl_coef=0", "trainer.lr=0.01",
                        f"run.output_dir={Path(worker.run.output_dir).parent / 'nokl'}")
    run(no_kl)
    c = _final_params(Path(no_kl.run.output_dir), 2)
    assert max(float((a[k] - c[k]).abs().max()) for k in a) > 1e-5
    _assert_trained(worker, a)


@pytest.mark.slow
def test_deepspeed_two_ranks_match_the_torch_trainer(tiny_config) -> None:
    """The same run with the trainer on DeepSpeed (ZeRO-2, 2 gloo ranks via torch's launcher).
    The torch trainer's run is in-process ``sync``, which periodic equals with
    trainer.deterministic (test_periodic_equals_sync_through_processes)."""
    common = ("run.iterations=2", "run.eval_every=0", "reward.fn=brevity", "trainer.lr=0.01",
              "rollout.groups_per_claim=1")
    torch_run = tiny_config("run.mode=sync", *common)
    run(torch_run)
    ds_run = tiny_config("run.mode=periodic", *common, "trainer.engine=deepspeed",
                         "trainer.num_ranks=2",
                         f"run.output_dir={Path(torch_run.run.output_dir).parent / 'ds'}")
    summary = run(ds_run)
    no_children_left()
    assert summary.status == "ok" and summary.iterations == 2
    a = _final_params(Path(torch_run.run.output_dir), 2)
    b = _final_params(Path(ds_run.run.output_dir), 2)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-5, worst


@pytest.mark.slow
def test_sigterm_stops_cleanly_without_redeliveries(tiny_config) -> None:
    cfg = tiny_config()
    out = Path(cfg.run.output_dir).parent / "sigterm"
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamflow", "run", str(ROOT / "configs" / "tiny.yaml"),
         "run.iterations=1000", f"run.output_dir={out}", "run.progress=false",
         "store.lease_seconds=60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        _wait_for_iterations(proc, out / "metrics.jsonl", 1, timeout=120)
        # SIGTERM while some worker holds a live lease (read from the store's own counts), so
        # "released at once, no redeliveries" is tested on leases that exist.
        cfg_json = json.loads((out / "workers" / "reward-0.json").read_text())
        with storage.connect(cfg_json["common"]["store_addresses"]) as client:

            def leased() -> int:
                assert proc.poll() is None, proc.stderr.read()
                stats = client.stats("samples")
                tasks = {t for shard in stats.shards for t in shard.tasks}
                return sum(stats.task_total(t).in_flight for t in tasks)

            wait_until(leased, timeout=120, what="a live lease")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]  # 143: stopped, not finished
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["stopped_by"] == "SIGTERM"
    # Every worker released or acked what it held: nothing was handed out twice, nothing is
    # left leased (with 60 s leases, anything not released would still be in flight).
    assert summary["redelivered_rows"] == 0 and summary["in_flight_rows"] == 0
    assert summary["dead_rows"] == 0
    for log in (out / "logs").glob("*-0.log"):
        assert "Traceback" not in log.read_text(), log


@pytest.mark.slow
def test_run_against_an_external_store_node(tiny_config, store_serve) -> None:
    """`store.addresses`: the run uses store nodes it did not start (compose, schedulers)."""
    address, node = store_serve(2)
    for _ in range(2):  # a second run on the same node replaces the first run's table
        cfg = tiny_config(f"store.addresses=[{address}]", "run.eval_every=0",
                          "run.overwrite=true")  # the same run directory, twice
        summary = run(cfg)
        assert summary.status == "ok" and summary.iterations == 2
    assert node.poll() is None, "the run must not stop a store it did not start"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_to_the_process_group_stops_cleanly(tiny_config) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the whole foreground process group, at a random
    moment inside an iteration, twice. Each run stops within the bound, in order (workers
    release their leases before the store stops: nothing redelivered, nothing left leased, no
    worker restarted, no traceback), says `interrupted` and exits 130; no process is left."""
    rng = random.Random(7)
    base = Path(tiny_config().run.output_dir).parent
    for attempt in range(2):
        out = base / f"ctrl-c-{attempt}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamflow", "run", str(ROOT / "configs" / "tiny.yaml"),
             "run.iterations=1000", f"run.output_dir={out}", "run.progress=false",
             "store.lease_seconds=60"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            start_new_session=True,  # its own process group, as a shell gives a job
        )
        try:
            metrics = out / "metrics.jsonl"
            _wait_for_iterations(proc, metrics, 2, timeout=180)
            records = [json.loads(x) for x in metrics.read_text().splitlines()]
            family = psutil.Process(proc.pid).children(recursive=True)
            assert len(family) >= 5  # store, rollout, reward, reference, trainer
            # a random point inside the next iteration (one iteration's wall time from its start):
            # the moment of the Ctrl-C is what is under test, not a wait for something
            time.sleep(rng.uniform(0.0, records[-1]["wall_seconds"]))
            os.killpg(proc.pid, signal.SIGINT)
            sent = time.monotonic()
            _, stderr = proc.communicate(timeout=90)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 130, stderr[-3000:]
        assert took < 45, f"attempt {attempt}: {took:.1f}s from Ctrl-C to exit"
        summary = json.loads((out / "summary.json").read_text())
        assert summary["status"] == "interrupted" and summary["stopped_by"] == "SIGINT"
        assert summary["worker_restarts"] == {}, summary["worker_restarts"]
        assert summary["in_flight_rows"] == 0 and summary["redelivered_rows"] == 0, summary
        assert "run interrupted (SIGINT)" in stderr and "Traceback" not in stderr, stderr[-3000:]
        for log in (out / "logs").glob("*.log"):
            assert "Traceback" not in log.read_text(), log
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert alive == [], alive
