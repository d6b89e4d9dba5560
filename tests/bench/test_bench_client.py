"""The load generator against a fake cbserve Generation server on loopback
(real gRPC, grpc.aio). No timing assertions."""

import asyncio

import grpc
import pytest

from bench.client import run_grpc_workload
from bench.stats import summarize
from bench.workload import WorkloadSpec, materialise
from cbserve.v1 import generation_pb2 as pb
from cbserve.v1 import generation_pb2_grpc as pbg


class FakeGeneration(pbg.GenerationServicer):
    def __init__(self, chunk: int = 1, fail_index: int | None = None):
        self.chunk = chunk
        self.fail_index = fail_index
        self.requests: list[pb.GenerateRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.fail_index is not None and request.request_id.endswith(f"-{self.fail_index}"):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
            n = request.stopping.max_new_tokens
            sent = 0
            while sent < n:
                await asyncio.sleep(0.001)
                k = min(self.chunk, n - sent)
                ids = list(range(sent, sent + k))
                sent += k
                last = sent == n
                yield pb.GenerateResponse(
                    request_id=request.request_id,
                    token_ids=ids,
                    text="x" * k,
                    finish_reason=pb.LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                    usage=pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=n) if last else None,
                )
        finally:
            self.in_flight -= 1


async def _serve(servicer):
    server = grpc.aio.server()
    pbg.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _run(servicer, workload, **kw):
    async def main():
        server, target = await _serve(servicer)
        try:
            return await run_grpc_workload(target, workload, progress=False, **kw)
        finally:
            await server.stop(None)

    return asyncio.run(main())


@pytest.mark.parametrize("chunk", [1, 3])
def test_client_records_every_token(chunk):
    w = materialise(WorkloadSpec(num_requests=12, prompt_len=16, cap=20, seed=2))
    fake = FakeGeneration(chunk=chunk)
    recs, duration = _run(fake, w)
    assert duration > 0
    assert len(fake.requests) == 12
    by_id = {r.request_id: r for r in fake.requests}
    for req, rec in zip(w.requests, recs):
        sent = by_id[f"bench-{req.index}"]
        assert list(sent.token_ids.ids) == req.prompt_ids
        assert sent.stopping.max_new_tokens == req.max_new_tokens
        assert sent.stopping.ignore_eos is True
        assert sent.sampling.temperature == 0.0
        assert rec.ok, rec.error
        assert rec.output_tokens == req.max_new_tokens == len(rec.token_times)
        assert rec.finish_reason == "LENGTH"
        assert rec.ttft >= 0 and rec.e2e >= rec.ttft
        assert all(g >= 0 for g in rec.itls())
        assert rec.token_times == sorted(rec.token_times)
    s = summarize(recs, duration)
    assert s["num_ok"] == 12 and s["output_tokens"] == w.total_output_tokens


def test_client_concurrency_limit_and_errors():
    w = materialise(WorkloadSpec(num_requests=10, prompt_len=4, output_dist="fixed", cap=5, concurrency=3))
    fake = FakeGeneration(fail_index=4)
    recs, _ = _run(fake, w)
    assert fake.max_in_flight <= 3
    bad = [r for r in recs if not r.ok]
    assert [r.index for r in bad] == [4]
    assert bad[0].error.startswith("RESOURCE_EXHAUSTED")
    s = summarize(recs)
    assert s["num_errors"] == 1 and s["num_ok"] == 9


def test_client_poisson_arrivals_respected():
    w = materialise(
        WorkloadSpec(num_requests=5, prompt_len=4, output_dist="fixed", cap=2, arrival="poisson", rate=50.0, seed=1)
    )
    recs, _ = _run(FakeGeneration(), w)
    for r in recs:
        assert r.ok
        assert r.send_s >= r.arrival_s  # never sent before its arrival time
