"""What docker/ci.sh checks once the compose stack's job has ended (standard library only: it runs
with the host's python3, outside the project's venv).

- The run's summary.json (copied out of the ``runs`` volume): status ok, every iteration done,
  samples trained on.
- Prometheus's HTTP API (on 127.0.0.1): every target it ever scraped was up, every role of the run
  was among them (the standalone store node, the controller, rollout, reward, trainer, and every
  endpoint the run's targets.json listed), and there was a moment when all of them were up at once.
- At that moment, a handful of the Grafana dashboards' own PromQL queries (read from
  grafana/dashboards/*.json by panel title, so a renamed panel fails here) return data, and the
  store's requests came from the standalone ``store`` service (the controller really used it).

Exit status 0 when everything holds; otherwise one line per failure on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "grafana" / "dashboards"
# (dashboard, panel title): one or two panels of each dashboard, covering the run, the data plane
# (the standalone store node) and the workers.
PANELS = [
    ("overview.json", "Policy version"),
    ("overview.json", "Scrape targets up"),
    ("overview.json", "Samples / s and generated tokens / s"),
    ("overview.json", "Stage utilisation (busy fraction per worker, averaged per stage)"),
    ("data-plane.json", "Queue depth per task and shard"),
    ("data-plane.json", "Requests / s per verb"),
    ("data-plane.json", "Store memory per table"),
    ("workers.json", "Rows processed / s per worker"),
    ("workers.json", "Resident memory per process"),
]
ROLES = {"store", "controller", "rollout", "reward", "trainer"}
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: never a proxy


class Failure(Exception):
    pass


def api(base: str, path: str, **params: object) -> list | dict:
    url = f"{base}/api/v1/{path}?" + urllib.parse.urlencode(params)
    try:
        with _HTTP.open(url, timeout=15) as resp:
            reply = json.loads(resp.read())
    except urllib.error.HTTPError as err:  # 400/422 carry the PromQL error as JSON
        reply = json.loads(err.read() or b"{}")
    except (urllib.error.URLError, OSError) as err:
        raise Failure(f"Prometheus at {base} unreachable: {err}") from err
    if reply.get("status") != "success":
        raise Failure(f"Prometheus {path} {params}: {reply.get('error', reply)}")
    return reply["data"]


def panel_exprs(board: str, title: str) -> list[str]:
    panels = json.loads((DASHBOARDS / board).read_text())["panels"]
    exprs = [t["expr"] for p in panels if p.get("title") == title for t in p.get("targets", [])]
    if not exprs:
        raise Failure(f"grafana/dashboards/{board}: no panel titled {title!r}")
    return exprs


def _target(metric: dict) -> str:
    return f"job={metric.get('job')} instance={metric.get('instance')} worker={metric.get('worker', '-')}"


def check_summary(run_dir: Path, iterations: int) -> list[str]:
    path = run_dir / "summary.json"
    if not path.is_file():
        return [f"{path.name} missing on the runs volume (the job wrote no summary)"]
    s = json.loads(path.read_text())
    bad = []
    if s.get("status") != "ok":
        bad.append(f"summary.json: status {s.get('status')!r}, error {s.get('error')!r}")
    if s.get("iterations") != iterations:
        bad.append(f"summary.json: {s.get('iterations')} iterations, expected {iterations}")
    if not s.get("samples"):
        bad.append("summary.json: no samples trained on")
    print(f"summary.json: status={s.get('status')} iterations={s.get('iterations')} "
          f"samples={s.get('samples')} reward {s.get('reward_mean_first')} -> "
          f"{s.get('reward_mean_last')} wall={s.get('wall_seconds', 0):.1f}s")
    return bad


def check_prometheus(base: str, run_dir: Path, since: float, skip_jobs: set[str]) -> list[str]:
    now = time.time()
    window = max(60, int(now - since) + 60)
    skip = "|".join(sorted(skip_jobs)) or "^$"
    sel = f'up{{job!~"{skip}"}}'
    ever = api(base, "query", query=f"max_over_time({sel}[{window}s])", time=now)["result"]
    bad = [f"target never up: {_target(s['metric'])}" for s in ever if float(s["value"][1]) < 1]
    roles = {s["metric"].get("role") for s in ever}
    if missing := ROLES - roles:
        bad.append(f"no scrape target of role(s) {sorted(missing)}; saw {sorted(map(str, roles))}")
    listed = run_dir / "prometheus" / "targets.json"
    scraped = {s["metric"].get("instance") for s in ever}
    if listed.is_file():
        for group in json.loads(listed.read_text()):
            for address in group["targets"]:
                if address not in scraped:
                    bad.append(f"targets.json lists {address} ({group['labels']}), never scraped")
    # How many times each was scraped up: the margin the run's length left over discovery.
    ups = {(s["metric"].get("job"), s["metric"].get("worker", "-")): int(float(s["value"][1]))
           for s in api(base, "query", query=f"sum_over_time({sel}[{window}s])", time=now)["result"]}
    names = sorted(f"{job}/{worker} ({n} up)" for (job, worker), n in ups.items())
    print(f"prometheus: {len(ever)} targets scraped during the run: {', '.join(names)}")
    if bad:
        return bad

    # The last moment every one of them was up at once: the dashboards are evaluated there.
    step = 1
    series = api(base, "query_range", query=f"count({sel} == 1)", start=since, end=now,
                 step=step)["result"]
    full = [float(t) for t, v in (series[0]["values"] if series else []) if int(v) == len(ever)]
    if not full:
        peak = max((int(v) for _, v in series[0]["values"]), default=0) if series else 0
        return [f"the {len(ever)} targets were never up at the same time (at most {peak})"]
    at = full[-1]
    print(f"prometheus: all {len(ever)} targets up at once, last at "
          f"{time.strftime('%H:%M:%S', time.gmtime(at))} UTC; dashboards evaluated there")
    for board, title in PANELS:
        for expr in panel_exprs(board, title):
            result = api(base, "query", query=expr, time=at)["result"]
            values = [float(r["value"][1]) for r in result]
            if not result:
                bad.append(f"{board} / {title}: no data: {expr}")
            else:
                shown = ", ".join(f"{v:.3g}" for v in values[:4] if not math.isnan(v))
                print(f"  {board} / {title}: {len(result)} series [{shown}]")
    requests = api(base, "query", time=at,
                   query='sum(rate(streamflow_store_request_duration_seconds_count{job="store"}[1m]))')
    served = float(requests["result"][0]["value"][1]) if requests["result"] else 0.0
    if not served > 0:
        bad.append("the standalone store service served no requests (job=store): "
                   "the run did not use store.addresses")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    ap.add_argument("--run-dir", required=True, type=Path,
                    help="a copy of the run's directory (summary.json, prometheus/targets.json)")
    ap.add_argument("--iterations", required=True, type=int)
    ap.add_argument("--since", required=True, type=float, help="epoch seconds the stack started")
    ap.add_argument("--skip-job", action="append", default=[],
                    help="a scrape job of a service not started (its target is down by design)")
    args = ap.parse_args(argv)
    try:
        bad = check_summary(args.run_dir, args.iterations)
        bad += check_prometheus(args.prometheus, args.run_dir, args.since, set(args.skip_job))
    except Failure as err:
        bad = [str(err)]
    for line in bad:
        print(f"CHECK FAILED: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
