"""Shared helpers for the native kernel tests (tests/native/): batches and the reference."""

from __future__ import annotations

import itertools
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # `executor.torch_ops` is the reference
    sys.path.insert(0, ROOT)

import native  # noqa: E402

SUPPORTED_ISAS = [
    isa for isa, ok in zip(("generic", "avx2", "avx512", "amx"), native.cpu_features()["supported"]) if ok
]


def make_batch(
    q_lens,
    ctx_lens,
    *,
    hq,
    hkv,
    d,
    block_size,
    dtype=torch.float32,
    kv_dtype=None,
    device="cpu",
    extra_blocks=3,
    extra_cols=2,
    seed=0,
):
    """Random paged-attention inputs with shuffled (non-contiguous) block tables.

    Columns of the block table past what a sequence needs hold garbage ids
    (out of range on purpose: they must never be read). The caches have
    `kv_dtype` (default: `dtype`), e.g. torch.float8_e5m2.
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(need) + extra_blocks
    max_blocks = max(need + [1]) + extra_cols
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(q_lens), max_blocks), num_blocks + 7, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[pos : pos + n], dtype=torch.int32)
        pos += n
    kc = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(kv_dtype or dtype)
    vc = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(kv_dtype or dtype)
    cu = torch.tensor(list(itertools.accumulate([0] + list(q_lens))), dtype=torch.int32)
    T = int(cu[-1])
    q = torch.randn(T, hq, d, generator=g).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    to = (lambda t: t.to(device)) if device != "cpu" else (lambda t: t)
    return dict(
        query=to(q),
        key_cache=to(kc),
        value_cache=to(vc),
        block_tables=to(table),
        cu_seqlens_q=to(cu),
        seq_lens=to(sl),
    )


def case_batch(case: dict, **kw):
    """make_batch for a hypothesis case dict (q_lens, ctx_lens, hq, hkv, d,
    block_size, dtype, seed); `kw` adds or overrides arguments."""
    keys = ("hq", "hkv", "d", "block_size", "dtype", "seed")
    return make_batch(case["q_lens"], case["ctx_lens"], **{**{k: case[k] for k in keys}, **kw})


def reference(batch, scale, **kw):
    """The torch reference in fp32 on CPU, from the same (possibly bf16)
    inputs; `kw`: sliding_window, softcap."""
    from executor.torch_ops import paged_attention as ref_attention

    q = batch["query"].cpu().float()
    out = torch.zeros_like(q)
    ref_attention(
        out,
        q,
        batch["key_cache"].cpu().float(),
        batch["value_cache"].cpu().float(),
        batch["block_tables"].cpu(),
        batch["cu_seqlens_q"].cpu(),
        batch["seq_lens"].cpu(),
        scale,
        **kw,
    )
    return out


def attend(batch, scale, **kw):
    """native.paged_attention into a NaN-filled output (every row must be written)."""
    out = torch.full_like(batch["query"], float("nan"))
    native.paged_attention(out, scale=scale, **batch, **kw)
    return out


def tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


def record_rows(monkeypatch, module, attr: str) -> list[int]:
    """Wraps the kernel `module.<attr>` (a PackedLinear's) so that each call
    appends its input's row count to the returned list, then runs it."""
    calls: list[int] = []
    real = getattr(module, attr)

    def spy(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(module, attr, spy)
    return calls
