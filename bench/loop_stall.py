"""Does one client's huge input stall the others? (`python -m bench.loop_stall`)

Against one `cbserve serve` (tiny model): one client streams a long
generation and another checks gRPC health every 50 ms, first alone, then
while 8 clients keep sending 3.9 MB prompts. The senders run in a process of
their own (so the probes' latency is not their own event loop's), at
`--sender-nice` (on a 2-core machine a nice sender stands in for a load
generator on another machine; 0 shares the cores evenly). Printed per phase:
the streaming client's inter-token gaps (p50 / p99 / max) and health's
latency (p50 / p99 / max), and how the big requests ended. With the
defaults such prompts are refused by gRPC from their length prefix
(`server.max_receive_message_bytes` derives from `limits.max_input_chars`);
`--max-receive-bytes 8388608` lets them through the transport to be parsed
and refused by validation, `--max-input-chars` above them to be tokenized
on the tokenizer threads and refused for the context.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import grpc


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _send(target: str, clients: int, seconds: float) -> dict:
    """The senders' side: `clients` loops of 3.9 MB Complete requests."""
    from cbserve.v1 import generation_pb2 as gpb
    from cbserve.v1 import generation_pb2_grpc as gpb_grpc

    big_text = "word " * (3_900_000 // 5)
    outcomes: Counter = Counter()
    end = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        stub = gpb_grpc.GenerationStub(ch)

        async def big() -> None:
            while time.monotonic() < end:
                try:
                    await stub.Complete(gpb.GenerateRequest(text=big_text), timeout=60)
                    outcomes["OK"] += 1
                except grpc.aio.AioRpcError as exc:
                    outcomes[exc.code().name] += 1

        await asyncio.gather(*(big() for _ in range(clients)))
    return dict(outcomes)


async def _phase(target: str, big_clients: int, seconds: float, sender_nice: int = 0) -> dict:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from cbserve.v1 import generation_pb2 as gpb
    from cbserve.v1 import generation_pb2_grpc as gpb_grpc

    gaps: list[float] = []
    health_ms: list[float] = []
    timeouts = [0]  # health checks not answered within their 5 s
    sender = None
    if big_clients:
        cmd = [sys.executable, "-m", "bench.loop_stall", "--send", target, "--clients", str(big_clients)]
        sender = subprocess.Popen(
            [*cmd, "--seconds", str(seconds)],
            stdout=subprocess.PIPE,
            preexec_fn=(lambda: os.nice(sender_nice)) if sender_nice else None,
        )
    end = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(target) as ch:
        stub = gpb_grpc.GenerationStub(ch)
        hstub = health_pb2_grpc.HealthStub(ch)

        async def stream() -> None:
            while time.monotonic() < end:
                req = gpb.GenerateRequest(stopping=gpb.StoppingCriteria(max_new_tokens=400, ignore_eos=True))
                req.token_ids.ids.extend([5, 6, 7])
                last = None
                async for _ in stub.Generate(req):
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    if now >= end:
                        break

        async def health() -> None:
            while time.monotonic() < end:
                t0 = time.monotonic()
                try:
                    await hstub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                except grpc.aio.AioRpcError:
                    timeouts[0] += 1
                health_ms.append(1e3 * (time.monotonic() - t0))
                await asyncio.sleep(0.05)

        await asyncio.gather(stream(), health())
    outcomes = json.loads(sender.communicate(timeout=120)[0]) if sender is not None else {}
    return {
        "big_clients": big_clients,
        "sender_nice": sender_nice,
        "itl_ms": {q: round(1e3 * _pct(gaps, p), 2) for q, p in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))},
        "health_ms": {q: round(_pct(health_ms, p), 2) for q, p in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))},
        "health_checks": len(health_ms),
        "health_timeouts": timeouts[0],
        "tokens": len(gaps),
        "big_outcomes": outcomes,
        "mean_itl_ms": round(1e3 * statistics.mean(gaps), 2) if gaps else None,
    }


_TIMES = ("cbserve_iteration_seconds", "cbserve_executor_step_seconds", "cbserve_executor_forward_seconds")


def _sums(metrics_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    from bench.metrics_scrape import fetch_text

    out = {}
    for fam in text_string_to_metric_families(fetch_text(metrics_url, timeout=5)):
        for smp in fam.samples:
            if smp.name.removesuffix("_sum").removesuffix("_count") in _TIMES and smp.name.endswith(("_sum", "_count")):
                out[smp.name] = smp.value
    return out


def _means(before: dict, after: dict) -> dict[str, float]:
    """Each histogram's mean (ms) over what was observed between two scrapes."""
    out = {}
    for name in _TIMES:
        n = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
        if n:
            total = after[f"{name}_sum"] - before.get(f"{name}_sum", 0)
            out[name.removeprefix("cbserve_").removesuffix("_seconds") + "_mean_ms"] = round(1e3 * total / n, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.server import CbserveServer

    p = argparse.ArgumentParser(prog="python -m bench.loop_stall", description=__doc__)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--max-input-chars", type=int, default=0, help="limits.max_input_chars (0: the default)")
    p.add_argument("--max-receive-bytes", type=int, default=0, help="server.max_receive_message_bytes (0: derived)")
    p.add_argument("--tokenizer-nice", type=int, default=-1, help="server.tokenizer_nice (-1: the default)")
    p.add_argument("--sender-nice", type=int, default=0, help="niceness of the senders' process")
    p.add_argument("--out", default="bench/results/loop_stall.json")
    p.add_argument("--send", metavar="TARGET", help=argparse.SUPPRESS)  # the senders' process
    p.add_argument("--clients", type=int, default=8, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.send:
        sys.stdout.write(json.dumps(asyncio.run(_send(a.send, a.clients, a.seconds))))
        return 0
    extra: dict = {"server": {"max_receive_message_bytes": a.max_receive_bytes}}
    if a.tokenizer_nice >= 0:
        extra["server"]["tokenizer_nice"] = a.tokenizer_nice
    if a.max_input_chars:
        extra["limits"] = {"max_input_chars": a.max_input_chars}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    server = CbserveServer(
        out.parent / "loop-stall-work", "fcfs", model="tiny", dtype="float32", config_overrides={"extra": extra}
    )
    server.start()
    try:
        result = {
            "max_input_chars": a.max_input_chars or "default",
            "max_receive_bytes": a.max_receive_bytes or "derived",
            "sender_nice": a.sender_nice,
        }
        for name, clients in (("alone", 0), ("with_big_inputs", 8)):
            before = _sums(server.metrics_url)
            result[name] = asyncio.run(_phase(server.target, clients, a.seconds, a.sender_nice))
            # Where a step's time went: the whole iteration (router), the
            # executor's step and its forward, as means over the phase.
            result[name]["steps"] = _means(before, _sums(server.metrics_url))
    finally:
        server.stop()
    out.write_text(json.dumps(result, indent=1))
    for name in ("alone", "with_big_inputs"):
        r = result[name]
        sys.stdout.write(
            f"{name:16s} ITL p50/p99/max {r['itl_ms']['p50']}/{r['itl_ms']['p99']}/{r['itl_ms']['max']} ms; "
            f"health p50/p99/max {r['health_ms']['p50']}/{r['health_ms']['p99']}/{r['health_ms']['max']} ms "
            f"({r['health_timeouts']} timed out); "
            f"big requests {r['big_outcomes']}; steps {r['steps']}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
