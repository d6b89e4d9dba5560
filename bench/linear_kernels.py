"""Decode-sized linear layers: oneDNN's prepacked bf16 kernel (PackedLinear's
default) vs native `skinny_linear`, over all of SmolLM2-135M's projections
(30 layers of fused q|k|v, o, fused gate|up and down, plus the tied LM head) at
a few rows. Every weight is a distinct tensor, so, as in a model step, the
weights stream from memory; GB/s = weight bytes / time.

Part of `python -m bench.kernels` (docs/kernels.md).
"""

from __future__ import annotations

import time

import torch

# SmolLM2-135M projections as the executor runs them: (out N, in K) per layer.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
LM_HEAD = (49152, 576)


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(reps: int = 5, rows=(1, 2, 4, 8)) -> list[dict]:
    import native._fused as fused

    if not fused.skinny_linear_supported():
        return []
    g = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [LM_HEAD]
    weights = [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for n, k in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    out = []
    with torch.inference_mode():
        for m in rows:
            xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {k for _, k in shapes}}

            def onednn():
                for w, p in zip(weights, packed):
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

            def skinny():
                for w in weights:
                    fused.skinny_linear(xs[w.shape[1]], w)

            t_dnn, t_sk = _best(onednn, reps), _best(skinny, reps)
            out.append({"rows": m, "onednn_ms": t_dnn * 1e3, "skinny_ms": t_sk * 1e3,
                        "onednn_gbs": nbytes / t_dnn / 1e9, "skinny_gbs": nbytes / t_sk / 1e9,
                        "weight_mb": nbytes / 1e6})
    return out


def table(rows: list[dict]) -> str:
    if not rows:
        return "(skinny_linear needs an AVX512-BF16 CPU: not measured here)"
    lines = ["| rows (batch) | oneDNN prepacked (ms) | skinny_linear (ms) | oneDNN GB/s | skinny GB/s | faster |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rows']} | {r['onednn_ms']:.2f} | {r['skinny_ms']:.2f} | {r['onednn_gbs']:.1f} | "
                     f"{r['skinny_gbs']:.1f} | {'skinny' if r['skinny_ms'] < r['onednn_ms'] else 'oneDNN'} |")
    lines.append("")
    lines.append(f"All projections of one decode step ({rows[0]['weight_mb']:.0f} MB of bf16 weights), best of "
                 "the timed loops. PackedLinear takes skinny_linear up to `SKINNY_MAX_ROWS` rows.")
    return "\n".join(lines)
