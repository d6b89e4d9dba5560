"""The shapes of the small random checkpoints the architecture tests build:
the tiny tokenizer's vocabulary, GQA, head_dim 64, room for several
16-token windows."""

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
