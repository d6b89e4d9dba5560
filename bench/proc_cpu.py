"""CPU seconds used by the server's processes and by the load generator over a
run, read from /proc (Linux; elsewhere every figure is None).

On a machine with as many cores as the executor has threads, whatever CPU the
router and the client take is taken from the executor's threads: a parallel
region waits for its slowest thread, so the forward stretches by roughly the
time another process held one of its cores. The iteration timers do not see
that cost (it lands inside the forward); these totals do.
"""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")


def _ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 100


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of one process (all its threads), or None."""
    try:
        fields = (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command: state ppid ... utime(14th field) stime(15th) -> indices 11, 12.
    return (int(fields[11]) + int(fields[12])) / _ticks()


def children(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's children list)."""
    out: list[int] = []
    try:
        tasks = list((_PROC / str(pid) / "task").iterdir())
    except OSError:
        return out
    for t in tasks:
        try:
            out += [int(c) for c in (t / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def own_cpu_s() -> float:
    """CPU seconds of this process (the load generator runs here)."""
    t = os.times()
    return t.user + t.system


class ServerCPU:
    """CPU seconds of the router (`pid`), its child processes (the executor)
    and this process between `start()` and `stop()`."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self._before: dict[str, float | None] = {}
        self.seconds: dict[str, float | None] = {"router": None, "executor": None, "client": None}

    def _read(self) -> dict[str, float | None]:
        kids = children(self.pid) if self.pid is not None else []
        kid_cpu = [process_cpu_s(k) for k in kids]
        return {
            "router": process_cpu_s(self.pid) if self.pid is not None else None,
            "executor": sum(c for c in kid_cpu if c is not None) if kids else None,
            "client": own_cpu_s(),
        }

    def start(self) -> "ServerCPU":
        self._before = self._read()
        return self

    def stop(self) -> dict[str, float | None]:
        after = self._read()
        for k, v1 in after.items():
            v0 = self._before.get(k)
            self.seconds[k] = v1 - v0 if v1 is not None and v0 is not None else None
        return self.seconds

    def __enter__(self) -> "ServerCPU":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
