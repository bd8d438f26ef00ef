"""Against a real Prometheus server (Debian's ``prometheus``; the Makefile installs it).

A short real job (configs/tiny.yaml, periodic, many iterations) runs in the background; a
Prometheus started here on 127.0.0.1 with a temporary data dir finds every endpoint through the
run's ``prometheus/targets.json`` (file_sd) and scrapes them every second. While the job still runs,
every PromQL expression of every panel of every dashboard in ``grafana/dashboards/`` goes through
``/api/v1/query``: each must succeed and return at least one series. The shipped alert rules are
loaded by the same server and must evaluate without error. ``promtool`` checks the shipped files.
Everything is bounded: the job is interrupted (clean stop) once the queries are done.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from testkit import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
PROM_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ENDPOINTS = 6  # controller, store-0, rollout-0, reward-0, reference-0, trainer-0 (tiny.yaml)
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: never a proxy


def _binary(name: str) -> str:
    path = shutil.which(name) or f"/usr/bin/{name}"
    assert Path(path).exists(), (
        f"{name} not found: apt-get install -y --no-install-recommends prometheus"
    )
    return path


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every target of every panel."""
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
    return out


def _query(base: str, expr: str) -> dict:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with _HTTP.open(url, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:  # 400/422 carry the PromQL error as JSON
        body = err.read()
        if err.code == 503:  # "Service Unavailable": still starting (its TSDB is not open yet)
            return {"status": "starting", "error": body.decode(errors="replace")}
        return json.loads(body)
    except urllib.error.URLError:  # not listening yet
        return {"status": "unreachable"}


def _scalar(base: str, expr: str) -> float:
    result = _query(base, expr).get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else 0.0


def test_promtool_accepts_shipped_config_and_rules() -> None:
    promtool = _binary("promtool")
    for args in (["check", "config", str(PROM_CONFIG)], ["check", "rules", str(ALERTS)]):
        proc = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True,
                          text=True, timeout=60)
    assert "7 rules found" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_dashboard_panel_returns_data_from_a_real_run(
    tmp_path: Path, model_cache: Path
) -> None:
    prometheus = _binary("prometheus")
    queries = panel_queries()
    assert len(queries) >= 30
    run_dir = model_cache / tmp_path.name  # the warm-started tiny model is cached per session
    targets = run_dir / "prometheus" / "targets.json"
    config = yaml.safe_load(PROM_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(ALERTS)]
    config["scrape_configs"][0]["file_sd_configs"] = [
        {"files": [str(targets)], "refresh_interval": "1s"}
    ]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job_log = open(tmp_path / "job.log", "wb")  # noqa: SIM115 - closed in finally
    prom_log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115
    job = subprocess.Popen(
        [sys.executable, "-m", "streamflow", "run", "configs/tiny.yaml",
         f"run.output_dir={run_dir}", "run.iterations=400", "run.checkpoint_every=2",
         "run.eval_every=1"],
        cwd=ROOT, stdout=job_log, stderr=subprocess.STDOUT, env=env,
    )
    prom = subprocess.Popen(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=prom_log, stderr=subprocess.STDOUT,
    )
    try:
        seen = {}

        def scraped() -> bool:  # every endpoint up, several iterations scraped, a checkpoint
            assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
            assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            seen.update(up=_scalar(base, 'sum(up{run="tiny"})'),
                        iterations=_scalar(base, "max(streamflow_run_iterations_total)"),
                        checkpoint=_scalar(
                            base, "max(streamflow_trainer_last_checkpoint_timestamp_seconds)"))
            return seen["up"] >= ENDPOINTS and seen["iterations"] >= 6 and seen["checkpoint"] > 0

        try:
            wait_until(scraped, timeout=180, what="every endpoint scraped")
        except AssertionError as timed_out:
            raise AssertionError(f"{timed_out}: {seen}") from None
        empty, failed = [], []

        def every_panel_answered() -> bool:  # rates need 2+ scrapes inside their window
            assert job.poll() is None, "the job ended before the queries: give it more iterations"
            empty.clear()
            failed.clear()
            for board, title, expr in queries:
                reply = _query(base, expr)
                if reply.get("status") != "success":
                    failed.append(f"{board} / {title}: {expr}: {reply.get('error')}")
                elif not reply["data"]["result"]:
                    empty.append(f"{board} / {title}: {expr}")
            return not failed and not empty

        # Bounded; on a timeout the two assertions below name the panels.
        with contextlib.suppress(AssertionError):
            wait_until(every_panel_answered, timeout=60, what="every panel's query to return data")
        assert job.poll() is None, "the job ended before the queries: give it more iterations"
        assert not failed, "\n".join(failed)
        assert not empty, "panels without data:\n" + "\n".join(empty)
        # Labels come from the service-discovery file: one series per worker of each role.
        roles = {r["metric"]["role"] for r in _query(base, 'up{run="tiny"}')["data"]["result"]}
        assert roles == {"controller", "store", "rollout", "reward", "reference", "trainer"}
        with _HTTP.open(f"{base}/api/v1/rules", timeout=10) as resp:
            rules = [r for g in json.loads(resp.read())["data"]["groups"] for r in g["rules"]]
        # every rule of the alerts file loaded (the file's own count, so a new alert counts too)
        declared = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
        assert len(declared) >= 7 and len(rules) == len(declared)
        assert all(r["health"] != "err" for r in rules), [r.get("lastError") for r in rules]
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGINT)  # clean stop: the controller stops its workers
            try:
                job.wait(60)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait()
        prom.terminate()
        try:
            prom.wait(30)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        job_log.close()
        prom_log.close()
