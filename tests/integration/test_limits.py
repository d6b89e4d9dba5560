"""Backpressure and time: a full queue is refused at once, deadlines are
honoured in the queue and while running, and nothing leaks."""

from __future__ import annotations

import time

import grpc
import pytest

from tests.conftest import start_server
from tests.integration.helpers import gen_request, stub, wait_idle


@pytest.fixture(scope="module")
def one_seat_server():
    server = start_server(
        "tiny",
        config={
            "scheduler": {"max_num_seqs": 1, "max_num_batched_tokens": 64},
            "limits": {"max_queued_requests": 2, "max_queued_tokens": 100},
        },
    )
    yield server
    server.stop()


def _start_long(s, n=1):
    calls = [s.Generate(gen_request([5, 6, 7], max_new=1500)) for _ in range(n)]
    for c in calls[:1]:
        next(c)
    return calls


def test_queue_full_is_resource_exhausted_at_once(one_seat_server):
    with one_seat_server.channel() as ch:
        s = stub(ch)
        running = _start_long(s)  # takes the only seat
        waiting = [s.Generate(gen_request([5, 6, 7], max_new=5)) for _ in range(2)]
        deadline = time.monotonic() + 5
        while one_seat_server.metrics()["cbserve_num_requests_waiting"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            s.Complete(gen_request([5, 6, 7], max_new=5))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in err.value.details()
        assert time.monotonic() - t0 < 2.0  # refused, not queued
        for c in running + waiting:
            c.cancel()
    wait_idle(one_seat_server)


def test_queued_token_limit(one_seat_server):
    with one_seat_server.channel() as ch:
        s = stub(ch)
        running = _start_long(s)
        with pytest.raises(grpc.RpcError) as err:
            s.Complete(gen_request([5] * 101, max_new=2))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        running[0].cancel()
    wait_idle(one_seat_server)


def test_deadline_while_running(one_seat_server):
    with one_seat_server.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(stub(ch).Generate(gen_request([5, 6], max_new=1500), timeout=0.7))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(one_seat_server)


def test_deadline_while_queued(one_seat_server):
    with one_seat_server.channel() as ch:
        s = stub(ch)
        running = _start_long(s)
        with pytest.raises(grpc.RpcError) as err:
            s.Complete(gen_request([5, 6], max_new=3), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # It leaves the queue at the next iteration boundary (a busy machine
        # may take a while to reach it; a stuck request never does).
        end = time.monotonic() + 10
        while one_seat_server.metrics()["cbserve_num_requests_waiting"] != 0 and time.monotonic() < end:
            time.sleep(0.1)
        assert one_seat_server.metrics()["cbserve_num_requests_waiting"] == 0
        running[0].cancel()
    wait_idle(one_seat_server)


def test_request_larger_than_the_kv_pool_is_refused():
    server = start_server("tiny", config={"cache": {"num_blocks": 8, "block_size": 16}})
    try:
        with server.channel() as ch:
            with pytest.raises(grpc.RpcError) as err:
                stub(ch).Complete(gen_request([5] * 100, max_new=100))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "KV memory" in err.value.details()
            assert len(stub(ch).Complete(gen_request([5] * 20, max_new=20)).token_ids) == 20
    finally:
        server.stop()
