"""The grammar mask the router puts in a plan covers exactly the model's
vocabulary in 32-bit words, whatever llguidance allocates."""

from __future__ import annotations

import pytest

from cbserve.v1 import generation_pb2 as gpb
from router.structured import Structured
from router.tokenizer import build_tiny_tokenizer


@pytest.mark.parametrize("vocab", [259, 288, 320])  # 288 and 320: multiples of 32
def test_mask_is_ceil_vocab_over_32_words(vocab):
    s = Structured(build_tiny_tokenizer(), vocab, 2)
    m = s.matcher(s.grammar(gpb.StructuredOutput(regex="[ab]+")))
    mask = m.compute_bitmask()
    assert len(mask) == 4 * -(-vocab // 32)
    allowed = {i for i in range(vocab) if mask[i // 8] >> (i % 8) & 1}
    assert allowed == {3 + ord("a"), 3 + ord("b")}  # byte tokens are 3 + byte value
    m.consume_token(3 + ord("a"))
    assert not m.is_error()
