"""executor.rope: Phi-3's longrope with its frequency set chosen per token
equals transformers' rotary embedding over the one sequence each token
belongs to."""

from __future__ import annotations

import copy

import torch
from transformers import Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from executor.rope import PerTokenLongRope
from tests.small_configs import longrope


def _rotary() -> Phi3RotaryEmbedding:
    cfg = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=512,
        original_max_position_embeddings=32,
        rope_parameters=longrope(8, 32),
    )
    return Phi3RotaryEmbedding(cfg)


def test_a_packed_batch_gets_each_sequences_own_frequencies():
    hf = _rotary()
    per_token = PerTokenLongRope(copy.deepcopy(hf))
    x = torch.zeros(1, dtype=torch.float32)
    # A 20-token chunk of a 50-token prompt (long: the prompt passes 32),
    # beside a 10-token prompt (short) in the same step.
    pos = torch.cat([torch.arange(20), torch.arange(10)]).unsqueeze(0)
    per_token.set_lengths(torch.tensor([50] * 20 + [10] * 10))
    cos, sin = per_token(x, pos)
    long_cos, long_sin = hf(x, torch.arange(50).unsqueeze(0))  # the whole prompt alone: long
    short_cos, short_sin = hf(x, torch.arange(10).unsqueeze(0))  # short
    torch.testing.assert_close(cos[0, :20], long_cos[0, :20], rtol=0, atol=0)
    torch.testing.assert_close(sin[0, 20:], short_sin[0], rtol=0, atol=0)
    assert not torch.allclose(cos[0, :20], hf(x, torch.arange(20).unsqueeze(0))[0][0])  # the chunk alone: short
    # Without lengths it falls back to transformers' own rule (warm-up calls).
    per_token.set_lengths(None)
    torch.testing.assert_close(per_token(x, torch.arange(40).unsqueeze(0))[0], hf(x, torch.arange(40).unsqueeze(0))[0])
