"""The router's StepStream when a write finds the call already over (the
executor rejected an earlier plan and ended the stream while the next plan
was being written): the plans in flight fail with the call's own status, a
PlanRejected for a rejected plan, as the reader would report it, not with
"RPC already finished" as if the executor had gone away. The call is a
stand-in here because the race (the reader not yet woken when the write
fails) cannot be forced on a real channel; tests/integration/
test_executor_order.py runs the same scenario over gRPC."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cbserve.v1 import executor_pb2 as pb
from router.executor_client import ExecutorUnavailable, PlanRejected, _StepStream


class _EndedCall:
    """A StepStream call that is over: writes fail, reads never return."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details
        self.cancelled = False

    async def write(self, _plan) -> None:
        raise grpc.aio.UsageError("RPC already finished.")

    async def read(self):
        await asyncio.Event().wait()

    async def code(self) -> grpc.StatusCode:
        return self._code

    async def details(self) -> str:
        return self._details

    def cancel(self) -> bool:
        self.cancelled = True
        return True


async def _fail_of(call: _EndedCall) -> tuple[Exception, Exception]:
    stream = _StepStream(call)
    first = await stream.send(pb.Plan(step_id=5))
    second = await stream.send(pb.Plan(step_id=6))
    await asyncio.sleep(0)
    assert stream.broken and call.cancelled
    return first.exception(), second.exception()


def test_a_rejected_plan_is_plan_rejected_even_when_the_write_sees_the_end_first():
    first, second = asyncio.run(_fail_of(_EndedCall(grpc.StatusCode.INVALID_ARGUMENT, "unknown sequence 99")))
    assert isinstance(first, PlanRejected) and "99" in str(first)
    assert isinstance(second, ExecutorUnavailable)  # the stream was already closed for it


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED])
def test_other_endings_mean_the_executor_is_unavailable(code):
    first, _ = asyncio.run(_fail_of(_EndedCall(code, "gone")))
    assert isinstance(first, ExecutorUnavailable) and code.name in str(first)
