"""Structured outputs through the whole server (tiny model, random sampling):
every output of a constrained request parses and validates, whatever the
model would have said; constrained and free requests share batches; bad
constraints are refused by name; nothing leaks."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbserve.v1 import generation_pb2 as gpb
from tests.integration.helpers import gen_request, stub, wait_idle

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def _complete(server, structured, seed=0, max_new=120, temperature=1.0, bias=None):
    req = gen_request(PROMPT, max_new=max_new, ignore_eos=False, structured=structured)
    req.sampling.CopyFrom(gpb.SamplingParams(temperature=temperature, seed=seed, logit_bias=bias or {}))
    with server.channel() as ch:
        return stub(ch).Complete(req, timeout=120)


# Bounded JSON Schemas: every value has a finite length, so a random model
# ends the object within the token budget.
_leaf = st.one_of(
    st.builds(
        lambda lo, n: {"type": "integer", "minimum": lo, "maximum": lo + n}, st.integers(-50, 50), st.integers(0, 99)
    ),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.just({"type": "boolean"}),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(lambda v: {"enum": v}),
)
_value = st.one_of(
    _leaf, st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, _leaf, st.integers(0, 3))
)


@st.composite
def schemas(draw):
    names = draw(st.lists(st.text("abcdefgh", min_size=1, max_size=5), min_size=1, max_size=4, unique=True))
    props = {n: draw(_value) for n in names}
    required = [n for n in names if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas(), seed=st.integers(0, 2**16))
def test_json_schema_output_always_validates(server, schema, seed):
    r = _complete(server, gpb.StructuredOutput(json_schema=json.dumps(schema)), seed=seed, max_new=200)
    assert r.finish_reason == gpb.EOS, (r.text, schema)
    jsonschema.validate(json.loads(r.text), schema)


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        (gpb.StructuredOutput(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (gpb.StructuredOutput(regex=r"[a-c]{2,4}-[0-9]{3}"), lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", t)),
        (
            gpb.StructuredOutput(choice=gpb.Choices(choices=["yes", "no", 'say "maybe"'])),
            lambda t: t in ("yes", "no", 'say "maybe"'),
        ),
        (
            gpb.StructuredOutput(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'),
            lambda t: re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", t),
        ),
        (gpb.StructuredOutput(grammar='root ::= "on" | "off"'), lambda t: t in ("on", "off")),  # GBNF
    ],
    ids=["json_object", "regex", "choice", "lark", "gbnf"],
)
def test_each_constraint_kind_holds_for_every_seed(server, structured, check):
    # Free-form JSON has no length bound: a bias towards '"' and '}' (byte
    # ids 37 and 128) ends strings and objects soon; the grammar, not the
    # bias, keeps the text valid.
    bias = {37: 4.0, 128: 6.0} if structured.HasField("json_object") else None
    for seed in range(4):
        r = _complete(server, structured, seed=seed, bias=bias)
        assert r.finish_reason == gpb.EOS and check(r.text), (r.text, seed)


def test_constrained_and_free_requests_share_batches(server):
    free_alone = list(_complete(server, None, temperature=0, max_new=24).token_ids)
    regex = r"[0-9]{4}"
    with ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(_complete, server, gpb.StructuredOutput(regex=regex), s) for s in range(5)]
        free = pool.submit(_complete, server, None, 0, 24, 0)
        outs = [j.result() for j in jobs]
        assert list(free.result().token_ids) == free_alone
    assert all(re.fullmatch(regex, o.text) for o in outs)
    wait_idle(server)


@pytest.mark.parametrize(
    ("structured", "field"),
    [
        (gpb.StructuredOutput(json_schema='{"type": "nonsense"}'), "structured.json_schema"),
        (gpb.StructuredOutput(json_schema="{not json"), "structured.json_schema"),
        (gpb.StructuredOutput(regex="[a-"), "structured.regex"),
        (gpb.StructuredOutput(grammar="start: undefined_rule"), "structured.grammar"),
        (gpb.StructuredOutput(choice=gpb.Choices()), "structured.choice"),
        (gpb.StructuredOutput(), "structured"),
    ],
)
def test_bad_constraints_are_invalid_argument_by_name(server, structured, field):
    with pytest.raises(grpc.RpcError) as err:
        _complete(server, structured)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field)


def test_openai_response_format_and_vllm_fields(server):
    client = openai.OpenAI(base_url=server.http_url, api_key="unused")
    model = client.models.list().data[0].id
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["city", "n"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=120,
        seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"
    c = client.completions.create(model=model, prompt="x", max_tokens=20, extra_body={"guided_choice": ["red", "blue"]})
    assert c.choices[0].text in ("red", "blue")
    c = client.completions.create(
        model=model, prompt="x", max_tokens=20, extra_body={"structured_outputs": {"regex": "[xyz]{5}"}}
    )
    assert re.fullmatch("[xyz]{5}", c.choices[0].text)
    bad = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"xpath": "//a"}}, "structured_outputs"),
    ]
    for extra, param in bad:
        resp = httpx.post(f"{server.http_url}/completions", json={"model": model, "prompt": "x", **extra}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    wait_idle(server)
