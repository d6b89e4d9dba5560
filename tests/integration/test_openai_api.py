"""The OpenAI-compatible HTTP API against real `cbserve serve` processes on
loopback: the official `openai` SDK (sync and async), raw HTTP for the SSE
framing and every error status, disconnects that free their KV blocks, and a
burst of concurrent streams that leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import grpc
import httpx
import openai
import pytest
import torch

from cbserve.v1 import generation_pb2 as gpb
from tests.conftest import start_server
from tests.integration.helpers import executor_held, gen_request, stub, wait_idle, wait_metric

PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11]


def _model(server) -> str:
    return httpx.get(f"{server.http_url}/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def api(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.http_url, api_key="unused", max_retries=0, timeout=60)
    return tiny_server, client, _model(tiny_server)


def _grpc_complete(server, ids, max_new, sampling=None, stopping=None):
    req = gen_request(ids, max_new=max_new, ignore_eos=True)
    if sampling is not None:
        req.sampling.CopyFrom(sampling)
    if stopping is not None:
        req.stopping.MergeFrom(stopping)
    with server.channel() as ch:
        return stub(ch).Complete(req, timeout=60)


# -- the SDK -----------------------------------------------------------------------
def test_completion_greedy_text_and_usage_equal_the_grpc_api(api):
    server, client, model = api
    r = client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    want = _grpc_complete(server, PROMPT_IDS, 12)
    assert r.object == "text_completion" and r.model == model and r.id.startswith("cmpl-")
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == want.usage.prompt_tokens == len(PROMPT_IDS)
    assert r.usage.completion_tokens == want.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == want.usage.cached_prompt_tokens


def test_streamed_completion_concatenates_to_the_whole_one(api):
    server, client, model = api
    whole = client.completions.create(
        model=model, prompt="The sky is", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.completions.create(
            model=model,
            prompt="The sky is",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_completion_and_its_stream(api):
    server, client, model = api
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ]
    r = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=8,
        temperature=0,
        logprobs=False,  # asks for nothing: accepted
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # The chat template is the gRPC API's: the same messages tokenize alike.
    with server.channel() as ch:
        from cbserve.v1 import generation_pb2 as gpb

        grpc_msgs = gpb.ChatMessages(
            messages=[
                gpb.ChatMessage(role="system", content="Be brief."),
                gpb.ChatMessage(role="user", content="Name a colour."),
            ]
        )
        ids = stub(ch).Tokenize(gpb.TokenizeRequest(messages=grpc_msgs)).token_ids
    assert r.usage.prompt_tokens == len(ids)


def test_async_client(api):
    server, _, model = api

    async def run():
        async with openai.AsyncOpenAI(base_url=server.http_url, api_key="unused", max_retries=0) as client:
            calls = [
                client.completions.create(
                    model=model, prompt=[i + 3, i + 4], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
                )
                for i in range(6)
            ]
            return await asyncio.gather(*calls)

    results = asyncio.run(run())
    assert [r.usage.completion_tokens for r in results] == [5] * 6
    assert results[0].choices[0].text == _grpc_complete(server, [3, 4], 5).text


def test_seeded_sampling_repeats(api):
    server, client, model = api

    def sample(seed):
        return (
            client.completions.create(
                model=model,
                prompt=PROMPT_IDS,
                max_tokens=12,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1  # the seed matters


def test_stop_string_ends_the_text_before_it(api):
    server, client, model = api
    full = (
        client.completions.create(
            model=model, prompt="abc", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    k = next(i for i in range(4, len(full) - 2) if full[i : i + 2].isprintable() and full[i : i + 2].strip())
    stop = full[k : k + 2]
    r = client.completions.create(
        model=model, prompt="abc", max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_several_prompts_get_a_choice_each(api):
    server, client, model = api
    r = client.completions.create(
        model=model, prompt=[[5, 6, 7], [8, 9]], max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[1].text == _grpc_complete(server, [8, 9], 4).text
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8


def test_models_tokenize_detokenize_version_health(api):
    server, client, model = api
    assert [m.id for m in client.models.list().data] == [model]
    base = f"http://127.0.0.1:{server.http_port}"
    tok = httpx.post(f"{base}/tokenize", json={"model": model, "prompt": "hello"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    assert httpx.post(f"{base}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "hello"
    assert httpx.get(f"{base}/version").json()["version"]
    assert httpx.get(f"{base}/health").status_code == 200


# -- raw HTTP: framing and errors ----------------------------------------------------
def test_sse_framing(api):
    server, _, model = api
    body = {"model": model, "prompt": "x", "max_tokens": 5, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.http_url}/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def _post(server, path, payload=None, content=None, headers=None, timeout=30):
    return httpx.post(f"{server.http_url}{path}", json=payload, content=content, headers=headers, timeout=timeout)


def _error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function"}]),
        ("best_of", 3),
        ("echo", True),
    ],
)
def test_fields_not_implemented_are_refused_by_name(api, field, value):
    server, _, model = api
    err = _error(_post(server, "/completions", {"model": model, "prompt": "x", field: value}), 400, field)
    assert field in err["message"]


def _http_choice(server, model, prompt, **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    r = _post(server, "/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_logit_bias_moves_greedy_tokens(api):
    server, _, model = api
    free = list(_grpc_complete(server, [5, 6, 7], 8).token_ids)
    forced = _grpc_complete(server, [5, 6, 7], 8, sampling=gpb.SamplingParams(logit_bias={72: 100.0}))
    assert list(forced.token_ids) == [72] * 8 and free != [72] * 8
    banned = _grpc_complete(server, [5, 6, 7], 8, sampling=gpb.SamplingParams(logit_bias={free[0]: -100.0}))
    assert free[0] not in banned.token_ids
    # The OpenAI API's string keys.
    assert _http_choice(server, model, [5, 6, 7], logit_bias={"72": 100})["text"] == forced.text


def test_stop_token_ids_end_the_output_and_min_tokens_holds_them_back(api):
    server, _, model = api
    free = list(_grpc_complete(server, [9, 10, 11], 12).token_ids)
    stop = free[2]
    first = free.index(stop)
    r = _grpc_complete(server, [9, 10, 11], 12, stopping=gpb.StoppingCriteria(max_new_tokens=12, stop_token_ids=[stop]))
    assert list(r.token_ids) == free[: first + 1] and r.finish_reason == gpb.STOP_SEQUENCE
    # min_tokens: the stop id cannot be sampled for the first 6 tokens; the
    # output ends at its first occurrence after that, or runs to the cap.
    held = _grpc_complete(
        server, [9, 10, 11], 12, stopping=gpb.StoppingCriteria(max_new_tokens=12, stop_token_ids=[stop], min_tokens=6)
    )
    out = list(held.token_ids)
    assert len(out) >= 6 and stop not in out[:6]
    assert (out[-1] == stop and stop not in out[:-1]) or (len(out) == 12 and stop not in out)
    choice = _http_choice(server, model, [9, 10, 11], max_tokens=12, stop_token_ids=[stop])
    assert choice["finish_reason"] == "stop" and choice["text"] == r.text


def test_presence_and_frequency_penalties_change_repetitive_greedy_output(api):
    server, _, model = api
    free = list(_grpc_complete(server, [5, 6, 7], 16).token_ids)
    assert len(set(free)) < len(free)  # the tiny model repeats itself
    penalties = gpb.SamplingParams(presence_penalty=2.0, frequency_penalty=2.0)
    pen = _grpc_complete(server, [5, 6, 7], 16, sampling=penalties)
    assert len(set(pen.token_ids)) > len(set(free))
    choice = _http_choice(server, model, [5, 6, 7], presence_penalty=2.0, frequency_penalty=2.0, max_tokens=16)
    assert choice["text"] == pen.text


def test_n_completions_share_the_prompt_and_follow_seed_plus_index(api):
    server, client, model = api
    prompt = list(range(5, 60))  # three full 16-token blocks
    hits = "cbserve_prefix_cache_hits_total"
    before = server.metrics().get(hits, 0)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=1.0, seed=7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(prompt) and 0 < r.usage.completion_tokens <= 18  # the prompt counts once
    # The two siblings took the shared prompt's full blocks from the first.
    assert server.metrics().get(hits, 0) - before >= 2 * 48
    for j, c in enumerate(r.choices):  # choice j is the request with seed 7 + j
        alone = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=1.0, seed=7 + j)
        assert c.text == alone.choices[0].text
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == chat.choices[
        1
    ].message.content
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, n=2, stream=True)
    seen = {c.index for ch in stream for c in ch.choices}
    assert seen == {0, 1}
    _error(_post(server, "/completions", {"model": model, "prompt": "x", "n": 9}), 400, "n")
    _error(_post(server, "/completions", {"model": model, "prompt": "x", "n": 0}), 400, "n")
    wait_idle(server)


def test_top_logprobs_are_the_raw_models_best_tokens_through_both_apis(api):
    from executor import model_loader, model_source

    server, client, model = api
    prompt = [5, 6, 7, 8]
    req = gen_request(prompt, max_new=6, ignore_eos=True, logprobs=True, top_logprobs=3)
    with server.channel() as ch:
        r = stub(ch).Complete(req, timeout=60)
    assert len(r.top_logprobs) == len(r.token_ids) == 6
    # The reference: the fp32 model's own log-softmax, position by position.
    ref = model_loader.load_model(model_source.resolve("tiny"), torch.float32)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + list(r.token_ids)])).logits[0, len(prompt) - 1 : -1]
    want = logits.log_softmax(-1).topk(3)
    for i, top in enumerate(r.top_logprobs):
        assert list(top.token_ids) == want.indices[i].tolist()
        assert list(top.logprobs) == pytest.approx(want.values[i].tolist(), abs=1e-4)
        assert top.token_ids[0] == r.token_ids[i] and top.logprobs[0] == pytest.approx(r.logprobs[i], abs=1e-6)
    with server.channel() as ch, pytest.raises(grpc.RpcError) as err:
        stub(ch).Complete(gen_request(prompt, max_new=2, logprobs=True, top_logprobs=21), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in err.value.details()

    c = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = c.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(list(r.logprobs), abs=1e-5) and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == c.choices[0].text
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        logprobs=True,
        stream=True,
        extra_body={"ignore_eos": True},  # sampled: a random tiny model may pick EOS early
    )
    streamed = [t for ch in stream if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert len(streamed) == 5 and all(t.top_logprobs == [] for t in streamed)
    bad = _post(
        server, "/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    )
    _error(bad, 400, "top_logprobs")


def test_completions_top_logprobs_always_hold_the_sampled_token(api):
    """The completions API (OpenAI's and vLLM's rule): each position's
    top_logprobs holds the k best alternatives and the sampled token, so up to
    k + 1 items, under sampling and in streaming; the chat API keeps k."""
    server, client, model = api
    k = 3
    # A random tiny model's distribution is nearly flat: at temperature 1 the
    # sampled token is almost never among the 3 best.
    args = dict(model=model, prompt=[5, 6, 7, 8], max_tokens=8, temperature=1.0, logprobs=k)
    c = client.completions.create(seed=11, extra_body={"ignore_eos": True}, **args)
    streamed = client.completions.create(seed=11, stream=True, extra_body={"ignore_eos": True}, **args)
    chunks = [ch.choices[0].logprobs for ch in streamed if ch.choices and ch.choices[0].logprobs]
    for lp in (c.choices[0].logprobs, *chunks):
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) >= 1
        for text, sampled, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert len(top) <= k + 1  # fewer where tokens decode alike (byte tokens: "\ufffd")
            assert top[text] == pytest.approx(sampled, abs=1e-6)
    positions = [top for lp in chunks for top in lp.top_logprobs]
    assert [t for lp in chunks for t in lp.tokens] == c.choices[0].logprobs.tokens  # the same seeded draw
    assert len(positions) == 8 and any(len(top) == k + 1 for top in positions)  # sampled outside the k best
    # logprobs: 0 -> the sampled token alone.
    zero = client.completions.create(**{**args, "logprobs": 0}, seed=11, extra_body={"ignore_eos": True})
    lp0 = zero.choices[0].logprobs
    assert [list(top) for top in lp0.top_logprobs] == [[t] for t in lp0.tokens]
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=1.0,
        seed=11,
        logprobs=True,
        top_logprobs=k,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(t.top_logprobs) == k for t in content)
    assert any(t.token not in {a.token for a in t.top_logprobs} for t in content)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_controls_get_400_with_the_field(api, extra, param):
    server, _, model = api
    _error(_post(server, "/completions", {"model": model, "prompt": "x", "max_tokens": 8, **extra}), 400, param)


def test_bad_input_gets_400_with_the_field(api):
    server, _, model = api
    _error(_post(server, "/completions", {"model": model, "prompt": "x", "temperature": "hot"}), 400, "temperature")
    _error(_post(server, "/completions", {"model": model}), 400, "prompt")
    _error(_post(server, "/completions", {"model": model, "prompt": "x", "max_tokens": 10**6}), 400, "max_tokens")
    _error(_post(server, "/completions", {"model": model, "prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    _error(_post(server, "/completions", {"model": model, "prompt": "x", "top_p": 3.0}), 400, "top_p")
    _error(_post(server, "/completions", {"model": model, "prompt": [10**7]}), 400, "prompt")
    _error(_post(server, "/completions", {"model": model, "prompt": ""}), 400, "prompt")
    # Beyond the protobuf fields' ranges: still the client's 400.
    _error(_post(server, "/completions", {"model": model, "prompt": [2**40]}), 400, "prompt")
    _error(_post(server, "/completions", {"model": model, "prompt": "x", "max_tokens": 2**40}), 400)
    _error(_post(server, "/completions", {"model": model, "prompt": "x", "priority": 2**40}), 400)
    _error(_post(server, "/completions", {"model": model, "prompt": "x", "top_k": 2**40}), 400)
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    _error(_post(server, "/chat/completions", {"model": model, "messages": [{"role": "user", "content": image}]}), 400)
    _error(
        _post(server, "/chat/completions", {"model": model, "messages": [{"role": "wizard", "content": "x"}]}),
        400,
        "messages",
    )
    # The message is the gRPC API's for the same mistake.
    with server.channel() as ch:
        with pytest.raises(grpc.RpcError) as grpc_err:
            stub(ch).Complete(gen_request([5], max_new=10**6))
    http_err = _error(_post(server, "/completions", {"model": model, "prompt": [5], "max_tokens": 10**6}), 400)
    assert http_err["message"] == grpc_err.value.details()


def test_malformed_bodies_are_400_or_413_never_500(api):
    server, _, model = api
    _error(_post(server, "/completions", content=b"{not json"), 400)
    _error(_post(server, "/completions", content=b"[1, 2]"), 400)
    _error(_post(server, "/completions", content=b"\xff\xfe"), 400)
    _error(_post(server, "/completions", content=b"[" * 200_000), 400)  # nested past the parser's recursion
    _error(_post(server, "/chat/completions", {"model": model, "messages": "hi"}), 400, "messages")
    big = b'{"model": "m", "prompt": "' + b"a" * (4 * 1024 * 1024 + 10) + b'"}'
    _error(_post(server, "/completions", content=big), 413)

    def chunks():
        yield big[: len(big) // 2]
        yield big[len(big) // 2 :]

    _error(_post(server, "/completions", content=chunks()), 413)  # no Content-Length: counted as read


def test_unknown_paths_and_methods_get_the_error_object(api):
    server, _, _ = api
    _error(httpx.get(f"{server.http_url}/engines", timeout=10), 404)
    _error(httpx.get(f"{server.http_url}/completions", timeout=10), 405)


def test_unknown_model_is_404_model_not_found(api):
    server, _, _ = api
    err = _error(_post(server, "/completions", {"model": "gpt-4", "prompt": "x"}), 404, "model")
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        api[1].chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_a_client_timeout_is_504(api):
    server, _, model = api
    body = {"model": model, "prompt": [5, 6], "max_tokens": 1500, "ignore_eos": True}
    _error(_post(server, "/completions", body, headers={"x-request-timeout": "0.3"}), 504)
    _error(_post(server, "/completions", body, headers={"x-envoy-expected-rq-timeout-ms": "300"}), 504)
    _error(_post(server, "/completions", body, headers={"x-request-timeout": "soon"}), 400)
    wait_idle(server)


def test_disconnects_free_their_blocks(api):
    server, _, model = api
    before = server.metrics().get("cbserve_requests_total{finish_reason=CANCELLED,status=CANCELLED}", 0)
    body = {"model": model, "prompt": [5, 6], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.http_url}/completions", json=body, timeout=30) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    # Not streamed: the client gives up while the request runs.
    with pytest.raises(httpx.ReadTimeout):
        _post(server, "/completions", {**body, "stream": False}, timeout=0.5)
    m = wait_idle(server, timeout=20)
    assert m["cbserve_requests_total{finish_reason=CANCELLED,status=CANCELLED}"] >= before + 2


def test_a_burst_of_64_streams_leaves_nothing_behind(api):
    server, _, model = api

    async def one(client, i):
        body = {"model": model, "prompt": [i % 200 + 3, 7, 8], "max_tokens": 12, "stream": True, "ignore_eos": True}
        text, finish = "", None
        async with client.stream("POST", f"{server.http_url}/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    c = json.loads(line[6:])["choices"][0]
                    text += c["text"]
                    finish = c["finish_reason"] or finish
        return finish

    async def burst():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert asyncio.run(burst()) == ["length"] * 64
    wait_idle(server)


# -- a server of its own: backpressure, duplicates, drain -----------------------------
def test_queue_full_duplicate_id_and_drain():
    server = start_server(
        "tiny",
        config={
            "limits": {"max_queued_requests": 1},
            "scheduler": {"max_num_seqs": 1, "max_num_batched_tokens": 64},
            "server": {"drain_timeout_s": 30.0},
        },
    )
    try:
        model = _model(server)
        long = {"model": model, "prompt": [5, 6], "max_tokens": 1500, "ignore_eos": True, "stream": True}
        cancelled = "cbserve_requests_total{finish_reason=CANCELLED,status=CANCELLED}"
        streams, opened, give_up = [], [], threading.Event()

        def hold(rid):
            with httpx.stream(
                "POST", f"{server.http_url}/completions", json=long, timeout=60, headers={"x-request-id": rid}
            ) as r:
                opened.append(r.status_code)
                if rid == "waiting-one":
                    give_up.wait(30)
                    return
                for _ in r.iter_lines():
                    pass

        def start(rid):
            t = threading.Thread(target=hold, args=(rid,), daemon=True)
            t.start()
            streams.append(t)
            end = time.monotonic() + 10
            while len(opened) < len(streams) and time.monotonic() < end:
                time.sleep(0.05)  # headers come once the request is submitted

        start("running-one")
        # scheduled (the gauge moves at step boundaries) before the executor stops
        wait_metric(server, lambda m: m.get("cbserve_num_requests_running") == 1, timeout=10)
        # A held executor keeps "running-one" in flight and "waiting-one" queued for
        # as long as the checks below take, however fast the machine generates; the
        # router keeps answering, and applies cancellations at the next step boundary.
        with executor_held(server):
            err = _error(_post(server, "/completions", long, headers={"x-request-id": "running-one"}), 409)
            assert "already in flight" in err["message"]
            start("waiting-one")
            _error(_post(server, "/completions", {**long, "stream": False}), 429)
            # The queued client gives up: its request leaves the queue without running.
            give_up.set()
            streams[-1].join(10)
        # the waiting gauge follows at the end of the iteration
        m = wait_metric(
            server, lambda m: m.get(cancelled, 0) >= 1 and m["cbserve_num_requests_waiting"] == 0, timeout=10
        )
        assert m[cancelled] == 1 and m["cbserve_num_requests_waiting"] == 0
        # Drain: new requests 503, health 503. The executor is held again so
        # "running-one" stays in flight and the drain can neither end nor
        # time out during the checks, however fast or slow the machine; once
        # it resumes, "running-one" finishes and the server exits.
        with executor_held(server):
            assert streams[0].is_alive(), "running-one ended before the drain"
            server.proc.send_signal(signal.SIGTERM)
            health = f"http://127.0.0.1:{server.http_port}/health"
            end = time.monotonic() + 10
            while httpx.get(health).status_code != 503 and time.monotonic() < end:
                time.sleep(0.05)
            assert httpx.get(health).status_code == 503
            _error(_post(server, "/completions", {**long, "stream": False}), 503)
        for t in streams:
            t.join(30)
        assert server.proc.wait(30) == 0
        assert opened == [200, 200]
    finally:
        server.stop()
