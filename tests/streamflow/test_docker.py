"""docker/ without a Docker engine: the compose file against the compose-spec schema, every
``streamflow`` command in it through the real CLI with ``--dry-run``, and the Prometheus config in
docker/ against the services the compose file names (one scrape job per service, on the port the
service declares, and the controller's service-discovery file on a volume Prometheus mounts)."""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from streamflow.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _check_jsonschema() -> str:
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    assert Path(exe).exists(), "check-jsonschema missing: pip install check-jsonschema (test extra)"
    return exe


def test_compose_file_matches_the_compose_spec(tmp_path: Path) -> None:
    exe = _check_jsonschema()
    ok = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # The validator is strict: an unknown key in a service is refused (so the check can fail).
    bad = _compose()
    bad["services"]["store"]["helthcheck"] = {"test": ["CMD", "true"]}
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(bad))
    refused = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(path)],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0


def test_every_service_has_a_healthcheck_and_existing_mounts() -> None:
    compose = _compose()
    assert {"store", "controller", "prometheus", "grafana"} <= set(compose["services"])
    for name, service in compose["services"].items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no health check"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in compose["volumes"], f"{name}: undeclared volume {source}"
    assert (ROOT / compose["x-streamflow-image"]["build"]["dockerfile"]).is_file()
    mounts = {v.split(":")[1] for v in compose["services"]["controller"]["volumes"]}
    assert {"/runs/quickstart/checkpoints", "/runs/quickstart/store"} <= mounts


def test_every_streamflow_command_parses_with_dry_run() -> None:
    commands = [s["command"] for s in _compose()["services"].values()
                if s.get("command", [None])[0] == "streamflow"]
    assert len(commands) == 2  # store serve, run
    for command in commands:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = cli_main([*command[1:], "--dry-run"])
        assert rc == 0, f"{command}: exit {rc}"
        assert out.getvalue().strip(), command
    # A typo in an override is refused by the same CLI (so the check above can fail).
    assert cli_main(["run", "configs/quickstart.yaml", "metrics.prot=1", "--dry-run"]) == 2


def _override(command: list[str], key: str) -> str:
    return next(a.split("=", 1)[1] for a in command if a.startswith(f"{key}="))


def test_docker_prometheus_config_scrapes_every_compose_service() -> None:
    compose = _compose()
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    services = compose["services"]
    assert set(jobs) == set(services)
    for name, service in services.items():
        if name == "controller":
            continue
        port = service["labels"]["org.streamflow.metrics-port"]
        targets = [t for sc in jobs[name]["static_configs"] for t in sc["targets"]]
        # Shared network namespace: every service is reachable on 127.0.0.1.
        assert targets == [f"127.0.0.1:{port}"], (name, targets)
        if name != "store":
            assert service["network_mode"] == "service:store", name
    # The controller and its children come from the run's file_sd list on the runs volume.
    controller = services["controller"]
    output_dir = _override(controller["command"], "run.output_dir")
    assert controller["network_mode"] == "service:store"
    files = [f for sd in jobs["controller"]["file_sd_configs"] for f in sd["files"]]
    assert files == [f"{output_dir}/prometheus/targets.json"]
    runs_mount = next(v for v in controller["volumes"] if v.startswith("runs:")).split(":")[1]
    assert f"runs:{runs_mount}:ro" in services["prometheus"]["volumes"]
    assert output_dir.startswith(runs_mount + "/")
    assert _override(controller["command"], "metrics.port") == (
        controller["labels"]["org.streamflow.metrics-port"]
    )
    # The store node's metrics port in its command matches what Prometheus scrapes.
    store_cmd = services["store"]["command"]
    assert store_cmd[store_cmd.index("--metrics-port") + 1] == (
        services["store"]["labels"]["org.streamflow.metrics-port"]
    )


def test_docker_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    # The rule file path is the container's: check syntax here, the rules themselves are checked
    # by test_prometheus.py (same file, mounted read-only).
    proc = subprocess.run([promtool, "check", "config", "--syntax-only",
                           str(DOCKER / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    mounted = _compose()["services"]["prometheus"]["volumes"]
    assert "../deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in mounted


def _schema_ok(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_check_jsonschema(), "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_gpu_override_reserves_gpus_and_builds_cuda_torch() -> None:
    gpu_file = DOCKER / "compose.gpu.yaml"
    ok = _schema_ok(gpu_file)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    gpu = yaml.safe_load(gpu_file.read_text())["services"]
    base = _compose()
    # compose.yaml alone reserves no device: it starts on a machine without GPUs.
    assert not any("deploy" in s for s in base["services"].values())
    devices = gpu["controller"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    # Every service the override touches uses one CUDA image (built once), never the CPU tag.
    images = {gpu[name]["image"] for name in gpu}
    assert images == {"streamflow:cuda"} != {base["x-streamflow-image"]["image"]}
    for name in gpu:
        assert gpu[name]["build"]["args"] == {"TORCH_VARIANT": "cuda"}, name
        assert name in base["services"], name
    # The build argument exists in the Dockerfile, and the default image stays the CPU one.
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert "ARG TORCH_VARIANT=cpu\n" in dockerfile
    assert base["x-streamflow-image"]["build"]["args"] == {"TORCH_VARIANT": "cpu"}


def test_ci_override_changes_only_images_and_the_jobs_length() -> None:
    ci_file = DOCKER / "ci" / "compose.ci.yaml"
    ok = _schema_ok(ci_file)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    ci = yaml.safe_load(ci_file.read_text())["services"]
    base = _compose()["services"]
    script = (DOCKER / "ci.sh").read_text()
    for name, service in ci.items():
        assert name in base, name
        assert service["pull_policy"] == "never", name  # nothing from an image registry
        assert f"={service['image']}" in script, f"{name}: ci.sh does not build {service['image']}"
        assert set(service) <= {"image", "pull_policy", "command"}, (name, set(service))
    # The controller runs compose.yaml's command, plus overrides that only shorten the job.
    command = ci["controller"]["command"]
    original = base["controller"]["command"]
    assert command[: len(original)] == original
    extra = command[len(original):]
    assert extra and {a.split("=")[0] for a in extra} <= {
        "run.iterations", "model.warmstart_steps", "run.eval_every", "run.eval_prompts",
        "run.checkpoint_every"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main([*command[1:], "--dry-run"]) == 0
    # ci.sh reads the iteration count back from the override to check summary.json.
    assert "run.iterations=" in script and "compose.ci.yaml" in script


def test_compose_prometheus_is_the_tested_version() -> None:
    """compose.yaml names the Prometheus release the tests run (Debian's package, also in the CI
    image), so what a user pulls is what was tested."""
    image = _compose()["services"]["prometheus"]["image"]
    assert image.startswith("prom/prometheus:v"), image
    prometheus = shutil.which("prometheus") or "/usr/bin/prometheus"
    proc = subprocess.run([prometheus, "--version"], capture_output=True, text=True, timeout=60)
    tested = (proc.stdout + proc.stderr).split()[2]  # "prometheus, version 2.42.0+ds (...)"
    assert image.split(":v")[1] == tested.split("+")[0], (image, tested)
    assert f"prometheus:{tested.split('+')[0]}" in (DOCKER / "ci.sh").read_text()


def test_dockerignore_lets_through_exactly_what_the_image_copies() -> None:
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"  # everything else (.venv, runs, .git) stays out of the context
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = set()
    for line in (DOCKER / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            copied.update(p.rstrip("/").removeprefix("./") for p in line.split()[1:-1])
    assert copied and copied == allowed, (copied, allowed)
    assert all((ROOT / p).exists() for p in copied)


def test_ci_script_parses() -> None:
    proc = subprocess.run(["bash", "-n", str(DOCKER / "ci.sh")], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr


def _load_check_stack():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_stack", DOCKER / "ci" / "check_stack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_TARGETS = [("store", "127.0.0.1:9401", "store", "store-node"),
            ("prometheus", "127.0.0.1:9090", None, None),
            ("controller", "127.0.0.1:9400", "controller", "controller"),
            ("controller", "127.0.0.1:4001", "rollout", "rollout-0"),
            ("controller", "127.0.0.1:4002", "reward", "reward-0"),
            ("controller", "127.0.0.1:4003", "trainer", "trainer-0")]


@pytest.mark.parametrize("fault", ["none", "target-down", "not-at-once", "empty-panel",
                                   "store-unused", "summary-failed", "role-missing"])
def test_check_stack_fails_on_each_fault(fault: str, tmp_path: Path, capsys) -> None:
    """docker/ci/check_stack.py against a fake Prometheus API: passes on a healthy run and names
    the fault otherwise (so the compose test can fail)."""
    import http.server
    import json
    import threading
    import time
    import urllib.parse

    check = _load_check_stack()
    targets = [t for t in _TARGETS if not (fault == "role-missing" and t[2] == "reward")]
    empty_expr = check.panel_exprs("data-plane.json", "Queue depth per task and shard")[0]

    class Fake(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            url = urllib.parse.urlparse(self.path)
            expr = urllib.parse.parse_qs(url.query)["query"][0]
            if url.path.endswith("/query_range"):
                peak = len(targets) - (fault == "not-at-once")
                data = {"resultType": "matrix", "result": [
                    {"metric": {}, "values": [[1000 + i, str(min(i + 1, peak))]
                                              for i in range(len(targets) + 3)]}]}
            elif expr.startswith("max_over_time(up"):
                data = {"resultType": "vector", "result": [
                    {"metric": {k: v for k, v in (("job", j), ("instance", a), ("role", r),
                                                  ("worker", w)) if v},
                     "value": [2000, "0" if fault == "target-down" and w == "trainer-0" else "1"]}
                    for j, a, r, w in targets]}
            elif 'job="store"' in expr:
                served = "0" if fault == "store-unused" else "12.5"
                data = {"resultType": "vector", "result": [{"metric": {}, "value": [2000, served]}]}
            else:
                empty = fault == "empty-panel" and expr == empty_expr
                data = {"resultType": "vector",
                        "result": [] if empty else [{"metric": {}, "value": [2000, "1"]}]}
            body = json.dumps({"status": "success", "data": data}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "prometheus").mkdir()
    (tmp_path / "prometheus" / "targets.json").write_text(json.dumps(
        [{"targets": [a], "labels": {"role": r, "worker": w}}
         for j, a, r, w in targets if j == "controller"]))
    (tmp_path / "summary.json").write_text(json.dumps(
        {"status": "failed" if fault == "summary-failed" else "ok", "iterations": 10,
         "samples": 640, "wall_seconds": 3.0}))
    try:
        rc = check.main(["--prometheus", f"http://127.0.0.1:{server.server_address[1]}",
                         "--run-dir", str(tmp_path), "--iterations", "10",
                         "--since", str(time.time() - 60), "--skip-job", "grafana"])
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    expected = {"none": "", "target-down": "target never up: job=controller",
                "not-at-once": "never up at the same time",
                "empty-panel": "Queue depth per task and shard: no data",
                "store-unused": "standalone store service served no requests",
                "summary-failed": "status 'failed'", "role-missing": "role(s) ['reward']"}[fault]
    assert rc == (fault != "none"), err
    assert expected in err, err
