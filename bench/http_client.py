"""Async load generator over the OpenAI completions API (streaming), shared by
every system measured through HTTP: cbserve's HTTP API and `vllm serve`.

One streamed `POST /v1/completions` per request (aiohttp: its C parser keeps
the client's CPU, which shares the machine with the server, near the gRPC
client's) (the prompt as token ids,
`max_tokens` = the request's output length, `ignore_eos`, greedy), released
at its workload arrival offset. Every SSE chunk is timestamped on arrival;
its token count comes from `stream_options.continuous_usage_stats` (both
servers report the completion tokens so far on every chunk), so a chunk that
carries several tokens, or tokens whose text is still incomplete, is counted
exactly. Records are bench.stats.RequestRecord, as the gRPC client's.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import aiohttp

from bench.client import prepare_run
from bench.stats import RequestRecord
from bench.workload import BenchRequest, Workload


def completion_body(model: str, req: BenchRequest, *, ignore_eos: bool, temperature: float = 0.0) -> dict:
    return {
        "model": model,
        "prompt": req.prompt_ids,
        "max_tokens": req.max_new_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


async def stream_completion(
    client: aiohttp.ClientSession, url: str, body: dict, rec: RequestRecord, t0: float, headers: dict | None = None
) -> None:
    """One streamed completion into `rec` (times relative to `t0`); errors
    are recorded, never raised."""
    rec.send_s = time.perf_counter() - t0
    try:
        async with client.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status}: {text[:200]}"
            else:
                async for raw in resp.content:  # one SSE line at a time
                    line = raw.decode("utf-8").rstrip("\r\n")
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter() - t0
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                        break
                    usage = chunk.get("usage") or {}
                    done = usage.get("completion_tokens")
                    choices = chunk.get("choices") or []
                    if done is None:  # a server without continuous usage: a chunk per token
                        done = rec.output_tokens + sum(1 for c in choices if c.get("text"))
                    rec.add_tokens(done - rec.output_tokens, now)  # counts them in rec.output_tokens
                    for c in choices:
                        if c.get("finish_reason"):
                            rec.finish_reason = c["finish_reason"]
    except Exception as e:  # noqa: BLE001 - a benchmark records, it does not crash
        rec.error = f"{type(e).__name__}: {e}"[:200]
    rec.end_s = time.perf_counter() - t0
    if not rec.error and not rec.finish_reason:
        rec.error = "stream ended without finish_reason"


async def run_http_workload(
    base_url: str,
    model: str,
    workload: Workload,
    *,
    timeout_s: float = 1800.0,
    progress: bool = True,
    desc: str = "http",
) -> tuple[list[RequestRecord], float]:
    """Runs the workload against `base_url` (`http://host:port/v1`). Returns the
    records and the measured duration (first send -> last response)."""
    spec = workload.spec
    records, bar = prepare_run(workload, progress, desc)
    url = f"{base_url}/completions"
    connector = aiohttp.TCPConnector(limit=0)  # no cap: every request has its own stream
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as client:
        t0 = time.perf_counter()

        async def task(req: BenchRequest, rec: RequestRecord) -> None:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            await stream_completion(client, url, completion_body(model, req, ignore_eos=spec.ignore_eos), rec, t0)
            if bar is not None:
                bar.update(1)

        await asyncio.gather(*(task(q, r) for q, r in zip(workload.requests, records)))
    if bar is not None:
        bar.close()
    sent = [r.send_s for r in records if not math.isnan(r.send_s)]
    ends = [r.end_s for r in records if not math.isnan(r.end_s)]
    return records, (max(ends) - min(sent)) if sent and ends else math.nan
