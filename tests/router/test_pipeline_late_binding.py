"""Late binding of the plan sent ahead (scheduler.pipeline_lead_ms): in
steady decode the router holds the next plan until just before the step in
flight ends, so a prompt that arrives meanwhile goes into the very next step
instead of queueing behind a decode already sent.

The executor here is a stand-in with a fixed step time: the property is about
when plans leave the router against when steps start and end, which a real
tiny model's ~1 ms decode steps cannot show apart from scheduling noise.
tests/integration/ runs the same loop against the real executor."""

from __future__ import annotations

import asyncio
import time

import pytest

from cbserve.v1 import executor_pb2 as pb
from router.config import RouterConfig
from router.engine import Engine
from router.metrics import Metrics
from router.request import Finish, Request, Sampling, Stopping
from router.tokenizer import load_tokenizer

STEP_S = 0.08  # every step of the stand-in, decode or prefill
TOKEN = 40


class TimedExecutor:
    """Runs plans strictly in order, each for STEP_S, and answers one token
    for every sequence in it (the prompts here fit in one step)."""

    def __init__(self) -> None:
        self.received: list[tuple[pb.Plan, float]] = []
        self.ran: list[tuple[pb.Plan, float, float]] = []  # plan, start, end
        self._queue: asyncio.Queue | None = None
        self._worker: asyncio.Task | None = None

    def _describe(self) -> pb.DescribeResponse:
        return pb.DescribeResponse(
            model="stand-in",
            dtype="float32",
            vocab_size=259,
            max_context_length=2048,
            block_size=16,
            num_blocks=64,
            num_swap_blocks=0,
            attention_backend="native",
            eos_token_ids=[2],
            instance_id=1,
        )

    async def wait_ready(self, stop=None, timeout: float = 5.0) -> pb.DescribeResponse:
        if self._worker is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._work())
        return self._describe()

    async def describe(self, timeout: float = 5.0, wait_for_ready: bool = True) -> pb.DescribeResponse:
        return self._describe()

    def connected(self) -> bool:
        return True

    async def wait_connection_change(self) -> None:
        await asyncio.Event().wait()

    async def reset(self) -> None:
        pass

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()

    async def step(self, plan: pb.Plan) -> pb.StepResult:
        fut = asyncio.get_running_loop().create_future()
        self.received.append((plan, time.perf_counter()))
        self._queue.put_nowait((plan, fut))
        return await fut

    async def _work(self) -> None:
        while True:
            plan, fut = await self._queue.get()
            start = time.perf_counter()
            await asyncio.sleep(STEP_S)
            end = time.perf_counter()
            self.ran.append((plan, start, end))
            ids = [s.seq_id for s in plan.seqs]
            fut.set_result(
                pb.StepResult(
                    step_id=plan.step_id,
                    seq_ids=ids,
                    token_ids=[TOKEN] * len(ids),
                    step_seconds=end - start,
                    forward_seconds=end - start,
                )
            )


def _request(rid: str, prompt: list[int], n: int) -> Request:
    return Request(rid, prompt, Sampling(), Stopping(max_new_tokens=n, ignore_eos=True))


async def _drain(handle) -> list[int]:
    tokens: list[int] = []
    while True:
        d = await asyncio.wait_for(handle.queue.get(), timeout=30)
        assert d.error is None
        tokens += d.token_ids
        if d.finish is not None:
            assert d.finish == Finish.LENGTH
            return tokens


async def _arrival_during_decode(lead_ms: float) -> tuple[int, float, Engine, TimedExecutor]:
    cfg = RouterConfig()
    cfg.scheduler.pipeline_lead_ms = lead_ms
    # Plans sent ahead carry no drafts: speculation would hold them back.
    cfg.speculative.method = ""
    fake = TimedExecutor()
    eng = Engine(cfg, load_tokenizer("tiny"), Metrics(), client=fake)
    eng.start()
    try:
        await asyncio.wait_for(eng.ready.wait(), timeout=30)
        a = eng.submit(_request("a", [5, 6, 7, 8], 12))
        # Steady decode: the prefill, then pure decodes planned ahead.
        while len(fake.ran) < 4:
            await asyncio.sleep(0.005)
        # Arrive a quarter into a step: the next plan is not due for ~3/4 of it.
        started = len(fake.ran)
        while len(fake.ran) == started:
            await asyncio.sleep(0.001)
        await asyncio.sleep(STEP_S / 4)
        running = len(fake.ran)  # the index of the step executing now
        b = eng.submit(_request("b", [9, 10, 11], 3))
        got_a, got_b = await asyncio.gather(_drain(a), _drain(b))
        assert got_a == [TOKEN] * 12 and got_b == [TOKEN] * 3
        first_b = next(i for i, (p, _, _) in enumerate(fake.ran) if any(s.seq_id == b.req.seq_id for s in p.seqs))
        ttft = b.req.first_token_time - b.req.arrival_time
        return first_b - running, ttft, eng, fake
    finally:
        await eng.stop()


@pytest.mark.parametrize("lead_ms, steps_later", [(4.0, 1), (0.0, 2)])
def test_a_prompt_arriving_mid_decode_joins_the_next_step(lead_ms, steps_later):
    later, ttft, eng, fake = asyncio.run(_arrival_during_decode(lead_ms))
    # Held: the step after the running one carries the new prompt. Sent at
    # once (0): that step was already on its way, and the prompt waits for it.
    assert later == steps_later
    assert ttft < (steps_later + 1) * STEP_S + 0.05
    # Pipelining stays on: decode plans still reach the executor before the
    # step ahead of them ends.
    ends = {p.step_id: e for p, _, e in fake.ran}
    early = [t for p, t in fake.received if p.step_id - 1 in ends and t < ends[p.step_id - 1]]
    assert len(early) >= 4
    assert eng.scheduler.blocks.usage() == 0 and not eng.scheduler.running and not eng.handles
