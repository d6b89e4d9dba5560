"""The small random checkpoints the architecture tests build: the tiny
tokenizer's vocabulary, GQA, head_dim 64, room for several 16-token windows,
and per architecture (ARCHS) a config whose features matter: windows of 16
tokens, soft caps that bend the scores, Granite's multipliers, Phi-3's
longrope (and a partial rotary, as Phi-4-mini's), q/k norms, experts."""

from __future__ import annotations

SMALL = dict(
    vocab_size=259,  # the tiny byte-level tokenizer's
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def small(**overrides) -> dict:
    """SMALL with `overrides` (a config's own keys on top)."""
    return {**SMALL, **overrides}


def longrope(half_dim: int, original: int) -> dict:
    """Phi-3 style longrope parameters for a head of 2 * half_dim: short
    factors up to `original` positions, clearly different long ones beyond."""
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(half_dim)],
        "long_factor": [2.0 + 0.5 * i for i in range(half_dim)],
        "original_max_position_embeddings": original,
    }


COMMON = SMALL
WINDOW = 16


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=WINDOW))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)
    return Qwen2ForCausalLM(cfg)


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        **{**COMMON, "hidden_activation": "gelu_pytorch_tanh"},
        sliding_window=WINDOW,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0,
        query_pre_attn_scalar=64,
    )
    return Gemma2ForCausalLM(cfg)


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # Alternating layer types: each type has its own rotary table and window.
    layer_types = ["sliding_attention", "full_attention"] * (COMMON["num_hidden_layers"] // 2)
    cfg = Gemma3TextConfig(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=64, layer_types=layer_types)
    return Gemma3ForCausalLM(cfg)


def _granite():
    from transformers import GraniteConfig, GraniteForCausalLM

    cfg = GraniteConfig(
        **COMMON, logits_scaling=4.0, embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.05
    )
    return GraniteForCausalLM(cfg)


def _phi3():
    # longrope: short factors up to 64 positions, long ones beyond. The 97-
    # and 150-token prompts are prefilled in 64-token chunks beside others;
    # every chunk must take the long factors, as a one-shot prefill does.
    # (No prompt here crosses 64 while decoding: generate() then recomputes
    # the whole cache, which cbserve does not; see docs/api.md.)
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(
        **{**COMMON, "head_dim": 32}, original_max_position_embeddings=64, rope_parameters=longrope(16, 64)
    )
    return Phi3ForCausalLM(cfg)


def _phi4_mini():
    # Phi-4-mini's partial rotary: the first 3/4 of each head's dims turn, the rest pass.
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    return Phi3ForCausalLM(Phi3Config(**{**COMMON, "head_dim": 32}, rope_parameters=rope))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**COMMON))  # per-head q/k RMSNorm


def _olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2ForCausalLM(Olmo2Config(**COMMON))  # q/k norms over all heads, norms after attention and MLP


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    return MixtralForCausalLM(cfg)


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128
    )
    return Qwen2MoeForCausalLM(cfg)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
    return Qwen3MoeForCausalLM(cfg)  # per-head q/k norms, experts without a shared one


ARCHS = {
    "mistral": _mistral,
    "qwen2": _qwen2,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "granite": _granite,
    "phi3": _phi3,
    "phi4_mini": _phi4_mini,
    "qwen3": _qwen3,
    "olmo2": _olmo2,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
}
