"""A model's generation-config sampling values pass the router's own request
validation before they become the OpenAI API's defaults: one no request
could send is left out, with the reason, instead of failing every request
that leaves the field out."""

from __future__ import annotations

from router.validation import sampling_defaults


def test_defaults_are_judged_by_the_request_validation():
    usable, refused = sampling_defaults(
        {"temperature": 0.7, "top_p": 1.5, "top_k": -1, "min_p": 0.05, "repetition_penalty": 200.0}, vocab_size=259
    )
    assert usable == {"temperature": 0.7, "top_k": -1, "min_p": 0.05}  # top_k -1 is vLLM's "off"
    assert set(refused) == {"top_p", "repetition_penalty"}
    assert "top_p" in refused["top_p"] and "repetition_penalty" in refused["repetition_penalty"]


def test_a_top_k_beyond_the_wire_type_is_left_out():
    usable, refused = sampling_defaults({"top_k": 2**40}, vocab_size=259)
    assert usable == {} and set(refused) == {"top_k"}
