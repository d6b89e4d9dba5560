"""Writes a small GGUF file from a transformers Llama or Qwen2 model with the
`gguf` package, as llama.cpp's converter lays it out (tensor names, q/k rows
permuted for Llama's rotary; fp32 tensors, or the projections quantised by
gguf-py to a block type), with the tiny byte-level tokenizer (GPT-2 byte
alphabet, no merges). Tests only."""

from __future__ import annotations

import numpy as np
import torch


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's reordering of q/k rows (transformers' loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] fp32 -> Q4_K super-blocks as uint8 [N, K / 256 * 144] (gguf-py
    reads and dequantises Q4_K but cannot write it). Per 32-weight block
    w ~ d * sc * q - dmin * mn, sc and mn 6-bit, q 4-bit; a plain
    min/max fit (llama.cpp's search for the scales is finer), enough for a
    model whose weights are these values."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(axis=3), 0.0)
    scale = (x.max(axis=3) - lo) / 15.0
    d = (scale.max(axis=2) / 63.0).astype(np.float16)
    dmin = (-lo.min(axis=2) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.divide(x + (dminf * mn)[..., None], step, out=np.zeros_like(x), where=step > 0)
    q = np.clip(np.round(q), 0, 15).astype(np.uint8)  # [n, sb, 8, 32]
    scales = np.concatenate(
        [
            (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
            (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4),
        ],
        axis=2,
    )
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(n, k // 256, 128)
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), scales, qs], axis=2)
    return blocks.reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[N, K] fp32 -> Q6_K super-blocks as uint8 [N, K / 256 * 210]: per 16
    weights w ~ d * sc * q, sc int8, q in -32..31 (stored as q + 32 in 4 low
    and 2 high bits); a plain max fit, as `quantize_q4_k`."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(x).max(axis=3) / 31.0
    d = (scale.max(axis=2) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = np.clip(np.round(np.divide(x, step, out=np.zeros_like(x), where=step > 0)), -32, 31)
    u = (q + 32).astype(np.uint8).reshape(n, k // 256, 2, 128)  # per half: weights r = 0..127
    low, high = u & 0x0F, u >> 4
    ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(n, k // 256, 128)
    qh = high[..., 0:32] | (high[..., 32:64] << 2) | (high[..., 64:96] << 4) | (high[..., 96:128] << 6)
    parts = [ql, qh.reshape(n, k // 256, 64), sc.view(np.uint8), d[..., None].view(np.uint8)]
    return np.concatenate(parts, axis=2).reshape(n, -1)


# "Q4_K_M" as llama.cpp's mix, simplified: Q6_K for attn_v and ffn_down, Q4_K elsewhere.
_Q4_K_M_SIX = ("attn_v", "ffn_down")


def write_gguf(model: torch.nn.Module, path: str, quant: str | None = None, embeddings: str | None = None) -> None:
    """quant: "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K" (gguf-py's names) or
    "Q4_K_M": the seven projections of every layer in that block type (Q4_K_M:
    Q6_K for attn_v and ffn_down, Q4_K for the others); embeddings: the type
    of token_embd and (untied) output; the rest stays fp32. A vocabulary
    larger than the byte tokenizer's 259 is padded with unused tokens."""
    import gguf
    from gguf.quants import quantize

    from router.tokenizer import _gpt2_byte_chars

    cfg = model.config
    arch = cfg.model_type
    assert arch in ("llama", "qwen2"), arch
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", 10000.0)))
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    pad = [f"<unused{i}>" for i in range(cfg.vocab_size - 259)]
    bytes_ = _gpt2_byte_chars()
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.UNUSED] * len(pad)
    # llama.cpp refuses a gpt2 vocabulary without merges: one merge, of the
    # byte 0x00 with itself, into the last padding token; text never holds
    # that byte, so every text tokenizes as without it.
    merges = []
    if pad:
        pad[-1] = bytes_[0] * 2
        types[-1] = gguf.TokenType.NORMAL
        merges = [f"{bytes_[0]} {bytes_[0]}"]
    tokens = ["<pad>", "<s>", "</s>"] + bytes_ + pad
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    if merges:
        w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    rope = _permute if arch == "llama" else (lambda t, n: t)

    def add_proj(name: str, t: np.ndarray, kind: str | None = quant) -> None:
        if kind is None:
            w.add_tensor(name, t)
            return
        if kind == "Q4_K_M":
            kind = "Q6_K" if name.split(".")[2] in _Q4_K_M_SIX else "Q4_K"
        qtype = gguf.GGMLQuantizationType[kind]
        own = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}.get(kind)  # gguf-py cannot write the K-quants
        data = own(t) if own is not None else quantize(np.ascontiguousarray(t), qtype)
        w.add_tensor(name, data, raw_dtype=qtype)

    add_proj("token_embd.weight", sd["model.embed_tokens.weight"], embeddings)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add_proj(f"blk.{i}.attn_q.weight", rope(sd[p + "self_attn.q_proj.weight"], hq))
        add_proj(f"blk.{i}.attn_k.weight", rope(sd[p + "self_attn.k_proj.weight"], hkv))
        add_proj(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        for proj in ("q", "k", "v"):
            bias = sd.get(p + f"self_attn.{proj}_proj.bias")
            if bias is not None:
                w.add_tensor(f"blk.{i}.attn_{proj}.bias", bias)
        add_proj(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        add_proj(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        add_proj(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        add_proj(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if embeddings is None or not cfg.tie_word_embeddings:  # a tied head is token_embd (as llama.cpp writes it)
        add_proj("output.weight", sd["lm_head.weight"], embeddings)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Random-weight models of real shapes, for measuring (docs/gguf.md).
SHAPES = {
    "llama-1b": dict(  # Llama-3.2-1B
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    ),
    "llama-3b": dict(  # Llama-3.2-3B
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """python -m tests.integration.gguf_writer --shape llama-1b --quant Q4_K_M --embeddings Q6_K OUT.gguf"""
    import argparse

    from transformers import LlamaConfig, LlamaForCausalLM

    p = argparse.ArgumentParser(description="a random-weight Llama of a real shape, written as a quantized GGUF")
    p.add_argument("out")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--quant", default="Q4_K_M")
    p.add_argument("--embeddings", default="Q6_K")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cfg = LlamaConfig(
        **SHAPES[args.shape], max_position_embeddings=4096, rope_theta=500000.0, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(args.seed)
    write_gguf(LlamaForCausalLM(cfg).eval(), args.out, quant=args.quant, embeddings=args.embeddings)


if __name__ == "__main__":
    main()
