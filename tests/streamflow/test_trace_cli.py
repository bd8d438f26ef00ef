"""The run's trace on disk (streamflow.tracefile) and `streamflow trace` (streamflow.trace) over a
synthetic trace directory: the explicit schema as written and read back by pyarrow's readers, the
summary, one row's story, the slowest rows, JSON, and the one-line errors. (A real run's trace is
checked in tests/streamflow/test_controller.py and test_run_faults.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from streamflow.cli import main
from streamflow.tracefile import TRACE_SCHEMA, TraceWriter, read_trace, trace_bytes_per_row
from workers.runtime.events import RowTrace


def _records(t0: float = 1000.0) -> list[RowTrace]:
    """Rows 1 and 2 of group 4 (iteration 2): row 1 cut at token 3 under v2 and resumed under v3
    after a failed delivery; row 2 uncut; an environment call on row 2."""
    both = [1, 2]
    return [
        RowTrace("put", "put", "controller", t0, both, groups=[4, 4], iterations=[2, 2]),
        RowTrace("claim", "rollout", "rollout-0", t0 + 0.1, both, 11, [1, 1], [4, 4], [2, 2]),
        RowTrace("write", "rollout", "rollout-0", t0 + 0.5, [1], 11, [1], seconds=0.4,
                 columns=["piece0_ids", "piece0_version", "piece0_end"], versions=[2], tokens=[3],
                 ends=["cut"]),
        RowTrace("write", "rollout", "rollout-0", t0 + 0.5, [2], 11, [1], seconds=0.4,
                 columns=["response_ids", "policy_version"], versions=[2], tokens=[5],
                 runs=[[0, 2]]),
        RowTrace("ack", "rollout", "rollout-0", t0 + 0.6, both, 11, [1, 1]),
        # a resume that does not claim group/iteration: the writer fills them from the put
        RowTrace("claim", "rollout.1", "rollout-1", t0 + 0.7, [1], 12, [1]),
        RowTrace("fail", "rollout.1", "rollout-1", t0 + 0.8, [1], 12, [1], error="boom"),
        RowTrace("claim", "rollout.1", "rollout-0", t0 + 0.9, [1], 13, [2]),
        RowTrace("write", "rollout.1", "rollout-0", t0 + 1.2, [1], 13, [2], seconds=0.3,
                 columns=["response_ids", "response_version_runs", "piece1_ids"], versions=[3],
                 tokens=[8], runs=[[0, 2, 3, 3]], ends=["stop"]),
        RowTrace("write", "env.1", "environment-0", t0 + 1.3, [2], 14, [1],
                 columns=["piece1_ids"], tokens=[4], tools=["calculator"], tool_seconds=[0.02],
                 tool_errors=["tool_error"], ends=["observation"]),
        RowTrace("claim", "trainer", "trainer-0", t0 + 1.5, both, 15, [1, 1], [4, 4], [2, 2]),
        RowTrace("consume", "trainer", "trainer-0", t0 + 2.0, [2], 15, [1], [4], [2],
                 columns=["advantage"], versions=[3]),
        RowTrace("consume", "trainer", "trainer-0", t0 + 2.5, [1], 15, [1], [4], [2],
                 columns=["advantage"], versions=[3]),
    ]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    writer = TraceWriter(run / "trace")
    records = _records()
    for rec in records[:5]:
        writer.add(rec)
    writer.flush()  # two part files, as two iteration records leave
    for rec in records[5:]:
        writer.add(rec)
    writer.close()
    (run / "config.yaml").write_text("run:\n  trace: true\n")
    return run


def test_a_part_file_is_written_once_the_buffer_is_big_or_old_enough(tmp_path: Path):
    # what breaks it: a part file per look (the fixed footer cost per iteration), or a buffer
    # that is never written before the end (a crash would lose the whole trace)
    writer = TraceWriter(tmp_path / "trace", flush_rows=4, flush_s=3600.0)
    records = _records()
    writer.add(records[0])
    writer.add(records[1])  # 2 + 2 event rows: due
    assert writer.flush_due() is not None and writer.flush_due() is None
    writer.add(records[2])
    assert writer.flush_due() is None  # 1 row, and not old
    writer.flush_s = 0.0
    assert writer.flush_due() is not None
    writer.close()
    assert len(list((tmp_path / "trace").glob("part-*.parquet"))) == 2


def test_the_trace_directory_loads_with_its_explicit_schema(run_dir: Path):
    parts = sorted((run_dir / "trace").glob("*.parquet"))
    assert [p.name for p in parts] == ["part-000000.parquet", "part-000001.parquet"]
    # what breaks it: a column whose type drifts from TRACE_SCHEMA, a file readers cannot join
    assert ds.dataset(run_dir / "trace").schema == TRACE_SCHEMA
    table = pq.read_table(run_dir / "trace")  # what pandas.read_parquet(dir) reads
    assert table.schema == TRACE_SCHEMA and table.num_rows == sum(
        len(r.row_ids) for r in _records())
    rows = read_trace(run_dir / "trace").to_pylist()
    resumed = [r for r in rows if r["task"] == "rollout.1" and r["event"] == "claim"]
    assert [(r["group_id"], r["iteration"], r["delivery"]) for r in resumed] == [
        (4, 2, 1), (4, 2, 2)]  # filled from the put
    tool = next(r for r in rows if r["tool"])
    assert (tool["tool"], tool["error"], tool["tokens"]) == ("calculator", "tool_error", 4)
    assert tool["tool_seconds"] == pytest.approx(0.02)
    done = next(r for r in rows if r["task"] == "rollout.1" and r["event"] == "write")
    assert done["version_runs"] == [{"start": 0, "version": 2}, {"start": 3, "version": 3}]
    assert trace_bytes_per_row(run_dir) == pytest.approx(
        sum(p.stat().st_size for p in parts) / 2)


def test_the_cli_tells_a_rows_story(run_dir: Path, capsys):
    assert main(["trace", str(run_dir), "--row", "1"]) == 0
    out = capsys.readouterr().out
    assert "row 1: iteration 2, group 4, put->consumed 2.500s; v2: tokens 0-2, v3: 3-7" in out
    lines = [x for x in out.splitlines() if "│ +" in x]
    assert [x.split("│")[3].strip() for x in lines] == [
        "put", "claim", "write", "ack", "claim", "fail", "claim", "write", "claim", "consume"]
    assert "12/1" in out and "13/2" in out and "boom" in out
    assert main(["trace", str(run_dir), "--group", "4"]) == 0
    out = capsys.readouterr().out
    assert "row 1:" in out and "row 2:" in out and "calculator 20.0ms" in out
    assert main(["trace", str(run_dir), "--slowest", "1", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert [(r["row_id"], r["put_to_consumed_s"]) for r in ranked] == [(1, pytest.approx(2.5))]


def test_the_summary_counts_redeliveries_cuts_resumes_and_tools(run_dir: Path, capsys):
    assert main(["trace", str(run_dir), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert {k: facts[k] for k in ("rows", "consumed", "redeliveries", "failed_deliveries",
                                  "cuts", "resumes", "tool_calls", "tool_errors")} == {
        "rows": 2, "consumed": 2, "redeliveries": 1, "failed_deliveries": 1, "cuts": 1,
        "resumes": 1, "tool_calls": 1, "tool_errors": 1}
    assert [r["row_id"] for r in facts["slowest"]] == [1, 2]
    assert main(["trace", str(run_dir)]) == 0
    assert "redeliveries" in capsys.readouterr().out


def test_bad_input_is_one_line_and_exit_2(run_dir: Path, tmp_path: Path, capsys):
    untraced = tmp_path / "untraced"
    (untraced / "trace").mkdir(parents=True)
    (untraced / "config.yaml").write_text("run:\n  trace: false\n")
    cases = {
        (str(run_dir), "--row", "999"): f"streamflow trace: run {run_dir} has no row 999",
        (str(run_dir), "--group", "7"): f"streamflow trace: run {run_dir} has no group 7",
        (str(untraced),): f"streamflow trace: {untraced} has no trace (run.trace was false)",
        (str(tmp_path / "nope"),): f"streamflow trace: no run directory {tmp_path / 'nope'}",
    }
    for args, message in cases.items():
        assert main(["trace", *args]) == 2, args
        err = capsys.readouterr().err
        assert err == f"error: {message}\n", err  # one line, no traceback
