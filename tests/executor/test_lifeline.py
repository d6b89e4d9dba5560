"""executor/lifeline.py with real processes: an executor whose serve was
SIGKILLed removes the private directory serve made for its socket (serve's
own clean-up at exit never ran); one stopped by a living serve leaves it to
serve."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# An executor still starting: the lifeline held, the graceful handler not yet installed.
CHILD = "from executor import lifeline; lifeline.hold(); import time; print('held', flush=True); time.sleep(60)"


def _child_env(parent: int, run_dir: str) -> dict[str, str]:
    return {**os.environ, "CBSERVE_PARENT_PID": str(parent), "CBSERVE_RUN_DIR": run_dir}


def _wait_gone(pid: int, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.parametrize("foreign", [None, "notes.txt"])
def test_an_orphaned_executor_removes_its_serves_directory(tmp_path, foreign):
    """What serve put there goes, and the directory with it; a file serve did
    not make keeps it (no more is removed than serve would have)."""
    run_dir = tmp_path / "cbserve-run"
    run_dir.mkdir()
    (run_dir / "executor-0.yaml").write_text("cache: {}\n")
    if foreign:
        (run_dir / foreign).write_text("kept\n")
    # A stand-in for serve: starts the child with its own pid as the parent, prints the child's pid.
    parent_code = (
        "import os, subprocess, sys, time\n"
        f"env = {{**os.environ, 'CBSERVE_PARENT_PID': str(os.getpid()), 'CBSERVE_RUN_DIR': {str(run_dir)!r}}}\n"
        f"child = subprocess.Popen([sys.executable, '-c', {CHILD!r}], env=env, stdout=subprocess.PIPE, text=True)\n"
        "child.stdout.readline()\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        took = _wait_gone(child, 10)
        assert took < 5, f"the orphan lived {took:.1f} s"
        if foreign:
            assert sorted(p.name for p in run_dir.iterdir()) == [foreign]
        else:
            assert not run_dir.exists()
    finally:
        parent.kill()
        parent.wait()


def test_an_executor_stopped_by_a_living_serve_leaves_the_directory_to_it(tmp_path):
    run_dir = tmp_path / "cbserve-run"
    run_dir.mkdir()
    env = _child_env(os.getpid(), str(run_dir))
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    child.send_signal(signal.SIGTERM)
    assert child.wait(10) == -signal.SIGTERM  # it dies of the signal, as before the lifeline's handler
    assert run_dir.exists()
