"""The restart back-off of `cbserve serve`'s executor supervisor
(router/supervisor.py), with real child processes standing in for the
executor: each writes its ready byte as the executor does, lives for the time
its turn in a schedule says, and exits 1."""

from __future__ import annotations

import asyncio
import textwrap

import structlog

from router.supervisor import ExecutorProcess

STAND_IN = textwrap.dedent(
    """
    import os, sys, time
    turns = sys.argv[1]
    with open(turns) as f:
        lives = [float(x) for x in f.read().split()]
    with open(turns + ".n", "a+") as f:
        f.seek(0)
        n = len(f.read())
        f.write("x")
    os.write(int(os.environ["CBSERVE_READY_FD"]), b"1")
    os.close(int(os.environ["CBSERVE_READY_FD"]))
    time.sleep(lives[min(n, len(lives) - 1)])
    sys.exit(1)
    """
)


def test_backoff_doubles_per_death_and_starts_again_after_a_healthy_run(tmp_path, monkeypatch):
    (tmp_path / "stand_in_executor.py").write_text(STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    # Four quick deaths, one after a healthy run, two quick ones again; then it stays up.
    turns = tmp_path / "turns"
    turns.write_text("0 0 0 0 1.5 0 0 600")

    async def run() -> list[float]:
        proc = ExecutorProcess([str(turns)], name="stand-in")
        proc.module = "stand_in_executor"
        proc.first_backoff_s, proc.max_backoff_s, proc.healthy_reset_s = 0.05, 0.2, 1.0
        await proc.start()
        watch = asyncio.create_task(proc.watch())
        with structlog.testing.capture_logs() as logs:
            while proc.restarts < 7:
                await asyncio.sleep(0.05)
        await proc.stop(timeout=5)
        watch.cancel()
        assert not proc.refused
        return [e["in_s"] for e in logs if e["event"] == "executor exited; restarting"]

    waits = asyncio.run(asyncio.wait_for(run(), 60))
    # Doubling up to the most; after the 1.5 s life (>= healthy_reset_s) the first again.
    assert waits == [0.05, 0.1, 0.2, 0.2, 0.05, 0.1, 0.2]
