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


def write_gguf(model: torch.nn.Module, path: str, quant: str | None = None) -> None:
    """quant: "Q4_0", "Q4_1", "Q8_0", ... (gguf-py's names): the seven
    projections of every layer in that block type; the rest stays fp32."""
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
    tokens = ["<pad>", "<s>", "</s>"] + _gpt2_byte_chars()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * 256)
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    rope = _permute if arch == "llama" else (lambda t, n: t)
    qtype = None if quant is None else gguf.GGMLQuantizationType[quant]

    def add_proj(name: str, t: np.ndarray) -> None:
        if qtype is None:
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, quantize(np.ascontiguousarray(t), qtype), raw_dtype=qtype)

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
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
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
