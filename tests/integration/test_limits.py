"""Backpressure and time: a full queue is refused at once, deadlines are
honoured in the queue and while running, and nothing leaks."""

from __future__ import annotations

import time

import grpc
import pytest

from tests.conftest import start_server
from tests.integration.helpers import executor_held, gen_request, stub, wait_idle, wait_submitted


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


@pytest.fixture(scope="module")
def strict_server():
    """Small input, salt and stream-buffer limits and nicer tokenizer threads,
    for the tests below that each check one of them."""
    server = start_server(
        "tiny",
        config={
            "limits": {"max_input_chars": 1000, "max_cache_salt_chars": 16, "max_stream_buffer": 16},
            "server": {"tokenizer_nice": 7},
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


def test_input_and_salt_limits_hold_for_generation_and_tokenize(strict_server):
    from cbserve.v1 import generation_pb2 as gpb

    server = strict_server
    with server.channel() as ch:
        s = stub(ch)
        too_long = [
            gen_request(text="x" * 1001, max_new=1),
            gen_request(
                max_new=1, messages=gpb.ChatMessages(messages=[gpb.ChatMessage(role="user", content="y" * 600)] * 2)
            ),
            gen_request([5, 6], max_new=1, cache_salt="s" * 17),
        ]
        for req, field in zip(too_long, ("text", "messages", "cache_salt")):
            with pytest.raises(grpc.RpcError) as err:
                s.Complete(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            s.Tokenize(gpb.TokenizeRequest(text="x" * 1001), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text" in err.value.details()
        assert len(s.Complete(gen_request(text="x" * 1000, max_new=1), timeout=30).token_ids) == 1
    wait_idle(server)


def test_the_transport_refuses_what_the_input_limit_never_admits(strict_server):
    """The gRPC receive limit and the HTTP body limit derive from
    limits.max_input_chars: a prompt of max_input_chars 4-byte characters
    passes the transport, a message past the derived limit is refused by gRPC
    (RESOURCE_EXHAUSTED) or HTTP (413) before it is parsed, and one between
    the two is parsed and refused by validation."""
    import httpx

    from cbserve.v1 import generation_pb2 as gpb
    from router.config import REQUEST_HEADROOM_BYTES

    server = strict_server
    with server.channel() as ch:
        s = stub(ch)
        # 1000 four-byte characters: 4000 bytes of UTF-8, valid.
        assert len(s.Tokenize(gpb.TokenizeRequest(text="\U0001f600" * 1000), timeout=30).token_ids) == 4000
        with pytest.raises(grpc.RpcError) as err:
            s.Complete(gen_request(text="x" * REQUEST_HEADROOM_BYTES, max_new=1), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            s.Complete(gen_request(text="x" * (REQUEST_HEADROOM_BYTES + 4001), max_new=1), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in err.value.details()

    model = httpx.get(f"{server.http_url}/models", timeout=10).json()["data"][0]["id"]

    def post(chars: int) -> httpx.Response:
        body = {"model": model, "prompt": "x" * chars, "max_tokens": 1}
        return httpx.post(f"{server.http_url}/completions", json=body, timeout=30)

    under = post(REQUEST_HEADROOM_BYTES)
    assert under.status_code == 400 and "longer than 1000" in under.json()["error"]["message"]
    over = post(REQUEST_HEADROOM_BYTES + 6001)
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"
    wait_idle(server)


class _CountingProxy:
    """A TCP relay on loopback that counts the bytes clients send upstream."""

    def __init__(self, upstream_port: int) -> None:
        import socket
        import threading

        self.upstream_port, self.sent = upstream_port, 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src, dst, count: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if count:
                    self.sent += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                sock.close()

    def close(self) -> None:
        self._listener.close()


@pytest.mark.parametrize("bdp_probe", [False, True])
def test_an_oversized_message_is_refused_before_the_client_sends_it_all(bdp_probe):
    """With gRPC's bandwidth-delay probing off (the default) a refused 3.9 MB
    request crosses the wire as its first window's worth of bytes; with it on
    the client pushes the whole message before the refusal reaches it."""
    server = start_server("tiny", config={"server": {"grpc_bdp_probe": bdp_probe}})
    proxy = _CountingProxy(server.port)
    try:
        opts = [("grpc.max_send_message_length", 8 << 20)]
        with grpc.insecure_channel(proxy.address, options=opts) as ch:
            s = stub(ch)
            s.Complete(gen_request([5, 6], max_new=1), timeout=30)  # warm the connection
            before = proxy.sent
            with pytest.raises(grpc.RpcError) as err:
                s.Complete(gen_request(text="x" * 3_900_000, max_new=1), timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            time.sleep(0.5)  # what the client had in flight arrives
            sent = proxy.sent - before
            assert len(s.Complete(gen_request([5, 6], max_new=2), timeout=30).token_ids) == 2
        if bdp_probe:
            assert sent > 3_000_000
        else:
            assert sent < 500_000
        wait_idle(server)
    finally:
        proxy.close()
        server.stop()


def test_large_tokenizations_run_beside_health_and_a_stream():
    """Four Tokenize calls of two million characters each (seconds of
    tokenizer work, two at a time on the tokenizer threads, two waiting)
    leave the event loop free: before the first of them is answered, a stream has received
    hundreds of tokens and every health check between them was answered.
    Had tokenization run on the event loop, or held the GIL as tokenizers'
    encode() does, a few dozen tokens would have come through."""
    import asyncio

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from cbserve.v1 import generation_pb2 as gpb
    from cbserve.v1 import generation_pb2_grpc as gpb_grpc

    chars = 2_000_000
    server = start_server("tiny", config={"limits": {"max_input_chars": chars}})

    async def run():
        opts = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 16 << 20)]
        async with grpc.aio.insecure_channel(server.address, options=opts) as ch:
            s, health = gpb_grpc.GenerationStub(ch), health_pb2_grpc.HealthStub(ch)
            stream = s.Generate(gen_request([5, 6, 7], max_new=2000))
            await stream.read()
            text = "word " * (chars // 5)
            big = [asyncio.ensure_future(s.Tokenize(gpb.TokenizeRequest(text=text))) for _ in range(4)]
            tokens = checks = 0
            while not any(f.done() for f in big) and await stream.read() is not grpc.aio.EOF:
                tokens += 1
                if tokens % 50 == 0:
                    assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == 1
                    checks += 1
            lengths = [len((await f).token_ids) for f in big]
            stream.cancel()
            return tokens, checks, lengths

    try:
        tokens, checks, lengths = asyncio.run(run())
        assert lengths == [chars] * 4  # the tiny tokenizer is byte-level
        assert tokens >= 200 and checks == tokens // 50
        wait_idle(server)
    finally:
        server.stop()


def test_tokenizer_threads_run_at_the_configured_niceness(strict_server):
    """server.tokenizer_nice: the threads that tokenize run that much nicer
    than the router's event loop (Linux keeps a niceness per thread)."""
    import pathlib

    from cbserve.v1 import generation_pb2 as gpb

    server = strict_server
    with server.channel() as ch:
        assert len(stub(ch).Tokenize(gpb.TokenizeRequest(text="hello"), timeout=30).token_ids) == 5
    tasks = pathlib.Path(f"/proc/{server.proc.pid}/task")
    nice = {int(t.name): int((t / "stat").read_text().rsplit(")", 1)[1].split()[16]) for t in tasks.iterdir()}
    assert nice[server.proc.pid] == 0 and 7 in nice.values()


def test_queued_bytes_limit_refuses_what_would_exceed_it():
    server = start_server(
        "tiny",
        config={"scheduler": {"max_num_seqs": 1}, "limits": {"max_queued_bytes": 100}},
    )
    try:
        with server.channel() as ch:
            s = stub(ch)
            running = _start_long(s)
            with executor_held(server):  # "running" holds the seat; the queue stays as it is
                since = server.metrics()["cbserve_prompt_tokens_total"]
                waiting = s.Generate(gen_request([5] * 40, max_new=2))  # 48 bytes: fits
                wait_submitted(server, since, 40)
                with pytest.raises(grpc.RpcError) as err:
                    s.Complete(gen_request([5] * 80, max_new=2), timeout=30)  # 88 more: do not
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "bytes" in err.value.details()
            for c in running:
                c.cancel()
            assert len([m for m in waiting for _ in m.token_ids]) == 2
        wait_idle(server)
    finally:
        server.stop()


def test_a_client_that_stops_reading_is_cancelled_and_its_blocks_freed(strict_server):
    # The client's HTTP/2 window is kept small (no BDP growth): once it is
    # full the server cannot write, and the router must not buffer the rest
    # of a 2,000-token stream.
    server = strict_server
    key = "cbserve_requests_total{finish_reason=CANCELLED,status=RESOURCE_EXHAUSTED}"
    before = server.metrics().get(key, 0)  # the server is shared: count this test's only
    opts = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    with grpc.insecure_channel(server.address, options=opts) as ch:
        it = stub(ch).Generate(gen_request([5, 6], max_new=2000))
        next(it)
        end = time.monotonic() + 60
        while server.metrics().get(key, 0) < before + 1 and time.monotonic() < end:
            time.sleep(0.2)
        assert server.metrics().get(key, 0) == before + 1
        with pytest.raises(grpc.RpcError) as err:
            for _ in it:
                pass
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "did not read" in err.value.details()
    wait_idle(server)


def test_without_chunked_prefill_a_prompt_over_the_token_budget_is_refused_at_once():
    server = start_server(
        "tiny", config={"scheduler": {"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_num_seqs": 8}}
    )
    try:
        with server.channel() as ch:
            s = stub(ch)
            with pytest.raises(grpc.RpcError) as err:
                s.Complete(gen_request([5] * 65, max_new=2), timeout=10)  # used to wait at the head of the queue
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chunked prefill off" in err.value.details()
            assert len(s.Complete(gen_request([5] * 60, max_new=2), timeout=30).token_ids) == 2
        wait_idle(server)
    finally:
        server.stop()
