"""The public API against a real router + executor (tiny model) on loopback."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cbserve.v1 import generation_pb2 as gpb
from tests.integration.helpers import gen_request, stub, wait_idle

PROMPT = [5, 17, 42, 99, 100, 101, 7, 8, 9, 10, 11, 12]


def test_generate_streams_deltas_and_finishes_with_usage(tiny_server):
    with tiny_server.channel() as ch:
        msgs = list(stub(ch).Generate(gen_request(PROMPT, max_new=12)))
    assert len(msgs) >= 2, "tokens arrive in several messages, not one"
    ids = [t for m in msgs for t in m.token_ids]
    assert len(ids) == 12
    assert all(m.finish_reason == gpb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == gpb.LENGTH
    assert last.usage.prompt_tokens == len(PROMPT) and last.usage.completion_tokens == 12
    assert len({m.request_id for m in msgs}) == 1 and msgs[0].request_id


def test_complete_equals_concatenated_stream(tiny_server):
    with tiny_server.channel() as ch:
        s = stub(ch)
        streamed = list(s.Generate(gen_request(PROMPT, max_new=10, request_id="a1")))
        whole = s.Complete(gen_request(PROMPT, max_new=10, request_id="a2"))
    assert list(whole.token_ids) == [t for m in streamed for t in m.token_ids]
    assert whole.text == "".join(m.text for m in streamed)
    assert whole.request_id == "a2" and whole.finish_reason == gpb.LENGTH


def test_text_and_chat_inputs(tiny_server):
    with tiny_server.channel() as ch:
        s = stub(ch)
        r1 = s.Complete(gen_request(text="héllo wörld", max_new=4))
        chat = gen_request(max_new=4)
        chat.messages.messages.add(role="user", content="hi")
        r2 = s.Complete(chat)
        tok = s.Tokenize(gpb.TokenizeRequest(text="héllo wörld"))
    assert r1.usage.prompt_tokens == len("héllo wörld".encode())  # byte-level tiny tokenizer
    assert r2.usage.prompt_tokens > 2  # the chat template added role markers
    assert len(tok.token_ids) == len("héllo wörld".encode()) == len(tok.tokens)


def test_tokenize_chat_matches_generate_prompt(tiny_server):
    with tiny_server.channel() as ch:
        s = stub(ch)
        req = gpb.TokenizeRequest()
        req.messages.messages.add(role="user", content="what?")
        tok = s.Tokenize(req)
        g = gen_request(max_new=1)
        g.messages.messages.add(role="user", content="what?")
        out = s.Complete(g)
    assert out.usage.prompt_tokens == len(tok.token_ids)


def test_model_info(tiny_server):
    with tiny_server.channel() as ch:
        info = stub(ch).ModelInfo(gpb.ModelInfoRequest())
    assert info.model == "tiny-random-llama"
    assert info.dtype == "float32"
    assert info.block_size == 16 and info.num_kv_blocks == 512
    assert info.max_context_length == 2048 and info.vocab_size == 259
    assert info.policy == "fcfs" and info.version and info.attention_backend == "native"


def test_health_and_reflection(tiny_server):
    with tiny_server.channel() as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for service in ("", "cbserve.v1.Generation"):
            assert (
                h.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
            )
        r = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
    assert {"cbserve.v1.Generation", "grpc.health.v1.Health"} <= names


def test_stop_string_ends_generation_without_the_stop_text(tiny_server):
    with tiny_server.channel() as ch:
        s = stub(ch)
        full = s.Complete(gen_request(PROMPT, max_new=24))
        text = full.text
        # Pick a stop string from the middle of what greedy decoding produces.
        assert len(text) >= 6, text
        stop = text[4:6]
        cut = text.find(stop)
        stopped = s.Complete(gen_request(PROMPT, max_new=24, stop=[stop]))
    assert stopped.finish_reason == gpb.STOP_SEQUENCE
    assert stopped.text == text[:cut]
    assert len(stopped.token_ids) < len(full.token_ids)


def test_chunked_prefill_of_prompt_longer_than_budget(tiny_server):
    # The shared server's budget is 256 tokens per iteration.
    long_prompt = [(i * 37) % 250 + 3 for i in range(700)]
    with tiny_server.channel() as ch:
        before = tiny_server.metrics()
        out = stub(ch).Complete(gen_request(long_prompt, max_new=5))
        after = tiny_server.metrics()
    assert out.usage.prompt_tokens == 700 and len(out.token_ids) == 5
    iterations = after["cbserve_iteration_tokens_count"] - before["cbserve_iteration_tokens_count"]
    assert iterations >= 3 + 4, "700 prompt tokens take at least 3 iterations of 256, then 4 decodes"
    assert after["cbserve_iteration_tokens_sum"] - before["cbserve_iteration_tokens_sum"] >= 700


def test_cancellation_frees_blocks(tiny_server):
    with tiny_server.channel() as ch:
        it = stub(ch).Generate(gen_request(PROMPT, max_new=1500))
        got = 0
        for msg in it:
            got += len(msg.token_ids)
            if got >= 3:
                break
        assert tiny_server.metrics()["cbserve_kv_cache_usage_ratio"] > 0
        it.cancel()
    m = wait_idle(tiny_server)
    assert m["cbserve_requests_total{finish_reason=CANCELLED,status=CANCELLED}"] >= 1


def test_burst_of_64_concurrent_requests_leaves_nothing_behind(tiny_server):
    results = [None] * 64
    with tiny_server.channel() as ch:
        s = stub(ch)
        futures = [s.Complete.future(gen_request([3 + i, 4, 5, 6 + i], max_new=5 + i % 7)) for i in range(64)]
        for i, f in enumerate(futures):
            results[i] = f.result(timeout=120)
    assert all(len(r.token_ids) == 5 + i % 7 for i, r in enumerate(results))
    m = wait_idle(tiny_server)
    assert m["cbserve_kv_cache_usage_ratio"] == 0


def test_same_seed_same_tokens_and_different_seeds_differ(tiny_server):
    def sampled(seed):
        req = gen_request(PROMPT, max_new=16, sampling=gpb.SamplingParams(temperature=1.0, seed=seed))
        with tiny_server.channel() as ch:
            return list(stub(ch).Complete(req).token_ids)

    a, b, c = sampled(1), sampled(1), sampled(2)
    assert a == b
    assert a != c


def test_logprobs_are_returned_when_asked(tiny_server):
    with tiny_server.channel() as ch:
        out = stub(ch).Complete(gen_request(PROMPT, max_new=6, logprobs=True))
        plain = stub(ch).Complete(gen_request(PROMPT, max_new=6))
    assert len(out.logprobs) == 6 and all(lp <= 0 for lp in out.logprobs)
    assert len(plain.logprobs) == 0


def test_concurrent_streams_are_isolated(tiny_server):
    """Each of several concurrent streams gets exactly its own tokens, equal
    to what it gets alone (greedy)."""
    prompts = [[3 + i, 50 + i, 60, 70 + 2 * i] for i in range(6)]
    with tiny_server.channel() as ch:
        s = stub(ch)
        alone = [list(s.Complete(gen_request(p, max_new=9)).token_ids) for p in prompts]
        out = [None] * len(prompts)

        def run(i):
            out[i] = [t for m in s.Generate(gen_request(prompts[i], max_new=9)) for t in m.token_ids]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert out == alone


def test_n_completions_interleave_by_index_and_share_the_prompt(tiny_server):
    prompt = list(range(5, 60))  # three full 16-token blocks and a partial one

    def req(n, seed, max_new=6):
        r = gen_request(prompt, max_new=max_new, n=n)
        r.sampling.CopyFrom(gpb.SamplingParams(temperature=1.0, seed=seed))
        return r

    hits = "cbserve_prefix_cache_hits_total"
    before = tiny_server.metrics().get(hits, 0)
    with tiny_server.channel() as ch:
        msgs = list(stub(ch).Generate(req(3, 7)))
        assert tiny_server.metrics().get(hits, 0) - before >= 2 * 48  # siblings took the first one's blocks
        by_index: dict[int, list[int]] = {0: [], 1: [], 2: []}
        for m in msgs:
            by_index[m.index].extend(m.token_ids)
        finals = {m.index: m for m in msgs if m.finish_reason}
        assert sorted(finals) == [0, 1, 2] and len({m.request_id for m in msgs}) == 1
        assert all(f.finish_reason == gpb.LENGTH and f.usage.completion_tokens == 6 for f in finals.values())
        for j in range(3):  # completion j is the request alone with seed 7 + j
            assert by_index[j] == list(stub(ch).Complete(req(1, 7 + j)).token_ids)
        whole = stub(ch).Complete(req(2, 7))
        assert [c.index for c in whole.choices] == [0, 1]
        assert [list(c.token_ids) for c in whole.choices] == [by_index[0], by_index[1]]
        assert list(whole.token_ids) == by_index[0] and whole.usage.completion_tokens == 12
        assert whole.usage.prompt_tokens == len(prompt)
        with pytest.raises(grpc.RpcError) as err:
            stub(ch).Complete(req(9, 7))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n:" in err.value.details()
    wait_idle(tiny_server)
