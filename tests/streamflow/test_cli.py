"""The `streamflow` CLI: run/--dry-run, errors and exit codes, bench dispatch, store serve."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml
from testkit import wait_until

import bench
from streamflow import cli
from streamflow.cli import main
from streamflow.config import config_from_dict, load_config
from streamflow.rundir import RunSummary

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


@pytest.fixture
def fake_controller(monkeypatch):
    """A stand-in streamflow.controller that records calls instead of starting processes."""
    module = types.ModuleType("streamflow.controller")
    module.calls = []
    module.outcome = lambda cfg: RunSummary.from_records(cfg.run.mode, [])

    def run(cfg):
        module.calls.append(cfg)
        return module.outcome(cfg)

    module.run = run
    monkeypatch.setitem(sys.modules, "streamflow.controller", module)
    # `from streamflow import controller` reads the package attribute first: once another test
    # imported the real controller, only replacing sys.modules would not be enough.
    import streamflow

    monkeypatch.setattr(streamflow, "controller", module, raising=False)
    return module


def test_dry_run_prints_resolved_yaml_and_starts_nothing(fake_controller, capsys, tmp_path):
    out_dir = tmp_path / "out"
    rc = main(["run", TINY, "trainer.lr=0.5", "--dry-run", f"run.output_dir={out_dir}"])
    assert rc == 0
    assert fake_controller.calls == []
    assert not out_dir.exists()
    printed = config_from_dict(yaml.safe_load(capsys.readouterr().out))
    assert printed == load_config(TINY, ["trainer.lr=0.5", f"run.output_dir={out_dir}"])
    assert printed.trainer.lr == 0.5


def test_dry_run_does_not_import_the_engine():
    # The config checks the simulated cost preset's name against workers.engines.sim_cost, a
    # standard-library-only table of presets; anything else of workers (engines, torch) is heavy.
    # The early checks (streamflow/preflight.py) resolve reward.fn with workers.tasks.verifiers, which
    # is standard-library only as well, and so are workers.settings (the knobs the config embeds)
    # and workers.checked (their checks).
    # The task checks build the arithmetic task and its held-out split (pyarrow only for files).
    # the verifiers read tool-call markers (workers.agent.toolcall) and run user functions in a
    # child (workers.runtime.child): both standard-library only.
    light = ("workers", "workers.engines", "workers.engines.sim_cost", "workers.tasks",
             "workers.tasks.verifiers", "workers.tasks.arithmetic", "workers.tasks.heldout",
             "workers.tasks.problem", "workers.tasks.prompt_file", "workers.settings",
             "workers.checked",
             "workers.models", "workers.models.spec", "workers.agent", "workers.agent.sandbox",
                 "workers.agent.cgroup",
             "workers.agent.toolcall", "workers.runtime", "workers.runtime.child")
    code = (
        "import sys; from streamflow.cli import main; "
        f"rc = main(['run', {TINY!r}, '--dry-run']); "
        "heavy = [m for m in sys.modules if m in ('torch', 'streamflow.controller') "
        f"or (m.split('.')[0] == 'workers' and m not in {light!r})]; "
        "print(rc, sorted(heavy))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "0 []"


def test_run_calls_controller(fake_controller, capsys):
    rc = main(["run", TINY, "run.mode=sync", "run.output_dir=/nonexistent/never-written"])
    assert rc == 0
    assert [c.run.mode for c in fake_controller.calls] == ["sync"]


def test_run_failure_exits_nonzero_with_one_line(fake_controller, capsys):
    def boom(cfg):
        raise RuntimeError("worker reward-0 exited with code 3: ZeroDivisionError")

    fake_controller.outcome = boom
    assert main(["run", TINY]) == 1
    err = capsys.readouterr().err
    assert "run failed: RuntimeError: worker reward-0 exited with code 3" in err
    assert "Traceback" not in err


def test_run_failed_summary_is_not_success(fake_controller, capsys):
    fake_controller.outcome = lambda cfg: RunSummary.from_records(
        "periodic", [], status="failed", error="trainer-0 died"
    )
    assert main(["run", TINY]) == 1
    assert "trainer-0 died" in capsys.readouterr().err


def test_interrupts(fake_controller, capsys):
    # Ctrl-C before the controller could stop anything (e.g. during the warm start): 130.
    def interrupt(cfg):
        raise KeyboardInterrupt

    fake_controller.outcome = interrupt
    assert main(["run", TINY]) == 130
    assert "before the run started" in capsys.readouterr().err
    # The controller stopped every worker cleanly: still not a finished run, so 128 + the signal
    # (130 Ctrl-C, 143 SIGTERM), as torchrun and Python programs stopped by Ctrl-C exit non-zero.
    for name, code in (("SIGINT", 130), ("SIGTERM", 143)):
        fake_controller.outcome = lambda cfg, name=name: RunSummary.from_records(
            "sync", [], status="interrupted", error=f"interrupted by {name}", stopped_by=name
        )
        assert main(["run", TINY]) == code
        err = capsys.readouterr().err
        assert f"run interrupted ({name}) and stopped cleanly" in err and "resume=auto" in err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["run", TINY, "trainer.lrr=1"], "trainer.lrr: unknown key"),
        (["run", TINY, "trainer.lr=x"], "trainer.lr: expected float, got 'x'"),
        (["run", TINY, "run.mode=fast"], "run.mode: must be one of 'sync', 'periodic', 'async'"),
        (["run", TINY, "trainer.lr"], "bad override 'trainer.lr'"),
        (["run", "missing.yaml", "--dry-run"], "config file not found: missing.yaml"),
    ],
)
def test_config_errors_are_one_line_exit_2(fake_controller, capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert fake_controller.calls == []


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert main(["run", TINY, "--bogus"]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["--help"]) == 0
    assert "run" in capsys.readouterr().out


def test_warnings_for_ignored_settings(capsys):
    assert main(["run", TINY, "run.mode=sync", "run.max_staleness=2", "--dry-run"]) == 0
    assert "warning: run.max_staleness=2 is ignored in mode 'sync'" in capsys.readouterr().err


def test_bench_unknown_lists_available(capsys):
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown bench 'nope'; available:" in err and "store" in err


def test_bench_dispatches_to_module_main(tmp_path, monkeypatch, capsys):
    (tmp_path / "fakebench.py").write_text(
        "def main(argv):\n    print('fakebench got', argv)\n    return 3\n"
    )
    monkeypatch.setattr(bench, "__path__", [*bench.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "bench.fakebench", raising=False)
    assert "fakebench" in cli.available_benches()
    assert main(["bench", "fakebench", "--json", "--iterations", "2"]) == 3
    assert "fakebench got ['--json', '--iterations', '2']" in capsys.readouterr().out
    sys.modules.pop("bench.fakebench", None)


def test_bench_lists_modules_not_helpers_or_packages():
    names = cli.available_benches()
    assert {"store", "simulate", "packing", "pipeline"} <= set(names)
    assert not any(n.startswith("_") for n in names) and "sim" not in names


def test_bench_without_the_bench_package_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bench", None)  # import bench -> ModuleNotFoundError
    assert main(["bench", "store"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'bench' package is not installed" in err


def test_streamflow_does_not_import_bench():
    code = ("import sys, streamflow.cli, streamflow.config, workers.engines.simulated; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'bench'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_store_serve_dry_run(tmp_path, capsys):
    assert main(["store", "serve", "--dry-run", "--shards", "3", "--node-index", "1"]) == 0
    out = capsys.readouterr().out
    assert "num_shards=3" in out and "node_index=1" in out and "127.0.0.1" in out
    cfg = tmp_path / "c.yaml"
    cfg.write_text("store:\n  num_shards: 4\n  port: 6000\n")
    assert main(["store", "serve", "--config", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "num_shards=4" in out and "tcp://127.0.0.1:6000" in out
    assert main(["store", "serve", "--shards", "0", "--dry-run"]) == 2
    assert "num_shards" in capsys.readouterr().err


def test_python_dash_m_streamflow():
    proc = subprocess.run(
        [sys.executable, "-m", "streamflow", "run", TINY, "--dry-run"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["run"]["name"] == "tiny"


def test_store_serve_runs_and_stops_on_sigterm(tmp_path):
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamflow",
            "store",
            "serve",
            "--bind",
            "tcp://127.0.0.1:0",
            "--shards",
            "2",
            "--ready-file",
            str(ready),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read()
            return ready.exists()

        wait_until(up, timeout=30, what="the ready file")
        addresses = json.loads(ready.read_text())["addresses"]
        assert addresses and all(a.startswith("tcp://127.0.0.1:") for a in addresses)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_worker_subcommand_runs_one_role_and_names_bad_configs(tmp_path, capsys):
    bad = tmp_path / "w.json"
    bad.write_text('{"common": {}, "nonsense": 1}')
    assert main(["worker", "--role", "reward", "--config", str(bad)]) == 2
    assert "unknown fields" in capsys.readouterr().err
    assert main(["worker", "--role", "juggler", "--config", str(bad)]) == 2


@pytest.mark.slow
def test_worker_subcommand_serves_its_role_against_a_store_node(tmp_path, store_serve):
    """`streamflow store serve` + `streamflow worker --role reward`: one role per process, as a
    container or scheduler runs it. The worker scores rows it did not see being made, writes
    its columns, and stops cleanly on SIGTERM (exit 0, nothing left leased)."""
    import numpy as np
    import pyarrow as pa

    import storage
    from workers.config import RewardWorkerConfig, WorkerCommon, to_json
    from workers.models.tokenizer import build_char_tokenizer
    from workers.schema import samples_table_spec

    tok = build_char_tokenizer()
    tok_dir = tmp_path / "tokenizer"
    tok.save_pretrained(tok_dir)
    address, _node = store_serve(1)
    worker = None
    try:
        client = storage.connect(address)
        client.create_table(samples_table_spec("samples", group_size=2, reference_worker=False,
                                               fsync="never"))
        answers, completions = ["12", "12", "7", "7"], ["12", "13", "7", " 7 "]
        row_ids = client.put("samples", pa.table({
            "group_id": np.array([0, 0, 1, 1]), "iteration": np.zeros(4, np.int64),
            "min_policy_version": np.zeros(4, np.int64),
            "prompt_ids": pa.array([tok.encode("6+6=")] * 2 + [tok.encode("3+4=")] * 2,
                                   pa.list_(pa.int32())),
            "answer": answers,
        }))
        rollout = client.claim("samples", "rollout", ["group_id"], 4, whole_groups=True)
        client.write("samples", rollout, pa.table({
            "response_ids": pa.array([tok.encode(c) for c in completions], pa.list_(pa.int32())),
            "response_logprobs": pa.array([[-0.1] * len(c) for c in completions],
                                          pa.list_(pa.float32())),
            "policy_version": np.zeros(4, np.int64), "finish_reason": ["stop"] * 4,
        }), ack=True)
        config = tmp_path / "reward-0.json"
        config.write_text(to_json(RewardWorkerConfig(
            common=WorkerCommon(name="reward-0", role="reward", store_addresses=[address],
                                table="samples", seed=0, threads=1, claim_timeout_s=0.2,
                                trace_rows=False),
            model_path=str(tok_dir), fn="exact_match", rows_per_claim=2, model_device="cpu",
            model_dtype="float32", hub=None,
        )))
        worker = subprocess.Popen(
            [sys.executable, "-m", "streamflow", "worker", "--role", "reward",
             "--config", str(config)], cwd=REPO, stderr=subprocess.PIPE, text=True,
        )
        def scored() -> bool:
            assert worker.poll() is None, worker.stderr.read()
            return client.stats("samples").task_total("reward").consumed >= 4

        wait_until(scored, timeout=120, what="the reward worker to score the 4 rows")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, worker.stderr.read()
        trainer = client.claim("samples", "trainer", ["reward", "reward_ok"], 4,
                               whole_groups=True)
        by_row = dict(zip(trainer.batch["row_id"].to_pylist(), trainer.batch["reward"].to_pylist(),
                          strict=True))
        assert [by_row[r] for r in row_ids.tolist()] == [1.0, 0.0, 1.0, 1.0]
        assert trainer.batch["reward_ok"].to_pylist() == [True] * 4
        stats = client.stats("samples").task_total("reward")
        assert stats.in_flight == 0 and stats.redelivered_total == 0
        client.close()
    finally:
        if worker is not None and worker.poll() is None:
            worker.terminate()
            worker.wait(timeout=30)


# -- early checks: one line, exit 2, before anything is imported, built or started ---------------


def _one_line_error(capsys, argv, needle, fake_controller) -> None:
    t0 = time.monotonic()
    assert main(argv) == 2
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert fake_controller.calls == []  # nothing built, nothing started
    assert took < 5, f"{took:.1f}s"


@pytest.fixture
def problems(tmp_path):
    good = tmp_path / "good.jsonl"
    # more distinct prompts than tiny.yaml's run.eval_prompts: some are left for training
    good.write_text("".join(f'{{"prompt": "1+{i}=", "answer": "{i + 1}"}}\n' for i in range(8)))
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text('{"prompt": "1+1="}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    return {"good": good, "no_answer": no_answer, "empty": empty, "broken": broken,
            "missing": tmp_path / "missing.jsonl"}


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["data.task=file", "data.file={missing}"], "data.file: problem file"),
        (["data.task=file", "data.file={no_answer}"], "data.file: "),
        (["data.task=file", "data.file={empty}"], "no rows"),
        (["data.task=file", "data.file={broken}"], "data.file: "),
        (["model.path={tmp}/no-such-model", "model.warmstart_steps=0"], "model.path: "),
        # a directory, but no config.json
        (["model.path={tmp}", "model.warmstart_steps=0"], "model.path: "),
        (["reward.fn=exact_mach"], "reward.fn: unknown reward 'exact_mach'"),
        (["reward.fn=no_such_module_xyz:score"], "reward.fn: reward 'no_such_module_xyz:score'"),
        (["reward.fn=json:no_such_function"], "has no attribute"),
        (["run.resume={tmp}/nowhere"], "run.resume: "),
    ],
)
def test_bad_inputs_are_one_line_before_anything_is_built(
    fake_controller, capsys, tmp_path, problems, overrides, needle, dry_run
):
    out = tmp_path / "run"
    argv = ["run", TINY, f"run.output_dir={out}",
            *[o.format(tmp=tmp_path, **problems) for o in overrides]]
    _one_line_error(capsys, argv + (["--dry-run"] if dry_run else []), needle, fake_controller)
    assert not out.exists()


def _few_distinct(tmp_path: Path) -> Path:
    """300 rows, 78 distinct prompts (the file a user held out completely with eval_prompts=200)."""
    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i % 78}: what is {i % 78} + 1?",
                                        "answer": str(i % 78 + 1)}) + "\n" for i in range(300)))
    return path


def test_an_all_held_out_prompt_file_fails_before_any_warm_start(capsys, tmp_path):
    # The real controller (no stand-in): without the early check it would warm-start the built-in
    # model into <output_dir>/../.cache before the split failed.
    runs = tmp_path / "runs"
    argv = ["run", TINY, f"run.output_dir={runs / 'x'}", "data.task=file",
            f"data.file={_few_distinct(tmp_path)}", "run.eval_prompts=200",
            "reward.fn=workers.tasks.word:last_number_match"]
    needle = "error: run.eval_prompts=200 holds out every prompt of "
    for extra in (["--dry-run"], []):
        assert main(argv + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith(needle) and "(78 distinct" in err, err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert not (runs / ".cache").exists() and not (runs / "x").exists()


def test_the_built_in_model_with_a_prompt_file_says_what_it_warm_starts_on(
    fake_controller, capsys, problems, tmp_path
):
    argv = ["run", TINY, f"run.output_dir={tmp_path / 'run'}", "data.task=file",
            f"data.file={problems['good']}"]
    note = ("note: model.path is unset: the built-in model is warm-started on its arithmetic "
            f"task, not on {problems['good']}; set model.path to train your own model")
    for extra in (["--dry-run"], []):
        assert main(argv + extra) == 0
        assert note in capsys.readouterr().err.splitlines()
    assert main(["run", TINY, f"run.output_dir={tmp_path / 'run2'}", "--dry-run"]) == 0
    assert "note:" not in capsys.readouterr().err  # the arithmetic task: nothing to say


def test_a_good_problem_file_passes(fake_controller, problems, tmp_path):
    assert main(["run", TINY, f"run.output_dir={tmp_path / 'run'}", "data.task=file",
                 f"data.file={problems['good']}"]) == 0
    assert len(fake_controller.calls) == 1


@pytest.fixture
def busy_port():
    """A real listener on 127.0.0.1: the port someone else holds. bind(0) is right here: the
    test holds the port from its pick to its end, so there is no gap for anything to take it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("key,address", [("store.port", "tcp://127.0.0.1:{port}"),
                                         ("metrics.port", "127.0.0.1:{port}")])
def test_busy_port_is_one_line_naming_key_and_address(
    fake_controller, capsys, tmp_path, busy_port, key, address
):
    argv = ["run", TINY, f"run.output_dir={tmp_path / 'run'}", f"{key}={busy_port}"]
    _one_line_error(capsys, argv, f"{key}: {address.format(port=busy_port)} is already in use",
                    fake_controller)


@pytest.mark.slow
@pytest.mark.parametrize("key,address", [("store.port", "tcp://127.0.0.1:{port}"),
                                         ("metrics.port", "127.0.0.1:{port}")])
def test_port_taken_after_the_checks_is_the_same_one_line(
    capsys, tmp_path, busy_port, key, address, monkeypatch, model_cache
):
    """The port is free at the check and taken before the bind (a race): the bind's failure is
    reported the same way, exit 2, and nothing is left running."""
    import psutil

    from streamflow import preflight

    monkeypatch.setattr(preflight, "check_ports", lambda cfg: None)
    out = model_cache / f"{tmp_path.name}-{key}"  # the tiny model is cached per session
    assert main(["run", TINY, f"run.output_dir={out}", f"{key}={busy_port}"]) == 2
    err = capsys.readouterr().err
    assert f"error: {key}: {address.format(port=busy_port)} is already in use" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    _, alive = psutil.wait_procs(_run_children(), timeout=15)
    assert alive == []


def _run_children() -> list:
    """This process's children but multiprocessing's resource tracker (an earlier test's spawned
    child starts it; it lives as long as this process)."""
    import psutil

    def ours(p: psutil.Process) -> bool:
        try:
            return "resource_tracker" not in " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            return False
    return [p for p in psutil.Process().children(recursive=True) if ours(p)]


# -- run.output_dir: never silently into an older run -------------------------------------------


def test_existing_run_dir_is_refused_unless_resumed_or_overwritten(fake_controller, capsys,
                                                                   tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("run: {}\n")  # a run that never trained: retrying is fine
    assert main(["run", TINY, f"run.output_dir={out}"]) == 0
    fake_controller.calls.clear()
    (out / "metrics.jsonl").write_text('{"iteration": 0}\n')
    _one_line_error(capsys, ["run", TINY, f"run.output_dir={out}"],
                    f"run.output_dir: {out} already holds a run", fake_controller)
    _one_line_error(capsys, ["run", TINY, f"run.output_dir={out}", "--dry-run"],
                    "run.overwrite=true", fake_controller)
    assert main(["run", TINY, f"run.output_dir={out}", "--overwrite"]) == 0
    assert fake_controller.calls[-1].run.overwrite
    assert main(["run", TINY, f"run.output_dir={out}", "run.resume=auto"]) == 0
    assert main(["run", TINY, f"run.output_dir={out}", "run.resume=auto", "--overwrite"]) == 2
    assert "run.overwrite: cannot be combined with run.resume" in capsys.readouterr().err
