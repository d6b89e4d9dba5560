"""Run-to-completion properties: random request mixes, policies and
preemption modes on tiny pools. Every request gets exactly its tokens, in the
same order a run with a huge pool gives (preemption neither duplicates nor
loses a token), within a bounded number of iterations."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from router.request import Status
from tests.router.router_factories import (
    FakeExecutor,
    assert_scheduler_empty,
    create_scheduler,
    make_request,
    run_to_completion,
    token_for,
)

POLICIES = ["fcfs", "sjf", "priority", "static", "dynamic", "fair", "slo"]
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 7))
    specs = []
    for i in range(n):
        plen = draw(st.integers(1, 18))
        shared = draw(st.booleans()) and i > 0
        specs.append(
            dict(
                prompt_len=plen,
                # Some prompts copy the first one's prefix: prefix-cache hits.
                shared=shared,
                max_new_tokens=draw(st.integers(1, 10)),
                priority=draw(st.integers(0, 3)),
                expected=draw(st.one_of(st.none(), st.integers(1, 10))),
                arrival=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0])) + i * 1e-3,
                # Iteration at which the request is added (while others run).
                join=draw(st.sampled_from([0, 0, 1, 2, 4])),
                # The sender (fair share orders and preempts by tenant).
                tenant=draw(st.sampled_from(["a", "b", "c"])),
            )
        )
    return specs


def build(specs):
    reqs = []
    for i, s in enumerate(specs):
        if s["shared"]:
            base = reqs[0].prompt_token_ids
            prompt = (base * 3)[: s["prompt_len"]]
        else:
            prompt = [10 + 1000 * i + j for j in range(s["prompt_len"])]
        reqs.append(
            make_request(
                prompt,
                s["max_new_tokens"],
                request_id=f"q{i}",
                arrival_time=s["arrival"],
                priority=s["priority"],
                expected_output_tokens=s["expected"],
            )
        )
        reqs[-1].tenant = s["tenant"]
    return reqs


def expected_tokens(req):
    n = len(req.prompt_token_ids)
    return [token_for(req, n + i) for i in range(req.stopping.max_new_tokens)]


class CheckingExecutor(FakeExecutor):
    """The fake executor, plus per-plan checks of what it is asked to do."""

    def __init__(self, sched):
        super().__init__()
        self.sched = sched

    def __call__(self, out):
        sched = self.sched
        seen = set()
        for item in out.seqs:
            req = item.req
            assert req.seq_id not in seen, "a sequence scheduled twice in one plan"
            seen.add(req.seq_id)
            assert req.status == Status.RUNNING
            assert item.num_tokens >= 1
            assert req.num_computed_tokens + item.num_tokens <= req.num_tokens
            # The sequence holds blocks for everything it computes.
            need = sched.blocks.blocks_needed(req.num_computed_tokens + item.num_tokens)
            assert len(sched.blocks.block_ids(req)) >= need
            if item.is_new:
                assert req.seq_id not in self.live or req.seq_id in out.free_seq_ids
        for sid in out.free_seq_ids:
            self.live.discard(sid)
        for item in out.seqs:
            self.live.add(item.req.seq_id)
        assert len(sched.running) <= sched.cfg.max_num_seqs
        return super().__call__(out)

    def __post_init__(self):
        super().__post_init__()
        self.live = set()


def _spec(prompt_len, max_new_tokens, tenant, arrival, priority=0):
    return dict(
        prompt_len=prompt_len,
        shared=False,
        max_new_tokens=max_new_tokens,
        priority=priority,
        expected=None,
        arrival=arrival,
        join=0,
        tenant=tenant,
    )


# Fair share once held prefill budget for a waiting prompt of a less-served
# tenant that could not get blocks, which the running prefills held: no token
# moved again. Without, and with, a prefix-cache hit of its own.
_RESERVE_STALLS = [
    dict(
        specs=[_spec(5, 1, "a", 0.0)]
        + [_spec(1, 1, "a", 1e-3 * i) for i in (1, 2, 3)]
        + [_spec(5, 1, "b", 0.004), _spec(3, 1, "c", 0.005), _spec(1, 1, "a", 0.006)],
        max_num_seqs=3,
        prefix=False,
    ),
    dict(
        specs=[_spec(1, 5, "a", 0.0, priority=3), _spec(7, 1, "b", 0.001, priority=3), _spec(1, 1, "a", 0.002)],
        max_num_seqs=2,
        prefix=True,
    ),
]


# Two long prompts of two tenants, prefilling side by side in a pool that
# holds only one of them whole: memory preemption evicted the most-served
# tenant's, whose counter the recompute then lifted past the other's, so
# each was evicted in turn, losing all it had computed, forever.
_EVICTION_PING_PONG = dict(
    specs=[_spec(1, 1, "a", 0.0), _spec(17, 4, "a", 0.001), _spec(1, 1, "a", 0.002)]
    + [_spec(16, 1, "b", 0.003), _spec(1, 1, "a", 0.004)],
    max_num_seqs=2,
    prefix=False,
)


# ... and for a waiting prompt that a swapped request kept from admission,
# while the running prefill held the blocks the swapped one needed.
_SWAP_STALL = dict(
    specs=[_spec(3, 5, "a", 0.0), _spec(1, 1, "a", 0.001), _spec(1, 6, "a", 0.002), _spec(12, 1, "b", 0.003)]
    + [_spec(1, 1, "a", 1e-3 * i) for i in (4, 5, 6)],
    max_num_seqs=3,
    prefix=False,
)


def _stall_example(case, **settings):
    """A fair-share stall case on a pool of exactly the largest request's
    blocks (recompute, no swap space, unless `settings` say otherwise)."""
    base = dict(
        policy="fair", mode="recompute", block_size=1, extra_blocks=0, num_swap_blocks=0, budget_extra=0, threshold=0
    )
    return example(**case, **{**base, **settings})


@SETTINGS
@_stall_example(_RESERVE_STALLS[0])
@_stall_example(_RESERVE_STALLS[1])
@_stall_example(_EVICTION_PING_PONG)
@_stall_example(_SWAP_STALL, mode="swap", num_swap_blocks=3, threshold=1)
@given(
    specs=workloads(),
    policy=st.sampled_from(POLICIES),
    mode=st.sampled_from(["recompute", "swap"]),
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 6),
    num_swap_blocks=st.integers(0, 12),
    max_num_seqs=st.integers(1, 4),
    budget_extra=st.integers(0, 24),
    threshold=st.sampled_from([0, 0, 1, 3, 8]),
    prefix=st.booleans(),
)
def test_run_to_completion_tiny_pool(
    specs, policy, mode, block_size, extra_blocks, num_swap_blocks, max_num_seqs, budget_extra, threshold, prefix
):
    reqs = build(specs)
    # The pool must hold the largest request alone, or it could never finish.
    biggest = max(-(-r.max_total_tokens // block_size) for r in reqs)
    sched = create_scheduler(
        policy,
        num_blocks=biggest + extra_blocks,
        block_size=block_size,
        num_swap_blocks=num_swap_blocks,
        enable_prefix_caching=prefix,
        preemption_mode=mode,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + budget_extra,
        long_prefill_token_threshold=threshold,
        static_batch_size=max_num_seqs,
        dynamic_max_wait_ms=20,
    )
    ex = CheckingExecutor(sched)
    run_to_completion(sched, reqs, ex, max_iters=2000, now=0.0, dt=0.01)
    for r in reqs:
        assert r.status == Status.FINISHED
        assert len(r.output_token_ids) == r.stopping.max_new_tokens
        assert r.output_token_ids == expected_tokens(r)
        # What the executor sampled, in order: nothing duplicated or lost.
        assert ex.produced[r.request_id] == r.output_token_ids
    assert_scheduler_empty(sched)

    # Same mix with a huge pool: identical tokens per request.
    ref = build(specs)
    big = create_scheduler(
        policy,
        num_blocks=4096,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + budget_extra,
        static_batch_size=max_num_seqs,
        dynamic_max_wait_ms=20,
    )
    ref_ex = run_to_completion(big, ref, max_iters=2000)
    assert {r.request_id: ex.produced[r.request_id] for r in reqs} == ref_ex.produced
    assert_scheduler_empty(big)


@SETTINGS
@given(
    specs=workloads(),
    policy=st.sampled_from(POLICIES),
    max_num_seqs=st.integers(1, 4),
    budget_extra=st.integers(0, 4),
    threshold=st.sampled_from([0, 0, 2, 5]),
)
def test_decodes_are_served_before_prefill_chunks(specs, policy, max_num_seqs, budget_extra, threshold):
    """With memory to spare, a running sequence that needs one token (a
    decode) is never left out of a plan that carries a prefill chunk."""
    reqs = build(specs)
    sched = create_scheduler(
        policy,
        num_blocks=4096,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + budget_extra,
        long_prefill_token_threshold=threshold,
        static_batch_size=max_num_seqs,
    )
    ex = FakeExecutor()
    now = 0.0
    for it in range(2000):
        for r, spec in zip(reqs, specs):
            if spec["join"] == it:
                r.arrival_time = now
                sched.add(r)
        if not sched.has_work() and it > 4:
            break
        decoding = [r for r in sched.running if r.num_uncomputed == 1]
        out = sched.schedule(now=now)
        scheduled = {s.req.seq_id for s in out.seqs}
        # A decode preempted in this iteration (by a higher-priority arrival)
        # is not starved: it left the running set.
        starved = [r.request_id for r in decoding if r.seq_id not in scheduled and r in sched.running]
        chunks = [s.req.request_id for s in out.seqs if s.num_tokens > 1]
        assert out.num_tokens <= sched.cfg.max_num_batched_tokens
        assert not (starved and chunks), f"decodes {starved} starved by prefill chunks {chunks}"
        sched.update(out, *ex(out), now=now)
        now += 0.01
    else:
        raise AssertionError("livelock")
    assert_scheduler_empty(sched)
