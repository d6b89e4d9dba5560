"""A Llama-family forward on a CUDA GPU in nine launches per layer.

Llama, Mistral and Qwen2 (Llama 3.x, Mistral, Qwen 2.5 checkpoints): the
same layer, with whatever projection biases the checkpoint has (Qwen2's
q/k/v) and each layer's sliding window (Mistral's, Qwen2's where enabled)
passed to the paged attention.

The same structure as the CPU lean forward (executor/cpu/fast_forward.py):
fused q|k|v and gate|up projections (one GEMM each, weights concatenated
once at start-up; the model's own q/k/v and gate/up weights become views of
them, so nothing is held twice), and native kernels for residual-add +
RMSNorm, rotary + KV-cache write and SiLU-and-mul (native/csrc/
cuda_layer_kernels.cu) around the paged attention. A layer is

    add_rms_norm -> qkv GEMM -> rotary_cache -> paged_attention -> o GEMM
    -> add_rms_norm -> gate_up GEMM -> silu_and_mul -> down GEMM

Nothing in it reads a device value on the host, so a decode step made of it
can be captured into a CUDA graph (graphs.py). The caller vouches for the
metadata's values: every block id, slot and position was checked by the
runner before it built them (the ops check only shapes and dtypes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor.attention import layer_window
from native import _C

# model_types whose decoder layer is exactly the one below.
ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass
class StepInputs:
    """One step's metadata on the device, all int32: token ids and positions
    [T], cache slots [T] (negative: not written), and per sequence the block
    tables [B, W], cu_seqlens_q [B + 1] and seq_lens [B]; `max_q_len` is the
    longest query of the step (1 for decode)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_q_len: int


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    window: int  # sliding window (0: none)
    # Projection biases (None: the projection has none).
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


def supported(model: torch.nn.Module) -> str | None:
    """None if the lean forward computes this model's forward; else why not."""
    cfg = model.config
    model_type = getattr(cfg, "model_type", None)
    if model_type not in ARCHITECTURES:
        return f"model_type {model_type!r} is not one of {', '.join(ARCHITECTURES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    if next(model.parameters()).device.type != "cuda":
        return "not on a CUDA device"
    return None


def _concat_bias(linears: list[torch.nn.Linear]) -> torch.Tensor | None:
    """The linears' biases end to end (zeros for one without), or None
    where none has a bias."""
    if all(m.bias is None for m in linears):
        return None
    return torch.cat(
        [m.bias.data if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in linears]
    ).contiguous()


def _concat_into_views(weights: list[torch.nn.Parameter]) -> torch.Tensor:
    """One [sum(out), in] tensor; each parameter becomes a view of its rows."""
    fused = torch.cat([w.data for w in weights], 0).contiguous()
    row = 0
    for w in weights:
        n = w.shape[0]
        w.data = fused[row : row + n]
        row += n
    return fused


class GpuLeanForward:
    def __init__(self, model: torch.nn.Module, max_positions: int) -> None:
        why = supported(model)
        if why is not None:
            raise ValueError(f"the GPU lean forward cannot run this model: {why}")
        cfg = model.config
        inner = model.model
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.hq = cfg.num_attention_heads
        self.hkv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inter = cfg.intermediate_size
        self.eps = float(cfg.rms_norm_eps)
        self.scale = float(inner.layers[0].self_attn.scaling)
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    ln1=layer.input_layernorm.weight.data,
                    qkv=_concat_into_views([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    o=a.o_proj.weight.data,
                    ln2=layer.post_attention_layernorm.weight.data,
                    gate_up=_concat_into_views([m.gate_proj.weight, m.up_proj.weight]),
                    down=m.down_proj.weight.data,
                    window=layer_window(cfg, a),
                    qkv_bias=_concat_bias([a.q_proj, a.k_proj, a.v_proj]),
                    o_bias=_concat_bias([a.o_proj]),
                    gate_up_bias=_concat_bias([m.gate_proj, m.up_proj]),
                    down_bias=_concat_bias([m.down_proj]),
                )
            )
        # The model's own rotary embedding (any rope scaling it has) for every
        # position, once: [P, D] cos and sin in the model's dtype, as it
        # would hand them to the attention layers.
        with torch.inference_mode():
            pos = torch.arange(max_positions, device=self.device).unsqueeze(0)
            cos, sin = inner.rotary_emb(torch.empty(0, dtype=self.dtype, device=self.device), pos)
        self.cos = cos[0].contiguous().clone()
        self.sin = sin[0].contiguous().clone()

    def __call__(self, inp: StepInputs, kv) -> torch.Tensor:
        """The final hidden states [T, H] of every token of the step."""
        x = F.embedding(inp.input_ids, self.embed)
        residual = torch.empty_like(x)
        T = x.shape[0]
        hq, D = self.hq, self.head_dim
        for i, L in enumerate(self.layers):
            _C.add_rms_norm_(x, residual, L.ln1, self.eps, i > 0)
            qkv = F.linear(x, L.qkv, L.qkv_bias)
            q = torch.empty((T, hq, D), dtype=x.dtype, device=x.device)
            _C.rotary_cache(q, qkv, inp.positions, self.cos, self.sin, kv.key[i], kv.value[i], inp.slots)
            attn = torch.empty_like(q)
            _C.paged_attention_graphed(
                attn,
                q,
                kv.key[i],
                kv.value[i],
                inp.block_tables,
                inp.cu_seqlens_q,
                inp.seq_lens,
                self.scale,
                inp.max_q_len,
                L.window,
            )
            x = F.linear(attn.view(T, hq * D), L.o, L.o_bias)
            _C.add_rms_norm_(x, residual, L.ln2, self.eps, True)
            gate_up = F.linear(x, L.gate_up, L.gate_up_bias)
            act = torch.empty((T, self.inter), dtype=x.dtype, device=x.device)
            _C.silu_and_mul(act, gate_up)
            x = F.linear(act, L.down, L.down_bias)
        _C.add_rms_norm_(x, residual, self.norm, self.eps, True)
        return x
