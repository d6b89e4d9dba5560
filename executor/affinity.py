"""Where the executor's OpenMP threads run: each bound to its own CPU when
they are as many as the CPUs the process may use (a dedicated machine, or a
container given exclusive CPUs), as vLLM's CPU backend binds its threads.

Unbound, the scheduler moves them around the router's and the clients'
wake-ups; a thread that lands behind one of those holds its partner at the
end of every parallel region (the served gain: docs/operations.md,
"Threads"). With fewer threads than CPUs (a machine shared by design, or a
Kubernetes CPU quota without exclusive CPUs, where CPU 0 and 1 may be
another pod's) nothing is bound. An operator's own OMP_PROC_BIND or
OMP_PLACES always wins.

It must run before torch (and with it OpenMP) is loaded: executor/__main__.py
calls it first.
"""

from __future__ import annotations

import argparse
import os
from typing import MutableMapping


def should_bind(threads: int, cpus: int, env: MutableMapping[str, str]) -> bool:
    """Whether to bind `threads` OpenMP threads (0: OMP_NUM_THREADS, else one
    per CPU) on a process allowed `cpus` CPUs."""
    if "OMP_PROC_BIND" in env or "OMP_PLACES" in env or cpus < 2:
        return False
    if threads <= 0:
        try:
            threads = int(env.get("OMP_NUM_THREADS", "").split(",")[0] or 0)
        except ValueError:
            return False
    return threads in (0, cpus)


def bind_omp_threads(argv: list[str], env: MutableMapping[str, str] = os.environ) -> bool:
    """Sets OMP_PROC_BIND=true in `env` where should_bind says so, from the
    executor's `--threads`; returns whether it did."""
    if not hasattr(os, "sched_getaffinity"):
        return False
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--threads", type=int, default=0)
    known, _ = p.parse_known_args(argv)
    if should_bind(known.threads, len(os.sched_getaffinity(0)), env):
        env["OMP_PROC_BIND"] = "true"
        return True
    return False
