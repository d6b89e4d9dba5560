"""Speculative decoding end to end: a server with n-gram drafts gives, through
the real `openai` client, exactly what the same model gives without them
(greedy, seeded sampling, penalties and bias, min_tokens and stop ids, stop
strings, logprobs, structured outputs, streaming, n > 1), while its metrics
show drafts accepted; a request can opt out; nothing leaks KV blocks; a bad
`speculative` section is exit 2."""

from __future__ import annotations

import subprocess
import sys
import time

import openai
import pytest

from tests.conftest import REPO, start_server

MODEL = "tiny-random-llama"
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Prompts that repeat themselves: a random tiny model's greedy output loops
# over them, so drafts are found and accepted.
PROMPTS = [[5, 9, 3, 17] * 6 + [22, 41], [7, 8] * 20, list(range(30, 70))]
CASES = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.9, "seed": 4},
    "penalties": {
        "temperature": 0.3,
        "seed": 9,
        "presence_penalty": 0.2,
        "frequency_penalty": 0.1,
        "logit_bias": {"9": 3.0, "17": -2.0},
        "extra_body": {"repetition_penalty": 1.05},
    },
    "min_tokens": {"temperature": 0, "extra_body": {"min_tokens": 20, "stop_token_ids": [9, 17]}},
    "filters": {"temperature": 0.5, "top_p": 0.9, "seed": 2, "extra_body": {"top_k": 30, "min_p": 0.05}},
}


@pytest.fixture(scope="module")
def servers():
    on = start_server("tiny", config={"speculative": SPEC})
    off = start_server("tiny", config={"speculative": {"method": ""}})
    yield on, off
    on.stop()
    off.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url, api_key="none")


def _complete(server, prompt, **kw):
    r = _client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=40, **kw)
    c = r.choices[0]
    return c.text, c.finish_reason, r.usage.completion_tokens, c.logprobs


def _spec_counts(server) -> tuple[float, float]:
    """Drafts verified and draft tokens accepted so far."""
    m = server.metrics()
    return (
        m.get("cbserve_spec_decode_num_drafts_total", 0.0),
        m.get("cbserve_spec_decode_num_accepted_tokens_total", 0.0),
    )


def _idle_blocks(server) -> float:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        usage = server.metrics()["cbserve_kv_cache_usage_ratio"]
        if usage == 0:
            return usage
        time.sleep(0.05)
    return usage


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_are_those_without_speculation(servers, case):
    on, off = servers
    before = _spec_counts(on)
    for prompt in PROMPTS:
        a = _complete(on, prompt, **CASES[case])
        b = _complete(off, prompt, **CASES[case])
        assert a[:3] == b[:3], prompt
    after = _spec_counts(on)
    assert after[0] > before[0]  # drafts were verified
    if CASES[case]["temperature"] == 0:
        assert after[1] > before[1]  # and some accepted
    assert _idle_blocks(on) == 0


def test_logprobs_and_stop_strings_are_those_without_speculation(servers):
    on, off = servers
    text = _complete(off, PROMPTS[0], temperature=0)[0]
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # a stop string inside a drafted stretch
    for kw in ({"logprobs": 3, "temperature": 0.8, "seed": 1}, {"stop": [stop], "temperature": 0}):
        for prompt in PROMPTS:
            a = _complete(on, prompt, **kw)
            b = _complete(off, prompt, **kw)
            assert a[:3] == b[:3]
            if a[3] is not None:
                assert a[3].tokens == b[3].tokens
                assert a[3].token_logprobs == pytest.approx(b[3].token_logprobs, abs=1e-4)
                assert [sorted(t) for t in a[3].top_logprobs] == [sorted(t) for t in b[3].top_logprobs]


def test_structured_streamed_and_n_outputs_are_those_without_speculation(servers):
    on, off = servers
    outs = []
    for server in (on, off):
        c = _client(server)
        regex = c.completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=30,
            temperature=0,
            extra_body={"guided_regex": "(ab|cd){3,8}x"},
        )
        stream = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "abc abc abc abc abc abc"}],
            max_tokens=40,
            temperature=0.8,
            seed=3,
            stream=True,
        )
        streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        many = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0.9, seed=5, n=3)
        outs.append((regex.choices[0].text, streamed, sorted(ch.text for ch in many.choices)))
    assert outs[0] == outs[1]
    assert _idle_blocks(on) == 0


def test_suffix_decoding_gives_the_same_outputs(servers):
    """method: suffix, drawing on its own tokens and on earlier requests'
    outputs (the same prompts twice: the second time the cache has them)."""
    _, off = servers
    section = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 2.0}
    suffix = start_server("tiny", config={"speculative": section})
    try:
        for case in ("greedy", "seeded", "min_tokens"):
            for prompt in PROMPTS + PROMPTS:
                assert _complete(suffix, prompt, **CASES[case])[:3] == _complete(off, prompt, **CASES[case])[:3]
        drafts, accepted = _spec_counts(suffix)
        assert drafts > 0 and accepted > 0
        assert _idle_blocks(suffix) == 0
    finally:
        suffix.stop()


def test_a_request_can_opt_out(servers):
    on, _ = servers
    drafts = lambda: on.metrics().get("cbserve_spec_decode_num_drafts_total", 0.0)  # noqa: E731
    before = drafts()
    _complete(on, PROMPTS[0], temperature=0, extra_body={"speculative": False})
    assert drafts() == before
    _complete(on, PROMPTS[0], temperature=0)
    assert drafts() > before
    # The final log line reports a drafted request's acceptance.
    assert '"spec_acceptance_rate"' in on.log() and '"spec_mean_accepted_length"' in on.log()


def test_a_cancelled_stream_with_drafts_in_flight_leaks_no_block(servers):
    on, _ = servers
    c = _client(on)
    for _ in range(3):
        stream = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=200, temperature=0, stream=True)
        for i, _chunk in enumerate(stream):
            if i == 5:
                break
        stream.close()
    assert _idle_blocks(on) == 0


@pytest.mark.parametrize(
    "spec, message",
    [
        ('{"method": "medusa"}', "--speculative-config.method: 'medusa' is not one of ngram, suffix"),
        (
            '{"method": "suffix", "suffix_decoding_min_token_prob": 2}',
            "suffix_decoding_min_token_prob: must be in [0, 1]",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens: must be > 0, got 0"),
        ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min: 4 is more than"),
        ("{method: ngram}", "--speculative-config: not JSON"),
    ],
)
def test_a_bad_speculative_config_exits_2_naming_the_key(spec, message):
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--model", "tiny", "--speculative-config", spec],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert message in proc.stderr + proc.stdout


def test_preemption_chunked_prefill_and_opt_outs_keep_the_outputs():
    """A pool of 12 blocks (preemption by recompute, then swap), a budget that
    chunks prompts, concurrent requests of which half opt out: the greedy
    tokens equal the same load's without speculation (every request opted
    out: no step carries a draft, as with the method off)."""
    from tests.conftest import BLOCK_BYTES_TINY_FP32
    from tests.integration.helpers import gen_request, wait_idle
    from tests.integration.test_prefix_cache import MAX_NEW, PRESSURE
    from tests.integration.test_scheduling import reconfigure, run_concurrent

    cfg = {
        "cache": {"num_blocks": 12, "block_size": 16, "swap_space_bytes": 64 * BLOCK_BYTES_TINY_FP32},
        "scheduler": {"max_num_batched_tokens": 48, "max_num_seqs": 16},
    }
    results = {}
    server = start_server("tiny", config={**cfg, "speculative": {"method": "ngram", "prompt_lookup_min": 1}})
    try:
        for mode in ("recompute", "swap"):
            reconfigure(server, {**cfg["scheduler"], "policy": "fcfs", "preemption_mode": mode})
            for drafted in (False, True):
                before = server.metrics()["cbserve_spec_decode_num_drafts_total"]
                reqs = {
                    k: gen_request(ids, max_new=MAX_NEW[k], speculative=drafted and i % 2 == 0)
                    for i, (k, ids) in enumerate(PRESSURE.items())
                }
                results[(drafted, mode)] = {k: r["ids"] for k, r in run_concurrent(server, reqs).items()}
                m = wait_idle(server)
                assert m["cbserve_num_preemptions_total"] > 0
                drafts = m["cbserve_spec_decode_num_drafts_total"] - before
                assert drafts > 0 if drafted else drafts == 0, (mode, drafted, drafts)
        assert m["cbserve_spec_decode_num_accepted_tokens_total"] > 0
    finally:
        server.stop()
    for mode in ("recompute", "swap"):
        assert results[(True, mode)] == results[(False, mode)], mode


def test_a_deadline_in_the_middle_of_drafted_steps_leaks_no_block(servers):
    import grpc

    from tests.integration.helpers import gen_request, stub

    on, _ = servers
    with on.channel() as ch:
        for timeout in (0.05, 0.1, 0.2):
            with pytest.raises(grpc.RpcError) as err:
                for _ in stub(ch).Generate(gen_request(PROMPTS[1], max_new=2000), timeout=timeout):
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _idle_blocks(on) == 0
