"""CPU accounting of real processes through /proc."""

import os
import subprocess
import sys
import time

import pytest

from bench.proc_cpu import ServerCPU, children, own_cpu_s, process_cpu_s

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")

_BURN = (
    "import time, sys\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
    "print('done', flush=True)\nsys.stdin.read()"
)


def _burn_here(seconds: float) -> None:
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


def test_child_and_own_cpu_are_counted():
    cpu = ServerCPU(os.getpid())
    child = subprocess.Popen(
        [sys.executable, "-c", _BURN.format(s=0.4)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        cpu.start()
        _burn_here(0.3)
        assert child.stdout.readline().strip() == "done"  # the child burned its CPU and still lives
        assert child.pid in children(os.getpid())
        s = cpu.stop()
    finally:
        child.communicate("", timeout=10)
    # The child may have used some CPU before start(): its burn overlaps the window partly.
    assert s["executor"] is not None and s["executor"] > 0.05
    assert s["router"] >= 0.25 and s["client"] >= 0.25  # this process is both here


def test_missing_process_reads_none():
    assert process_cpu_s(2**22 + 12345) is None
    cpu = ServerCPU(None)
    with cpu:
        _burn_here(0.05)
    assert cpu.seconds["router"] is None and cpu.seconds["executor"] is None
    # os.times() counts whole clock ticks: a 0.05 s burn may read a tick short at each end.
    assert cpu.seconds["client"] >= 0.05 - 2 / os.sysconf("SC_CLK_TCK") - 1e-9
    assert own_cpu_s() > 0
