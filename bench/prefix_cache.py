"""Prefix-caching benchmark (issue #5): requests sharing a long system prompt.

64 requests share a 512-token prefix, each with its own 32-token question and
64 output tokens (EOS ignored), all sent at t=0 to SmolLM2 under fcfs, once
with `cache.enable_prefix_caching: true` and once with false. Prints a table
of throughput and TTFT and writes docs/prefix_cache.md.

    python -m bench.prefix_cache [--requests 64] [--prefix 512] [--question 32] [--output 64]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.runner import run_cbserve
from bench.workload import PROMPT_ID_LOW, BenchRequest, Workload, WorkloadSpec


def shared_prefix_workload(n: int, prefix: int, question: int, output: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    system = rng.integers(PROMPT_ID_LOW, 49152, size=prefix).tolist()
    reqs = [
        BenchRequest(i, system + rng.integers(PROMPT_ID_LOW, 49152, size=question).tolist(), output, 0.0)
        for i in range(n)
    ]
    spec = WorkloadSpec(num_requests=n, prompt_len=prefix + question, output_dist="fixed", cap=output, seed=seed)
    return Workload(spec, reqs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--question", type=int, default=32)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="docs/prefix_cache.md")
    args = p.parse_args(argv)
    w = shared_prefix_workload(args.requests, args.prefix, args.question, args.output)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for enabled in (False, True):
            run = run_cbserve(
                "fcfs",
                [w],
                dtype=args.dtype,
                workdir=Path(tmp),
                warmup=False,
                progress=False,
                config_overrides={"extra": {"cache": {"enable_prefix_caching": enabled}}},
            )[0]
            if run.get("error"):
                print(f"prefix caching {enabled}: failed: {run['error']}", file=sys.stderr)
                return 1
            s = run["summary"]
            rows.append((enabled, s))
    off, on = rows[0][1], rows[1][1]
    lines = [
        "# Prefix caching: shared system prompt",
        "",
        f"{args.requests} requests, each a shared {args.prefix}-token prefix + its own {args.question}-token "
        f"question, {args.output} output tokens (EOS ignored), all at t=0; SmolLM2-135M-Instruct, {args.dtype}, "
        f"fcfs, default budget (512 tokens/iteration). Machine: {platform.processor() or platform.machine()}, "
        f"2 cores. Command: `python -m bench.prefix_cache`.",
        "",
        "| prefix caching | output tok/s | TTFT mean (s) | TTFT p50 (s) | TTFT p99 (s) | e2e mean (s) |",
        "|---|---|---|---|---|---|",
    ]
    for enabled, s in rows:
        lines.append(
            f"| {'on' if enabled else 'off'} | {s['output_tokens_per_s']:.1f} | {s['ttft_s']['mean']:.3f} | "
            f"{s['ttft_s']['p50']:.3f} | {s['ttft_s']['p99']:.3f} | {s['e2e_s']['mean']:.3f} |"
        )
    lines += [
        "",
        f"Throughput x{on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}, mean TTFT "
        f"/{off['ttft_s']['mean'] / on['ttft_s']['mean']:.2f} with caching on.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
