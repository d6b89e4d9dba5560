"""Async gRPC load generator over cbserve's public API (cbserve.v1.Generation).

One channel, one server-streaming `Generate` call per request, every streamed
delta timestamped on arrival. Requests are released at their workload arrival
offsets (all at t=0 for a burst) and at most `concurrency` are in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import time
from typing import Callable

import grpc

from bench.stats import RequestRecord
from bench.workload import BenchRequest, Workload

try:  # installed editable by `make install`; fall back to the source tree.
    from cbserve.v1 import generation_pb2, generation_pb2_grpc
except ImportError:  # pragma: no cover - depends on the environment
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "protos"))
    from cbserve.v1 import generation_pb2, generation_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.http2.max_pings_without_data", 0),
]


def build_request(
    req: BenchRequest, *, ignore_eos: bool = True, temperature: float = 0.0, request_id_prefix: str = "bench"
) -> "generation_pb2.GenerateRequest":
    return generation_pb2.GenerateRequest(
        request_id=f"{request_id_prefix}-{req.index}",
        token_ids=generation_pb2.TokenIds(ids=req.prompt_ids),
        sampling=generation_pb2.SamplingParams(temperature=temperature),
        stopping=generation_pb2.StoppingCriteria(max_new_tokens=req.max_new_tokens, ignore_eos=ignore_eos),
        expected_output_tokens=req.max_new_tokens,
    )


async def _one(
    stub,
    req: BenchRequest,
    rec: RequestRecord,
    t0: float,
    *,
    ignore_eos: bool,
    temperature: float,
    timeout_s: float,
    prefix: str,
    shape: Callable | None = None,
) -> None:
    msg = build_request(req, ignore_eos=ignore_eos, temperature=temperature, request_id_prefix=prefix)
    if shape is not None:
        shape(msg, req.index)
    rec.send_s = time.perf_counter() - t0
    try:
        call = stub.Generate(msg, timeout=timeout_s)
        async for resp in call:
            now = time.perf_counter() - t0
            rec.add_tokens(len(resp.token_ids), now)
            if resp.finish_reason:
                rec.finish_reason = generation_pb2.FinishReason.Name(resp.finish_reason)
    except grpc.aio.AioRpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
    except Exception as e:  # noqa: BLE001 - a benchmark records, it does not crash
        rec.error = f"{type(e).__name__}: {e}"
    rec.end_s = time.perf_counter() - t0
    if not rec.error and not rec.finish_reason:
        rec.error = "stream ended without finish_reason"


def prepare_run(workload: Workload, progress: bool, desc: str) -> tuple[list[RequestRecord], object | None]:
    """What every load client does before its first send: one empty record
    per request, a progress bar, and the process's objects frozen."""
    records = [
        RequestRecord(
            index=r.index, prompt_tokens=len(r.prompt_ids), max_new_tokens=r.max_new_tokens, arrival_s=r.arrival_s
        )
        for r in workload.requests
    ]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(records), desc=desc, unit="req", leave=False)
    # The suite's process has run in-process peers (transformers, torch) before:
    # leave their objects out of the cyclic collections the client's per-token
    # garbage triggers during the run (each one would walk them all, on the
    # cores the server under test is using).
    gc.collect()
    gc.freeze()
    return records, bar


async def run_grpc_workload(
    target: str,
    workload: Workload,
    *,
    concurrency: int | None = None,
    temperature: float = 0.0,
    timeout_s: float = 1800.0,
    progress: bool = True,
    desc: str = "cbserve",
    prefix: str = "bench",
    on_done: Callable[[RequestRecord], None] | None = None,
    shape: Callable | None = None,
) -> tuple[list[RequestRecord], float]:
    """Runs the workload against `target` (host:port). Returns the records and
    the measured duration (first send -> last response). `shape(msg, index)`
    may change each GenerateRequest before it is sent."""
    spec = workload.spec
    conc = concurrency or spec.concurrency
    sem = asyncio.Semaphore(conc) if conc else None
    records, bar = prepare_run(workload, progress, desc)
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await channel.channel_ready()
        t0 = time.perf_counter()

        async def task(req: BenchRequest, rec: RequestRecord) -> None:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem if sem is not None else contextlib.nullcontext():
                await _one(
                    stub,
                    req,
                    rec,
                    t0,
                    ignore_eos=spec.ignore_eos,
                    temperature=temperature,
                    timeout_s=timeout_s,
                    prefix=prefix,
                    shape=shape,
                )
            if bar is not None:
                bar.update(1)
            if on_done is not None:
                on_done(rec)

        await asyncio.gather(*(task(q, r) for q, r in zip(workload.requests, records)))
    if bar is not None:
        bar.close()
    sent = [r.send_s for r in records if not math.isnan(r.send_s)]
    ends = [r.end_s for r in records if not math.isnan(r.end_s)]
    duration = (max(ends) - min(sent)) if sent and ends else math.nan
    return records, duration


def run_grpc_workload_sync(target: str, workload: Workload, **kw) -> tuple[list[RequestRecord], float]:
    return asyncio.run(run_grpc_workload(target, workload, **kw))
