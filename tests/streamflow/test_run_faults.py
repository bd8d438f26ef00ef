"""Faults inside a full run, through real processes (issue 4; docs/faults.md).

Each test starts a real run of configs/tiny.yaml with short leases, injects faults at moments
read from the run itself (the store's own counts: the victim's task holds a live lease), and checks
what the run did: completed or failed with the cause, within a bound; every row trained exactly
once; the store's counts of redeliveries and dead rows. Runs are deterministic
(``trainer.deterministic``, sampling seeded per group and version), so a run that survived a fault
must end with the parameters of an uninterrupted run of the same config (run in-process in sync,
which streaming equals bitwise) — redelivered rows are regenerated and rescored identically.
"""

from __future__ import annotations

import itertools
import json
import re
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
from storage.errors import Unavailable
from streamflow.controller import WorkerFailed, run
from streamflow.supervisor import RestartPolicy, Supervisor
from workers.models.checkpoint import latest_checkpoint, read_state
from workers.tasks.arithmetic import ArithmeticTask

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 5
POISON_ENV = "STREAMFLOW_TEST_POISON_ANSWER"  # read by tests/streamflow/faulty_rewards.py
# Short leases so a dead or frozen worker's rows come back within seconds; a checkpoint every
# iteration so a trainer could be restarted; no evaluation (not what is tested here).
COMMON = (
    f"run.iterations={ITERATIONS}",
    "run.eval_every=0",
    "store.lease_seconds=2",
    "rollout.groups_per_claim=2",
    "run.checkpoint_every=1",
    "run.stall_timeout_s=90",
    # Leases held long enough to be caught (a tiny iteration takes ~30 ms without it)
    "reward.fn=tests.streamflow.faulty_rewards:slow",
)
# The balancer on: two shards start the run's coordinator (one shard has nothing to balance).
BALANCED = ("store.num_shards=2", "store.balancer=true")
# How long a victim is stopped before the store's counts are read: a write or ack it sent just
# before the stop has reached the store and been handled by then.
SETTLE_S = 0.1


def _params(run_dir: Path) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step-{ITERATIONS:06d}" / "model.safetensors"))


def _reference_run(out: Path, *overrides: str) -> tuple[dict, dict]:
    """A run without faults (final parameters, summary): what a faulted run must end with."""
    from streamflow.config import load_config

    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [f"run.output_dir={out}", "run.progress=false", *COMMON, *overrides],
    )
    summary = run(cfg)
    assert summary.status == "ok" and summary.redelivered_rows == 0
    return _params(out), json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(model_cache: Path) -> tuple[dict, dict]:
    """The reference of every faulted run: the same config in-process in ``sync`` (no child
    processes). With trainer.deterministic the streaming runs end with its parameters bitwise,
    with or without the balancer and its two shards (they change where rows wait, not what a
    step trains): a faulted run that differs trained a row twice or lost one."""
    return _reference_run(model_cache / "faults-uninterrupted", "run.mode=sync")


@pytest.fixture
def start_run():
    """Starts ``Run``s; whatever a test left running (it failed before ``Run.wait``) is killed and
    reaped at teardown, so no run outlives its test as a child — or a zombie — of pytest."""
    started: list[Run] = []

    def start(out: Path, *overrides: str) -> Run:
        started.append(Run(out, *overrides))
        return started[-1]

    yield start
    for r in started:
        r.close()


class Run:
    """``streamflow run`` as a child process, with handles on its workers and its store."""

    def __init__(self, out: Path, *overrides: str) -> None:
        self.out = out
        self.log = open(out.parent / f"{out.name}.stderr", "w")  # noqa: SIM115 - closed in wait
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "streamflow",
                "run",
                str(ROOT / "configs" / "tiny.yaml"),
                *COMMON,
                f"run.output_dir={out}",
                "run.progress=false",
                *overrides,
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            cwd=ROOT,
        )

    def process(self, name: str, timeout: float = 120) -> psutil.Process:
        """The process of worker ``name`` (e.g. "reward-0") or of the store ("store-0")."""

        def found() -> psutil.Process | None:
            assert self.proc.poll() is None, self.stderr()
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    cmd = " ".join(child.cmdline())
                except psutil.NoSuchProcess:
                    continue
                if (name == "store-0" and "storage.server" in cmd) or f"/{name}.json" in cmd:
                    return child
            return None

        return wait_until(found, timeout=timeout, what=f"the process of {name}")

    def iterations_done(self) -> int:
        """Iterations the controller recorded (it records one when the trainer reports its step)."""
        metrics = self.out / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    def _store(self) -> storage.Client:
        cfg = json.loads((self.out / "workers" / "reward-0.json").read_text())
        # A short request timeout: a run that ended took its store node with it.
        return storage.connect(cfg["common"]["store_addresses"], request_timeout=5.0)

    def wait_lease_expired(self, task: str, timeout: float = 60) -> None:
        """Wait until the store shows no live lease of ``task``, whose only worker is stopped
        holding one: the store expired it (nothing else could end it)."""
        with self._store() as client:

            def expired() -> bool:
                assert self.proc.poll() is None, self.stderr()
                return client.stats("samples").task_total(task).in_flight == 0

            wait_until(expired, timeout=timeout, what=f"the stopped {task} worker's lease to expire")

    def freeze_leased(
        self, task: str, victim: psutil.Process, min_iteration_done: int = 1, timeout: float = 120
    ) -> int:
        """Freeze ``victim``, the only worker of ``task``, at a moment it holds a live lease, after
        ``min_iteration_done`` iterations finished; the victim is left stopped (SIGSTOP) for the
        test to kill or resume. Returns the iterations done seen first: a lower bound of those
        done when the lease was seen.

        The victim is stepped: stopped, checked, let run for a few milliseconds, stopped again.
        A stopped worker cannot ack, so a lease of ``task`` the store shows once the victim has
        been stopped for ``SETTLE_S`` (long enough for a write or ack it sent just before to be
        handled) is the victim's and stays live. The run cannot outpace the check: the victim
        only works in short slices, and a lease granted while it is stopped (a claim it had
        parked in the store) is seen at the next check. A lease lasts at least one claim's
        compute, longer than most slices, so a few iterations of stepping catch one."""
        deadline = time.monotonic() + timeout

        def enough_done() -> tuple[int] | None:  # a tuple: truthy even when 0 are needed
            assert self.proc.poll() is None, self.stderr()
            done = self.iterations_done()
            return (done,) if done >= min_iteration_done else None

        (done,) = wait_until(enough_done, timeout=timeout,
                             what=f"{min_iteration_done} iteration(s) done")
        slices = itertools.cycle((0.002, 0.005, 0.01, 0.003, 0.02, 0.007))
        with self._store() as client:

            def leased() -> bool:
                try:
                    return client.stats("samples").task_total(task).in_flight > 0
                except Unavailable:
                    raise AssertionError(f"the run ended first\n{self.stderr()}") from None

            def signal_victim(sig: signal.Signals) -> None:
                try:
                    if victim.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped
                        raise psutil.NoSuchProcess(victim.pid)
                    victim.send_signal(sig)
                    if sig == signal.SIGSTOP:  # the signal is asynchronous: wait for the stop
                        wait_until(lambda: victim.status() == psutil.STATUS_STOPPED,
                                   timeout=5, interval=0.001, what=f"{victim.pid} stopped")
                except psutil.NoSuchProcess:
                    raise AssertionError(f"{task} worker {victim.pid} exited before it was seen "
                                         f"holding a lease\n{self.stderr()}") from None

            def frozen_holding_a_lease() -> bool:
                assert self.proc.poll() is None, self.stderr()
                signal_victim(signal.SIGSTOP)
                time.sleep(SETTLE_S)
                stopped_until = time.monotonic() + 0.15
                while True:  # checked for a while: a parked claim may be granted meanwhile
                    if leased():
                        return True
                    if time.monotonic() > stopped_until:
                        break
                    time.sleep(0.005)
                signal_victim(signal.SIGCONT)
                time.sleep(next(slices))
                return False

            wait_until(frozen_holding_a_lease, timeout=max(deadline - time.monotonic(), 1.0),
                       interval=0.0, what=f"{victim.pid} ({task}) frozen holding a lease")
            return done

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        """Kill the run if it still runs, reap it, close its stderr file."""
        if self.proc.poll() is None:
            self.proc.kill()  # its workers and store get SIGTERM (PR_SET_PDEATHSIG)
            self.proc.wait()
        self.log.close()

    def stderr(self, tail: int = 3000) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.out.parent / f"{self.out.name}.stderr").read_text()[-tail:]

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())


def _samples_per_iteration(out: Path) -> list[int]:
    return [json.loads(x)["samples"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_trained_exactly_once(r: Run, reference: tuple[dict, dict]) -> dict:
    summary = r.summary()
    assert summary["status"] == "ok" and summary["iterations"] == ITERATIONS, summary
    rows = 4 * 2  # prompts_per_iteration x group_size of configs/tiny.yaml
    assert _samples_per_iteration(r.out) == [rows] * ITERATIONS
    assert summary["dead_rows"] == 0 and summary["in_flight_rows"] == 0
    params, _ = reference
    mine = _params(r.out)
    worst = max(float((params[k] - mine[k]).abs().max()) for k in params)
    assert worst == 0.0, f"parameters differ from the uninterrupted run by {worst}"
    return summary


@pytest.mark.slow
def test_frozen_and_killed_workers_rejoin_and_the_run_is_exact(
    model_cache, uninterrupted, start_run
):
    """One run, three faults, each at a moment the store shows a live lease of the victim:
    the reward worker frozen (SIGSTOP) past its lease then resumed, later SIGKILLed, then the
    trainer SIGKILLed mid-iteration. Every row is still trained exactly once: the parameters are
    the uninterrupted run's, bitwise."""
    r = start_run(model_cache / "faults-workers")
    reward = r.process("reward-0")
    r.freeze_leased("reward", reward, min_iteration_done=1)
    # The victim stays frozen until its 2 s lease expired under it (its keeper's renewals are
    # frozen too): the fault under test.
    r.wait_lease_expired("reward")
    reward.send_signal(signal.SIGCONT)  # its late write+ack is fenced; it goes on claiming
    r.freeze_leased("reward", reward, min_iteration_done=2)
    reward.send_signal(signal.SIGKILL)  # restarted; its lease expires, the rows come back
    trainer = r.process("trainer-0")
    # (after 2 iterations, not later: the last iterations of this tiny run pass in a blink, and a
    # trainer that finished cannot be caught holding a lease)
    done = r.freeze_leased("trainer", trainer, min_iteration_done=2)
    trainer.send_signal(signal.SIGKILL)  # restarted from its newest checkpoint
    trainer.wait(30)
    # The newest complete checkpoint once it is dead: the one the restart must resume from. The
    # controller records iteration k when the trainer reports it, and the trainer writes
    # checkpoint k+1 after that report (step -> publish -> report -> checkpoint -> ack), but
    # checkpoint k before its report of iteration k: with `done` iterations recorded before the
    # kill, checkpoint done-1 or a newer one is complete (done itself may not be yet).
    newest = latest_checkpoint(r.out / "checkpoints")
    assert newest is not None and read_state(newest).step >= done - 1 >= 1, (newest, done)
    assert r.wait() == 0, r.stderr()
    summary = _assert_trained_exactly_once(r, uninterrupted)
    assert summary["worker_restarts"] == {"reward-0": 1, "trainer-0": 1}
    assert summary["redelivered_rows"] > 0
    _assert_redelivery_traced(r.out)
    logs = r.out / "logs"
    assert "fenced off" in (logs / "reward-0.log").read_text()
    assert "restart 1 of reward-0" in (logs / "reward-0.log").read_text()
    controller_log = r.stderr(tail=1_000_000)
    assert f"restarting the trainer from {newest}" in controller_log, controller_log


def _assert_redelivery_traced(out: Path) -> None:
    """The run's trace shows the redeliveries as the store made them: reward claims with delivery
    2, none after an ack of the row's first delivery, and the frozen worker's late result as a
    write then "fenced" (the killed worker may have died before it could report its claim: the
    trace holds what workers sent). What breaks it: deliveries not read from the lease, an ack
    recorded for a refused result, a fenced result not recorded."""
    from streamflow.tracefile import read_trace

    events = sorted(read_trace(out / "trace").to_pylist(), key=lambda e: e["t"])
    again = [e for e in events if (e["task"], e["event"], e["delivery"]) == ("reward", "claim", 2)]
    assert again, "no reward claim with delivery 2 in the trace"
    befores = [[e["event"] for e in events if e["row_id"] == second["row_id"]
                and e["task"] == "reward" and e["t"] <= second["t"] and e is not second]
               for second in again]
    assert all("ack" not in before for before in befores), befores
    assert any(before[:1] == ["claim"] and "fenced" in before for before in befores), befores


def _assignments(log_text: str, worker: str) -> list[list[int]]:
    """The shard sets a worker's balancer session adopted, in order (its log lines
    "<worker>: assigned shards [..] (generation g)", storage/coordinator_session.py)."""
    found = re.findall(rf"{re.escape(worker)}: assigned shards \[([\d, ]*)\] \(generation \d+\)",
                       log_text)
    return [[int(x) for x in f.split(",") if x.strip()] for f in found]


@pytest.mark.slow
def test_rollout_and_reference_killed_rejoin_the_balancer_and_the_run_is_exact(
    model_cache, uninterrupted, start_run
):
    """The balancer on (two shards): the rollout worker SIGKILLed while it holds a lease, then
    the reference worker too. Each is its role's only worker, so the run cannot finish until the
    restarted one has rejoined its consumer group and claimed again; its leases expire after
    store.lease_seconds and the rows are redelivered. Every row trained exactly once (bitwise the
    uninterrupted run of the same config); each restarted process was given shards."""
    r = start_run(model_cache / "faults-balanced", *BALANCED)
    rollout, reference = r.process("rollout-0"), r.process("reference-0")
    r.freeze_leased("rollout", rollout, min_iteration_done=1)
    rollout.send_signal(signal.SIGKILL)
    r.freeze_leased("reference", reference, min_iteration_done=2)
    reference.send_signal(signal.SIGKILL)
    assert r.wait(180) == 0, r.stderr()
    summary = _assert_trained_exactly_once(r, uninterrupted)
    assert summary["worker_restarts"] == {"rollout-0": 1, "reference-0": 1}
    # Each victim's rows came back to its task: the dead lease expired and was claimed again
    # (the store's final counts, read by the controller after every worker stopped).
    by_task = summary["redelivered_by_task"]
    assert by_task.get("rollout", 0) > 0 and by_task.get("reference", 0) > 0, by_task
    for worker in ("rollout-0", "reference-0"):
        # Only the restarted process's lines count (the victim may have died before its first
        # assignment: until then a session's claims steal, and the kill can come that early).
        _, marker, after = (r.out / "logs" / f"{worker}.log").read_text().partition(
            f"--- supervisor: restart 1 of {worker} ---")
        assert marker, f"{worker} was not restarted"
        given = _assignments(after, worker)
        assert any(given), f"restarted {worker} was never given shards: {given}\n{after[-2000:]}"


@pytest.mark.slow
def test_store_node_killed_and_restarted_under_load(model_cache, uninterrupted, start_run):
    r = start_run(model_cache / "faults-store", "store.persist=true")
    reward = r.process("reward-0")
    r.freeze_leased("reward", reward)  # a moment the store holds a live lease
    r.process("store-0").send_signal(signal.SIGKILL)
    reward.send_signal(signal.SIGCONT)
    assert r.wait(180) == 0, r.stderr()
    summary = _assert_trained_exactly_once(r, uninterrupted)
    assert summary["worker_restarts"] == {"store-0": 1}  # the workers rode it out
    assert "table samples recovered" in r.stderr()


@pytest.mark.slow
def test_store_node_killed_without_persistence_ends_the_run_with_the_cause(model_cache, start_run):
    """Without store.persist a dead store node's rows are gone: it is not restarted and the run
    fails at once, naming why, rather than stalling or going on with a hole in its data."""
    r = start_run(model_cache / "faults-store-no-persist")
    reward = r.process("reward-0")
    r.freeze_leased("reward", reward)  # a moment the store holds a live lease
    killed = time.monotonic()
    r.process("store-0").send_signal(signal.SIGKILL)
    reward.send_signal(signal.SIGCONT)
    assert r.wait(120) != 0
    assert time.monotonic() - killed < 60, "the run did not notice the dead store in time"
    assert "store.persist is false: the rows it held are lost" in r.stderr(tail=1_000_000)
    assert r.summary()["status"] == "failed"


def _poison_answer() -> tuple[str, list[int]]:
    """An answer of iteration 0 (one prompt = one group) and how many groups of each iteration
    carry it (the arithmetic task of configs/tiny.yaml is a pure function of the iteration)."""
    task = ArithmeticTask(digits=2, operations=("+",), seed=0)
    answers = [
        [p.answer for p in task.train_problems(4, epoch_or_offset=k)] for k in range(ITERATIONS)
    ]
    answer = answers[0][1]
    return answer, [a.count(answer) for a in answers]


@pytest.mark.slow
def test_poison_sample_is_quarantined_and_the_run_goes_on(tiny_config, monkeypatch):
    answer, poisoned = _poison_answer()
    monkeypatch.setenv(POISON_ENV, answer)
    cfg = tiny_config(
        *COMMON, "reward.fn=tests.streamflow.faulty_rewards:poison", "store.max_deliveries=2"
    )
    summary = run(cfg)
    out = Path(cfg.run.output_dir)
    assert summary.status == "ok" and summary.iterations == ITERATIONS
    # The trainer stepped over the groups that exist: an iteration loses the poisoned group.
    assert _samples_per_iteration(out) == [(4 - n) * 2 for n in poisoned]
    assert summary.dead_rows == 2 * sum(poisoned)  # both responses of each poisoned group
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["dead_rows"] == summary.dead_rows
    reasons = on_disk["dead_reasons"]
    assert sum(reasons.values()) == summary.dead_rows
    assert all(
        r.startswith("reward: iteration ") and f"poison sample (answer {answer})" in r
        for r in reasons
    ), reasons
    assert summary.redelivered_rows >= summary.dead_rows  # tried max_deliveries times each


@pytest.mark.slow
def test_every_sample_failing_ends_the_run_fast_with_the_cause(tiny_config):
    cfg = tiny_config(*COMMON, "reward.fn=tests.streamflow.faulty_rewards:always_fails")
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as failed:
        run(cfg)
    # Two bounds: the whole run (start-up of six processes included, which alone took up to
    # ~45 s on the loaded 2-core CI machine), and detection once the pipeline runs (the loop
    # clock starts when every worker is ready), far below the 90 s stall timeout.
    assert time.monotonic() - start < 120
    assert "every group of iteration 0 is DEAD" in str(failed.value)
    assert "this verifier is broken" in str(failed.value)
    summary = json.loads((Path(cfg.run.output_dir) / "summary.json").read_text())
    assert summary["status"] == "failed" and "every group of iteration 0" in summary["error"]
    assert summary["wall_seconds"] < 30, summary["wall_seconds"]
    assert summary["iterations"] == 0


@pytest.mark.slow
def test_a_worker_that_cannot_start_ends_the_run_fast_with_its_log(tiny_config):
    cfg = tiny_config(*COMMON, "reward.fn=tests.streamflow.no_such_module:score")
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as failed:
        run(cfg)
    assert time.monotonic() - start < 120  # start-up of the processes, then at once
    message = str(failed.value)
    assert "reward-0 exited with status 1 before it was ready" in message
    assert "cannot import module 'tests.streamflow.no_such_module'" in message  # the log tail
    no_children_left()


def test_stop_all_reaps_every_child_even_when_cut_short(tmp_path):
    """streamflow/supervisor.py: a second Ctrl-C (KeyboardInterrupt) while the controller reads
    the final counts between the two groups must not leave the last group (the store) running or
    unreaped: every process the supervisor started has been waited for when stop_all returns."""
    sup = Supervisor(tmp_path, RestartPolicy(max_restarts=0))
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    sup.start("rollout-0", "rollout", sleep, threads=1)
    # exited already, unreaped
    sup.start("reward-0", "reward", [sys.executable, "-c", "pass"], threads=1)
    sup.start("store-0", "store", sleep, threads=1)

    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sup.stop_all(grace_s=5, between=interrupted)
    assert {n: c.popen.returncode is not None for n, c in sup.children.items()} == {
        "rollout-0": True, "reward-0": True, "store-0": True}




@pytest.mark.slow
def test_a_killed_reward_model_worker_loses_no_row(model_cache, start_run, tmp_path):
    """reward.model: a tiny sequence classifier built here scores beside the slow verifier
    (combine=sum keeps the leases long enough to catch); its worker is SIGKILLed holding a lease,
    is restarted, reloads the model and the run trains every row of every iteration once. Breaks
    if the reward-model worker cannot start from the plan's record, if its lost lease's rows
    were dropped or trained twice, or if the model's score did not reach the trainer."""
    import transformers

    from workers.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_labels=1,
        pad_token_id=tok.pad_token_id)
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    iterations = 3  # one before the kill, the one it hits, one after
    r = start_run(model_cache / "faults-reward-model", f"reward.model={tmp_path / 'rm'}",
                  "reward.combine=sum", "reward.verifier_weight=0.5",
                  f"run.iterations={iterations}")
    reward = r.process("reward-0")
    r.freeze_leased("reward", reward, min_iteration_done=1)
    reward.send_signal(signal.SIGKILL)  # restarted; its lease expires, the rows come back
    assert r.wait() == 0, r.stderr()
    summary = r.summary()
    assert summary["status"] == "ok" and summary["iterations"] == iterations, summary
    assert _samples_per_iteration(r.out) == [4 * 2] * iterations
    assert summary["dead_rows"] == 0 and summary["in_flight_rows"] == 0
    assert summary["redelivered_rows"] > 0
    assert summary["worker_restarts"] == {"reward-0": 1}
    # 0.5 x (0 or 1) + a random model's logit: a mean of 8 such rewards is no multiple of 1/16
    metrics = (r.out / "metrics.jsonl").read_text().splitlines()
    means = [json.loads(x)["reward_mean"] for x in metrics]
    assert all(abs(m * 16 - round(m * 16)) > 1e-4 for m in means), means
