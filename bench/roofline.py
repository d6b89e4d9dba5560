"""Roofline for decode: the achieved matmul GFLOP/s at SmolLM2's projection
shapes (M = batch rows; per shape the fastest of torch's F.linear and
cbserve's native bf16 kernels) and the decode bound it implies:

    tokens/s <= achieved FLOP/s / (2 x parameters)

computed shape by shape: one decode step at batch M costs
sum_i t_i(M) (30 layers of q/k/v/o/gate/up/down + the LM head), so the bound
is M / sum_i t_i(M) tokens/s. Attention over the KV cache, norms and
activations are left out (they only lower the real ceiling).

Those matmuls run on weights already in cache. The memory roof beside it:
a decode step reads every weight once plus each sequence's K and V, so at the
measured stream bandwidth it cannot beat M / (bytes per step / bandwidth)
tokens/s; the roofline bound is the lower of the two.

    python -m bench roofline [--batch 64] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

# SmolLM2-135M: hidden 576, intermediate 1536, 9 q heads, 3 kv heads, head dim 64,
# 30 layers, vocab 49152 (tied embeddings: the LM head is the embedding matrix).
SMOLLM2 = dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, layers=30, vocab=49152)


def shapes_of(model_dir: str) -> dict:
    """A checkpoint's shapes in SMOLLM2's keys, from its config.json (a
    multimodal config's text part)."""
    from pathlib import Path

    c = json.loads((Path(model_dir) / "config.json").read_text())
    c = c.get("text_config", c)
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    return dict(
        hidden=hidden,
        intermediate=c["intermediate_size"],
        heads=heads,
        kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or hidden // heads,
        layers=c["num_hidden_layers"],
        vocab=c["vocab_size"],
    )


@dataclass
class Proj:
    name: str
    k: int  # in features
    n: int  # out features
    per_token_calls: int  # how many times one decode step runs it (layers)


def projections(cfg: dict = SMOLLM2) -> list[Proj]:
    h, i, d, L = cfg["hidden"], cfg["intermediate"], cfg["head_dim"], cfg["layers"]
    q, kv = cfg["heads"] * d, cfg["kv_heads"] * d
    return [
        Proj("q_proj", h, q, L),
        Proj("k_proj", h, kv, L),
        Proj("v_proj", h, kv, L),
        Proj("o_proj", q, h, L),
        Proj("gate_proj", h, i, L),
        Proj("up_proj", h, i, L),
        Proj("down_proj", i, h, L),
        Proj("lm_head", h, cfg["vocab"], 1),
    ]


def param_count(cfg: dict = SMOLLM2) -> dict[str, int]:
    mm = sum(p.k * p.n * p.per_token_calls for p in projections(cfg))
    norms = cfg["hidden"] * (2 * cfg["layers"] + 1)
    return {"matmul_params": mm, "total_params": mm + norms, "embedding_params": cfg["hidden"] * cfg["vocab"]}


def linear_impls(k: int, n: int, dtype) -> list[tuple[str, Any]]:
    """(name, call(x)) of each implementation of one [n, k] linear layer that
    the roof is measured over: torch's F.linear and, in bfloat16, cbserve's
    native kernels over packed weights where the CPU has them (the lean
    forward runs those). The roof is the fastest: a bound that the served
    model beats is no bound."""
    import torch
    import torch.nn.functional as F

    w = torch.randn(n, k, dtype=dtype)
    impls: list[tuple[str, Any]] = [("F.linear", lambda x: F.linear(x, w))]
    if dtype != torch.bfloat16:
        return impls
    try:
        import native._fused as fused
    except ImportError:
        return impls
    natives = [
        (name, call)
        for name, supported, call in (
            ("amx_linear", fused.amx_linear_supported, fused.amx_linear),
            ("avx512_linear", fused.avx512_linear_supported, fused.avx512_linear),
        )
        if supported()
    ]
    packed = fused.amx_pack_weight(w) if natives else None  # the layout both kernels read
    return impls + [(name, lambda x, call=call: call(x, packed, n, None)) for name, call in natives]


def time_linear(m: int, k: int, n: int, dtype, min_time_s: float = 0.15, reps: int = 7) -> tuple[float, str]:
    """Best (minimum) seconds per call of a [m, k] x [n, k]^T linear layer over
    `reps` timed loops of each implementation (linear_impls), and the
    implementation that ran it: a roofline is an upper bound, and on a shared
    machine the minimum is the sample least disturbed by other load."""
    import torch

    x = torch.randn(m, k, dtype=dtype)
    best = (math.inf, "")
    with torch.inference_mode():
        for name, call in linear_impls(k, n, dtype):
            for _ in range(3):
                call(x)
            # calibrate the inner loop to ~min_time_s / reps
            t0 = time.perf_counter()
            call(x)
            one = max(time.perf_counter() - t0, 1e-6)
            iters = max(1, int(min_time_s / reps / one))
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(iters):
                    call(x)
                best = min(best, ((time.perf_counter() - t0) / iters, name))
    return best


def measure(
    batch: int = 64,
    dtypes: tuple[str, ...] = ("bfloat16", "float32"),
    cfg: dict = SMOLLM2,
    min_time_s: float = 0.15,
    progress: bool = False,
) -> dict[str, Any]:
    import torch

    projs = projections(cfg)
    params = param_count(cfg)
    out: dict[str, Any] = {
        "batch": batch,
        "threads": torch.get_num_threads(),
        "params": params,
        "matmuls": [],
        "bounds": [],
    }
    it = [(dt, p) for dt in dtypes for p in projs]
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="roofline", unit="shape", leave=False)
    per_dtype: dict[str, float] = {}
    one_row: dict[str, float] = {}
    for dt, p in it:
        tdt = getattr(torch, dt)
        s, impl = time_linear(batch, p.k, p.n, tdt, min_time_s)
        gf = 2 * batch * p.k * p.n / s / 1e9
        out["matmuls"].append(
            {
                "name": p.name,
                "m": batch,
                "k": p.k,
                "n": p.n,
                "dtype": dt,
                "ms": s * 1e3,
                "gflops": gf,
                "impl": impl,
                "calls_per_step": p.per_token_calls,
            }
        )
        per_dtype[dt] = per_dtype.get(dt, 0.0) + s * p.per_token_calls
        if p.name == "gate_proj":
            s1, _ = time_linear(1, p.k, p.n, tdt, min_time_s / 2)
            one_row[dt] = 2 * p.k * p.n / s1 / 1e9
    for dt in dtypes:
        step_s = per_dtype[dt]
        flops_step = 2 * batch * params["matmul_params"]
        gflops_w = flops_step / step_s / 1e9
        bound = batch / step_s  # == achieved FLOP/s / (2 x matmul params)
        g1536 = next(m["gflops"] for m in out["matmuls"] if m["dtype"] == dt and m["name"] == "gate_proj")
        out["bounds"].append(
            {
                "dtype": dt,
                "gflops_weighted": gflops_w,
                "decode_bound_tok_s": bound,
                "gflops_576x1536": g1536,
                "simple_bound_tok_s": g1536 * 1e9 / (2 * params["matmul_params"]),
                "step_matmul_ms": step_s * 1e3,
                "gflops_batch1_576x1536": one_row.get(dt),
            }
        )
    return out


def stream_gb_s(mib: int = 512, reps: int = 5) -> float:
    """Best read bandwidth (GB/s) of a reduction over a `mib` MiB buffer, far
    larger than the caches, with torch's threads."""
    import torch

    x = torch.ones(mib * 1024 * 1024 // 4, dtype=torch.float32)
    x.sum()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 1 if dtype == "fp8_e5m2" else 2


def step_bytes(
    batch: int,
    context: int,
    dtype: str,
    cfg: dict = SMOLLM2,
    weight_bytes: int | None = None,
    kv_dtype: str | None = None,
) -> int:
    """Bytes one decode step must read: every matmul weight once (in `dtype`,
    or `weight_bytes` as the executor stores them: GGUF blocks where its
    kernels stream those), plus K and V of `context` tokens for each of
    `batch` sequences (in `kv_dtype`, default `dtype`)."""
    es = dtype_bytes(dtype)
    kv = 2 * cfg["layers"] * cfg["kv_heads"] * cfg["head_dim"] * dtype_bytes(kv_dtype or dtype) * batch * context
    return (param_count(cfg)["matmul_params"] * es if weight_bytes is None else weight_bytes) + kv


def attach_memory_roof(
    roof: dict, gb_s: float, context: int, cfg: dict = SMOLLM2, weight_bytes: dict[str, int] | None = None
) -> dict:
    """Adds the memory bound and the roofline bound (the lower roof) per
    dtype; `weight_bytes` (per dtype) as the executor stores the weights."""
    roof["stream_gb_s"] = gb_s
    roof["context"] = context
    for b in roof["bounds"]:
        wb = (weight_bytes or {}).get(b["dtype"])
        nbytes = step_bytes(roof["batch"], context, b["dtype"], cfg, wb)
        b["step_mb"] = nbytes / 1e6
        b["memory_bound_tok_s"] = roof["batch"] / (nbytes / (gb_s * 1e9))
        # The step's matmuls at the compute roof, then its attention streaming
        # the batch's K/V at the stream bandwidth: a decode step runs them one
        # after the other, so this is the tighter bound of the two phases.
        kv_s = step_bytes(roof["batch"], context, b["dtype"], cfg, weight_bytes=0) / (gb_s * 1e9)
        b["kv_stream_ms"] = kv_s * 1e3
        b["phase_bound_tok_s"] = roof["batch"] / (b["step_matmul_ms"] / 1e3 + kv_s)
        b["roofline_bound_tok_s"] = min(b["memory_bound_tok_s"], b["decode_bound_tok_s"])
        if "cbserve_decode_tok_s" in b:
            b["roofline_share"] = b["cbserve_decode_tok_s"] / b["roofline_bound_tok_s"]
    return roof


def attach_cbserve(roof: dict, decode_tok_s_by_dtype: dict[str, float]) -> dict:
    for b in roof["bounds"]:
        v = decode_tok_s_by_dtype.get(b["dtype"])
        if v is not None:
            b["cbserve_decode_tok_s"] = v
            b["share"] = v / b["decode_bound_tok_s"]
    return roof


def _fastest(roof: dict) -> str:
    """Which implementation ran each dtype's shapes fastest, e.g.
    "bfloat16: avx512_linear ×7, F.linear ×1; float32: F.linear ×8"."""
    from collections import Counter

    by_dtype: dict[str, Counter] = {}
    for m in roof["matmuls"]:
        by_dtype.setdefault(m["dtype"], Counter())[m.get("impl") or "F.linear"] += 1
    return "; ".join(f"{dt}: " + ", ".join(f"{name} ×{n}" for name, n in c.most_common()) for dt, c in by_dtype.items())


def describe(roof: dict) -> str:
    p = roof["params"]
    lines = [
        "Bound: tokens/s <= achieved FLOP/s / (2 × parameters). 'Decode bound' adds up the measured time of "
        "every projection of one decode step at batch M (so slow shapes count); 'simple bound' uses the "
        "64×576×1536 rate alone. Best of 7 timed loops per shape.",
        f"Matmul parameters per decode step: {p['matmul_params'] / 1e6:.1f} M (30 layers of q/k/v/o/gate/up/down "
        f"+ the tied 576×49152 LM head); one decode token costs 2 × that in FLOPs. Per shape the faster of torch "
        f"{roof.get('torch', '')} F.linear and cbserve's native bf16 kernels ({_fastest(roof)}), "
        f"{roof['threads']} threads, M = {roof['batch']} rows (one row per sequence in the batch).",
    ]
    for b in roof["bounds"]:
        if b.get("gflops_batch1_576x1536"):
            lines.append(
                f"{b['dtype']}: 576×1536 at one row reaches {b['gflops_batch1_576x1536']:.0f} GFLOP/s "
                f"(batching is what makes decode efficient)."
            )
    return " ".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    ap = argparse.ArgumentParser(prog="bench roofline")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument(
        "--context",
        type=int,
        default=152,
        help="tokens of context per sequence for the memory roof (K/V read per step)",
    )
    ap.add_argument("--out", default=None, help="write the JSON here")
    a = ap.parse_args(argv)
    roof = measure(a.batch, tuple(a.dtypes.split(",")), progress=True)
    roof["torch"] = torch.__version__
    attach_memory_roof(roof, stream_gb_s(), context=a.context)
    for m in roof["matmuls"]:
        print(
            f"{m['dtype']:>9} {m['name']:>9} {m['m']}x{m['k']}x{m['n']:<6} {m['gflops']:7.1f} GFLOP/s {m['ms']:.3f} ms"
        )
    for b in roof["bounds"]:
        print(
            f"{b['dtype']:>9}: weighted {b['gflops_weighted']:.1f} GFLOP/s -> decode bound "
            f"{b['decode_bound_tok_s']:.0f} tok/s at batch {a.batch}; memory roof "
            f"{b['memory_bound_tok_s']:.0f} tok/s ({b['step_mb']:.0f} MB a step at {roof['stream_gb_s']:.1f} GB/s, "
            f"{a.context} tokens of context) -> roofline bound {b['roofline_bound_tok_s']:.0f} tok/s"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(roof, f, indent=2)
    return 0
