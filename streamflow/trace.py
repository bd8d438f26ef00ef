"""``streamflow trace RUN [--group G | --row R | --slowest N] [--json]``: one sample's story.

Reads ``RUN/trace`` (``streamflow.tracefile``) and prints either a summary of the run (rows,
redeliveries, cuts and resumes, tool calls, the slowest rows), or per selected row a header
(iteration, group, put to consumed, which policy versions generated which tokens) and one line per
event in time order, or the rows ranked by put to consumed. ``--json``: the same as one JSON
document. Bad input raises ``TraceError`` with one line (the CLI exits 2). Design: docs/partial.md
"The trace".
"""

from __future__ import annotations

import io
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import yaml
from rich.console import Console
from rich.table import Table

from streamflow.tracefile import read_trace

PREFIX = "streamflow trace"
SUMMARY_SLOWEST = 5  # rows the summary lists


class TraceError(Exception):
    """A run directory, trace, row or group that is not there (one line)."""


def load(run_dir: str | Path) -> pa.Table:
    """The run's trace, in time order; TraceError when there is none."""
    path = Path(run_dir)
    if not path.is_dir():
        raise TraceError(f"{PREFIX}: no run directory {run_dir}")
    table = read_trace(path / "trace")
    if table.num_rows == 0:
        raise TraceError(f"{PREFIX}: {run_dir} has no trace ({_why_none(path)})")
    return table.take(pc.sort_indices(table, [("t", "ascending")]))


def _why_none(path: Path) -> str:
    try:
        traced = (yaml.safe_load((path / "config.yaml").read_text()) or {})["run"].get("trace")
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return "no config.yaml: not a run directory?"
    return "run.trace was false" if traced is False else "nothing recorded yet"


def _select(table: pa.Table, column: str, value: int) -> pa.Table:
    return table.filter(pc.equal(table.column(column), pa.scalar(value, table.schema.field(
        column).type)))


def row_stories(table: pa.Table) -> list[dict[str, Any]]:
    """Per row of ``table`` (in order of first event): its header facts and its events."""
    by_row: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for event in table.to_pylist():
        by_row[event["row_id"]].append(event)
    return [_story(row_id, events) for row_id, events in by_row.items()]


def _story(row_id: int, events: list[dict[str, Any]]) -> dict[str, Any]:
    put = next((e["t"] for e in events if e["event"] == "put"), None)
    consumed = next((e["t"] for e in events if e["event"] == "consume"), None)
    first = next((e for e in events if e["group_id"] is not None), events[0])
    start = put if put is not None else events[0]["t"]
    return {
        "row_id": row_id, "group_id": first["group_id"], "iteration": first["iteration"],
        "put_to_consumed_s": consumed - put if put is not None and consumed is not None else None,
        "versions": _versions(events),
        "deliveries": max((e["delivery"] or 0 for e in events), default=0),
        "events": [{**e, "offset_s": e["t"] - start} for e in events],
    }


def _versions(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Which versions generated which tokens: the newest write's runs over its response
    (start, end exclusive), else each write's (version, tokens) in time order."""
    writes = [e for e in events if e["event"] == "write" and e["tokens"] is not None]
    with_runs = [e for e in writes if e["version_runs"]]
    if with_runs:
        last = with_runs[-1]
        runs = last["version_runs"]
        ends = [r["start"] for r in runs[1:]] + [last["tokens"]]
        return [{"version": r["version"], "start": r["start"], "end": end}
                for r, end in zip(runs, ends, strict=True)]
    return [{"version": e["policy_version"], "tokens": e["tokens"], "task": e["task"]}
            for e in writes if e["policy_version"] is not None]


def versions_text(versions: list[dict[str, Any]]) -> str:
    """``v3: tokens 0-511, v4: 512-980`` (or ``v3 (rollout): 12 tokens, ...``)."""
    parts = []
    for i, v in enumerate(versions):
        if "start" in v:
            span = f"{v['start']}-{v['end'] - 1}" if v["end"] > v["start"] else "none"
            parts.append(f"v{v['version']}: {'tokens ' if i == 0 else ''}{span}")
        else:
            parts.append(f"v{v['version']} ({v['task']}): {v['tokens']} tokens")
    return ", ".join(parts) or "-"


def summary(table: pa.Table) -> dict[str, Any]:
    """Counts over the whole trace, and the slowest rows."""
    cols = {name: table.column(name).to_pylist() for name in (
        "event", "task", "delivery", "tool", "error", "end", "row_id")}
    events, tasks = cols["event"], cols["task"]
    writes = [i for i, e in enumerate(events) if e == "write"]
    return {
        "rows": sum(1 for e in events if e == "put"),
        "events": len(events),
        "consumed": sum(1 for e in events if e == "consume"),
        "redeliveries": sum(1 for i, e in enumerate(events)
                            if e == "claim" and (cols["delivery"][i] or 1) > 1),
        "failed_deliveries": events.count("fail"),
        "fenced": events.count("fenced"),
        "kept": events.count("kept"),
        "cuts": sum(1 for i in writes if cols["end"][i] == "cut"),
        "resumes": _resumes(writes, cols["row_id"], cols["end"], tasks),
        "tool_calls": sum(1 for i in writes if cols["tool"][i]),
        "tool_errors": sum(1 for i in writes if cols["tool"][i] and cols["error"][i]),
        "slowest": slowest(table, SUMMARY_SLOWEST),
    }


def _resumes(writes: list[int], rows: list[int], ends: list[str | None],
             tasks: list[str]) -> int:
    """Writes of ``rollout.{k}`` continuing a piece k-1 that a write of the row's task for
    piece k-1 ended "cut" (by task, not by time: a write is stamped when it is traced)."""
    def piece(task: str) -> int | None:
        if task == "rollout":
            return 0
        return int(task.split(".")[1]) if task.startswith("rollout.") else None

    cut = {(rows[i], piece(tasks[i])) for i in writes if ends[i] == "cut"}
    return sum(1 for i in writes if (k := piece(tasks[i])) and (rows[i], k - 1) in cut)


def slowest(table: pa.Table, n: int) -> list[dict[str, Any]]:
    """The ``n`` rows with the longest put to consumed (rows never consumed left out)."""
    keep = pc.is_in(table.column("event"), pa.array(["put", "consume", "claim", "write"]))
    stories = [s for s in row_stories(table.filter(keep)) if s["put_to_consumed_s"] is not None]
    stories.sort(key=lambda s: -s["put_to_consumed_s"])
    return [{k: v for k, v in s.items() if k != "events"} for s in stories[:n]]


def _render(build: Callable[[Console], None]) -> str:
    buf = io.StringIO()
    build(Console(file=buf, width=160, color_system=None, force_terminal=False))
    return buf.getvalue()


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def _slowest_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="rows by put -> consumed")
    for name, just in (("row", "right"), ("iteration", "right"), ("group", "right"),
                       ("put->consumed", "right"), ("deliveries", "right"), ("versions", "left")):
        table.add_column(name, justify=just)  # type: ignore[arg-type]
    for s in rows:
        table.add_row(str(s["row_id"]), str(s["iteration"]), str(s["group_id"]),
                      _seconds(s["put_to_consumed_s"]), str(s["deliveries"]),
                      versions_text(s["versions"]))
    return table


def _event_cell(e: dict[str, Any]) -> list[str]:
    lease = f"{e['lease_id']}/{e['delivery']}" if e["lease_id"] is not None else "-"
    cols = ",".join(e["columns"] or ())
    tool = (f"{e['tool']} {e['tool_seconds'] * 1000:.1f}ms" if e["tool"] else "")
    version = f"v{e['policy_version']}" if e["policy_version"] is not None else ""
    tokens = str(e["tokens"]) if e["tokens"] is not None else ""
    return [f"+{e['offset_s']:.3f}s", e["task"], e["event"], e["worker"], lease,
            cols if len(cols) <= 60 else cols[:57] + "...", tokens, version, tool,
            (e["error"] or "")[:80]]


def render_rows(stories: list[dict[str, Any]]) -> str:
    def build(console: Console) -> None:
        for s in stories:
            console.print(f"row {s['row_id']}: iteration {s['iteration']}, group "
                          f"{s['group_id']}, put->consumed {_seconds(s['put_to_consumed_s'])}; "
                          f"{versions_text(s['versions'])}", soft_wrap=True)
            table = Table()
            for name in ("offset", "task", "event", "worker", "lease/delivery", "columns",
                         "tokens", "version", "tool", "error"):
                table.add_column(name)
            for e in s["events"]:
                table.add_row(*_event_cell(e))
            console.print(table)
    return _render(build)


def render_summary(run_dir: str, facts: dict[str, Any]) -> str:
    def build(console: Console) -> None:
        console.print(f"trace of {run_dir}", soft_wrap=True)
        table = Table()
        table.add_column("what")
        table.add_column("count", justify="right")
        for key, value in facts.items():
            if key != "slowest":
                table.add_row(key.replace("_", " "), str(value))
        console.print(table)
        console.print(_slowest_table(facts["slowest"]))
    return _render(build)


def render(run_dir: str, *, group: int | None = None, row: int | None = None,
           slowest_n: int | None = None, as_json: bool = False) -> str:
    """What ``streamflow trace`` prints; TraceError (one line) on bad input."""
    table = load(run_dir)
    if row is not None or group is not None:
        column, value, what = ("row_id", row, "row") if row is not None else (
            "group_id", group, "group")
        if value is None or value < 0:
            raise TraceError(f"{PREFIX}: run {run_dir} has no {what} {value}")
        rows = _select(table, column, value)
        if rows.num_rows == 0:
            raise TraceError(f"{PREFIX}: run {run_dir} has no {what} {value}")
        if column == "group_id":  # every event of the group's rows (a put carries the group)
            rows = table.filter(pc.is_in(table.column("row_id"), pc.unique(rows["row_id"])))
        stories = row_stories(rows)
        return (json.dumps(stories, indent=1) + "\n" if as_json
                else render_rows(stories))
    if slowest_n is not None:
        if slowest_n < 1:
            raise TraceError(f"{PREFIX}: --slowest must be >= 1, got {slowest_n}")
        ranked = slowest(table, slowest_n)
        return (json.dumps(ranked, indent=1) + "\n" if as_json
                else _render(lambda c: c.print(_slowest_table(ranked))))
    facts = summary(table)
    return json.dumps(facts, indent=1) + "\n" if as_json else render_summary(run_dir, facts)
