"""The python-tool sandbox against what a model might write: network, files outside its directory,
fork bombs, memory, loops, output floods, signals at its parents, bad bytes. Each case must end as
a result within its limits while this (the calling) process stays up."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
import time
import uuid

import pytest

from workers.agent import sandbox
from workers.agent.sandbox import (
    SandboxLimits,
    SandboxResult,
    check_sandbox,
    memory_plan,
    run_python,
)

pytestmark = pytest.mark.slow  # every case starts real, isolated processes

# A wall-clock limit far above what a case needs: a loaded machine must not turn a normal run
# into a timeout (the timeout cases set their own, short limits).
FAST = SandboxLimits(wall_s=30.0, cpu_s=2.0, memory_mb=128, max_output_bytes=4096)


def wait_for(condition, deadline_s: float, what: str) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not within {deadline_s} s: {what}")
        time.sleep(0.05)


def pids_running(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker`` (the code is in the payload's argv)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(name))
        except OSError:  # gone meanwhile
            pass
    return found


def test_check_sandbox_works_on_this_machine():
    assert check_sandbox() is None


def test_normal_code_returns_stdout_and_exit_zero():
    res = run_python("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)", FAST)
    assert res == SandboxResult("42\n", "warn\n", 0, None, res.wall_s)
    assert 0 < res.wall_s < FAST.wall_s


def test_syntax_error_is_a_traceback_and_nonzero_exit_without_error():
    res = run_python("def f(:\n    pass", FAST)
    assert res.exit_code == 1 and res.error is None
    assert "SyntaxError" in res.stderr and res.stdout == ""


def test_loopback_connection_fails_and_listener_sees_nothing():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        code = ("import socket\n"
                f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "s.sendall(b'escaped')\nprint('connected')")
        res = run_python(code, FAST)
        assert "connected" not in res.stdout
        assert res.exit_code == 1 and "Network is unreachable" in res.stderr
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # no connection is waiting to be accepted
            listener.accept()


def test_files_outside_the_working_directory_are_invisible(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the-known-secret-content")
    target = tmp_path / "written.txt"
    # FileNotFoundError, not PermissionError: the path does not exist in there at all
    code = (f"try:\n    print(open({str(secret)!r}).read())\n"
            "except OSError as e:\n    print(type(e).__name__)\n"
            f"try:\n    open({str(target)!r}, 'w').write('escaped')\n"
            "except OSError as e:\n    print(type(e).__name__)\n")
    res = run_python(code, FAST)
    assert "the-known-secret-content" not in res.stdout + res.stderr
    assert res.stdout == "FileNotFoundError\nFileNotFoundError\n" and res.exit_code == 0
    assert not target.exists()
    # the host itself is not readable either: /etc and /proc are not there
    res = run_python("import os\nprint(sorted(os.listdir('/')))", FAST)
    assert res.stdout.strip() == str(sorted(["bin", "dev", "lib", "lib64", "root", "sandbox",
                                              "sbin", "usr"]))


def test_working_directory_is_fresh_and_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where run_python makes its dir
    first = run_python("import os\nopen('state.txt', 'w').write('x')\nprint(os.getcwd())", FAST)
    assert first.stdout == "/sandbox\n" and first.error is None
    assert list(tmp_path.iterdir()) == []  # the host-side directory is gone
    second = run_python("import os\nprint(os.listdir('.'))", FAST)
    assert second.stdout == "[]\n"


@pytest.mark.parametrize("body", [
    "while True:\n    os.fork()",
    # a bomb that survives its failed forks and leaves the process group: only the end of the
    # pid namespace stops it
    "while True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n"
    "    except OSError:\n        time.sleep(0.01)",
])
def test_fork_bomb_ends_and_leaves_no_process(body):
    marker = f"bomb-{uuid.uuid4().hex}"
    limits = SandboxLimits(wall_s=2.0, cpu_s=2.0, memory_mb=128, max_processes=16)
    try:
        res = run_python(f"import os, time  # {marker}\n{body}", limits)
        assert res.error is not None or res.exit_code != 0
        assert res.wall_s < limits.wall_s + 6.0  # the deadline plus the kill's grace
        wait_for(lambda: not pids_running(marker), 5.0, f"processes of {marker} gone")
    finally:  # if any escaped, stop them here (by pid) rather than leave them to the machine
        def killed_all() -> bool:
            for pid in pids_running(marker):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return not pids_running(marker)

        wait_for(killed_all, 10.0, f"escaped processes of {marker} killed")


def test_memory_beyond_the_limit_is_a_memory_error():
    limits = SandboxLimits(wall_s=30.0, cpu_s=2.0, memory_mb=64)
    res = run_python("chunks = [bytearray(1 << 20) for _ in range(2048)]\nprint('allocated')",
                     limits)
    assert res.error == "memory" and res.exit_code == 1
    assert res.stdout == "" and "MemoryError" in res.stderr


def test_infinite_loop_is_a_timeout():
    res = run_python("while True:\n    pass", FAST)
    assert res.error == "timeout"
    assert res.exit_code in (None, -signal.SIGXCPU)  # wall deadline, or the CPU limit first
    assert res.wall_s < FAST.wall_s + 6.0


def test_sleeping_past_the_wall_clock_is_a_timeout():
    limits = SandboxLimits(wall_s=1.0, cpu_s=5.0)
    res = run_python("import time\nprint('start', flush=True)\ntime.sleep(60)", limits)
    assert res.error == "timeout" and res.exit_code is None and res.stdout == "start\n"
    assert limits.wall_s <= res.wall_s < limits.wall_s + 6.0


def test_limits_are_applied_inside():
    code = ("import resource as r\n"
            "for n in ('CPU', 'AS', 'NPROC', 'FSIZE', 'NOFILE', 'CORE'):\n"
            "    print(n, r.getrlimit(getattr(r, 'RLIMIT_' + n)))")
    limits = SandboxLimits(cpu_s=2.0, memory_mb=64, max_processes=16)
    res = run_python(code, limits)
    plan = memory_plan(limits)  # where a cgroup caps the call: 64 MiB, 64 MiB and 16
    mib, fsize, nproc = plan.process_mb * 1024 * 1024, plan.tmpfs_mb * 1024 * 1024, plan.processes
    assert res.stdout.splitlines() == [
        "CPU (2, 3)", f"AS ({mib}, {mib})", f"NPROC ({nproc}, {nproc})", f"FSIZE ({fsize}, {fsize})",
        "NOFILE (64, 64)", "CORE (0, 0)"]


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_flood_is_cut_at_the_limit_promptly(stream):
    limits = SandboxLimits(wall_s=30.0, max_output_bytes=1000)
    res = run_python(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 1048576)", limits)
    assert res.error == "output_limit"
    assert getattr(res, stream) == "x" * limits.max_output_bytes
    assert res.wall_s < limits.wall_s  # killed at the limit, not at the deadline


def test_killing_its_parents_leaves_the_caller_up():
    me, group = os.getpid(), os.getpgrp()
    res = run_python("import os\nos.kill(os.getppid(), 9)\nprint('survived')", FAST)
    assert res.exit_code == 1 and "PermissionError" in res.stderr  # its init is not its to kill
    res = run_python("import os\nos.killpg(0, 9)\nprint('survived')", FAST)
    assert res.error == "killed" and res.exit_code == -signal.SIGKILL and res.stdout == ""
    # kill(-1) spares the sender and init, and sees nothing else: no process outside is named
    res = run_python("import os\nos.kill(-1, 9)\nprint('survived')", FAST)
    assert res.exit_code == 1 and "ProcessLookupError" in res.stderr
    assert os.getpid() == me and os.getpgrp() == group
    assert run_python("print('after')", FAST).stdout == "after\n"


def test_non_utf8_output_is_replaced():
    res = run_python("import sys\nsys.stdout.buffer.write(b'ok\\xff\\xfe\\n')", FAST)
    assert res.stdout == "ok\ufffd\ufffd\n" and res.error is None


@pytest.mark.parametrize("code", ["\ud800", "print('\ud800')", "x = 1\n# \udcff\nprint(x)"])
def test_a_lone_surrogate_in_the_code_is_a_syntax_error_of_the_code(code):
    # not encodable as UTF-8: the code's bytes (surrogatepass) reach Python, which refuses them
    res = run_python(code, FAST)
    assert res.error is None and res.exit_code == 1, res
    assert "SyntaxError" in res.stderr and res.stdout == ""


def test_a_surrogate_made_at_run_time_is_the_codes_own_error():
    res = run_python("print('ok')\nprint('\\ud800')", FAST)
    assert res.error is None and res.exit_code == 1 and res.stdout == "ok\n", res
    assert "UnicodeEncodeError" in res.stderr


def outer_uid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("Uid:"))
    except (OSError, StopIteration):
        return None


def test_concurrent_sandboxes_run_apart():
    # 4 sandboxes, each forks 6 children under a limit of 8: RLIMIT_NPROC counts per user
    # namespace, so one sandbox's processes never use up another's (or a worker's) allowance.
    # Seen from here, each runs under its own uid, and never under root's.
    markers = [f"apart-{uuid.uuid4().hex}" for _ in range(4)]
    code = ("import os, time  # {}\nkids = []\nfor _ in range(6):\n    pid = os.fork()\n"
            "    if pid == 0:\n        time.sleep(1.5)\n        os._exit(0)\n    kids.append(pid)\n"
            "for pid in kids:\n    os.waitpid(pid, 0)\nprint('ok')")
    limits = SandboxLimits(wall_s=30.0, max_processes=8)
    results: list[SandboxResult] = []
    threads = [threading.Thread(target=lambda m=m: results.append(run_python(code.format(m),
                                                                             limits)))
               for m in markers]
    for t in threads:
        t.start()
    uids: dict[str, int] = {}

    def all_seen() -> bool:
        for m in markers:
            for pid in pids_running(m):
                uid = outer_uid(pid)
                if uid is not None:
                    uids[m] = uid
        return len(uids) == len(markers) or not any(t.is_alive() for t in threads)

    wait_for(all_seen, 10.0, "every sandbox's processes seen")
    for t in threads:
        t.join(timeout=30)
    assert [r.stdout for r in results] == ["ok\n"] * 4, results
    assert len(uids) == 4 and len(set(uids.values())) == 4 and 0 not in uids.values(), uids


def test_unavailable_sandbox_runs_nothing(monkeypatch):
    monkeypatch.setattr(sandbox, "_check_result", ["no namespaces here"])
    res = run_python("print('ran')", FAST)
    assert res.error == "unavailable" and res.stdout == "" and res.exit_code is None
    assert res.stderr == "no namespaces here"
