"""CUDA paged attention with sliding windows and soft caps (docs/native.md, CUDA).

Times `native._C.paged_attention_graphed` (the op the CUDA graphs capture: no
host checks) with CUDA events at Mistral-7B-like shapes (32 query / 8 KV
heads, head_dim 128, bf16, 16-token blocks in shuffled order): a decode batch
over a long context and a prefill chunk after cached context, without a
window, with windows of several sizes, and with Gemma 2's soft cap. A window
should cut the time in proportion to the KV it leaves unread; the KV bytes a
call must read over its time, against the device's copy bandwidth measured
in the same run, say how close each is to the memory bound.

    python -m bench.gpu_attention [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

HQ, HKV, D, BS = 32, 8, 128, 16


def _events_ms(fn, reps: int) -> float:
    """Median of `reps` timings of fn() with CUDA events (after warm-up)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (_events_ms(lambda: y.copy_(x), 10) / 1e3)


def _case(batch: int, ctx: int, q_len: int, gen: torch.Generator):
    need = (ctx + q_len + BS - 1) // BS
    blocks = batch * need
    table = torch.randperm(blocks, generator=gen).to(torch.int32).view(batch, need)
    kc = torch.randn(blocks, BS, HKV, D, generator=gen).to(torch.bfloat16)
    return dict(
        query=torch.randn(batch * q_len, HQ, D, generator=gen).to(torch.bfloat16).cuda(),
        key_cache=kc.cuda(),
        value_cache=torch.randn(blocks, BS, HKV, D, generator=gen).to(torch.bfloat16).cuda(),
        block_tables=table.cuda(),
        cu_seqlens_q=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32).cuda(),
        seq_lens=torch.full((batch,), ctx + q_len, dtype=torch.int32).cuda(),
    )


def _kv_bytes(batch: int, ctx: int, q_len: int, window: int) -> int:
    """K and V bytes a call must read: each sequence's tokens that any of
    its query rows sees."""
    first = max(0, ctx - window + 1) if window else 0
    return batch * (ctx + q_len - first) * HKV * D * 2 * 2


def run(reps: int) -> dict:
    from native import _C

    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    rows = []
    shapes = [("decode", 64, 4096, 1), ("prefill", 4, 3584, 512)]
    masks = [(0, 0.0), (0, 50.0), (4096, 0.0), (1024, 0.0), (256, 0.0), (256, 50.0)]
    for kind, batch, ctx, q_len in shapes:
        inputs = _case(batch, ctx, q_len, gen)
        out = torch.empty_like(inputs["query"])
        base = None
        for window, cap in masks:

            def call(out=out, args=tuple(inputs.values()), q_len=q_len, window=window, cap=cap):
                _C.paged_attention_graphed(out, *args, D**-0.5, q_len, window, cap)

            ms = _events_ms(call, reps)
            base = base or ms
            need = _kv_bytes(batch, ctx, q_len, window)
            rows.append(
                dict(
                    kind=kind,
                    batch=batch,
                    context=ctx,
                    q_len=q_len,
                    window=window,
                    softcap=cap,
                    ms=ms,
                    vs_no_window=ms / base,
                    kv_gb_per_s=need / (ms / 1e3) / 1e9,
                    share_of_copy_bw=need / (ms / 1e3) / bw,
                )
            )
        del inputs, out
        torch.cuda.empty_cache()
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gb_per_s=bw / 1e9, rows=rows)


def table(res: dict) -> str:
    lines = [
        f"{res['device']}, torch {res['torch']}, copy bandwidth {res['copy_gb_per_s']:.0f} GB/s",
        "",
        "| call | batch x context + new | window | soft cap | ms | vs no window | KV GB/s | share of copy bw |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['kind']} | {r['batch']} x {r['context']} + {r['q_len']} | {r['window'] or 'none'} | "
            f"{r['softcap'] or 'none'} | {r['ms']:.3f} | {r['vs_no_window']:.2f} | {r['kv_gb_per_s']:.0f} | "
            f"{r['share_of_copy_bw']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    res = run(args.reps)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
