"""A model runner over an fp8 e5m2 KV cache (cache.kv_cache_dtype: fp8_e5m2):
the native and the torch-reference backends write the same cache bytes and
sample the same tokens, through the lean bf16 forward and the transformers
forward alike, and the cache holds one byte per value."""

from __future__ import annotations

import pytest
import torch

from executor import model_loader, model_source
from executor.cpu.packed_linear import supported
from executor.runner import ModelRunner
from tests.executor.helpers import count_fused_calls, greedy

F8 = torch.float8_e5m2
PROMPTS = [[(5 * i + 3 * L) % 250 + 3 for i in range(L)] for L in (1, 17, 40, 70)]


def _runner(dtype, backend="native", **kw):
    return ModelRunner(
        model_loader.load_model(model_source.resolve("tiny"), dtype),
        16,
        64,
        attention_backend=backend,
        kv_cache_dtype=F8,
        **kw,
    )


def _cache_bytes(runner, layers=2):
    return [runner.kv.key[i].view(torch.uint8).clone() for i in range(layers)]


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                not supported(torch.bfloat16, torch.device("cpu")), reason="CPU lacks native bf16"
            ),
        ),
    ],
)
def test_native_and_reference_backends_agree_over_an_fp8_cache(dtype):
    native_rt, ref_rt = _runner(dtype), _runner(dtype, "torch")
    assert native_rt.kv.key[0].dtype == F8 and native_rt.kv.key[0].element_size() == 1
    assert native_rt.cache_shape.dtype == F8 and native_rt.dtype == dtype  # only the cache is 8-bit
    got = greedy(native_rt, PROMPTS, 10)
    want = greedy(ref_rt, PROMPTS, 10)
    assert [g[:4] for g in got] == [w[:4] for w in want]
    agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(len(w) for w in want)
    assert agree >= 0.9
    if dtype == torch.float32:
        greedy(native_rt, PROMPTS[1:2], 1), greedy(ref_rt, PROMPTS[1:2], 1)  # (greedy resets the runners)
        (a0, a1), (b0, b1) = _cache_bytes(native_rt), _cache_bytes(ref_rt)
        # Layer 0: the same K/V in, the same rounding: the same cache bytes.
        assert torch.equal(a0, b0)
        # Layer 1's K/V come after one attention of each backend, whose sums
        # differ in the last fp32 bits: a value on a rounding edge may land
        # one fp8 code away, nothing more.
        diff = (a1.int() - b1.int()).abs()
        assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= diff.numel() // 1000


@pytest.mark.skipif(not supported(torch.bfloat16, torch.device("cpu")), reason="no bf16 fast path here")
def test_lean_forward_writes_an_fp8_cache_through_reshape_and_cache(monkeypatch):
    """The fused rotary + cache write keeps the activations' dtype; over an
    fp8 cache the lean forward splits rotary and cache write instead."""
    calls = count_fused_calls(monkeypatch)
    rt = _runner(torch.bfloat16)
    assert rt.lean is not None
    out = greedy(rt, PROMPTS, 4)
    assert calls["rope_split"] > 0 and calls["rope_cache"] == 0
    assert all(len(o) == 4 for o in out)
    assert any(bool(k.view(torch.uint8).any()) for k in rt.kv.key)  # the cache was written
