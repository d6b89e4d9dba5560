"""Paged attention plugged into the transformers model definition.

The model runs on one packed row `[1, sum(L_i), H]`; every op but attention is
batched over all tokens (selective batching). This attention function is
registered with transformers' AttentionInterface; per-step metadata arrives as
the `cb_meta` keyword argument and splits the packed batch per sequence inside
the kernel, reading K/V from the paged block pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from executor.kv_cache import KVCache

ATTN_IMPL_NAME = "cbserve_paged"


@dataclass
class AttnMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., None]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    cb_meta: AttnMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if cb_meta is None:
        # Not an executor step (e.g. HF generate() on the same model object):
        # behave like the stock SDPA implementation.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    layer = module.layer_idx
    q = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    cache = cb_meta.kv_cache
    cb_meta.reshape_and_cache(k, v, cache.key[layer], cache.value[layer], cb_meta.slot_mapping)
    out = torch.empty_like(q)
    scale = float(scaling if scaling is not None else q.shape[-1] ** -0.5)
    # Per layer, from the model code: Mistral / Qwen2 / Gemma 2-3 windows,
    # Gemma 2's attention-logit soft cap.
    window = kwargs.get("sliding_window") or 0
    softcap = kwargs.get("softcap") or 0.0
    cb_meta.paged_attention(
        out,
        q,
        cache.key[layer],
        cache.value[layer],
        cb_meta.block_tables,
        cb_meta.cu_seqlens_q,
        cb_meta.seq_lens,
        scale,
        int(window),
        float(softcap),
    )
    return out.unsqueeze(0), None  # [1, T, Hq, D]


def layer_window(cfg, attn: torch.nn.Module) -> int:
    """A layer's sliding window as its model code applies it (0: none): Qwen2
    sets one per layer (None on full-attention layers), Mistral reads its
    config. The lean forwards pass it to the paged attention."""
    if hasattr(attn, "sliding_window"):
        return int(attn.sliding_window or 0)
    if getattr(cfg, "model_type", None) in ("mistral", "mixtral", "phi3"):  # every layer, from the config
        return int(getattr(cfg, "sliding_window", None) or 0)
    return 0


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL_NAME, paged_attention_forward)
    return ATTN_IMPL_NAME


def backend_ops(name: str) -> tuple[Callable[..., None], Callable[..., None]]:
    """(reshape_and_cache, paged_attention) of the 'native' or 'torch' backend."""
    if name == "torch":
        from executor import torch_ops

        return torch_ops.reshape_and_cache, torch_ops.paged_attention
    if name == "native":
        # The extension's functions themselves (same arguments and checks as
        # the documented wrappers in native/__init__.py, one Python call less
        # each: a step makes 60 of them).
        from native import _C

        return _C.reshape_and_cache, _C.paged_attention
    raise ValueError(f"attention_backend {name!r} is not native|torch")
