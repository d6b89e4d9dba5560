"""The executor runs plans in step_id order, whatever order their RPCs arrive
in (the router sends the next decode plan before the current result is back),
and a Reset drops plans that were waiting for a predecessor."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc
import pytest

from cbserve.v1 import executor_pb2 as pb
from cbserve.v1 import executor_pb2_grpc as pb_grpc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _small_cache(directory: str) -> str:
    """A config whose KV pool is what these tests use (the default gigabyte
    takes seconds to commit)."""
    path = os.path.join(directory, "cache.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("cache:\n  num_blocks: 128\n  swap_space_bytes: 0\n")
    return path


@pytest.fixture(scope="module")
def executor_stub(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("order")
    address = f"unix://{tmp}/executor.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "executor",
            "--model",
            "tiny",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--listen",
            address,
            "--config",
            _small_cache(tmp),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.ExecutorStub(channel)
    stub._address = address  # for the tests that open their own client
    try:
        stub.Describe(pb.DescribeRequest(), timeout=120, wait_for_ready=True)
        yield stub
    finally:
        channel.close()
        proc.terminate()
        proc.wait(timeout=30)


def _new_seq(seq_id: int, prompt: list[int], blocks: list[int]) -> pb.ScheduledSeq:
    return pb.ScheduledSeq(
        seq_id=seq_id,
        num_tokens=len(prompt),
        new_block_ids=blocks,
        new=pb.NewSeq(token_ids=prompt, sampling=pb.SeqSampling()),
    )


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
    second = stub.Step(pb.Plan(step_id=2, seqs=[pb.ScheduledSeq(seq_id=7, num_tokens=1)]), timeout=30)
    t.join(30)
    assert "error" not in box, box.get("error")
    assert list(second.seq_ids) == [7] and list(box["result"].seq_ids) == [7]


def test_reset_drops_a_plan_waiting_for_a_predecessor(executor_stub):
    stub = executor_stub
    stub.Reset(pb.ResetRequest(), timeout=10)
    stub.Step(pb.Plan(step_id=1, seqs=[_new_seq(3, [9, 9], [1])]), timeout=30)
    # Plan 5 waits for plans 2-4, which never come; the reset must not run it
    # on the new state.
    t, box = _in_background(
        lambda: stub.Step(pb.Plan(step_id=5, seqs=[pb.ScheduledSeq(seq_id=3, num_tokens=1)]), timeout=30)
    )
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


def _plans(first_step: int) -> list[pb.Plan]:
    """A prefill of two sequences, then three decode steps of both."""
    plans = [pb.Plan(step_id=first_step, seqs=[_new_seq(1, [5, 6, 7, 8], [10]), _new_seq(2, [9, 3], [11])])]
    for i in range(1, 4):
        plans.append(
            pb.Plan(
                step_id=first_step + i,
                seqs=[pb.ScheduledSeq(seq_id=1, num_tokens=1), pb.ScheduledSeq(seq_id=2, num_tokens=1)],
            )
        )
    return plans


def test_step_stream_answers_each_plan_in_order_as_step_would(executor_stub):
    stub = executor_stub
    stub.Reset(pb.ResetRequest(), timeout=10)
    unary = [stub.Step(p, timeout=30) for p in _plans(1)]
    stub.Reset(pb.ResetRequest(), timeout=10)
    streamed = list(stub.StepStream(iter(_plans(1)), timeout=60))
    assert [r.step_id for r in streamed] == [1, 2, 3, 4]
    assert [(list(r.seq_ids), list(r.token_ids)) for r in streamed] == [
        (list(r.seq_ids), list(r.token_ids)) for r in unary
    ]
    assert all(r.forward_seconds > 0 for r in streamed)


def test_step_stream_answers_a_rejected_plan_then_ends_invalid_argument(executor_stub):
    stub = executor_stub
    stub.Reset(pb.ResetRequest(), timeout=10)
    plans = _plans(1)[:1] + [pb.Plan(step_id=2, seqs=[pb.ScheduledSeq(seq_id=99, num_tokens=1)])]
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for r in stub.StepStream(iter(plans), timeout=60):
            got.append((r.step_id, r.error_code, r.error))
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert [g[:2] for g in got] == [(1, 0), (2, invalid.value[0])] and "99" in got[1][2]
    # The call ends with the same status once this side has ended.
    assert err.value.code() == invalid and err.value.details() == got[1][2]


def test_reset_ends_an_open_step_stream_before_its_next_plan(executor_stub):
    import queue

    stub = executor_stub
    stub.Reset(pb.ResetRequest(), timeout=10)
    plans: queue.Queue = queue.Queue()
    plan_list = _plans(1)
    plans.put(plan_list[0])
    responses = stub.StepStream(iter(plans.get, None), timeout=60)
    assert next(responses).step_id == 1
    stub.Reset(pb.ResetRequest(), timeout=10)
    plans.put(plan_list[1])  # seq 1 would still be known without the check: the reset must win
    try:
        with pytest.raises(grpc.RpcError) as err:
            next(responses)
        assert err.value.code() == grpc.StatusCode.ABORTED
    finally:
        plans.put(None)  # ends the request iterator


def test_the_router_retries_a_describe_that_waited_out_its_deadline_at_once(executor_stub, tmp_path):
    """An executor that starts listening after the router's first Describe
    gave up is connected on the next one: a Describe that waited out its
    deadline is not followed by the back-off sleep (here ten minutes), which
    is for calls that fail at once."""
    import asyncio

    from router.config import ExecutorConfig
    from router.executor_client import ExecutorClient

    late = tmp_path / "late.sock"
    client = ExecutorClient(
        ExecutorConfig(address=f"unix://{late}", reconnect_backoff_s=600, reconnect_backoff_max_s=600)
    )

    async def scenario():
        try:
            ready = asyncio.ensure_future(client.wait_ready(timeout=0.5))
            await asyncio.sleep(1.2)  # two Describes have waited out their deadline
            assert not ready.done()
            os.symlink(executor_stub._address.removeprefix("unix://"), late)  # the executor is there now
            return await asyncio.wait_for(ready, 60)
        finally:
            await client.close()

    described = asyncio.run(scenario())
    assert described.model and described.num_blocks == 128


@pytest.mark.parametrize("step_stream", [True, False])
def test_router_client_pipelines_plans_and_recovers_from_a_rejected_one(executor_stub, step_stream):
    """The router's ExecutorClient on both transports: two plans in flight
    (pipelined decode) come back in order; a rejected plan fails with
    PlanRejected, the plan in flight behind it fails too, and after the reset
    the next plans run (on a new stream)."""
    import asyncio

    from router.config import ExecutorConfig
    from router.executor_client import ExecutorClient, ExecutorUnavailable, PlanRejected

    address = executor_stub._address

    async def scenario():
        client = ExecutorClient(ExecutorConfig(address=address, step_stream=step_stream, step_timeout_s=30))
        try:
            await client.describe()
            await client.reset()
            plans = _plans(1)
            # After a reset the first plan sets the order, so it goes alone;
            # the decodes behind it are in flight together (the engine's pipelining).
            results = [await client.step(plans[0])]
            tasks = [asyncio.ensure_future(client.step(p)) for p in plans[1:]]
            results += [await t for t in tasks]
            assert [r.step_id for r in results] == [1, 2, 3, 4]
            first_stream = client._stream
            assert (first_stream is not None) == step_stream
            bad = asyncio.ensure_future(
                client.step(pb.Plan(step_id=5, seqs=[pb.ScheduledSeq(seq_id=99, num_tokens=1)]))
            )
            behind = asyncio.ensure_future(
                client.step(pb.Plan(step_id=6, seqs=[pb.ScheduledSeq(seq_id=1, num_tokens=1)]))
            )
            with pytest.raises(PlanRejected, match="99"):
                await bad
            # On the stream the plan behind a rejected one fails with it; a unary
            # call may run it (on state the router must reset anyway).
            outcome = (await asyncio.gather(behind, return_exceptions=True))[0]
            if step_stream:
                assert isinstance(outcome, (PlanRejected, ExecutorUnavailable))
            await client.reset()
            again = await client.step(_plans(100)[0])
            assert list(again.seq_ids) == [1, 2]
            if step_stream:
                assert client._stream is not None and client._stream is not first_stream
        finally:
            await client.close()

    asyncio.run(scenario())


def test_plans_queued_behind_a_rejected_one_on_the_stream_do_not_run(executor_stub):
    """The executor reads plans ahead of the one running; after a rejected
    plan the ones already read behind it are dropped, not run."""
    stub = executor_stub
    stub.Reset(pb.ResetRequest(), timeout=10)
    plans = [
        _plans(1)[0],
        pb.Plan(step_id=2, seqs=[pb.ScheduledSeq(seq_id=99, num_tokens=1)]),
        pb.Plan(step_id=3, seqs=[_new_seq(3, [4, 4, 4], [20])]),
    ]
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for r in stub.StepStream(iter(plans), timeout=60):
            got.append((r.step_id, r.error_code))
    codes = grpc.StatusCode
    assert got == [(1, 0), (2, codes.INVALID_ARGUMENT.value[0]), (3, codes.ABORTED.value[0])]
    assert err.value.code() == codes.INVALID_ARGUMENT
    # Sequence 3 was never introduced: plan 3 did not run. The probe is step 3
    # (the stream took plan 3 off the wire: next in turn is 4).
    with pytest.raises(grpc.RpcError) as unknown:
        stub.Step(pb.Plan(step_id=3, seqs=[pb.ScheduledSeq(seq_id=3, num_tokens=1)]), timeout=30)
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "3" in unknown.value.details()
    # Sequence 1 from plan 1 is still there.
    assert list(stub.Step(pb.Plan(step_id=4, seqs=[pb.ScheduledSeq(seq_id=1, num_tokens=1)]), timeout=30).seq_ids) == [
        1
    ]


def test_one_sequences_bad_input_fails_it_alone_and_the_batch_runs(executor_stub):
    stub = executor_stub
    stub.Reset(pb.ResetRequest())
    good, bad = _new_seq(1, [5, 6, 7], [0]), _new_seq(2, [5, 10**6], [1])  # id beyond the embedding
    r = stub.Step(pb.Plan(step_id=1, seqs=[good, bad]), timeout=60)
    assert list(r.seq_ids) == [1] and list(r.failed_seq_ids) == [2] and "vocabulary" in r.failed_reasons[0]
    # A plan sent ahead still names it: reported again, the other decodes on.
    decode = [pb.ScheduledSeq(seq_id=1, num_tokens=1), pb.ScheduledSeq(seq_id=2, num_tokens=1)]
    r = stub.Step(pb.Plan(step_id=2, seqs=decode), timeout=60)
    assert list(r.seq_ids) == [1] and list(r.failed_seq_ids) == [2]
    # Once the router frees it, the id is a new sequence's like any other.
    r = stub.Step(pb.Plan(step_id=3, free_seq_ids=[2], seqs=[_new_seq(2, [8, 9], [2])]), timeout=60)
    assert sorted(r.seq_ids) == [2] and not r.failed_seq_ids
    stub.Reset(pb.ResetRequest())


def test_a_step_that_runs_too_long_turns_the_executors_health_not_serving(tmp_path):
    # A prefill far heavier than the hang timeout stands in for a hung step
    # (a stopped process would stop the health server too): the liveness
    # probe sees NOT_SERVING while it runs and SERVING once it ends.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = f"unix://{tmp_path}/executor.sock"
    big = '{"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 8}'
    cmd = [sys.executable, "-m", "executor", "--model", f"tiny:{big}", "--dtype", "float32", "--device", "cpu"]
    proc = subprocess.Popen(
        cmd + ["--listen", address, "--config", _small_cache(str(tmp_path)), "--threads", "1", "--hang-timeout", "0.3"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.ExecutorStub(ch)
            stub.Describe(pb.DescribeRequest(), timeout=180, wait_for_ready=True)
            health = health_pb2_grpc.HealthStub(ch)
            # ~150 GFLOP on one thread: seconds, several times the hang timeout.
            blocks = list(range(0, 1600 // 16 + 1))
            t, box = _in_background(
                lambda: stub.Step(pb.Plan(step_id=1, seqs=[_new_seq(1, [5] * 1600, blocks)]), timeout=120)
            )
            seen = set()
            while t.is_alive():
                seen.add(health.Check(health_pb2.HealthCheckRequest(), timeout=5).status)
                time.sleep(0.05)
            t.join()
            assert "error" not in box and list(box["result"].seq_ids) == [1]
            assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
            end = time.monotonic() + 5
            status = None
            while time.monotonic() < end and status != health_pb2.HealthCheckResponse.SERVING:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                time.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.terminate()
        proc.wait(timeout=30)
