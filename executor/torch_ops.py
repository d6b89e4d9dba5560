"""Pure-torch reference of the paged KV-cache ops.

Same signatures and semantics as the native kernels (see
docs/native.md and native/__init__.py). The executor uses
these when `attention_backend: torch`; the native tests use them as the
reference.

KV cache layout, per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`
for K and for V; `slot = block_id * block_size + offset`.
"""

from __future__ import annotations

import torch

from executor.kv_cache import copyable


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written
    slot_mapping: torch.Tensor,  # [T] int64; negative = skip
) -> None:
    """Writes each token's K and V into its slot of the paged cache (rounded
    to the cache's dtype: a float8_e5m2 cache holds them to 2 mantissa bits)."""
    num_blocks, block_size, hkv, d = key_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_blocks * block_size:
        raise IndexError("slot_mapping holds a slot beyond the cache")
    for src, cache in ((key, key_cache), (value, value_cache)):
        copyable(cache.view(-1, hkv, d)).index_copy_(0, slot_mapping, copyable(src.to(cache.dtype)))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence's K or V: `[length, Hkv, D]`."""
    block_size = cache.shape[1]
    num = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num].long())
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def paged_attention(
    out: torch.Tensor,  # [T, Hq, D], written
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, KV length including this step
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Causal attention of each sequence's query tokens over its paged KV.

    Query token i of sequence b sits at position `seq_lens[b] - q_len_b + i`
    and attends to KV positions <= its own (and > its own minus
    `sliding_window` when that is set). GQA when Hq is a multiple of Hkv.
    `softcap`: scaled scores s become softcap * tanh(s / softcap).
    """
    hq = query.shape[1]
    hkv = key_cache.shape[2]
    group = hq // hkv
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        q0, q1 = cu[b], cu[b + 1]
        q_len, kv_len = q1 - q0, lens[b]
        if q_len == 0:
            continue
        k = gather_kv(key_cache, block_tables[b], kv_len).float()
        v = gather_kv(value_cache, block_tables[b], kv_len).float()
        q = query[q0:q1].float().transpose(0, 1)  # [Hq, q, D]
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, kv, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(kv_len, device=query.device).unsqueeze(0)
        mask = k_pos <= q_pos  # [q, kv]
        if sliding_window:
            mask &= k_pos > q_pos - sliding_window
        if softcap:
            s = (q @ k.transpose(1, 2)) * scale
            s = torch.tanh(s / softcap) * softcap
            o = (s.masked_fill(~mask, float("-inf")).softmax(-1) @ v).unsqueeze(0)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale
            )
        out[q0:q1] = o[0].transpose(0, 1).to(out.dtype)
