"""Speculative decoding in the router: n-gram drafts, their budget and
blocks, and what a verified step's result does to a request (a fake
executor that verifies drafts against a fake model)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import ConfigError, SpeculativeConfig, config_from_dict
from router.scheduler import SchedulerOutput
from router.speculative import NgramIndex, Speculator, suffix_draft
from tests.router.router_factories import EOS, FIRST_TOKEN, create_scheduler, make_request


def _model(req, position: int) -> int:
    """A fake model that mostly copies its prompt (every 7th position not),
    so n-gram drafts are often, not always, right."""
    p = req.prompt_token_ids
    return p[position % len(p)] if position % 7 else FIRST_TOKEN + 50_000 + position


class VerifyingExecutor:
    """Samples as the fake model; keeps drafts while they equal what it samples."""

    def __init__(self) -> None:
        self.steps = 0
        self.rows = 0

    def __call__(self, out: SchedulerOutput):
        self.steps += 1
        seq_ids, toks, counts = [], [], []
        for item in out.seqs:
            req = item.req
            k = len(item.draft_token_ids)
            self.rows += item.num_tokens
            if req.num_computed_tokens + item.num_tokens - k != req.num_tokens:
                continue
            emitted = []
            for j in range(k + 1):
                tok = _model(req, req.num_tokens + j)
                emitted.append(tok)
                if j == k or tok != item.draft_token_ids[j]:
                    break
            seq_ids.append(req.seq_id)
            toks.extend(emitted)
            counts.append(len(emitted))
        return seq_ids, toks, counts


def _run(sched, reqs, execute, on_step=None) -> None:
    for r in reqs:
        sched.add(r)
    for _ in range(10_000):
        if not sched.has_work():
            return
        out = sched.schedule()
        assert out.num_tokens <= sched.cfg.max_num_batched_tokens
        seq_ids, toks, counts = execute(out)
        sched.update(out, seq_ids, toks, [], counts=counts)
        sched.blocks.check_invariants()
        if on_step:
            on_step(sched, out)
    raise AssertionError("livelock")


def _requests(n: int, max_new: int = 40, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [
        make_request([FIRST_TOKEN + rng.randrange(20) for _ in range(12 + 5 * i)], max_new, request_id=f"r{i}")
        for i in range(n)
    ]


def _spec(**kw) -> Speculator:
    return Speculator(SpeculativeConfig(method="ngram", **{"prompt_lookup_min": 1, **kw}))


@pytest.mark.parametrize("k", [1, 3, 6])
def test_drafted_outputs_equal_plain_ones_in_fewer_steps(k):
    plain, spec = VerifyingExecutor(), VerifyingExecutor()
    a = create_scheduler(block_size=4)
    b = create_scheduler(block_size=4)
    b.speculator = _spec(num_speculative_tokens=k)
    ra, rb = _requests(5), _requests(5)
    _run(a, ra, plain)
    seen = []
    _run(b, rb, spec, on_step=lambda s, out: seen.append([len(i.draft_token_ids) for i in out.seqs]))
    assert [r.output_token_ids for r in rb] == [r.output_token_ids for r in ra]
    assert all(len(r.output_token_ids) == 40 for r in rb)  # never past max_new_tokens
    assert max(max(x, default=0) for x in seen) == k
    assert spec.steps < plain.steps
    assert b.spec_accepted > 0 and b.spec_accepted < b.spec_draft_tokens
    assert sum(b.spec_accepted_per_pos) == b.spec_accepted
    assert b.blocks.num_used_blocks == 0  # nothing left behind, drafts or not


def test_accepted_tokens_enter_the_prefix_cache_and_rejected_ones_do_not():
    sched = create_scheduler(block_size=4)
    sched.speculator = _spec(num_speculative_tokens=4)
    (req,) = _requests(1, max_new=30)
    _run(sched, [req], VerifyingExecutor())
    again = make_request(req.prompt_token_ids + req.output_token_ids, 1)
    hits = sched.blocks.lookup_prefix(again)
    # Every full block of prompt + output (but the last, which is left to
    # compute) is found: the hashes were made of the tokens kept.
    assert len(hits) == (again.num_tokens - 1) // 4


def test_no_drafts_from_the_batch_size_on_nor_for_requests_that_opt_out():
    sched = create_scheduler(block_size=4)
    sched.speculator = _spec(num_speculative_tokens=3, disable_by_batch_size=3)
    reqs = _requests(4, max_new=30)
    reqs[0].speculative = False
    reqs[1].stopping = reqs[2].stopping = type(reqs[1].stopping)(max_new_tokens=8)
    batches = []
    _run(sched, reqs, VerifyingExecutor(), on_step=lambda s, out: batches.append(out))
    for out in batches:
        drafted = [i for i in out.seqs if i.draft_token_ids]
        assert not any(i.req is reqs[0] for i in drafted)
        if drafted:
            assert len(out.seqs) < 3
    assert reqs[0].spec_drafts == 0 and reqs[3].spec_drafts > 0


def test_drafts_count_against_the_token_budget_after_every_decode():
    sched = create_scheduler(block_size=4, max_num_batched_tokens=6, max_num_seqs=4)
    sched.speculator = _spec(num_speculative_tokens=5, disable_by_batch_size=8)
    reqs = _requests(4, max_new=20)

    def check(s, out):
        decodes = [i for i in out.seqs if i.num_prompt_tokens == 0]
        assert out.num_tokens <= 6
        if any(i.draft_token_ids for i in decodes):
            # Every decode got its own token before any draft.
            assert all(i.num_tokens >= 1 for i in decodes)

    _run(sched, reqs, VerifyingExecutor(), on_step=check)
    assert all(len(r.output_token_ids) == 20 for r in reqs)


def test_an_eos_among_accepted_tokens_ends_the_request_there():
    sched = create_scheduler(block_size=4)
    sched.speculator = _spec(num_speculative_tokens=4)
    x, y, z, w = (FIRST_TOKEN + i for i in range(4))
    req = make_request([x, y, z, EOS, w, x, y], 30)

    def copier(out):  # copies the prompt from its third token: z, then EOS w x y (a draft of x y z's match)
        seq_ids, toks, counts = [], [], []
        for item in out.seqs:
            r = item.req
            k = len(item.draft_token_ids)
            if r.num_computed_tokens + item.num_tokens - k != r.num_tokens:
                continue
            emitted = []
            for j in range(k + 1):
                tok = r.prompt_token_ids[(r.num_tokens + j - 5) % 7]
                emitted.append(tok)
                if j == k or tok != item.draft_token_ids[j]:
                    break
            seq_ids.append(r.seq_id)
            toks += emitted
            counts.append(len(emitted))
        return seq_ids, toks, counts

    _run(sched, [req], copier)
    assert req.output_token_ids == [z, EOS]  # not w, x, y accepted after it
    assert req.spec_drafts == 1 and req.spec_accepted == 4
    assert sched.blocks.num_used_blocks == 0


def test_no_step_is_planned_ahead_while_a_sequence_has_a_draft():
    sched = create_scheduler(block_size=4)
    sched.speculator = _spec(num_speculative_tokens=3)
    (req,) = _requests(1, max_new=30)
    sched.add(req)
    out = sched.schedule()
    seq_ids, toks, counts = VerifyingExecutor()(out)
    sched.update(out, seq_ids, toks, [], counts=counts)
    out = sched.schedule()
    assert out.seqs[0].draft_token_ids  # the prompt repeats: a draft is found
    assert sched.schedule_ahead(out) is None


@given(st.lists(st.integers(0, 5), min_size=2, max_size=60), st.integers(1, 4), st.integers(1, 4))
@settings(max_examples=200, deadline=None)
def test_an_ngram_draft_continues_the_latest_earlier_match_of_the_longest_suffix(tokens, n_min, span):
    n_max = n_min + span - 1
    index = NgramIndex()
    index.sync(tokens, [])
    got = index.propose(n_min, n_max, 3)
    want = []
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if starts:
            at = starts[-1] + n
            want = tokens[at : at + 3]
            break
    assert got == want


@pytest.mark.parametrize(
    "section, message",
    [
        ({"method": "eagle"}, "speculative.method: 'eagle' is not one of ngram, suffix"),
        (
            {"method": "suffix", "suffix_decoding_max_tree_depth": 0},
            "speculative.suffix_decoding_max_tree_depth: must be",
        ),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative.num_speculative_tokens: must be > 0, got 0"),
        (
            {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "speculative.prompt_lookup_min: 5 is more than prompt_lookup_max (3)",
        ),
        ({"method": "ngram", "k": 3}, "speculative.k: unknown key"),
    ],
)
def test_a_bad_speculative_section_is_refused_naming_the_key(section, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict({"speculative": section})


# -- suffix ------------------------------------------------------------------------
def _suffix(**kw) -> Speculator:
    return Speculator(SpeculativeConfig(method="suffix", **kw))


@pytest.mark.parametrize("k", [2, 5])
def test_suffix_drafted_outputs_equal_plain_ones_in_fewer_steps(k):
    plain, spec = VerifyingExecutor(), VerifyingExecutor()
    a, b = create_scheduler(block_size=4), create_scheduler(block_size=4)
    b.speculator = _suffix(num_speculative_tokens=k)
    ra, rb = _requests(5), _requests(5)
    _run(a, ra, plain)
    _run(b, rb, spec)
    assert [r.output_token_ids for r in rb] == [r.output_token_ids for r in ra]
    assert spec.steps < plain.steps and b.spec_accepted > 0
    assert b.blocks.num_used_blocks == 0
    assert len(b.speculator.cache.texts) == 5  # every finished output went into the cache


def test_suffix_draws_on_other_requests_outputs():
    spec = _suffix(num_speculative_tokens=6, suffix_decoding_max_spec_factor=2.0)
    earlier = [FIRST_TOKEN + t for t in (40, 41, 42, 43, 44, 45, 46, 47, 48, 49)]
    done = make_request([1, 2, 3], 10)
    done.output_token_ids = earlier
    spec.finished(done)
    req = make_request([FIRST_TOKEN + 7, FIRST_TOKEN + 8] + earlier[:4], 20)  # nothing of it repeats itself
    req.executor_has_state = True
    assert spec.propose(req, 6) == earlier[4:10]  # match of 4 tokens x factor 2, capped at k = 6
    # Another tenant's outputs are not drawn on (as the prefix cache, nothing crosses tenants).
    req.tenant = "other"
    assert spec.propose(req, 6) == []


def test_suffix_follows_the_most_frequent_continuation_while_it_is_likely():
    cfg = SpeculativeConfig(method="suffix", suffix_decoding_min_token_prob=0.3)
    text = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3, 9, 5]
    occ = [(text, e) for e in (2, 6, 10, 14)]  # the ends of "1 2 3"
    draft, score = suffix_draft(occ, 3, cfg, 5)
    # 9 follows 3 of 4 times (p 0.75), then 1 or 5 (p 0.75 x 2/3 = 0.5), then
    # 2 (0.5), 3 (0.5), then 7 or 9 once each: 0.25 < 0.3 stops.
    assert draft == [9, 1, 2]  # capped at factor 1.0 x match 3
    assert score == pytest.approx(0.75 + 0.5 + 0.5)


def test_the_suffix_cache_is_bounded_and_its_index_has_no_stale_entry():
    from router.speculative import SuffixCache

    cache = SuffixCache(max_requests=3, max_tokens=50)
    rng = random.Random(1)
    for _ in range(20):
        cache.add([rng.randrange(6) for _ in range(rng.randrange(4, 30))])
        assert len(cache.texts) <= 3 and cache.num_tokens <= 50
        for run, at in cache.index.items():
            assert at, run
            for key, end in at:
                scope, text = cache.texts[key]
                assert (scope, *text[end - 2 : end + 1]) == run and end + 1 < len(text)


@given(st.lists(st.integers(0, 3), min_size=2, max_size=50), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_the_longest_suffix_and_its_occurrences_are_found(tokens, depth):
    from router.speculative import _longest_suffix

    index = NgramIndex()
    index.sync(tokens, [])
    match, occ = _longest_suffix(index, depth)
    n = len(tokens)

    def ends(m):  # where an earlier copy of the last m tokens ends
        return [e for e in range(m - 1, n - 1) if tokens[e - m + 1 : e + 1] == tokens[n - m :]]

    want = max((m for m in range(1, min(depth, n - 1) + 1) if ends(m)), default=0)
    assert match == want
    if want:
        assert sorted(e for _, e in occ) == sorted(ends(want))[-len(occ) :]


def test_drafts_never_preempt_anyone():
    """A pool with room for every sequence's next token but not for drafts:
    the step goes without them and nobody is preempted for them."""
    plain = create_scheduler(block_size=4, num_blocks=16)
    spec = create_scheduler(block_size=4, num_blocks=16)
    spec.speculator = _spec(num_speculative_tokens=6)
    ra, rb = _requests(3, max_new=12), _requests(3, max_new=12)
    _run(plain, ra, VerifyingExecutor())
    _run(spec, rb, VerifyingExecutor())
    assert [r.output_token_ids for r in rb] == [r.output_token_ids for r in ra]
    assert plain.num_preemptions > 0  # the pool is short
    assert spec.num_preemptions == plain.num_preemptions
    assert spec.spec_drafts > 0
