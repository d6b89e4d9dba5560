"""The best run time a classic workload can have on this machine: FCFS
chunked prefill (cbserve's and vLLM's schedule) replayed on a roofline cost
model, so a measured run, and a target stated as a ratio to a peer, can be
set against what the machine allows.

Every iteration runs the running sequences' decode tokens first, then prompt
chunks in arrival order up to the token budget. Its time is its phases, each
at the better of its two roofs, one after the other (as a layer-by-layer
forward runs them):

    projections  max(tokens x 2 x decoder params / peak, decoder weight bytes / bandwidth)
    attention    max(query x context FLOPs / peak,      K and V bytes read / bandwidth)
    LM head      max(sampled rows x 2 x head params / peak, head bytes / bandwidth)
    + a fixed per-iteration overhead (router, plan, transport)

Nothing a real system does is free here (no kernel below its roof, no
contention with the router or the load generator, no cap on KV blocks or
running sequences), so the result is a lower bound on run time: an upper
bound on tokens/s.

    python -m bench bound [--caps 128 512] [--seeds 6 7 8] [--peak-gflops 400]
        [--bandwidth-gbs 34] [--overhead-ms 0.3] [--budget 512] [--results R.json ...]
        [--model CHECKPOINT_DIR]

`--results` takes `bench run` result files of the same workloads (any
system) and prints each run's time beside the bound.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from bench.roofline import SMOLLM2, dtype_bytes, param_count, shapes_of, step_bytes
from bench.server import DEFAULT_MAX_NUM_BATCHED_TOKENS
from bench.workload import WorkloadSpec, materialise


@dataclass(frozen=True)
class Machine:
    peak_flops: float  # matmul FLOP/s the kernels sustain (bf16: cbserve's 512-token prefill steps)
    bandwidth: float  # bytes/s streamed from memory
    overhead_s: float = 0.0  # per iteration outside the forward


@dataclass(frozen=True)
class ModelCost:
    proj_flops: float  # per token, decoder projections
    head_flops: float  # per sampled row
    weight_bytes: float  # decoder projections, read once per iteration
    head_bytes: float
    kv_bytes: float  # K and V of one cached token, all layers
    attn_flops: float  # per (query token, context token) pair, all layers

    @classmethod
    def of(cls, cfg: dict = SMOLLM2, dtype: str = "bfloat16") -> "ModelCost":
        head = cfg["hidden"] * cfg["vocab"]
        decoder = param_count(cfg)["matmul_params"] - head
        es = dtype_bytes(dtype)
        return cls(
            proj_flops=2.0 * decoder,
            head_flops=2.0 * head,
            weight_bytes=float(decoder * es),
            head_bytes=float(head * es),
            kv_bytes=float(step_bytes(1, 1, dtype, cfg, weight_bytes=0)),
            attn_flops=float(4 * cfg["heads"] * cfg["head_dim"] * cfg["layers"]),
        )


def iteration_flops(cost: ModelCost, tokens: int, sampled: int, pairs: float) -> float:
    return tokens * cost.proj_flops + pairs * cost.attn_flops + sampled * cost.head_flops


def iteration_s(cost: ModelCost, m: Machine, tokens: int, sampled: int, kv_tokens: float, pairs: float) -> float:
    """One iteration: `tokens` rows through the projections, `sampled` rows
    through the LM head, `kv_tokens` cached tokens read, `pairs` attention
    (query, key) pairs."""
    t = max(tokens * cost.proj_flops / m.peak_flops, cost.weight_bytes / m.bandwidth)
    t += max(pairs * cost.attn_flops / m.peak_flops, kv_tokens * cost.kv_bytes / m.bandwidth)
    if sampled:
        t += max(sampled * cost.head_flops / m.peak_flops, cost.head_bytes / m.bandwidth)
    return t + m.overhead_s


@dataclass
class Bound:
    seconds: float
    iterations: int
    last_first_token_s: float  # when the last prompt's first token comes
    output_tokens: int
    prompt_phase_flops: float  # all iterations' FLOPs up to the last prompt's first token

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def fcfs_bound(lengths: list[int], prompt_len: int, budget: int, cost: ModelCost, m: Machine) -> Bound:
    """All requests there at t = 0 with `prompt_len`-token prompts and
    `lengths` output tokens each (the first from the prompt's last chunk)."""
    if budget < 1 or prompt_len < 1 or any(n < 1 for n in lengths):
        raise ValueError("budget, prompt_len and every length must be >= 1")
    n = len(lengths)
    prompt_left = [prompt_len] * n
    out = [0] * n
    ctx = [0] * n
    running: list[int] = []
    nxt = 0
    t = 0.0
    iterations = 0
    last_first = 0.0
    flops = prompt_phase_flops = 0.0
    while running or nxt < n:
        tokens = sampled = len(running)
        kv = float(sum(ctx[i] for i in running))
        pairs = kv
        chunks = []
        room = budget - tokens
        j = nxt
        while room > 0 and j < n:
            take = min(room, prompt_left[j])
            chunks.append((j, take))
            kv += ctx[j]
            pairs += take * (ctx[j] + (take + 1) / 2)
            tokens += take
            sampled += take == prompt_left[j]
            room -= take
            j += 1
        t += iteration_s(cost, m, tokens, sampled, kv, pairs)
        flops += iteration_flops(cost, tokens, sampled, pairs)
        iterations += 1
        for i in running:
            out[i] += 1
            ctx[i] += 1
        for j, take in chunks:
            prompt_left[j] -= take
            ctx[j] += take
            if prompt_left[j] == 0:
                out[j] = 1
                running.append(j)
                nxt = j + 1
                last_first, prompt_phase_flops = t, flops
        running = [i for i in running if out[i] < lengths[i]]
    return Bound(t, iterations, last_first, sum(lengths), prompt_phase_flops)


def classic_lengths(cap: int, seed: int, num_requests: int = 64, prompt_len: int = 128) -> list[int]:
    spec = WorkloadSpec(num_requests=num_requests, prompt_len=prompt_len, cap=cap, seed=seed)
    return [r.max_new_tokens for r in materialise(spec).requests]


def _measured(paths: list[str], dtype: str) -> dict[tuple[int, int, int, int], list[tuple[str, float]]]:
    """(cap, seed, requests, prompt length) -> [(system, seconds)] from the
    burst runs in `dtype` in `bench run` result files."""
    runs: dict[tuple[int, int, int, int], list[tuple[str, float]]] = {}
    for p in paths:
        for r in json.loads(Path(p).read_text())["runs"]:
            w = r.get("workload") or {}
            if (
                r.get("error")
                or r.get("dtype", dtype) != dtype
                or w.get("arrival", "burst") != "burst"
                or w.get("prompt_file")
            ):
                continue
            key = (int(w["cap"]), int(w["seed"]), int(w["num_requests"]), int(w["prompt_len"]))
            runs.setdefault(key, []).append((r["system"], float(r["summary"]["duration_s"])))
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench bound", description=__doc__.split("\n\n")[0])
    ap.add_argument("--caps", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--budget", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS, help="max_num_batched_tokens")
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="weights and KV cache (bytes per value); pass the matmul rate of that dtype too",
    )
    ap.add_argument(
        "--peak-gflops",
        type=float,
        default=400.0,
        help="matmul rate (default: cbserve's served 512-token bf16 prefill iterations on the 2-core Zen 4)",
    )
    ap.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=34.0,
        help="read bandwidth (default: a 2-thread sum over 512 MB there; `bench roofline` measures it)",
    )
    ap.add_argument("--overhead-ms", type=float, default=0.3, help="per iteration outside the forward")
    ap.add_argument("--results", nargs="*", default=[], help="bench run result files to set beside the bound")
    ap.add_argument("--model", default=None, help="a checkpoint directory: its shapes (default: SmolLM2's)")
    a = ap.parse_args(argv)
    m = Machine(a.peak_gflops * 1e9, a.bandwidth_gbs * 1e9, a.overhead_ms / 1e3)
    cost = ModelCost.of(shapes_of(a.model) if a.model else SMOLLM2, dtype=a.dtype)
    measured = _measured(a.results, a.dtype)
    print(
        f"FCFS bound ({a.dtype}): {a.peak_gflops:g} GFLOP/s, {a.bandwidth_gbs:g} GB/s, {a.overhead_ms:g} ms/iteration, "
        f"budget {a.budget}, {a.num_requests} x {a.prompt_len}-token prompts"
    )
    for cap in a.caps:
        for seed in a.seeds:
            b = fcfs_bound(classic_lengths(cap, seed, a.num_requests, a.prompt_len), a.prompt_len, a.budget, cost, m)
            line = (
                f"cap {cap} seed {seed}: {b.output_tokens} tokens, bound {b.seconds:.2f} s = "
                f"{b.tokens_per_s:.0f} tok/s ({b.iterations} iterations, last first token {b.last_first_token_s:.2f} s)"
            )
            for system, secs in measured.get((cap, seed, a.num_requests, a.prompt_len), []):
                line += f"; {system} {secs:.2f} s (runs at {b.seconds / secs:.0%} of the bound's speed)"
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
