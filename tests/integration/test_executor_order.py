"""The executor runs plans in step_id order, whatever order their RPCs arrive
in (the router sends the next decode plan before the current result is back),
and a Reset drops plans that were waiting for a predecessor."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import pytest

from cbserve.v1 import executor_pb2 as pb
from cbserve.v1 import executor_pb2_grpc as pb_grpc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def executor_stub():
    tmp = tempfile.mkdtemp(prefix="cbserve-order-")
    address = f"unix://{tmp}/executor.sock"
    proc = subprocess.Popen([sys.executable, "-m", "executor", "--model", "tiny", "--dtype", "float32",
                             "--listen", address], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.ExecutorStub(channel)
    try:
        stub.Describe(pb.DescribeRequest(), timeout=120, wait_for_ready=True)
        yield stub
    finally:
        channel.close()
        proc.terminate()
        proc.wait(timeout=30)


def _new_seq(seq_id: int, prompt: list[int], blocks: list[int]) -> pb.ScheduledSeq:
    return pb.ScheduledSeq(seq_id=seq_id, num_tokens=len(prompt), new_block_ids=blocks,
                           new=pb.NewSeq(token_ids=prompt, sampling=pb.SeqSampling()))


def _in_background(fn):
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except grpc.RpcError as exc:
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_a_plan_that_arrives_early_waits_for_its_predecessor(executor_stub):
    stub = executor_stub
    stub.Reset(pb.ResetRequest(), timeout=10)
    first = stub.Step(pb.Plan(step_id=1, seqs=[_new_seq(7, [5, 6, 7], [0])]), timeout=30)
    assert list(first.seq_ids) == [7]
    # Plan 3 arrives before plan 2: it must wait, then run on plan 2's state.
    third = pb.Plan(step_id=3, seqs=[pb.ScheduledSeq(seq_id=7, num_tokens=1)])
    t, box = _in_background(lambda: stub.Step(third, timeout=30))
    time.sleep(0.3)
    assert t.is_alive(), "plan 3 ran before plan 2 arrived"
    second = stub.Step(pb.Plan(step_id=2, seqs=[pb.ScheduledSeq(seq_id=7, num_tokens=1)]),
                       timeout=30)
    t.join(30)
    assert "error" not in box, box.get("error")
    assert list(second.seq_ids) == [7] and list(box["result"].seq_ids) == [7]


def test_reset_drops_a_plan_waiting_for_a_predecessor(executor_stub):
    stub = executor_stub
    stub.Reset(pb.ResetRequest(), timeout=10)
    stub.Step(pb.Plan(step_id=1, seqs=[_new_seq(3, [9, 9], [1])]), timeout=30)
    # Plan 5 waits for plans 2-4, which never come; the reset must not run it
    # on the new state.
    t, box = _in_background(lambda: stub.Step(pb.Plan(step_id=5, seqs=[pb.ScheduledSeq(seq_id=3, num_tokens=1)]),
                                              timeout=30))
    time.sleep(0.3)
    assert t.is_alive()
    stub.Reset(pb.ResetRequest(), timeout=10)
    t.join(30)
    assert box["error"].code() == grpc.StatusCode.ABORTED
    # After the reset any step id starts the sequence again; seq 3 is gone.
    res = stub.Step(pb.Plan(step_id=100, seqs=[_new_seq(4, [1, 2, 3], [2])]), timeout=30)
    assert list(res.seq_ids) == [4]
    with pytest.raises(grpc.RpcError) as err:
        stub.Step(pb.Plan(step_id=101, seqs=[pb.ScheduledSeq(seq_id=3, num_tokens=1)]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
