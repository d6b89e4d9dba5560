"""SLO classes on the scheduler alone (simulated clock, fake executor whose
step takes a + b * tokens seconds): EDF order, missed deadlines after the
ones still met, `reject` only for requests that cannot meet their deadline
even if scheduled at once, the TPOT guard on the batch, the step model, no
block leaked; and the config's refusals."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config import ConfigError, config_from_dict
from router.policies.slo import SloPolicy, StepModel
from router.request import Finish, Status
from tests.router.router_factories import FakeExecutor, assert_scheduler_empty, create_scheduler, distinct_request

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def classed(prompt_len, max_new, now, ttft_s=None, tpot_s=None, priority=0):
    req = distinct_request(prompt_len, max_new, now, prefix="s", priority=priority)
    if ttft_s is not None:
        req.slo_class, req.ttft_deadline, req.tpot_s = "c", now + ttft_s, tpot_s
    return req


class TimedExecutor(FakeExecutor):
    """A step lasts a + b * tokens seconds of the simulated clock."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b


def run_step(sched, ex, clock):
    """schedule at clock[0], the step lasts a + b * tokens, update after."""
    out = sched.schedule(now=clock[0])
    seq_ids, toks, lps = ex(out)
    clock[0] += ex.a + ex.b * out.num_tokens if out.seqs else 0.01
    sched.update(out, seq_ids, toks, lps, now=clock[0])
    return out


def test_step_model_recovers_a_linear_cost():
    m = StepModel()
    assert m.predict(10) is None
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 300)
        m.observe(n, 0.02 + 0.0005 * n)
    a, b = m.coefficients()
    assert a == pytest.approx(0.02, rel=1e-6) and b == pytest.approx(0.0005, rel=1e-6)
    assert m.tokens_within(0.07) == pytest.approx(100)


def test_earliest_deadline_first_not_arrival():
    sched = create_scheduler("slo", max_num_seqs=1, max_num_batched_tokens=64)
    loose = classed(8, 2, 0.0, ttft_s=20.0, tpot_s=1.0)
    tight = classed(8, 2, 0.5, ttft_s=1.0, tpot_s=1.0)
    plain = classed(8, 2, 0.1)  # no class: after every classed one
    for r in (plain, loose, tight):
        sched.add(r)
    ex, clock, order = TimedExecutor(0.01, 0.0), [1.0], []
    while sched.has_work():
        out = run_step(sched, ex, clock)
        order += [s.req for s in out.seqs if s.is_new]
    assert order == [tight, loose, plain]
    assert_scheduler_empty(sched)


def test_a_missed_deadline_goes_after_the_ones_still_met():
    sched = create_scheduler("slo", max_num_seqs=1, max_num_batched_tokens=64)
    missed = classed(8, 2, 0.0, ttft_s=0.5, tpot_s=1.0)  # deadline 0.5, long past at t=5
    later = classed(8, 2, 4.0, ttft_s=3.0, tpot_s=1.0)  # deadline 7.0, still reachable
    sched.add(missed)
    sched.add(later)
    ex, clock, order = TimedExecutor(0.01, 0.0), [5.0], []
    while sched.has_work():
        out = run_step(sched, ex, clock)
        order += [s.req for s in out.seqs if s.is_new]
    assert order == [later, missed]  # EDF alone would run `missed` first
    assert_scheduler_empty(sched)


@SETTINGS
@given(
    a=st.floats(0.005, 0.05),
    b=st.floats(1e-5, 1e-3),
    seed=st.integers(0, 2**16),
    max_num_seqs=st.integers(1, 6),
)
def test_reject_only_when_the_deadline_cannot_be_met(a, b, seed, max_num_seqs):
    """With on_miss reject, each iteration ends the waiting requests the
    policy says cannot meet their TTFT (as the engine does). Each of them,
    scheduled alone at that moment, would have missed: its own prefill at
    the true step cost already ends past the deadline. Every request ends,
    and no block is leaked."""
    rng = random.Random(seed)
    sched = create_scheduler("slo", max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    sched.cfg.slo.on_miss = "reject"
    ex, clock = TimedExecutor(a, b), [0.0]
    reqs = []
    for i in range(300):
        if rng.random() < 0.4:
            plen = rng.randint(1, 150)
            r = classed(plen, rng.randint(1, 8), clock[0], ttft_s=rng.uniform(0.01, 1.5), tpot_s=1.0)
            reqs.append(r)
            sched.add(r)
        now = clock[0]
        for r in [w for w in sched.waiting if sched.policy.cannot_meet(w, now)]:
            chunks = math.ceil(r.num_uncomputed / 64)
            alone = chunks * (a + b * min(r.num_uncomputed, 64))
            assert now + alone > r.ttft_deadline - 1e-9 or sched.policy.steps.coefficients() is None
            sched.finish(r, Finish.CANCELLED)
        run_step(sched, ex, clock)
    while sched.has_work():
        run_step(sched, ex, clock)
    assert all(r.status == Status.FINISHED for r in reqs)
    assert_scheduler_empty(sched)


def test_the_batch_keeps_the_tightest_tpot():
    """Steps cost 10 ms + 1 ms a token: a class with a 25 ms TPOT lets at
    most 15 sequences decode together (and a budget of 15 tokens), where
    max_num_seqs would allow 32."""
    sched = create_scheduler("slo", max_num_seqs=32, max_num_batched_tokens=256)
    ex, clock = TimedExecutor(0.010, 0.001), [0.0]
    # Teach the step model first with unclassed requests.
    for i in range(12):
        sched.add(classed(4 + 8 * i, 12, clock[0]))
    while sched.has_work():
        run_step(sched, ex, clock)
    reqs = [classed(4, 40, clock[0], ttft_s=100.0, tpot_s=0.025) for _ in range(32)]
    for r in reqs:
        sched.add(r)
    peak = 0
    while sched.has_work():
        out = run_step(sched, ex, clock)
        peak = max(peak, len(sched.running))
        if not out.num_prompt_tokens:  # a decode step: within the TPOT
            assert out.num_tokens <= 15
    assert peak == 15
    assert_scheduler_empty(sched)


def test_no_block_leaks_with_slo_and_preemption():
    rng = random.Random(3)
    sched = create_scheduler("slo", num_blocks=60, block_size=4, max_num_seqs=6, max_num_batched_tokens=48)
    ex, clock, reqs = TimedExecutor(0.01, 0.0002), [0.0], []
    for i in range(300):
        if rng.random() < 0.5:
            r = classed(rng.randint(1, 40), rng.randint(1, 20), clock[0], ttft_s=rng.uniform(0.05, 2), tpot_s=0.05)
            reqs.append(r)
            sched.add(r)
        live = [r for r in reqs if r.status != Status.FINISHED]
        if live and rng.random() < 0.1:
            sched.finish(rng.choice(live), Finish.CANCELLED)
        run_step(sched, ex, clock)
    while sched.has_work():
        run_step(sched, ex, clock)
    assert_scheduler_empty(sched)
    assert isinstance(sched.policy, SloPolicy)


@pytest.mark.parametrize(
    "scheduler, message",
    [
        ({"policy": "slo"}, "scheduler.policy slo needs scheduler.slo_classes"),
        ({"slo_classes": {"i": {"ttft_ms": 100}}}, "scheduler.slo_classes.i: tpot_ms required"),
        (
            {"slo_classes": {"i": {"ttft_ms": 100, "tpot_ms": 0}}},
            "scheduler.slo_classes.i.tpot_ms: expected a positive",
        ),
        ({"slo_classes": {"i": {"ttft": 1, "tpot_ms": 5}}}, "scheduler.slo_classes.i.ttft: unknown key"),
        ({"slo_classes": {"i": [1, 2]}}, "scheduler.slo_classes.i: expected a mapping"),
        ({"slo_classes": {"a b": {"ttft_ms": 1, "tpot_ms": 1}}}, "'a b' is not a class name"),
        ({"default_slo_class": "batch"}, "scheduler.default_slo_class: 'batch' is not in scheduler.slo_classes"),
        ({"slo": {"on_miss": "drop"}}, "scheduler.slo.on_miss: 'drop' must be 'deprioritize' or 'reject'"),
    ],
)
def test_bad_slo_settings_are_refused_naming_the_key(scheduler, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"scheduler": scheduler})
    assert message in str(err.value)
