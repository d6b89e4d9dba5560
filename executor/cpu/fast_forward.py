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
is a Llama, a Mistral, a Qwen2, a Qwen3 or an OLMo 2 (what they add to
Llama: q/k/v biases, folded into the fused projection; per-layer sliding
windows, handed to the attention; Qwen3's per-head q/k RMSNorm, applied to
the fused projection's q and k before the rotary pass, rounded as
Qwen3RMSNorm rounds; OLMo 2's q/k RMSNorm over the whole projections and its
norms after attention and after the MLP instead of before, each scaling in
fp32 before it rounds, as Olmo2RMSNorm does); otherwise the runner calls the
transformers model with the registered paged-attention function.

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
    in_norm: FusedRMSNorm | None  # None: OLMo 2 (no norm before attention)
    post_norm: torch.nn.Module
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
    # OLMo 2's norms, each (fp32 weight, eps): over the whole q and k
    # projections, and after attention and after the MLP (_Post).
    qk_full_norm: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None = None
    post: "_Post | None" = None


@dataclass
class _Post:
    """OLMo 2's post-norm block: x + norm(attention(x)), then h + norm(mlp(h))."""

    attn: tuple[torch.Tensor, float]
    mlp: tuple[torch.Tensor, float]


def _w32(norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """A norm that scales in fp32 before it casts: (its weight in fp32, eps)."""
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    return norm.weight.detach().float().contiguous(), eps


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
        self._norm_w32 = fused.rms_norm_w32_
        # OLMo 2 normalises after attention and after the MLP, not before.
        self.post_norm = cfg.model_type in POST_NORM
        self.final_w32 = _w32(inner.norm) if self.post_norm else None
        self.layers = [
            _Layer(
                i,
                getattr(layer, "input_layernorm", None),
                layer.post_attention_layernorm,
                float(layer.self_attn.scaling),
                _window(cfg, layer.self_attn),
                _fused_qkv(layer.self_attn).forward,
                layer.self_attn.o_proj.forward,
                layer.mlp.act,
                layer.mlp.down.forward,
                None if self.post_norm else _qk_norm(layer.self_attn),
                (_w32(layer.self_attn.q_norm), _w32(layer.self_attn.k_norm)) if self.post_norm else None,
                _Post(_w32(layer.post_attention_layernorm), _w32(layer.post_feedforward_layernorm))
                if self.post_norm
                else None,
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
            if L.post is not None:
                h = residual
            elif x is None:
                h = L.in_norm(residual)
            else:
                h = self._add_rms_norm(x, residual, L.in_norm.weight, L.in_norm.eps)
            kc, vc = cache.key[L.index], cache.value[L.index]
            qkv = L.qkv(h)
            if L.qk_norm is not None:
                self._norm_heads(qkv, L.qk_norm)
            elif L.qk_full_norm is not None:
                self._norm_q_k(qkv, L.qk_full_norm)
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
            if L.post is not None:
                # residual + norm(o), then the same around the MLP: each sum
                # rounded in the model dtype, as the decoder layer adds.
                residual = residual + self._norm_w32_new(o, L.post.attn)
                residual = residual + self._norm_w32_new(L.down(L.act(residual)), L.post.mlp)
                continue
            h = self._add_rms_norm(o, residual, L.post_norm.weight, L.post_norm.eps)
            x = L.down(L.act(h))
        if self.final_w32 is not None:
            return self._norm_w32_new(residual, self.final_w32)
        if x is None:
            return self.final_norm(residual)
        return self._add_rms_norm(x, residual, self.final_norm.weight, self.final_norm.eps)

    def _norm_w32_new(self, x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
        out = torch.empty_like(x)
        self._norm_w32(x, norm[0], norm[1], out)
        return out

    def _norm_q_k(self, qkv: torch.Tensor, norms) -> None:
        """OLMo 2's q_norm and k_norm, each over the whole projection (all
        heads together), in place on the fused projection's q and k."""
        nq, nk = self.hq * self.head_dim, self.hkv * self.head_dim
        q, k = qkv[:, :nq], qkv[:, nq : nq + nk]
        self._norm_w32(q, norms[0][0], norms[0][1], q)
        self._norm_w32(k, norms[1][0], norms[1][1], k)

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
# windows, per-head q/k norms (Qwen3), or whole-projection q/k norms and
# post-norms (OLMo 2).
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "olmo2")
POST_NORM = ("olmo2",)


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
    post = model.config.model_type in POST_NORM
    if not layers or not (post or isinstance(inner.norm, FusedRMSNorm)):
        return None
    for layer in layers:
        attn = layer.self_attn
        norms_ok = (
            all(hasattr(m, "weight") for m in (layer.post_attention_layernorm, layer.post_feedforward_layernorm))
            if post
            else isinstance(getattr(layer, "input_layernorm", None), FusedRMSNorm)
            and isinstance(layer.post_attention_layernorm, FusedRMSNorm)
        )
        if not (
            norms_ok
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
