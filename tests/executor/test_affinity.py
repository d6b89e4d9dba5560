"""Binding the executor's OpenMP threads (executor/affinity.py): only when
they are as many as the process's CPUs and the operator set no binding, and
then, in a real process, each thread runs on a CPU of its own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from executor.affinity import bind_omp_threads, should_bind


@pytest.mark.parametrize(
    "threads,cpus,env,want",
    [
        (0, 2, {}, True),  # one thread per CPU: the default
        (2, 2, {}, True),
        (1, 2, {}, False),  # fewer threads than CPUs: a shared machine
        (0, 64, {"OMP_NUM_THREADS": "2"}, False),  # a CPU quota, not exclusive CPUs
        (0, 2, {"OMP_NUM_THREADS": "2"}, True),
        (0, 2, {"OMP_NUM_THREADS": "x"}, False),
        (0, 2, {"OMP_PROC_BIND": "false"}, False),  # the operator's choice wins
        (0, 2, {"OMP_PLACES": "cores"}, False),
        (0, 1, {}, False),  # one CPU: nothing to choose
    ],
)
def test_when_threads_are_bound(threads, cpus, env, want):
    assert should_bind(threads, cpus, env) is want


def test_the_executor_arguments_decide():
    cpus = len(os.sched_getaffinity(0))
    env: dict[str, str] = {}
    assert bind_omp_threads(["--model", "tiny", "--threads", str(cpus + 1)], env) is False and env == {}
    assert bind_omp_threads(["--model", "tiny"], env) is (cpus >= 2)
    assert env == ({"OMP_PROC_BIND": "true"} if cpus >= 2 else {})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_bound_threads_run_on_cpus_of_their_own():
    code = (
        "import os, sys\n"
        "from executor.affinity import bind_omp_threads\n"
        "assert bind_omp_threads([])\n"
        "import torch\n"
        "torch.ones(1 << 22).sum()  # a parallel region: OpenMP starts its threads\n"
        "masks = [os.sched_getaffinity(int(t)) for t in os.listdir('/proc/self/task')]\n"
        "print(sorted(sorted(m) for m in masks if len(m) == 1))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert out.returncode == 0, out.stderr
    pinned = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own subprocess's list of lists
    cpus = {cpu for mask in pinned for cpu in mask}
    assert len(cpus) >= 2, f"OpenMP threads on single CPUs: {pinned}"
