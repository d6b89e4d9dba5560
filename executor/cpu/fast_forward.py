"""A lean forward of the Llama-family decoder stack for the bf16 CPU executor.

The transformers layer code costs about 25 ATen/Python calls per layer
(separate q/k/v projections, rotary embedding as element-wise ops, transposes,
residual adds); at decode sizes the calls, not the arithmetic, dominate. This
forward runs the same weights in eight calls per layer (what that buys:
docs/native.md):

    h  = add_rms_norm(x, residual)        # residual += x; RMSNorm
    qkv = qkv_proj(h)                     # one prepacked matmul for q, k and v
    q = rope_cache(qkv, cos, sin, cache)  # rotary on q/k; k, v into their cache slots
    paged_attention(q)
    o  = o_proj(attn)
    h  = add_rms_norm(o, residual)
    x  = down(act(h))                     # FusedMLP: gate|up matmul with SiLU-mul, down

It keeps the rounding points of the Hugging Face modules (every bf16 product and
sum rounded where the model's code rounds it), so its greedy output matches
the transformers forward. With the 'torch' attention backend the rotated k
and v go through that backend's reshape_and_cache instead (rope_split), so
the reference backend stays a reference for the cache write too. Used only
where `fuse_llama_blocks` applied (bf16 on AVX-512 bf16 CPUs) and the model
is a Llama, a Mistral, a Qwen2 or a Qwen3 (what they add to Llama: q/k/v
biases, folded into the fused projection; per-layer sliding windows, handed
to the attention; Qwen3's per-head q/k RMSNorm, applied to the fused
projection's q and k before the rotary pass, rounded as Qwen3RMSNorm
rounds); otherwise the runner calls the transformers model with the
registered paged-attention function.

Given the rows that sample (`SampledRows`), the last layer computes q, k and v
for every row (the cache needs every row's k and v) but attention, o_proj and
the MLP only for the sampled rows, and the forward returns only their hidden
states: a prompt chunk's other rows feed nothing after the last layer's cache
write. A sampled row's last-layer attention then runs as a one-token query
over its whole context, as its later decode steps do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import structlog
import torch

from executor.attention import AttnMetadata
from executor.cpu.fused_modules import FusedMLP, FusedRMSNorm
from executor.cpu.gguf_weights import blocks_of
from executor.cpu.packed_linear import PackedLinear

_LOGGER = structlog.get_logger(__name__)


@dataclass
class SampledRows:
    """The rows of a step that sample, and their sequences' attention
    metadata for the last layer (each row a one-token query)."""

    rows: torch.Tensor  # [S] int64, row indices into the packed batch
    block_tables: torch.Tensor  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [S + 1] int32: 0, 1, ..., S
    seq_lens: torch.Tensor  # [S] int32


@dataclass
class _Layer:
    index: int
    in_norm: FusedRMSNorm
    post_norm: FusedRMSNorm
    scale: float
    window: int  # sliding window of this layer's attention, 0 = none
    # Bound forward methods: a step makes ~150 of these calls, and going
    # through nn.Module.__call__ (hooks, tracing checks) costs a few us each.
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o_proj: Callable[[torch.Tensor], torch.Tensor]
    act: Callable[[torch.Tensor], torch.Tensor]  # silu(gate(h)) * up(h)
    down: Callable[[torch.Tensor], torch.Tensor]
    # Qwen3's q/k norms (_qk_norm), or None.
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None


def _fused_qkv(attn: torch.nn.Module) -> PackedLinear:
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    has_bias = [p.bias is not None for p in projs]
    if any(has_bias) and not all(has_bias):
        raise ValueError("q/k/v projections disagree on bias")
    w = torch.cat([p.weight.detach() for p in projs], 0)
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=all(has_bias), dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if all(has_bias):
            lin.bias.copy_(torch.cat([p.bias.detach() for p in projs], 0))
    blocks = blocks_of(*projs)
    if blocks is not None:
        lin.cbserve_blocks = blocks
    return PackedLinear(lin)


class LeanLlamaForward:
    def __init__(self, model: torch.nn.Module) -> None:
        import native._fused as fused

        cfg = model.config
        self._add_rms_norm = fused.add_rms_norm
        self._rms_norm = fused.rms_norm
        self._rope_split = fused.rope_split
        self._rope_cache = fused.rope_cache
        from native import _C

        self._native_write = _C.reshape_and_cache
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.final_norm: FusedRMSNorm = inner.norm
        self.hq = cfg.num_attention_heads
        self.hkv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers = [
            _Layer(
                i,
                layer.input_layernorm,
                layer.post_attention_layernorm,
                float(layer.self_attn.scaling),
                _window(cfg, layer.self_attn),
                _fused_qkv(layer.self_attn).forward,
                layer.self_attn.o_proj.forward,
                layer.mlp.act,
                layer.mlp.down.forward,
                _qk_norm(layer.self_attn),
            )
            for i, layer in enumerate(inner.layers)
        ]

    def modules(self) -> list[torch.nn.Module]:
        """The modules whose methods the layers call (the fused q|k|v
        projections are not part of the model)."""
        return [f.__self__ for L in self.layers for f in (L.qkv, L.o_proj, L.act, L.down)]

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, sampled: SampledRows | None = None
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, H], or
        [S, H] for the sampled rows alone where `sampled` is given."""
        residual = self.embed(input_ids)
        cos, sin = self.rotary(residual, positions.unsqueeze(0))
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        cache = meta.kv_cache
        write_kv, attend = meta.reshape_and_cache, meta.paged_attention
        # The native backend's cache write is fused into the rotary pass
        # (where the cache has the activations' dtype; an fp8 cache is
        # written, and rounded, by reshape_and_cache).
        fused_write = write_kv is self._native_write and cache.key[0].dtype == residual.dtype
        x = None
        attn = None  # one output buffer for every layer: o_proj has read it before the next layer writes
        last = self.layers[-1].index
        for L in self.layers:
            if x is None:
                h = L.in_norm(residual)
            else:
                h = self._add_rms_norm(x, residual, L.in_norm.weight, L.in_norm.eps)
            kc, vc = cache.key[L.index], cache.value[L.index]
            qkv = L.qkv(h)
            if L.qk_norm is not None:
                self._norm_heads(qkv, L.qk_norm)
            if fused_write:
                q = self._rope_cache(qkv, cos, sin, self.hq, self.hkv, self.head_dim, kc, vc, meta.slot_mapping)
            else:
                q, k, v = self._rope_split(qkv, cos, sin, self.hq, self.hkv, self.head_dim)
                write_kv(k, v, kc, vc, meta.slot_mapping)
            at = meta
            if sampled is not None and L.index == last:
                if sampled.rows.numel() == 0:
                    return residual.new_empty((0, residual.shape[1]))
                q = q.index_select(0, sampled.rows)
                residual = residual.index_select(0, sampled.rows)
                attn, at = None, sampled
            if attn is None:
                attn = torch.empty_like(q)
            attend(attn, q, kc, vc, at.block_tables, at.cu_seqlens_q, at.seq_lens, L.scale, L.window, 0.0)
            o = L.o_proj(attn.view(q.shape[0], self.hq * self.head_dim))
            h = self._add_rms_norm(o, residual, L.post_norm.weight, L.post_norm.eps)
            x = L.down(L.act(h))
        if x is None:
            return self.final_norm(residual)
        return self._add_rms_norm(x, residual, self.final_norm.weight, self.final_norm.eps)

    def _norm_heads(self, qkv: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor, float]) -> None:
        """Qwen3's q_norm / k_norm in place on the fused projection's q and k
        heads (adjacent in it): the native RMSNorm over each head's dim with
        unit weight (the normalised value rounded to the activations' dtype,
        times 1), then times each head's weight into the projection. That is
        Qwen3RMSNorm's rounding: weight * round(x * rsqrt(mean(x^2) + eps))."""
        d, t, heads = self.head_dim, qkv.shape[0], self.hq + self.hkv
        qk = qkv[:, : heads * d].view(t, heads, d)
        weights, ones, eps = norm
        normed = self._rms_norm(qk.reshape(-1, d), ones, eps).view(t, heads, d)
        torch.mul(normed, weights, out=qk)


# Architectures whose decoder layer is Llama's up to q/k/v biases, sliding
# windows and per-head q/k norms.
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")


def _qk_norm(attn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(per-head weights [hq + hkv, head_dim]: q_norm's for the q heads,
    k_norm's for the k heads; a unit weight [head_dim]; eps), or None
    without q/k norms."""
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if qn is None or kn is None:
        return None
    cfg = attn.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    weights = torch.cat([qn.weight.detach().expand(hq, -1), kn.weight.detach().expand(hkv, -1)], 0).contiguous()
    return weights, torch.ones_like(qn.weight.detach()), float(qn.variance_epsilon)


def _window(cfg, attn: torch.nn.Module) -> int:
    """A layer's sliding window as its model code applies it: Qwen2 sets one
    per layer (None on full-attention layers), Mistral reads its config."""
    if hasattr(attn, "sliding_window"):
        return int(attn.sliding_window or 0)
    if getattr(cfg, "model_type", None) == "mistral":
        return int(getattr(cfg, "sliding_window", None) or 0)
    return 0


def build(model: torch.nn.Module) -> LeanLlamaForward | None:
    """The lean forward for `model`, or None where it does not apply (the
    runner then uses the transformers forward)."""
    inner = getattr(model, "model", None)
    if getattr(model.config, "model_type", None) not in LLAMA_LIKE or inner is None:
        return None
    layers = getattr(inner, "layers", [])
    if not layers or not isinstance(inner.norm, FusedRMSNorm):
        return None
    for layer in layers:
        attn = layer.self_attn
        if not (
            isinstance(layer.input_layernorm, FusedRMSNorm)
            and isinstance(layer.post_attention_layernorm, FusedRMSNorm)
            and isinstance(layer.mlp, FusedMLP)
            and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling"))
        ):
            return None
    try:
        fwd = LeanLlamaForward(model)
    except (ImportError, AttributeError, ValueError) as exc:
        _LOGGER.warning("lean forward unavailable; using the transformers forward", error=str(exc))
        return None
    _LOGGER.info("lean decoder forward", layers=len(fwd.layers))
    return fwd
