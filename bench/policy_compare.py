"""Same burst, every policy: output throughput and mean TTFT per scheduling policy.

    python -m bench.policy_compare [--model smollm2] [--dtype bfloat16] [--n 32]

For each policy (fcfs, sjf, priority, static, dynamic) starts `cbserve serve`
with that policy, sends one burst of N requests at once (64-token prompts,
max_new_tokens mixed in 16..128 with a matching expected_output_tokens hint,
priorities mixed in 0..3, ignore_eos so every request produces exactly its
max_new_tokens), and prints a table. Greedy decoding; the same seeded burst for
every policy. A single run on a shared machine: treat differences of a few
percent as noise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import yaml

from cbserve.v1 import generation_pb2 as gpb
from cbserve.v1 import generation_pb2_grpc as gpb_grpc
from common.ports import free_port

POLICIES = ("fcfs", "sjf", "priority", "static", "dynamic")


def _wait_serving(address: str, proc: subprocess.Popen, timeout: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if h.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not serving after {timeout}s")


def burst(n: int, prompt_len: int, vocab_lo: int, vocab_hi: int, seed: int = 0) -> list[gpb.GenerateRequest]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        max_new = rng.randint(16, 128)
        r = gpb.GenerateRequest(
            request_id=f"b{i}",
            stopping=gpb.StoppingCriteria(max_new_tokens=max_new, ignore_eos=True),
            priority=rng.randint(0, 3),
            expected_output_tokens=max_new,
        )
        r.token_ids.ids.extend(rng.randrange(vocab_lo, vocab_hi) for _ in range(prompt_len))
        reqs.append(r)
    return reqs


async def _send_all(address: str, reqs: list[gpb.GenerateRequest]) -> tuple[float, list[float], int]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = gpb_grpc.GenerationStub(ch)
        t0 = time.perf_counter()

        async def one(r):
            first, n = None, 0
            async for m in stub.Generate(r, timeout=600):
                if m.token_ids and first is None:
                    first = time.perf_counter() - t0
                n += len(m.token_ids)
            return first, n

        res = await asyncio.gather(*(one(r) for r in reqs))
        wall = time.perf_counter() - t0
    return wall, [f for f, _ in res], sum(n for _, n in res)


def run_policy(policy: str, args, reqs) -> dict:
    cfg = {
        "scheduler": {
            "policy": policy,
            "max_num_seqs": args.max_num_seqs,
            "static_batch_size": args.static_batch_size,
            "dynamic_max_wait_ms": 50.0,
        },
        "logging": {"format": "json", "level": "warning"},
    }
    fd, cfg_path = tempfile.mkstemp(suffix=".yaml", prefix="cbserve-policy-")
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(cfg, fh)
    port, mport = free_port(), free_port()
    log = open(os.path.join(tempfile.gettempdir(), f"cbserve-policy-{policy}.log"), "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            "--model",
            args.model,
            "--dtype",
            args.dtype,
            "--config",
            cfg_path,
            "--port",
            str(port),
            "--metrics-port",
            str(mport),
            "--http-port",
            "0",
            "--host",
            "127.0.0.1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    address = f"127.0.0.1:{port}"
    try:
        _wait_serving(address, proc, 300)
        asyncio.run(_send_all(address, reqs[:2]))  # warm-up (first-call allocations)
        wall, ttfts, tokens = asyncio.run(_send_all(address, reqs))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(cfg_path)
    return {
        "policy": policy,
        "wall_s": wall,
        "output_tokens": tokens,
        "tok_s": tokens / wall,
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "max_ttft_s": max(ttfts),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--static-batch-size", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES))
    args = p.parse_args(argv)
    vocab_hi = 259 if args.model.startswith("tiny") else 49152
    reqs = burst(args.n, args.prompt_len, 3, vocab_hi)
    rows = []
    for policy in args.policies.split(","):
        row = run_policy(policy, args, reqs)
        rows.append(row)
        print(f"  done {policy}: {row['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    print(
        f"\nmodel={args.model} dtype={args.dtype} burst={args.n} x {args.prompt_len}-token prompts, "
        f"max_new 16..128 (total {rows[0]['output_tokens']} output tokens), max_num_seqs={args.max_num_seqs}, "
        f"static_batch_size={args.static_batch_size}"
    )
    print(f"{'policy':<10}{'wall s':>9}{'out tok/s':>11}{'mean TTFT s':>13}{'max TTFT s':>12}")
    for r in rows:
        print(
            f"{r['policy']:<10}{r['wall_s']:>9.2f}{r['tok_s']:>11.1f}{r['mean_ttft_s']:>13.3f}{r['max_ttft_s']:>12.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
