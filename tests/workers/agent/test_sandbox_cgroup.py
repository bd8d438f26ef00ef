"""The sandbox's cap on the SUM of a call's memory and processes: a cgroup per call where this
host lets us write one (its limits, its members, its tmpfs charged to it, removed after the call),
and the per-process fallback forced by pointing the cgroup root at a path that does not exist."""

from __future__ import annotations

import logging
import os
import signal
import threading
import uuid

import pytest

from tests.workers.agent.test_sandbox import pids_running, wait_for
from workers.agent import cgroup
from workers.agent.observe import make_environment
from workers.agent.sandbox import SandboxLimits, SandboxResult, memory_plan, run_python
from workers.settings import AgentSettings

pytestmark = pytest.mark.slow  # every case starts real, isolated processes

MIB = 1024 * 1024

# Forks N children that each touch MB MiB and hold it until every child either holds its share or
# has ended; prints each child's exit code. Each child stays under memory_mb, their sum does not.
SUM_CODE = """
import os, select
N, MB = {n}, {mb}
r, w = os.pipe()
go_r, go_w = os.pipe()
kids = []
for _ in range(N):
    try:
        pid = os.fork()
    except OSError:  # the process limit
        break
    if pid == 0:
        os.close(r)
        os.close(go_w)
        try:
            held = b'x' * (MB << 20)  # every page written
        except MemoryError:
            os._exit(3)
        os.write(w, b'a')
        os.read(go_r, 1)
        os._exit(0)
    kids.append(pid)
os.close(w)
os.close(go_r)
holding, codes = 0, {{}}
while kids and holding + len(codes) < len(kids):
    if select.select([r], [], [], 0.05)[0]:
        holding += len(os.read(r, 64))
    while len(codes) < len(kids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        codes[pid] = os.waitstatus_to_exitcode(status)
os.close(go_w)
for pid in kids:
    if pid not in codes:
        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print('codes', sorted(codes.values()))
"""


def child_codes(res: SandboxResult) -> list[int]:
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("codes "))
    return [int(c) for c in line[len("codes "):].strip("[]").split(",") if c.strip()]


def leftovers() -> list[str]:
    """This process's call cgroups still on the host."""
    prefix = f"streamflow-sandbox-{os.getpid()}-"
    return [os.path.join(p, d) for p in cgroup.host().parents for d in os.listdir(p)
            if d.startswith(prefix)]


def cgroups_writable_here() -> bool:
    """Root, with the memory+pids cgroup hierarchies (v2, or v1) mounted read-write."""
    if os.geteuid() != 0:
        return False
    with open("/proc/self/mounts") as f:
        mounts = [ln.split() for ln in f]
    return any(m[2] == "cgroup2" and m[1] == cgroup.ROOT and "rw" in m[3].split(",")
               for m in mounts) or all(
        any(m[2] == "cgroup" and name in m[3].split(",") and "rw" in m[3].split(",")
            for m in mounts) for name in ("memory", "pids"))


needs_cgroups = pytest.mark.skipif(not cgroups_writable_here(),
                                   reason="needs root and read-write memory and pids cgroups")


@pytest.fixture(autouse=True)
def no_cgroup_left():
    yield
    assert leftovers() == []


@pytest.fixture
def peaks(monkeypatch):
    """The peak memory of each call's cgroup, read just before it is removed."""
    seen: list[int | None] = []
    close = cgroup.CallCgroup.close

    def recording_close(self, timeout_s: float = 5.0) -> None:
        seen.append(self.peak_bytes())
        close(self, timeout_s)

    monkeypatch.setattr(cgroup.CallCgroup, "close", recording_close)
    return seen


@needs_cgroups
def test_a_writable_host_caps_each_call_with_a_cgroup():
    plan = memory_plan(SandboxLimits(memory_mb=256, max_processes=16))
    assert plan.mode in (cgroup.V1, cgroup.V2), plan
    assert (plan.process_mb, plan.tmpfs_mb, plan.processes) == (256, 256, 16)


@needs_cgroups
def test_processes_whose_sum_exceeds_memory_mb_are_stopped(peaks):
    limits = SandboxLimits(wall_s=30.0, memory_mb=96, max_processes=8)
    res = run_python(SUM_CODE.format(n=4, mb=40), limits)  # 4 x 40 MiB, each under 96
    codes = child_codes(res)
    assert len(codes) == 4 and codes.count(0) < 4, res  # not all of them held their 40 MiB
    assert -signal.SIGKILL in codes  # the cgroup's OOM killer ended one
    assert peaks and peaks[0] is not None and peaks[0] <= limits.memory_mb * MIB, peaks


@needs_cgroups
def test_the_tmpfs_counts_toward_the_calls_memory(peaks):
    limits = SandboxLimits(wall_s=30.0, memory_mb=96)
    code = ("chunk = b'x' * (1 << 20)\nwith open('big', 'wb') as f:\n"
            "    for _ in range(64):\n        f.write(chunk)\n"
            "print('written', flush=True)\nheld = b'y' * (48 << 20)\nprint('allocated')")
    res = run_python(code, limits)  # 64 MiB on the tmpfs + 48 MiB in the process: over 96
    assert res.stdout == "written\n" and res.error == "memory", res
    assert 64 * MIB <= peaks[0] <= limits.memory_mb * MIB, peaks  # the file's pages were charged


@needs_cgroups
def test_the_call_runs_inside_its_cgroup_which_is_removed_after():
    marker = f"inside-{uuid.uuid4().hex}"
    limits = SandboxLimits(wall_s=30.0, memory_mb=128, max_processes=8)
    results: list[SandboxResult] = []
    call = threading.Thread(target=lambda: results.append(
        run_python(f"import time  # {marker}\ntime.sleep(60)", limits)))
    call.start()
    try:
        wait_for(lambda: bool(pids_running(marker)) and bool(leftovers()), 20.0,
                 "the payload running and its cgroup made")
        dirs = leftovers()
        mem, pids = dirs[0], dirs[-1]
        memory_file = "memory.max" if cgroup.host().mode == cgroup.V2 else "memory.limit_in_bytes"
        with open(os.path.join(mem, memory_file)) as f:
            assert int(f.read()) == 128 * MIB
        with open(os.path.join(pids, "pids.max")) as f:
            assert int(f.read()) == 8 + cgroup.LAUNCHER_PROCESSES
        payload = pids_running(marker)
        for path in dirs:  # the launcher, its two helpers and the code: all inside
            with open(os.path.join(path, "cgroup.procs")) as f:
                members = {int(p) for p in f.read().split()}
            assert set(payload) <= members and len(members) >= 4, (members, payload)
        for pid in payload:
            os.kill(pid, signal.SIGKILL)
    finally:
        call.join(timeout=30)
    assert results and results[0].error == "killed", results
    assert leftovers() == [] and not any(os.path.exists(d) for d in dirs)


def test_without_a_cgroup_the_fallback_bounds_the_sum(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cgroup, "ROOT", str(tmp_path / "no-cgroups"))
    limits = SandboxLimits(wall_s=30.0, memory_mb=256, max_processes=16)
    plan = memory_plan(limits)
    assert plan.mode == cgroup.FALLBACK and "no-cgroups" in plan.reason
    assert plan.processes * plan.process_mb + plan.tmpfs_mb <= limits.memory_mb
    assert plan.process_mb >= cgroup.FALLBACK_MIN_PROCESS_MB and plan.processes < 16
    # the limits inside are the plan's
    code = ("import resource as r, os\n"
            "for n in ('AS', 'NPROC', 'FSIZE'):\n    print(n, r.getrlimit(getattr(r, 'RLIMIT_' + n)))\n"
            "st = os.statvfs('/sandbox')\nprint('tmpfs', st.f_blocks * st.f_frsize)")
    res = run_python(code, limits)
    as_, fsize = plan.process_mb * MIB, plan.tmpfs_mb * MIB
    assert res.stdout.splitlines() == [
        f"AS ({as_}, {as_})", f"NPROC ({plan.processes}, {plan.processes})",
        f"FSIZE ({fsize}, {fsize})", f"tmpfs {fsize}"], res
    # what a cgroup stops, the fallback stops too: no child can hold 40 MiB
    res = run_python(SUM_CODE.format(n=4, mb=40), limits)
    codes = child_codes(res)
    assert codes and codes.count(0) == 0, res
    # and the standard library still imports
    res = run_python("import json, re, collections, fractions, decimal\nprint('ok')", limits)
    assert res.stdout == "ok\n" and res.error is None, res
    # the environment worker says which mode holds when it makes the python tool
    with caplog.at_level(logging.INFO, logger="workers.agent.observe"):
        make_environment(AgentSettings(max_turns=2, fn="python"))
    assert any(cgroup.FALLBACK in r.getMessage() and "no-cgroups" in r.getMessage()
               for r in caplog.records), caplog.text


def test_v2_without_the_pids_controller_falls_back(monkeypatch, tmp_path):
    with open("/proc/self/cgroup") as f:  # "0::/path": the caller's own v2 cgroup, and its parent
        own = next(ln.rstrip("\n").split(":", 2)[2] for ln in f if ln.startswith("0::"))
    for level in {own, os.path.dirname(own)}:
        (tmp_path / level.lstrip("/")).mkdir(parents=True, exist_ok=True)
        (tmp_path / level.lstrip("/") / "cgroup.controllers").write_text("cpu memory io\n")
    monkeypatch.setattr(cgroup, "ROOT", str(tmp_path))
    host = cgroup.host()
    assert host.mode == cgroup.FALLBACK and "['pids'] not available" in host.reason, host


def test_the_mode_is_logged_when_the_python_environment_is_made(caplog):
    with caplog.at_level(logging.INFO, logger="workers.agent.observe"):
        make_environment(AgentSettings(max_turns=2, fn="python"))
    expected = memory_plan(AgentSettings(max_turns=2, fn="python").sandbox.limits()).describe()
    assert [r.getMessage() for r in caplog.records if r.name == "workers.agent.observe"] == [
        f"python tool sandbox: {expected}"]
