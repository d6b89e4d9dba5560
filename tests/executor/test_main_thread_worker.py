"""The executor's main-thread loop (executor/server.py MainThreadWorker):
jobs run in order on the thread that serves, a stop that comes with wake()
ends the loop's wait at once, and jobs still queued at a stop fail."""

from __future__ import annotations

import threading

import pytest

from executor.server import MainThreadWorker, _Stopping


def _serving(worker: MainThreadWorker, stop: threading.Event) -> threading.Thread:
    thread = threading.Thread(target=worker.serve, args=(stop,), daemon=True)
    thread.start()
    return thread


def _stopped(worker: MainThreadWorker, stop: threading.Event, thread: threading.Thread) -> bool:
    """Sets the stop with wake(); whether the loop has ended 30 s later."""
    stop.set()
    worker.wake()
    thread.join(30)
    return not thread.is_alive()


def test_jobs_run_in_order_on_the_serving_thread():
    worker, stop = MainThreadWorker(), threading.Event()
    thread = _serving(worker, stop)
    seen = []
    futs = [worker.submit(lambda i=i: seen.append((i, threading.current_thread())) or i) for i in range(5)]
    assert [f.result(timeout=10) for f in futs] == list(range(5))
    assert [i for i, _ in seen] == list(range(5)) and {t for _, t in seen} == {thread}
    assert _stopped(worker, stop, thread)


def test_a_stop_with_wake_ends_the_wait_for_a_job_at_once():
    worker, stop = MainThreadWorker(), threading.Event()
    worker.poll_s = 600.0  # without wake() the loop would wait ten minutes to see the stop
    thread = _serving(worker, stop)
    assert worker.call(lambda: 7) == 7
    assert _stopped(worker, stop, thread)


def test_jobs_still_queued_at_a_stop_fail():
    worker, stop = MainThreadWorker(), threading.Event()
    fut = worker.submit(lambda: 1)
    worker.wake()  # its cancelled job is skipped, never run
    stop.set()
    worker.serve(stop)  # the stop is already set: the loop ends, the queue is drained
    with pytest.raises(_Stopping):
        fut.result(timeout=1)
