"""router.tool_calls: the declared tools, the forced-call schemas, and the
auto formats parsed whole and streamed in arbitrary pieces."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router import tool_calls as tc

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]
FUNCS = tc.declared(TOOLS)


def test_declared_tools_and_their_refusals():
    assert FUNCS == {"get_weather": WEATHER, "now": {"type": "object"}}
    bad = [
        ([{"type": "retrieval"}], "tools[0]"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        ([TOOLS[0], TOOLS[0]], "declared twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters"),
    ]
    for tools, why in bad:
        with pytest.raises(tc.ToolError, match=why.replace("[", r"\[").replace("]", r"\]")):
            tc.declared(tools)


def test_required_schema_accepts_exactly_calls_to_declared_functions():
    schema = tc.required_schema(FUNCS, parallel=True)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {"days": 2}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, tc.required_schema(FUNCS, parallel=False))
    calls = tc.calls_from_required(json.dumps(good))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert tc.calls_from_required('[{"name": "get_weather", "param') == []  # cut by max_tokens
    assert tc.call_from_named("now", " {} ")[0].arguments == "{}"
    assert tc.call_from_named("now", "[1]") == []


def test_detect_reads_the_format_off_the_template():
    assert tc.detect("{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>") == "hermes"
    assert tc.detect('{{- "<|python_tag|>" }}') == "llama3_json"
    assert tc.detect("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "none"
    assert tc.detect(None) == "none"


HERMES_OUT = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
LLAMA_OUT = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now", "parameters": {}}'


def test_parse_whole_outputs():
    content, calls = tc.parse("hermes", HERMES_OUT, FUNCS)
    assert content == "Let me look."
    got = [(c.name, json.loads(c.arguments)) for c in calls]
    assert got == [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    content, calls = tc.parse("llama3_json", LLAMA_OUT, FUNCS)
    assert content == "" and [c.name for c in calls] == ["get_weather", "now"]
    # Not a call: unknown function, broken JSON, plain text; the text stays content.
    for fmt, text in [
        ("hermes", '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'),
        ("hermes", '<tool_call>{"name": "now", "argu'),
        ("llama3_json", "Paris is the capital."),
        ("llama3_json", '{"name": "now", "parameters": {}} and then prose'),
        ("none", HERMES_OUT),
    ]:
        assert tc.parse(fmt, text, FUNCS) == (text, [])
    # Arguments written as a JSON string are taken as the object they hold.
    _, calls = tc.parse("hermes", '<tool_call>{"name": "now", "arguments": "{\\"a\\": 1}"}</tool_call>', FUNCS)
    assert json.loads(calls[0].arguments) == {"a": 1}


def _stream(fmt: str, text: str, cuts: list[int]) -> tuple[str, str, list]:
    s = tc.AutoStream(fmt, FUNCS)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out = "".join(s.feed(p) for p in pieces)
    rest, calls = s.finish()
    return out, rest, calls


@given(st.data())
def test_streamed_pieces_give_what_the_whole_text_gives(data):
    for fmt, text in [
        ("hermes", HERMES_OUT),
        ("llama3_json", LLAMA_OUT),
        ("hermes", "No call here, only <tool text."),
        ("llama3_json", "  Plain {braces} later."),
        ("hermes", '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'),
    ]:
        cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=8))))
        out, rest, calls = _stream(fmt, text, cuts)
        content, want = tc.parse(fmt, text, FUNCS)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want]
        if want:
            assert (out + rest).rstrip() == content  # the content before the calls, nothing of them
            assert tc._HERMES_START not in out
        else:
            assert out + rest == text  # everything arrives as content


def test_the_parser_setting_is_checked_at_load():
    from router.config import ConfigError, config_from_dict

    assert config_from_dict({"server": {"tool_call_parser": "hermes"}}).server.tool_call_parser == "hermes"
    with pytest.raises(ConfigError, match="server.tool_call_parser"):
        config_from_dict({"server": {"tool_call_parser": "xml"}})
