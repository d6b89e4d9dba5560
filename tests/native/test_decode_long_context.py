"""The decode path over contexts longer than one softmax chunk (512 tokens)
agrees with the torch reference, for every dtype and a few query lengths."""

from __future__ import annotations

import pytest
import torch

import native
from executor import torch_ops

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_len", [1, 2, 5])
def test_long_context_decode_matches_reference(dtype, q_len):
    g = torch.Generator().manual_seed(q_len)
    hq, hkv, d, bs = 9, 3, 64, 16
    ctx = [700, 1025, 1500, 513]
    blocks = [(c + bs - 1) // bs for c in ctx]
    nblk = sum(blocks) + 3
    kc = torch.randn(nblk, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nblk, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(nblk, generator=g).to(torch.int32)  # shuffled block tables
    tables = torch.zeros(len(ctx), max(blocks), dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[at : at + n]
        at += n
    t = q_len * len(ctx)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    cu = torch.arange(0, t + 1, q_len, dtype=torch.int32)
    lens = torch.tensor(ctx, dtype=torch.int32)
    out = torch.empty_like(q)
    native.paged_attention(out, q, kc, vc, tables, cu, lens, d**-0.5)
    ref = torch.empty(t, hq, d)
    torch_ops.paged_attention(ref, q.float(), kc.float(), vc.float(), tables, cu, lens, d**-0.5)
    assert (out.float() - ref).abs().max().item() <= TOL[dtype]
