"""An executor started on its own (`cbserve executor`) outlives the routers
that drive it: a router that restarts, or one killed in the middle of its
streams, leaves nothing behind for the next (the executor resets its state
for each router that connects), which finds the whole KV pool free, no
sequence of the first held by the executor, and the same greedy tokens."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc

from tests.conftest import start_server
from tests.integration.helpers import gen_request, stub, wait_idle

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _complete(server) -> list[int]:
    with server.channel() as ch:
        return list(stub(ch).Complete(gen_request(PROMPT, max_new=12), timeout=60).token_ids)


def _streams(server, n: int) -> list[threading.Thread]:
    """n long streams that end however they end (their router is killed)."""

    def run(i: int) -> None:
        try:
            with server.channel() as ch:
                for _ in stub(ch).Generate(gen_request([3 + i] * (20 + i), max_new=1500), timeout=60):
                    pass
        except grpc.RpcError:
            pass

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_a_router_killed_mid_stream_leaves_its_executor_clean_for_the_next():
    first = start_server("tiny")
    assert first.shared is not None  # `cbserve router` against an executor started on its own
    executor = first.shared
    want = _complete(first)
    threads = _streams(first, 4)
    end = time.monotonic() + 30
    while first.metrics().get("cbserve_num_requests_running", 0) < 4 and time.monotonic() < end:
        time.sleep(0.05)
    assert first.metrics()["cbserve_num_requests_running"] == 4
    os.kill(first.proc.pid, signal.SIGKILL)  # blocks held, steps in flight
    first.proc.wait(10)
    for t in threads:
        t.join(30)
    log_at = executor.server.log_size()

    second = start_server("tiny")
    try:
        assert second.shared is executor and executor.server.proc.poll() is None
        assert _complete(second) == want
        m = wait_idle(second)
        assert m["cbserve_kv_cache_usage_ratio"] == 0
        assert "state reset" in executor.server.log(log_at)
        # The killed router's four sequences are gone from the executor too.
        assert executor.server.metrics()["cbserve_executor_sequences"] == 0
    finally:
        second.stop()
