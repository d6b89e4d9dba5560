"""The executor's gRPC boundary types its errors: a plan that contradicts its
state is a PlanError (INVALID_ARGUMENT, counted as a rejected plan); any other
failure of a step (a kernel bug, out of memory) is INTERNAL and not counted as
a rejected plan, on both the unary Step and the StepStream transport."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from cbserve.v1 import executor_pb2 as pb
from cbserve.v1 import executor_pb2_grpc as pb_grpc
from executor import model_loader, model_source
from executor.errors import PlanError
from executor.runner import ModelRunner
from executor.server import ExecutorService, build_server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    runner = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.float32), 16, 32)
    service = ExecutorService(runner, "tiny", [0])
    address = f"unix://{tmp_path_factory.mktemp('errors')}/executor.sock"
    server, _ = build_server(service, address)
    stop = threading.Event()
    worker = threading.Thread(target=service.worker.serve, args=(stop,), daemon=True)
    worker.start()
    channel = grpc.insecure_channel(address)
    try:
        yield service, pb_grpc.ExecutorStub(channel)
    finally:
        channel.close()
        stop.set()
        server.stop(0)
        worker.join(10)


def _prefill(step_id: int) -> pb.Plan:
    return pb.Plan(
        step_id=step_id,
        seqs=[
            pb.ScheduledSeq(
                seq_id=1, num_tokens=3, new_block_ids=[0], new=pb.NewSeq(token_ids=[5, 6, 7], sampling=pb.SeqSampling())
            )
        ],
    )


def _rejected(service) -> float:
    return service.metrics.rejected_plans._value.get()


def _call(stub, plan: pb.Plan, stream: bool) -> list[pb.StepResult]:
    """The plan on Step, or alone on a StepStream: the stream answers a plan
    that fails with its status in the result, then ends with that status
    (raised here) once this side has ended."""
    if not stream:
        return [stub.Step(plan, timeout=30)]
    got: list[pb.StepResult] = []
    try:
        for r in stub.StepStream(iter([plan]), timeout=30):
            got.append(r)
    except grpc.RpcError as exc:
        assert [(r.step_id, r.error_code) for r in got] == [(plan.step_id, exc.code().value[0])]
        assert got[0].error == exc.details() and not got[0].seq_ids
        raise
    return got


@pytest.mark.parametrize("stream", [False, True])
def test_a_plan_error_is_invalid_argument_and_counted(served, stream):
    service, stub = served
    stub.Reset(pb.ResetRequest(), timeout=10)
    before = _rejected(service)
    bad = pb.Plan(step_id=1, seqs=[pb.ScheduledSeq(seq_id=42, num_tokens=1)])  # never sent as new
    with pytest.raises(grpc.RpcError) as err:
        _call(stub, bad, stream)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequence 42 is unknown" in err.value.details()
    assert _rejected(service) == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_failure_inside_the_step_is_internal_not_a_rejected_plan(served, monkeypatch, stream):
    service, stub = served
    stub.Reset(pb.ResetRequest(), timeout=10)
    before = _rejected(service)

    def kernel_bug(batch):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(service.runner, "_run_model", kernel_bug)
    with pytest.raises(grpc.RpcError) as err:
        _call(stub, _prefill(1), stream)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "RuntimeError: simulated kernel failure" in err.value.details()
    assert _rejected(service) == before
    monkeypatch.undo()
    # The executor itself is fine: after the router's reset the same plan runs.
    stub.Reset(pb.ResetRequest(), timeout=10)
    assert list(stub.Step(_prefill(1), timeout=30).seq_ids) == [1]


def test_plan_error_is_not_a_value_error():
    # A ValueError raised by a library during a step must not pass for a bad plan.
    assert not issubclass(PlanError, ValueError)
