"""The detokenizer releases an incomplete trailing UTF-8 character at the
end: the streamed text equals the decode of the output tokens."""

from __future__ import annotations

from router.detokenizer import IncrementalDetokenizer
from router.tokenizer import load_tokenizer


def test_an_output_that_ends_inside_a_character_is_flushed_at_the_end():
    tok = load_tokenizer("tiny")
    euro = [b + 3 for b in "€".encode()]  # tiny ids are bytes + 3
    out = [ord("a") + 3, *euro, ord("b") + 3, *euro[:2]]  # ends with 2 of the 3 bytes of a euro sign
    d = IncrementalDetokenizer(tok, [5, 6])
    streamed = ""
    for t in out:
        d.add([t])
        streamed += d.take()
    assert streamed == "a€b"  # the incomplete character is held back while more may come
    streamed += d.take(final=True)
    assert streamed == tok.decode(out) and streamed.endswith("\ufffd")
