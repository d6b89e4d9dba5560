"""Inputs at the edges of what a request may be, against a real server on a
checkpoint built here: a chat template that raises, a prompt that tokenizes
to nothing, fields the router does not know. Each is answered with the right
status on both APIs, and the server stays clean afterwards."""

from __future__ import annotations

import grpc
import httpx
import pytest

from cbserve.v1 import generation_pb2 as gpb
from tests.conftest import start_server
from tests.integration.helpers import gen_request, stub, wait_idle

# Mistral-style: roles must alternate user / assistant, else the template
# raises with its own message.
STRICT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
QUEUED_BYTES = 200_000


@pytest.fixture(scope="module")
def edge_server(tmp_path_factory):
    from tokenizers import normalizers
    from transformers import LlamaConfig, LlamaForCausalLM

    from router.tokenizer import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("strict-checkpoint")
    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok = build_tiny_tokenizer()
    # A tokenizer that strips its input: blank text tokenizes to nothing.
    tok.backend_tokenizer.normalizer = normalizers.Strip()
    tok.chat_template = STRICT_TEMPLATE
    tok.save_pretrained(path)
    server = start_server(str(path), config={"limits": {"max_queued_bytes": QUEUED_BYTES}})
    server.model = httpx.get(f"{server.http_url}/models", timeout=10).json()["data"][0]["id"]
    yield server
    server.stop()


def _chat(*roles: str) -> gpb.GenerateRequest:
    req = gen_request(max_new=2)
    for role in roles:
        req.messages.messages.add(role=role, content="hi")
    return req


def test_a_template_that_raises_is_invalid_argument_with_its_message(edge_server):
    with edge_server.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            stub(ch).Complete(_chat("user", "user"), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Conversation roles must alternate" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub(ch).Tokenize(gpb.TokenizeRequest(messages=_chat("assistant").messages), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(stub(ch).Complete(_chat("user", "assistant", "user"), timeout=30).token_ids) == 2
    body = {"model": edge_server.model, "messages": [{"role": "user", "content": "a"}] * 2, "max_tokens": 2}
    r = httpx.post(f"{edge_server.http_url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "Conversation roles must alternate" in r.json()["error"]["message"]


def test_a_prompt_that_tokenizes_to_nothing_is_invalid_argument(edge_server):
    with edge_server.channel() as ch:
        assert list(stub(ch).Tokenize(gpb.TokenizeRequest(text="  hi  ")).token_ids) == [ord("h") + 3, ord("i") + 3]
        with pytest.raises(grpc.RpcError) as err:
            stub(ch).Complete(gen_request(text="   \n ", max_new=2), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the prompt is empty once tokenized" in err.value.details()
    body = {"model": edge_server.model, "prompt": "   ", "max_tokens": 2}
    r = httpx.post(f"{edge_server.http_url}/completions", json=body, timeout=30)
    assert r.status_code == 400 and "empty once tokenized" in r.json()["error"]["message"]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def test_unknown_fields_are_dropped_before_the_request_is_queued(edge_server):
    """A request padded with a 1 MB field the router does not know would, if
    kept, count five times over limits.max_queued_bytes; dropped on arrival,
    the request is queued by what it really asks and served."""
    padding = b"u" * (5 * QUEUED_BYTES)
    raw = gen_request([5, 6, 7], max_new=3).SerializeToString()
    raw += _varint((9999 << 3) | 2) + _varint(len(padding)) + padding
    with edge_server.channel() as ch:
        complete = ch.unary_unary(
            "/cbserve.v1.Generation/Complete",
            request_serializer=lambda b: b,
            response_deserializer=gpb.GenerateResponse.FromString,
        )
        out = complete(raw, timeout=30)
        assert len(out.token_ids) == 3


def test_the_edge_server_is_serving_and_idle_afterwards(edge_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with edge_server.channel() as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    wait_idle(edge_server)


def test_output_ending_inside_a_character_is_flushed_at_the_finish(tiny_server):
    """The tiny model's ids are bytes + 3; a logit bias makes it end on the
    first byte of a three-byte character. The held-back byte is released at
    the finish as U+FFFD, so `text` (unary and streamed) equals the decode of
    `token_ids` on both APIs."""
    euro = [b + 3 for b in "€".encode()]
    sampling = gpb.SamplingParams(logit_bias={euro[0]: 100.0})
    with tiny_server.channel() as ch:
        s = stub(ch)
        ends_inside = gen_request([5, 6, 7], max_new=1, sampling=sampling)
        out = s.Complete(ends_inside, timeout=30)
        assert list(out.token_ids) == [euro[0]] and out.text == "\ufffd"
        streamed = list(s.Generate(gen_request([5, 6, 7], max_new=3, sampling=sampling), timeout=30))
        ids = [t for m in streamed for t in m.token_ids]
        assert ids == [euro[0]] * 3 and "".join(m.text for m in streamed) == b"\xe2\xe2\xe2".decode(errors="replace")
    body = {"model": "", "prompt": [5, 6, 7], "max_tokens": 1, "logit_bias": {str(euro[0]): 100}}
    r = httpx.post(f"{tiny_server.http_url}/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "\ufffd"
    wait_idle(tiny_server)
