"""cbserve native kernels: paged KV-cache write and paged attention.

Both ops run on CPU (AVX-512 / AVX2 / portable code picked at run time, see
`cpu_features()`) and, when the extension was built with CUDA
(`has_cuda()`), on CUDA tensors; the device of the arguments picks the
implementation. They validate every argument and raise TypeError (dtypes),
ValueError (devices, shapes, layouts, inconsistent lengths) or IndexError
(slot or block ids out of range) instead of touching memory out of bounds.

KV cache layout, per layer: `[num_blocks, block_size, Hkv, D]` for K and for
V; token slot `slot = block_id * block_size + offset`.

The pure-torch reference with the same semantics is `executor.torch_ops`.
"""

from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C

__all__ = ["reshape_and_cache", "paged_attention", "has_cuda", "cpu_features"]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K and V into its slot of the paged cache.

    Args:
        key, value: `[T, Hkv, D]` float32, bfloat16 or float16, contiguous.
        key_cache, value_cache: `[num_blocks, block_size, Hkv, D]`, contiguous,
            the dtype of key and value, or float8_e5m2 (CPU only: each value
            rounded to nearest even, as `tensor.to(torch.float8_e5m2)`).
            **Written** (in place).
        slot_mapping: `[T]` int64; token t goes to slot
            `block_id * block_size + offset`; a negative slot skips the token.
            Every slot must be `< num_blocks * block_size` (else IndexError).
    """
    _C.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Causal attention of a packed batch of query tokens over a paged KV cache.

    Covers prefill, chunked prefill with cached context and decode in one
    call (any mix of query lengths, including 0).

    Args:
        out: `[T, Hq, D]`, same dtype as `query`. **Written**.
        query: `[T, Hq, D]` float32, bfloat16 or float16, tokens of all
            sequences packed back to back.
        key_cache, value_cache: `[num_blocks, block_size, Hkv, D]`, the
            dtype of `query` or float8_e5m2 (CPU only; widened exactly as
            it is read); `Hq` must be a multiple of `Hkv` (GQA).
        block_tables: `[B, max_blocks]` int32: block ids of each sequence.
        cu_seqlens_q: `[B + 1]` int32, starts at 0, non-decreasing, ends at T:
            sequence b owns query rows `cu_seqlens_q[b]:cu_seqlens_q[b+1]`.
        seq_lens: `[B]` int32: KV length of each sequence including this
            step's tokens (>= its query length). Query token i of sequence b
            sits at position `seq_lens[b] - q_len_b + i` and attends to KV
            positions `<=` its own.
        scale: softmax scale (usually `D ** -0.5`).
        sliding_window: 0, or W: a query at position p sees only keys at
            positions (p - W, p] (Mistral, Gemma 2/3's local layers).
        softcap: 0, or C: each scaled score s becomes C * tanh(s / C)
            before the softmax (Gemma 2). Both CPU only for now.

    Accumulation is float32 whatever the storage dtype.
    """
    _C.paged_attention(
        out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, float(scale), sliding_window, softcap
    )


def has_cuda() -> bool:
    """Whether this build contains the CUDA kernels."""
    return bool(_C.has_cuda())


def cpu_features() -> dict:
    """CPU features seen at run time and the kernel ISA in use.

    Keys: `isa` ("amx", "avx512", "avx2" or "generic": the kernels the CPU ops use
    now), `best_isa` (what dispatch picks by default; `CBSERVE_NATIVE_ISA`
    in the environment can force a lower one), the individual feature flags
    (`avx2`, `fma`, `f16c`, `avx512f`, `avx512bw`, `avx512vl`, `avx512dq`,
    `avx512_bf16`, `amx_bf16`: AMX tiles usable by this process) and
    `supported` (generic, avx2, avx512, amx usable here). "amx" is the
    AVX-512 build with bf16 prefill attention on AMX tiles.
    """
    return dict(_C.cpu_features())


def _set_isa(isa: str) -> None:
    """Force the CPU kernels to "generic", "avx2", "avx512" or "amx" (tests, benchmarks)."""
    _C.set_isa(isa)
