"""Linear layers at decode and prefill row counts: oneDNN's prepacked bf16
kernel, plain `F.linear`, native `avx512_linear` and native `amx_linear`, over
all of SmolLM2-135M's projections (30 layers of fused q|k|v, o, fused gate|up
and down, plus the tied LM head), and `amx_linear` over the same shapes as
GGUF blocks (Q4_1 projections, Q8_0 LM head: SmolLM2's GGUF, what the
executor serves it from). Every weight is a distinct tensor, so, as in a model
step, the weights stream from memory; GB/s = bytes the fastest kernel's
weights take / time.

Part of `python -m bench.kernels` (docs/kernels.md).
"""

from __future__ import annotations

import time

import torch

# SmolLM2-135M projections as the executor runs them: (out N, in K) per layer.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
LM_HEAD = (49152, 576)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _random_blocks(n: int, k: int, kind: str, g: torch.Generator):
    """GGUF blocks of an [n, k] weight with random q values and scales."""
    from executor.cpu.gguf_weights import BLOCK, BlockWeight

    d = (torch.rand(n, k // BLOCK, generator=g) * 0.01).half()
    if kind == "q4_1":
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        return BlockWeight(kind, q, d, (-8 * d.float()).half())
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return BlockWeight(kind, q, d, None)


def _kernels(weights, g: torch.Generator):
    """name -> (max rows or None, fn(x_by_k), weight bytes) for the kernels this CPU runs."""
    import native._fused as fused

    out = {}
    bf16_bytes = sum(w.numel() * w.element_size() for w in weights)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    out["oneDNN prepacked"] = (
        None,
        lambda xs: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, packed)
        ],
        bf16_bytes,
    )
    out["F.linear"] = (None, lambda xs: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights], bf16_bytes)
    tiles = [fused.amx_pack_weight(w) for w in weights] if fused.avx512_linear_supported() else []
    if fused.avx512_linear_supported():
        out["avx512_linear"] = (
            None,
            lambda xs: [fused.avx512_linear(xs[w.shape[1]], p, w.shape[0], None) for w, p in zip(weights, tiles)],
            bf16_bytes,
        )
    if fused.amx_linear_supported():
        out["amx_linear"] = (
            None,
            lambda xs: [fused.amx_linear(xs[w.shape[1]], p, w.shape[0], None) for w, p in zip(weights, tiles)],
            bf16_bytes,
        )
        raw = [_random_blocks(*w.shape, "q8_0" if tuple(w.shape) == LM_HEAD else "q4_1", g) for w in weights]
        blocks = [bw.pack() for bw in raw]
        out["amx_linear GGUF blocks"] = (
            None,
            lambda xs: [fused.amx_linear(xs[w.shape[1]], p, w.shape[0], None) for w, p in zip(weights, blocks)],
            sum(p.numel() for p in blocks),
        )
        # What the executor runs up to Q4_ROWS_MAX_ROWS: the Q4_1 projections
        # on amx_q4_rows_linear (feature-major blocks), the Q8_0 head on amx_linear.
        from executor.cpu.packed_linear import Q4_ROWS_MAX_ROWS

        rows = [bw.pack_rows() for bw in raw]
        out["amx_q4_rows_linear GGUF blocks"] = (
            Q4_ROWS_MAX_ROWS,
            lambda xs: [
                fused.amx_linear(xs[w.shape[1]], p, w.shape[0], None)
                if r is None
                else fused.amx_q4_rows_linear(xs[w.shape[1]], r, w.shape[0])
                for w, p, r in zip(weights, blocks, rows)
            ],
            sum(p.numel() for p in blocks),
        )
    return out


def run(reps: int = 5, rows=ROWS) -> list[dict]:
    from executor.cpu.packed_linear import PackedLinear

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return []
    g = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [LM_HEAD]
    weights = [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for n, k in shapes]
    kernels = _kernels(weights, g)
    probe = PackedLinear(torch.nn.Linear(64, 16, bias=False, dtype=torch.bfloat16))
    out = []
    with torch.inference_mode():
        for m in rows:
            xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {k for _, k in shapes}}
            ms = {
                name: _best(lambda: fn(xs), reps if m <= 128 else 2) * 1e3
                for name, (limit, fn, _) in kernels.items()
                if limit is None or m <= limit
            }
            out.append(
                {
                    "rows": m,
                    "ms": ms,
                    "weight_mb": {name: b / 1e6 for name, (_, _, b) in kernels.items()},
                    "packed_linear": probe.kernel_for(m),
                }
            )
    return out


def table(rows: list[dict]) -> str:
    if not rows:
        return "(no bf16 oneDNN on this CPU: not measured here)"
    names = list(rows[0]["ms"])
    lines = [
        "| rows (batch) | " + " | ".join(f"{n} (ms)" for n in names) + " | best GB/s | fastest | PackedLinear runs |",
        "|---|" + "---|" * (len(names) + 3),
    ]
    for r in rows:
        best = min(r["ms"], key=r["ms"].get)
        cells = [f"{r['ms'][n]:.2f}" if n in r["ms"] else "-" for n in names]
        lines.append(
            f"| {r['rows']} | "
            + " | ".join(cells)
            + f" | {r['weight_mb'][best] / r['ms'][best]:.1f} | {best} | {r['packed_linear']} |"
        )
    mb = rows[0]["weight_mb"]
    lines.append("")
    lines.append(
        f"All projections of one model step ({mb['F.linear']:.0f} MB of bf16 weights"
        + (f", {mb['amx_linear GGUF blocks']:.0f} MB as GGUF blocks" if "amx_linear GGUF blocks" in mb else "")
        + "), best of the timed loops. '-': not timed (the executor runs amx_q4_rows_linear up to 32 rows). "
        "avx512_linear is what CPUs with AVX512-BF16 but no AMX run. 'PackedLinear runs': amx_linear is its "
        "blocks variant where the model's GGUF blocks expand exactly to the loaded weights (SmolLM2), its "
        "bf16-tile variant otherwise; up to 32 rows such a model's Q4_1 layers run amx_q4_rows_linear "
        "instead (the column of that name: those layers on it, the Q8_0 LM head on amx_linear)."
    )
    return "\n".join(lines)
