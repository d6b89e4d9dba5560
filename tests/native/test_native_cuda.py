"""CUDA twins of the native ops.

`test_cuda_sources_compile` needs only nvcc (it runs `make native-cuda-check`:
sm_80 + sm_90). The `cuda`-marked tests run the kernels against the torch
reference and need a GPU plus an extension built with CUDA; they skip
otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import native
from tests.native.helpers import ROOT, make_batch, reference, tolerance
from tests.native.test_native_window_softcap import check_windowed, windowed

needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and native.has_cuda()),
    reason="needs a CUDA GPU and native._C built with CUDA",
)


def _nvcc():
    return shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed")
@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_cuda_sources_compile():
    r = subprocess.run(["make", "-s", "native-cuda-check"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    for obj in ("cuda_kernels.o", "cuda_layer_kernels.o", "cuda_sampling.o"):
        assert os.path.getsize(os.path.join(ROOT, "build", "native-cuda", obj)) > 0


@st.composite
def cases(draw):
    block_size = draw(st.sampled_from([8, 16, 32, 128]))
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 3, 4, 8]))
    nseq = draw(st.integers(1, 4))
    q_lens = draw(st.lists(st.sampled_from([0, 1, 2, block_size + 3]), min_size=nseq, max_size=nseq))
    ctx_lens = draw(st.lists(st.integers(0, 3 * block_size), min_size=nseq, max_size=nseq))
    return dict(
        q_lens=q_lens,
        ctx_lens=ctx_lens,
        hq=hkv * group,
        hkv=hkv,
        d=draw(st.sampled_from([64, 80, 96, 128, 256])),
        block_size=block_size,
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.cuda
@needs_gpu
@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_cuda_attention_matches_reference(case):
    dtype = case.pop("dtype")
    batch = make_batch(case.pop("q_lens"), case.pop("ctx_lens"), dtype=dtype, device="cuda", **case)
    scale = case["d"] ** -0.5
    out = torch.full_like(batch["query"], float("nan"))
    native.paged_attention(out, scale=scale, **batch)
    torch.cuda.synchronize()
    want = reference(batch, scale)
    if out.numel():
        assert (out.cpu().float() - want).abs().max().item() <= tolerance(dtype)


@pytest.mark.cuda
@needs_gpu
@settings(max_examples=40, deadline=None)
@given(case=windowed())
def test_cuda_window_and_softcap_match_the_reference(case):
    # The CPU kernels' property test on the GPU: prefill chunks after cached
    # context, decode rows and mixes of both; windows shorter than a token's
    # context, than a block, and longer than a KV tile; caps that bend the scores.
    check_windowed(case, "cuda")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_reshape_and_cache_matches_reference(dtype):
    from executor.torch_ops import reshape_and_cache as ref

    kc = torch.randn(6, 16, 2, 64).to(dtype)
    vc = torch.randn(6, 16, 2, 64).to(dtype)
    key = torch.randn(50, 2, 64).to(dtype)
    value = torch.randn(50, 2, 64).to(dtype)
    slots = torch.randperm(96)[:50]
    slots[::7] = -1
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref(key, value, kc_ref, vc_ref, slots)
    kc_d, vc_d = kc.cuda(), vc.cuda()
    native.reshape_and_cache(key.cuda(), value.cuda(), kc_d, vc_d, slots.cuda())
    assert torch.equal(kc_d.cpu(), kc_ref) and torch.equal(vc_d.cpu(), vc_ref)


@pytest.mark.cuda
@needs_gpu
def test_cuda_validation():
    batch = make_batch([2], [5], hq=2, hkv=1, d=64, block_size=8, device="cuda")
    out = torch.empty_like(batch["query"])
    batch["block_tables"][0, 0] = 10**6
    with pytest.raises(IndexError, match="out of range"):
        native.paged_attention(out, scale=0.1, **batch)
    with pytest.raises(ValueError, match="same device"):
        native.paged_attention(out.cpu(), scale=0.1, **batch)
    # The 8-bit cache has CPU kernels only: refused on the GPU, nothing written.
    batch["block_tables"][0, 0] = 0
    f8 = {k: batch[k].to(torch.float8_e5m2) for k in ("key_cache", "value_cache")}
    with pytest.raises(TypeError, match="float8_e5m2 KV cache is supported on the CPU only"):
        native.paged_attention(out, scale=0.1, **{**batch, **f8})
    before = f8["key_cache"].view(torch.uint8).clone()
    k = torch.randn(1, 1, 64, device="cuda")
    with pytest.raises(TypeError, match="CPU only"):
        native.reshape_and_cache(k, k, f8["key_cache"], f8["value_cache"], torch.tensor([0], device="cuda"))
    assert torch.equal(f8["key_cache"].view(torch.uint8), before)


@pytest.mark.cuda
@needs_gpu
def test_cuda_checks_follow_in_place_changes_of_tensors_already_checked():
    # The ops reuse the host copy of a metadata tensor they have checked while
    # it is the same tensor at the same version (one GPU wait per step, not
    # per layer): every in-place write must still be seen.
    batch = make_batch([2, 1], [5, 9], hq=2, hkv=1, d=64, block_size=8, device="cuda")
    out = torch.empty_like(batch["query"])
    good = batch["block_tables"][0, 0].item()
    for _ in range(2):
        native.paged_attention(out, scale=0.1, **batch)
    want = reference(batch, 0.1)
    assert (out.cpu().float() - want).abs().max().item() <= tolerance(torch.float32)
    batch["block_tables"][0, 0] = 10**6
    with pytest.raises(IndexError, match=r"block_tables\[0, 0\] = 1000000 is out of range"):
        native.paged_attention(out, scale=0.1, **batch)
    batch["block_tables"][0, 0] = good
    native.paged_attention(out, scale=0.1, **batch)
    with torch.inference_mode():  # normal tensors written in inference mode still bump their version
        batch["seq_lens"][1] = 10**4
        with pytest.raises(IndexError, match="needs .* blocks"):
            native.paged_attention(out, scale=0.1, **batch)
        # Inference tensors have no version counter: checked afresh every call.
        tables = batch["block_tables"].clone()
        batch["seq_lens"][1] = 10
        native.paged_attention(out, scale=0.1, **{**batch, "block_tables": tables})
        tables[1, 0] = -1
        with pytest.raises(IndexError, match=r"block_tables\[1, 0\] = -1"):
            native.paged_attention(out, scale=0.1, **{**batch, "block_tables": tables})

    kc = torch.zeros(4, 8, 2, 16, device="cuda")
    vc = torch.zeros_like(kc)
    key = torch.randn(3, 2, 16, device="cuda")
    slots = torch.tensor([0, 9, -1], device="cuda")
    native.reshape_and_cache(key, key, kc, vc, slots)
    slots[2] = 32
    with pytest.raises(IndexError, match=r"slot_mapping\[2\] = 32 is out of range"):
        native.reshape_and_cache(key, key, kc, vc, slots)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "mask",
    # windows that leave partitions wholly before them (skipped by the split
    # and by its combine), one inside a partition, one of a single token
    [{}, {"sliding_window": 200, "softcap": 2.0}, {"sliding_window": 70}, {"sliding_window": 1}],
    ids=["plain", "window-200-cap", "window-70", "window-1"],
)
@pytest.mark.parametrize(
    ("ctx_lens", "q_lens", "group"),
    [
        ([3000, 5, 700, 64], [1, 1, 1, 1], 3),  # split decode: 32 partitions of 96 tokens
        ([2047, 1, 300], [1, 0, 1], 8),  # a sequence with no query token in the split launch
        ([20, 9], [1, 1], 4),  # four table columns, 64 tokens: one partition, no split
    ],
)
def test_cuda_decode_split_over_the_kv_range_matches_reference(dtype, mask, ctx_lens, q_lens, group):
    # Decode launches (every query length 0 or 1) split each sequence's KV
    # range into partitions and combine them; the checked op and the one the
    # CUDA graphs capture (no host checks) must give the reference.
    batch = make_batch(q_lens, ctx_lens, hq=2 * group, hkv=2, d=64, block_size=16, dtype=dtype, device="cuda", seed=7)
    _decode_matches_reference(batch, 64**-0.5, dtype, **mask)


def _decode_matches_reference(batch, scale, dtype, **mask):
    """The checked op and the one the CUDA graphs capture (no host checks),
    as a decode launch, against the reference; `mask`: sliding_window, softcap."""
    from native import _C

    want = reference(batch, scale, **mask)
    out = torch.full_like(batch["query"], float("nan"))
    native.paged_attention(out, scale=scale, **batch, **mask)
    graphed = torch.full_like(batch["query"], float("nan"))
    b = batch
    _C.paged_attention_graphed(
        graphed,
        b["query"],
        b["key_cache"],
        b["value_cache"],
        b["block_tables"],
        b["cu_seqlens_q"],
        b["seq_lens"],
        scale,
        1 if b["query"].shape[0] else 0,
        **mask,
    )
    torch.cuda.synchronize()
    for got in (out, graphed):
        assert not got.isnan().any()
        if got.numel():
            assert (got.cpu().float() - want).abs().max().item() <= tolerance(dtype)


@st.composite
def decode_cases(draw):
    block_size = draw(st.sampled_from([8, 16, 32]))
    hkv = draw(st.integers(1, 3))
    nseq = draw(st.integers(1, 5))
    return dict(
        q_lens=draw(st.lists(st.sampled_from([0, 1, 1, 1]), min_size=nseq, max_size=nseq)),
        # across the decode kernel's 128-token chunks and the split's partitions
        ctx_lens=draw(st.lists(st.integers(0, 700), min_size=nseq, max_size=nseq)),
        hkv=hkv,
        # groups above 8 and head dims of 80 take the general kernel
        group=draw(st.sampled_from([1, 2, 3, 5, 8, 12])),
        d=draw(st.sampled_from([64, 80, 128, 256])),
        block_size=block_size,
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        seed=draw(st.integers(0, 2**16)),
        # windows inside a chunk, across chunks and partitions, and none
        mask={
            "sliding_window": draw(st.sampled_from([0, 0, 1, 5, 100, 300])),
            "softcap": draw(st.sampled_from([0.0, 0.0, 1.0, 30.0])),
        },
    )


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("decode_kernel", [True, False], ids=["decode-kernel", "general-kernel"])
@settings(max_examples=30, deadline=None)
@given(case=decode_cases())
def test_cuda_decode_launches_match_reference_with_either_kernel(decode_kernel, case):
    # Decode launches (every query length 0 or 1) take the decode kernel
    # where its shapes allow, else the general one; both, checked and graphed
    # op, must give the reference.
    from native import _C

    dtype, group, mask = case.pop("dtype"), case.pop("group"), case.pop("mask")
    batch = make_batch(
        case.pop("q_lens"), case.pop("ctx_lens"), hq=case["hkv"] * group, dtype=dtype, device="cuda", **case
    )
    _C.set_cuda_decode_kernel(decode_kernel)
    try:
        _decode_matches_reference(batch, case["d"] ** -0.5, dtype, **mask)
    finally:
        _C.set_cuda_decode_kernel(True)
