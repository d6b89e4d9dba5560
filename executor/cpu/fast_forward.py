"""A lean forward of the Llama-family decoder stack for the CPU executor.

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
where `fuse_llama_blocks` applied (bf16 natively or on AVX2; fp32 where its
projections run avx2_f32_linear, its passes then within a few ulp of
torch's, the order of fp32 sums aside) and the model
is one of LLAMA_LIKE. What each adds to Llama, and where it goes here:
- q/k/v biases (Qwen2): folded into the fused projection's bias;
- sliding windows per layer (Mistral, Qwen2, Phi-3, Gemma 2 / 3) and Gemma
  2's attention-logit soft cap: handed to the attention;
- Qwen3's per-head q/k RMSNorm: on the fused projection's q and k before the
  rotary pass, rounded as Qwen3RMSNorm rounds;
- OLMo 2's q/k RMSNorm over the whole projections and its norms after
  attention and after the MLP instead of before (each scaling in fp32
  before it rounds, as Olmo2RMSNorm does);
- Gemma 2 / 3's norms before and after attention and the MLP, each scaling
  by 1 + weight in fp32 (`norm_add_norm_w32`: a block's post-norm, the
  residual add and the next pre-norm in one pass), Gemma 3's per-head q/k
  norms of the same kind, its per-layer-type rotary tables, and the GELU-tanh
  MLP (FusedMLP's activation); the embedding scale is the embedding module's;
- Granite's multipliers: embeddings, each block's output before its residual
  add (rounded first, as `residual + h * m`), attention scale;
- Phi-3's fused qkv_proj and gate_up_proj checkpoints (used as they are), its
  longrope (the runner's per-token table), and Phi-4-mini's partial rotary
  (the native rotary turns the table's first dims of each head).
Otherwise the runner calls the transformers model with the registered
paged-attention function.

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

from executor.attention import AttnMetadata, layer_window
from executor.cpu.fused_modules import FusedExperts, FusedMLP, FusedRMSNorm
from executor.cpu.gguf_weights import blocks_of
from executor.cpu.packed_linear import PackedLinear, same_output

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
    in_norm: FusedRMSNorm | None  # None: OLMo 2 and Gemma (their norms are below)
    post_norm: torch.nn.Module | None
    scale: float
    window: int  # sliding window of this layer's attention, 0 = none
    # Bound forward methods: a step makes ~150 of these calls, and going
    # through nn.Module.__call__ (hooks, tracing checks) costs a few us each.
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o_proj: Callable[[torch.Tensor], torch.Tensor]
    act: Callable[[torch.Tensor], torch.Tensor] | None  # act(gate(h)) * up(h); None in a mixture-of-experts layer
    down: Callable[[torch.Tensor], torch.Tensor] | None
    # Qwen3's q/k norms (_qk_norm), or None.
    qk_norm: tuple[torch.Tensor, float] | None = None
    # OLMo 2's norms, each (fp32 weight, eps): over the whole q and k
    # projections, and after attention and after the MLP (_Post).
    qk_full_norm: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None = None
    post: "_Post | None" = None
    # Gemma's four norms per layer (_Sandwich), and Gemma 3's per-head q/k
    # norms, each (fp32 1 + weight, eps).
    sandwich: "_Sandwich | None" = None
    qk_head_norm: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None = None
    softcap: float = 0.0  # Gemma 2's attention-logit soft cap, 0 = none
    residual_scale: float = 1.0  # Granite's residual_multiplier on each block's output
    rope: str = ""  # the rotary table of this layer: Gemma 3's layer type, else ""
    moe: torch.nn.Module | None = None  # a mixture-of-experts block (its experts FusedExperts), in place of act / down


@dataclass
class _Post:
    """OLMo 2's post-norm block: x + norm(attention(x)), then h + norm(mlp(h))."""

    attn: tuple[torch.Tensor, float]
    mlp: tuple[torch.Tensor, float]


@dataclass
class _Sandwich:
    """Gemma's block: h = x + post_attn(attention(pre_attn(x))), then
    h + post_ff(mlp(pre_ff(h))); each a norm that scales by 1 + weight in fp32."""

    pre_attn: tuple[torch.Tensor, float]
    post_attn: tuple[torch.Tensor, float]
    pre_ff: tuple[torch.Tensor, float]
    post_ff: tuple[torch.Tensor, float]


def _w32(norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """A norm that scales in fp32 before it casts, as (fp32 weight, eps) for
    rms_norm_w32_: its weight (OLMo 2) or 1 + weight (Gemma), whichever
    reproduces the module exactly on probe rows; ValueError if neither does."""
    import native._fused as fused

    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    weight = norm.weight.detach()
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, weight.shape[0], generator=g) * torch.logspace(-2, 2, 8).unsqueeze(1)).to(weight.dtype)
    with torch.no_grad():
        want = norm(x)
    for w in (weight.float().contiguous(), (1.0 + weight.float()).contiguous()):
        out = torch.empty_like(x)
        fused.rms_norm_w32_(x, w, eps, out)
        if same_output(out, want):
            return w, eps
    raise ValueError(f"{type(norm).__name__} is neither an fp32-weight nor a (1 + weight) RMSNorm")


class SplitQkv(torch.nn.Module):
    """q|k|v as three matmuls whose outputs are joined: for projections
    served from GGUF blocks of different types (a Q4_K_M file's Q6_K v beside
    Q4_K q and k), which one packed weight cannot hold; a bf16 fused copy
    would take 3.5x their bytes."""

    def __init__(self, projs: tuple[PackedLinear, ...]) -> None:
        super().__init__()
        self.projs = torch.nn.ModuleList(projs)

    @property
    def kernel(self) -> str:
        return " | ".join(p.kernel for p in self.projs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.projs], dim=-1)


def _fused_qkv(attn: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The q|k|v projection as one matmul: Phi-3's own qkv_proj, else q_proj,
    k_proj and v_proj (and their biases) packed together (SplitQkv where
    they are GGUF blocks of different types)."""
    if hasattr(attn, "qkv_proj"):
        return attn.qkv_proj.forward
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    from_blocks = all(isinstance(p, PackedLinear) and p.kernel.startswith(("amx-", "avx512-", "gguf-")) for p in projs)
    if from_blocks and blocks_of(*projs) is None:
        return SplitQkv(projs).forward
    has_bias = [p.bias is not None for p in projs]
    if any(has_bias) and not all(has_bias):
        raise ValueError("q/k/v projections disagree on bias")
    w = torch.cat([p.plain_weight() if isinstance(p, PackedLinear) else p.weight.detach() for p in projs], 0)
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=all(has_bias), dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if all(has_bias):
            lin.bias.copy_(torch.cat([p.bias.detach() for p in projs], 0))
    blocks = blocks_of(*projs)
    if blocks is not None:
        lin.cbserve_blocks = blocks
    return PackedLinear(lin, keep_plain=False).forward


class QkvPart(torch.nn.Module):
    """q, k or v as columns of the lean forward's fused q|k|v projection.
    Once the lean forward owns the fused copy, the model's own q_proj,
    k_proj and v_proj would hold the same weights a second time (packed, and
    in bf16 plain as well); they become these views. The transformers layer
    code, which the runner does not call while a lean forward exists, still
    runs through them (the fused matmul, then its columns)."""

    def __init__(self, fused: PackedLinear, start: int, end: int) -> None:
        super().__init__()
        self._fused = (fused,)  # not a submodule: the lean forward owns it
        self.start = start
        self.end = end
        self.in_features = fused.in_features
        self.out_features = end - start

    @property
    def fused(self) -> PackedLinear:
        return self._fused[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0](x)[..., self.start : self.end].contiguous()


def _share_qkv(attn: torch.nn.Module, fused: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replaces attn's separate q/k/v projections by QkvPart views of the
    fused one (a checkpoint's own qkv_proj has none)."""
    module = getattr(fused, "__self__", None)
    if hasattr(attn, "qkv_proj") or not isinstance(module, PackedLinear):
        return
    start = 0
    for name in ("q_proj", "k_proj", "v_proj"):
        width = getattr(attn, name).out_features
        setattr(attn, name, QkvPart(module, start, start + width))
        start += width


class LeanLlamaForward:
    def __init__(self, model: torch.nn.Module) -> None:
        import native._fused as fused

        cfg = model.config
        self._add_rms_norm = fused.add_rms_norm
        self._rope_split = fused.rope_split
        self._rope_cache = fused.rope_cache
        self._norm_add_norm = fused.norm_add_norm_w32
        self._norm_add = fused.norm_add_w32_
        from native import _C

        self._native_write = _C.reshape_and_cache
        inner = model.model
        self.embed = inner.embed_tokens
        # Granite scales the embeddings (Gemma's scale is in its embedding module).
        self.embed_scale = float(getattr(cfg, "embedding_multiplier", 1.0) or 1.0)
        self.rotary = inner.rotary_emb
        self.final_norm: FusedRMSNorm = inner.norm
        self.hq = cfg.num_attention_heads
        self.hkv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._norm_w32 = fused.rms_norm_w32_
        # OLMo 2 normalises after attention and after the MLP, not before;
        # Gemma before and after each.
        self.post_norm = cfg.model_type in POST_NORM
        self.sandwich = cfg.model_type in SANDWICH
        self.final_w32 = _w32(inner.norm) if self.post_norm or self.sandwich else None
        # Gemma 3 rotates its sliding and full layers with different tables.
        self.rope_keys = sorted(set(cfg.layer_types)) if cfg.model_type in ROPE_PER_LAYER_TYPE else [""]
        self.layers = [self._layer(cfg, i, layer) for i, layer in enumerate(inner.layers)]
        # The runner's LoraManager where adapters are served (executor/lora.py):
        # its deltas go after q|k|v, o_proj and the MLP's projections.
        self.lora = None
        for key in self.rope_keys:  # a partial rotary turns the first `width` dims (Phi-4-mini)
            zero = torch.zeros(1, dtype=torch.long)
            probe = torch.zeros(1, 1, dtype=self.embed.weight.dtype)  # the weight may be a meta tensor
            width = self._rotary_table(probe, zero, key)[0].shape[-1]
            if width > self.head_dim or width % 2:
                raise ValueError(f"rotary over {width} of {self.head_dim} head dims")

    def _layer(self, cfg, i: int, layer: torch.nn.Module) -> _Layer:
        attn = layer.self_attn
        moe = None if isinstance(layer.mlp, FusedMLP) else layer.mlp
        return _Layer(
            i,
            None if self.post_norm or self.sandwich else layer.input_layernorm,
            None if self.post_norm or self.sandwich else layer.post_attention_layernorm,
            float(attn.scaling),
            layer_window(cfg, attn),
            _fused_qkv(attn),
            attn.o_proj.forward,
            None if moe is not None else layer.mlp.act,
            None if moe is not None else layer.mlp.down.forward,
            qk_norm=None if self.post_norm or self.sandwich else _qk_norm(attn),
            qk_full_norm=(_w32(attn.q_norm), _w32(attn.k_norm)) if self.post_norm else None,
            post=_Post(_w32(layer.post_attention_layernorm), _w32(layer.post_feedforward_layernorm))
            if self.post_norm
            else None,
            sandwich=_Sandwich(
                _w32(layer.input_layernorm),
                _w32(layer.post_attention_layernorm),
                _w32(layer.pre_feedforward_layernorm),
                _w32(layer.post_feedforward_layernorm),
            )
            if self.sandwich
            else None,
            qk_head_norm=(_w32(attn.q_norm), _w32(attn.k_norm)) if self.sandwich and hasattr(attn, "q_norm") else None,
            softcap=float(getattr(attn, "attn_logit_softcapping", None) or 0.0),
            residual_scale=float(getattr(cfg, "residual_multiplier", 1.0) or 1.0),
            rope=(getattr(attn, "layer_type", None) or "") if self.rope_keys != [""] else "",
            moe=moe,
        )

    def _rotary_table(self, x: torch.Tensor, positions: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, D] for `positions`, from the model's rotary module
        (Gemma 3's: of layer type `key`)."""
        args = (x, positions.unsqueeze(0)) if key == "" else (x, positions.unsqueeze(0), key)
        cos, sin = self.rotary(*args)
        return cos[0].contiguous(), sin[0].contiguous()

    def modules(self) -> list[torch.nn.Module]:
        """The modules whose methods the layers call (the fused q|k|v
        projections are not part of the model)."""
        calls = [f.__self__ for L in self.layers for f in (L.qkv, L.o_proj, L.act, L.down) if f is not None]
        return calls + [L.moe for L in self.layers if L.moe is not None]

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, sampled: SampledRows | None = None
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, H], or
        [S, H] for the sampled rows alone where `sampled` is given."""
        residual = self.embed(input_ids)
        if self.embed_scale != 1.0:
            residual = residual * self.embed_scale
        tables = {key: self._rotary_table(residual, positions, key) for key in self.rope_keys}
        cache = meta.kv_cache
        write_kv, attend = meta.reshape_and_cache, meta.paged_attention
        # The native backend's cache write is fused into the rotary pass
        # (where the cache has the activations' dtype; an fp8 cache is
        # written, and rounded, by reshape_and_cache).
        fused_write = write_kv is self._native_write and cache.key[0].dtype == residual.dtype
        x = None
        after = None  # Gemma: the previous layer's post-MLP norm, applied with this layer's first
        attn = None  # one output buffer for every layer: o_proj has read it before the next layer writes
        last = self.layers[-1].index
        for L in self.layers:
            if L.sandwich is not None:
                sw = L.sandwich
                h = (
                    self._norm_w32_new(residual, sw.pre_attn)
                    if x is None
                    else self._sandwich(x, residual, after, sw.pre_attn)
                )
            elif L.post is not None:
                h = residual
            elif x is None:
                h = L.in_norm(residual)
            else:
                h = self._add_rms_norm(x, residual, L.in_norm.weight, L.in_norm.eps)
            kc, vc = cache.key[L.index], cache.value[L.index]
            qkv = L.qkv(h)
            lora = self.lora if self.lora is not None and self.lora.rows is not None else None
            if lora is not None:
                self._lora_qkv(lora, L.index, h, qkv)
            if L.qk_norm is not None:
                self._norm_heads(qkv, L.qk_norm)
            elif L.qk_full_norm is not None:
                self._norm_q_k(qkv, L.qk_full_norm)
            elif L.qk_head_norm is not None:
                self._norm_heads_w32(qkv, L.qk_head_norm)
            cos, sin = tables[L.rope]
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
                if lora is not None:
                    lora.use_sampled()
            if attn is None:
                attn = torch.empty_like(q)
            attend(attn, q, kc, vc, at.block_tables, at.cu_seqlens_q, at.seq_lens, L.scale, L.window, L.softcap)
            o_in = attn.view(q.shape[0], self.hq * self.head_dim)
            o = L.o_proj(o_in)
            if lora is not None:
                lora.add(L.index, "o_proj", o_in, o)
            if L.post is not None:
                # residual += norm(o), then the same around the MLP, in place
                # (the residual is this forward's own tensor): each sum
                # rounded in the model dtype, as the decoder layer adds.
                self._norm_add(o, residual, *L.post.attn)
                self._norm_add(self._mlp(L, residual), residual, *L.post.mlp)
                continue
            if L.sandwich is not None:
                h = self._sandwich(o, residual, L.sandwich.post_attn, L.sandwich.pre_ff)
                x, after = self._mlp(L, h), L.sandwich.post_ff
                continue
            if L.residual_scale != 1.0:  # Granite: residual + o * m, the product rounded first
                o.mul_(L.residual_scale)
            h = self._add_rms_norm(o, residual, L.post_norm.weight, L.post_norm.eps)
            x = self._mlp(L, h)
            if L.residual_scale != 1.0:
                x.mul_(L.residual_scale)
        if after is not None:
            return self._sandwich(x, residual, after, self.final_w32)
        if self.final_w32 is not None:
            return self._norm_w32_new(residual, self.final_w32)
        if x is None:
            return self.final_norm(residual)
        return self._add_rms_norm(x, residual, self.final_norm.weight, self.final_norm.eps)

    def _mlp(self, L: _Layer, h: torch.Tensor) -> torch.Tensor:
        """The layer's MLP on [T, H] rows: down(act(h)), or its mixture of
        experts (the block's own forward, which takes [1, T, H])."""
        if L.moe is None:
            if self.lora is not None and self.lora.rows is not None:
                return self.lora.mlp(L.index, L.act.__self__, h)
            return L.down(L.act(h))
        return L.moe(h.unsqueeze(0))[0]

    def _lora_qkv(self, lora, layer: int, h: torch.Tensor, qkv: torch.Tensor) -> None:
        """The q, k and v deltas, each into its columns of the fused projection."""
        nq, nk = self.hq * self.head_dim, self.hkv * self.head_dim
        lora.add(layer, "q_proj", h, qkv, 0)
        lora.add(layer, "k_proj", h, qkv, nq)
        lora.add(layer, "v_proj", h, qkv, nq + nk)

    def _sandwich(self, x: torch.Tensor, residual: torch.Tensor, first, second) -> torch.Tensor:
        """residual += first(x) in place; returns second(residual)."""
        return self._norm_add_norm(x, residual, first[0], first[1], second[0], second[1])

    def _norm_heads_w32(self, qkv: torch.Tensor, norms) -> None:
        """Gemma 3's q_norm and k_norm over each head, in place on the fused
        projection's q and k heads."""
        d, t = self.head_dim, qkv.shape[0]
        nq, nk = self.hq * d, self.hkv * d
        q = qkv[:, :nq].view(t, self.hq, d)
        k = qkv[:, nq : nq + nk].view(t, self.hkv, d)
        self._norm_w32(q, norms[0][0], norms[0][1], q)
        self._norm_w32(k, norms[1][0], norms[1][1], k)

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

    def _norm_heads(self, qkv: torch.Tensor, norm: tuple[torch.Tensor, float]) -> None:
        """Qwen3's q_norm / k_norm in place on the fused projection's q and k
        heads (adjacent in it), one native call with a weight row per head:
        Qwen3RMSNorm's rounding, weight * round(x * rsqrt(mean(x^2) + eps))
        rounded again (round_first)."""
        d, t, heads = self.head_dim, qkv.shape[0], self.hq + self.hkv
        qk = qkv[:, : heads * d].view(t, heads, d)
        self._norm_w32(qk, norm[0], norm[1], qk, True)


# Architectures whose decoder layer is Llama's up to q/k/v biases, sliding
# windows, per-head q/k norms (Qwen3), whole-projection q/k norms and
# post-norms (OLMo 2), multipliers (Granite), fused q|k|v and gate|up
# checkpoints (Phi-3), or (1 + weight) norms before and after each block,
# GELU-tanh MLPs, soft caps and per-layer-type rotary tables (Gemma 2 / 3).
LLAMA_LIKE = (
    *("llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "phi3", "gemma2", "gemma3_text"),
    *("mixtral", "qwen2_moe", "qwen3_moe"),  # their experts as FusedExperts (fused_modules)
)
POST_NORM = ("olmo2",)
SANDWICH = ("gemma2", "gemma3_text")
ROPE_PER_LAYER_TYPE = ("gemma3_text",)


def _qk_norm(attn: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
    """(per-head fp32 weights [hq + hkv, head_dim]: q_norm's for the q heads,
    k_norm's for the k heads, each exactly its model-dtype values; eps), or
    None without q/k norms."""
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if qn is None or kn is None:
        return None
    cfg = attn.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    weights = torch.cat([qn.weight.detach().expand(hq, -1), kn.weight.detach().expand(hkv, -1)], 0)
    return weights.float().contiguous(), float(qn.variance_epsilon)


def build(model: torch.nn.Module) -> LeanLlamaForward | None:
    """The lean forward for `model`, or None where it does not apply (the
    runner then uses the transformers forward)."""
    inner = getattr(model, "model", None)
    if getattr(model.config, "model_type", None) not in LLAMA_LIKE or inner is None:
        return None
    layers = getattr(inner, "layers", [])
    w32 = model.config.model_type in POST_NORM + SANDWICH  # norms the lean forward runs itself (_w32)
    if not layers or not (w32 or isinstance(inner.norm, FusedRMSNorm)):
        return None
    names = {
        "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm"),
        "gemma2": (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ),
    }
    names["gemma3_text"] = names["gemma2"]
    for layer in layers:
        attn = layer.self_attn
        norms_ok = (
            all(hasattr(getattr(layer, n, None), "weight") for n in names[model.config.model_type])
            if w32
            else isinstance(getattr(layer, "input_layernorm", None), FusedRMSNorm)
            and isinstance(layer.post_attention_layernorm, FusedRMSNorm)
        )
        projections = hasattr(attn, "qkv_proj") or all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
        mlp_ok = isinstance(layer.mlp, FusedMLP) or isinstance(getattr(layer.mlp, "experts", None), FusedExperts)
        if not (norms_ok and mlp_ok and projections and hasattr(attn, "o_proj") and hasattr(attn, "scaling")):
            return None
    try:
        fwd = LeanLlamaForward(model)
    except (ImportError, AttributeError, ValueError) as exc:
        _LOGGER.warning("lean forward unavailable; using the transformers forward", error=str(exc))
        return None
    for layer, L in zip(layers, fwd.layers):
        _share_qkv(layer.self_attn, L.qkv)
    _LOGGER.info("lean decoder forward", layers=len(fwd.layers))
    return fwd
