"""The gRPC handlers' sends when the client has already left.

Which of a handler's sends meets a client that just left (its deadline passed
or it cancelled) is a race that the storm tests in tests/integration/test_fuzz.py
hit only now and then; here each case is made to happen, with gRPC's own
error type, so that the handler's answer to it is checked every run."""

import asyncio

import grpc
import pytest
from grpc._cython import cygrpc

from router import server


class Context:
    """The parts of grpc.aio.ServicerContext that the send helpers use."""

    def __init__(self, remaining=None, done=False, fails=None):
        self.remaining, self._done, self.fails, self.sent = remaining, done, fails, []

    def time_remaining(self):
        return self.remaining

    def done(self):
        return self._done

    async def write(self, message):
        if self.fails is not None:
            raise self.fails
        self.sent.append(message)

    async def abort(self, code, details):
        self.sent.append((code, details))
        raise grpc.aio.AbortError()


def run(coro):
    return asyncio.run(coro)


def test_a_send_the_client_can_take_goes_out():
    ctx = Context(remaining=5.0)
    run(server._send(ctx, "m"))
    assert ctx.sent == ["m"]


@pytest.mark.parametrize("ctx", [Context(remaining=-0.01), Context(remaining=0.0), Context(done=True)])
def test_nothing_is_sent_after_the_deadline_or_end(ctx):
    with pytest.raises(asyncio.CancelledError):
        run(server._send(ctx, "m"))
    with pytest.raises(asyncio.CancelledError):
        run(server._abort(ctx, (grpc.StatusCode.INTERNAL, "x")))
    assert ctx.sent == []


def test_a_write_that_fails_in_core_stops_the_handler_quietly():
    ctx = Context(remaining=1.0, fails=cygrpc.ExecuteBatchError("Failed execute_batch"))
    with pytest.raises(asyncio.CancelledError) as info:
        run(server._send(ctx, "m"))
    assert isinstance(info.value.__cause__, cygrpc.ExecuteBatchError)


def test_other_errors_still_surface():
    ctx = Context(remaining=1.0, fails=ValueError("serializer"))
    with pytest.raises(ValueError):
        run(server._send(ctx, "m"))


def test_abort_ends_the_handler_as_grpc_expects():
    ctx = Context()
    with pytest.raises(grpc.aio.AbortError):
        run(server._abort(ctx, (grpc.StatusCode.RESOURCE_EXHAUSTED, "full")))
    assert ctx.sent == [(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")]
    with pytest.raises(asyncio.CancelledError):
        server._stop_if_client_left(Context(remaining=-1))
