"""Scheduler core: ordering per policy, token budget, chunked prefill,
preemption (recompute, swap, priority), static/dynamic batching, and the
one release path. Every test ends with assert_scheduler_empty()."""

from __future__ import annotations

from router.request import Finish, Status
from router.scheduler import SchedulerOutput
from tests.router.router_factories import (
    EOS,
    FIRST_TOKEN,
    FakeExecutor,
    assert_scheduler_empty,
    create_requests,
    create_scheduler,
    make_request,
    run_to_completion,
    step,
)


def ids(out) -> list[str]:
    return [s.req.request_id for s in out.seqs]


def add_all(sched, reqs):
    for r in reqs:
        sched.add(r)


def test_fcfs_order():
    sched = create_scheduler("fcfs", max_num_seqs=2)
    reqs = create_requests(4, prompt_len=4, max_new_tokens=2)
    add_all(sched, reversed(reqs))  # queue order must not matter, arrival does
    out = step(sched, now=10)
    # r0 and r1 arrived first; two seats.
    assert ids(out) == ["r0", "r1"]
    out = step(sched, now=11)
    # r0, r1 decode their second and last token.
    assert ids(out) == ["r0", "r1"]
    assert reqs[0].status == reqs[1].status == Status.FINISHED
    out = step(sched, now=12)
    assert ids(out) == ["r2", "r3"]
    run_to_completion(sched, reqs)
    assert all(len(r.output_token_ids) == 2 for r in reqs)
    assert_scheduler_empty(sched)


def test_budget_never_exceeded_and_decodes_before_prefill():
    sched = create_scheduler("fcfs", max_num_batched_tokens=10)
    short = create_requests(3, prompt_len=2, max_new_tokens=6)
    add_all(sched, short)
    out = step(sched, now=0)
    assert ids(out) == ["r0", "r1", "r2"] and out.num_tokens == 6
    (long,) = create_requests(1, prompt_len=40, max_new_tokens=1, arrival_start=5, prefix="L")
    sched.add(long)
    for it in range(4):
        out = step(sched, now=10 + it)
        # Decodes of r0..r2 (1 token each) first, then L's chunk with the rest.
        assert ids(out) == ["r0", "r1", "r2", "L0"]
        assert [s.num_tokens for s in out.seqs] == [1, 1, 1, 7]
        assert out.num_tokens == 10
    run_to_completion(sched, short + [long])
    assert_scheduler_empty(sched)


def test_chunked_prefill_spans_iterations_then_decodes():
    sched = create_scheduler("fcfs", max_num_batched_tokens=8)
    (req,) = create_requests(1, prompt_len=20, max_new_tokens=3)
    sched.add(req)
    ex = FakeExecutor()
    chunks = []
    for it in range(5):
        out = step(sched, ex, now=it)
        chunks.append([(s.num_tokens, s.num_prompt_tokens, s.is_new) for s in out.seqs])
    # 8 + 8 + 4 prompt tokens (first token sampled after the third), then decodes.
    assert chunks == [[(8, 8, True)], [(8, 8, False)], [(4, 4, False)], [(1, 0, False)], [(1, 0, False)]]
    assert req.status == Status.FINISHED and len(req.output_token_ids) == 3
    assert ex.produced["r0"] == req.output_token_ids
    assert_scheduler_empty(sched)


def test_chunked_prefill_disabled_waits_for_budget():
    sched = create_scheduler("fcfs", max_num_batched_tokens=8, enable_chunked_prefill=False)
    a, b = create_requests(2, prompt_len=[4, 6], max_new_tokens=3)
    add_all(sched, [a, b])
    out = step(sched, now=0)
    # b's whole prompt (6) does not fit next to a's (4): it waits.
    assert ids(out) == ["r0"]
    out = step(sched, now=1)
    assert ids(out) == ["r0", "r1"] and [s.num_tokens for s in out.seqs] == [1, 6]
    run_to_completion(sched, [a, b])
    assert_scheduler_empty(sched)


def test_long_prefill_token_threshold_caps_a_chunk():
    sched = create_scheduler("fcfs", max_num_batched_tokens=32, long_prefill_token_threshold=5)
    long, short = create_requests(2, prompt_len=[12, 3], max_new_tokens=2)
    add_all(sched, [long, short])
    out = step(sched, now=0)
    # r0 gets at most 5 prompt tokens, leaving room for r1 in the same step.
    assert [(r, s.num_tokens) for r, s in zip(ids(out), out.seqs)] == [("r0", 5), ("r1", 3)]
    out = step(sched, now=1)
    assert [(r, s.num_tokens) for r, s in zip(ids(out), out.seqs)] == [("r0", 5), ("r1", 1)]
    out = step(sched, now=2)
    assert [(r, s.num_tokens) for r, s in zip(ids(out), out.seqs)] == [("r0", 2)]
    run_to_completion(sched, [long, short])
    assert_scheduler_empty(sched)


def test_max_num_seqs_respected():
    sched = create_scheduler("fcfs", max_num_seqs=3, max_num_batched_tokens=100)
    reqs = create_requests(7, prompt_len=2, max_new_tokens=3)
    add_all(sched, reqs)

    def check(s, out):
        assert len(s.running) <= 3 and len(out.seqs) <= 3

    out = step(sched, now=0)
    assert ids(out) == ["r0", "r1", "r2"]
    run_to_completion(sched, reqs, on_step=check)
    assert_scheduler_empty(sched)


def test_sjf_orders_by_hint_else_max_new_tokens():
    sched = create_scheduler("sjf", max_num_seqs=1, sjf_max_wait_s=1000)
    reqs = create_requests(4, prompt_len=3, max_new_tokens=[50, 8, 30, 20], expected_output_tokens=[2, None, None, 5])
    add_all(sched, reqs)
    order = []
    ex = FakeExecutor()
    while sched.has_work():
        out = step(sched, ex, now=10)
        order += [i for i in ids(out) if i not in order]
    # Job sizes: r0 hint 2, r1 8 (max_new_tokens), r2 30, r3 hint 5.
    assert order == ["r0", "r3", "r1", "r2"]
    assert_scheduler_empty(sched)


def test_sjf_aging_lets_an_old_long_job_go_first():
    sched = create_scheduler("sjf", max_num_seqs=1, sjf_max_wait_s=10)
    (old_long,) = create_requests(1, prompt_len=3, max_new_tokens=100, arrival_start=0, prefix="long")
    shorts = create_requests(3, prompt_len=3, max_new_tokens=1, arrival_start=5, prefix="s")
    add_all(sched, [old_long] + shorts)
    # At t=9 the long job has waited 9 s < 10: the shortest go first.
    out = sched.schedule(now=9)
    assert ids(out) == ["s0"]
    sched.update(out, *FakeExecutor()(out), now=9)
    # At t=10 it has waited 10 s: aged, it goes before every younger one.
    out = sched.schedule(now=10)
    assert ids(out) == ["long0"]
    sched.update(out, *FakeExecutor()(out), now=10)
    for r in [old_long] + shorts:
        sched.finish(r, Finish.CANCELLED)
    assert_scheduler_empty(sched)


def test_priority_higher_first_fcfs_within_level():
    sched = create_scheduler("priority", max_num_seqs=1)
    reqs = create_requests(5, prompt_len=2, max_new_tokens=1, priorities=[0, 5, 1, 5, 0])
    add_all(sched, reqs)
    order = []
    while sched.has_work():
        out = step(sched, now=10)
        order += ids(out)
    # priority 5 (r1, r3 by arrival), then 1 (r2), then 0 (r0, r4).
    assert order == ["r1", "r3", "r2", "r0", "r4"]
    assert_scheduler_empty(sched)


def test_priority_preempts_for_a_seat():
    sched = create_scheduler("priority", max_num_seqs=2)
    low = create_requests(2, prompt_len=4, max_new_tokens=10, priorities=[1, 0])
    add_all(sched, low)
    step(sched, now=0)
    step(sched, now=1)
    (high,) = create_requests(1, prompt_len=4, max_new_tokens=2, priorities=[9], arrival_start=5, prefix="h")
    sched.add(high)
    out = step(sched, now=6)
    # r1 (priority 0) is the victim; r0 keeps running; h0 takes the seat.
    assert out.num_preempted == 1 and low[1].seq_id in out.free_seq_ids
    assert sorted(ids(out)) == ["h0", "r0"]
    assert low[1].status == Status.WAITING and low[1].num_computed_tokens == 0
    assert low[1].num_preemptions == 1
    run_to_completion(sched, low + [high], now=7)
    assert [len(r.output_token_ids) for r in low + [high]] == [10, 10, 2]
    assert_scheduler_empty(sched)


def test_priority_preempts_for_memory_lowest_priority_latest_arrival():
    # 6 blocks of 4: three low-priority requests hold 2 blocks each.
    sched = create_scheduler("priority", num_blocks=6, max_num_seqs=8)
    low = create_requests(3, prompt_len=6, max_new_tokens=2, priorities=[0, 0, 1])
    add_all(sched, low)
    step(sched, now=0)
    assert sched.blocks.num_free_blocks == 0
    (high,) = create_requests(1, prompt_len=6, max_new_tokens=2, priorities=[5], arrival_start=5, prefix="h")
    sched.add(high)
    out = step(sched, now=6)
    # Victim: lowest priority (0: r0, r1), latest arrival among them -> r1.
    assert out.num_preempted == 1 and out.free_seq_ids == [low[1].seq_id]
    assert "h0" in ids(out) and "r1" not in ids(out)
    run_to_completion(sched, low + [high], now=7)
    assert all(len(r.output_token_ids) == 2 for r in low + [high])
    assert_scheduler_empty(sched)


def test_priority_does_not_preempt_equal_priority():
    sched = create_scheduler("priority", max_num_seqs=1)
    a, b = create_requests(2, prompt_len=2, max_new_tokens=3, priorities=[3, 3])
    add_all(sched, [a, b])
    for t in range(3):
        out = step(sched, now=t)
        assert ids(out) == ["r0"] and out.num_preempted == 0
    run_to_completion(sched, [a, b])
    assert_scheduler_empty(sched)


def memory_pressure_scheduler(mode: str, policy: str = "fcfs"):
    # 4 blocks of 4 tokens; three 4-token prompts fill three blocks and each
    # needs a second block for its second token.
    return create_scheduler(policy, num_blocks=4, num_swap_blocks=8, preemption_mode=mode)


def test_fcfs_memory_preemption_recompute_picks_latest_arrival():
    # 7 blocks of 4: three 8-token prompts hold 2 blocks each; each needs a
    # third block for its second token.
    sched = create_scheduler("fcfs", num_blocks=7)
    reqs = create_requests(3, prompt_len=8, max_new_tokens=2)
    add_all(sched, reqs)
    step(sched, now=0)
    assert [len(r.output_token_ids) for r in reqs] == [1, 1, 1]
    r2 = reqs[2]
    out = step(sched, now=1)
    # r0 grows into the last free block, r1 needs one: the latest arrival (r2) goes.
    assert ids(out) == ["r0", "r1"]
    assert out.num_preempted == 1 and out.free_seq_ids == [r2.seq_id]
    assert r2.status == Status.WAITING and not sched.blocks.holds(r2)
    assert r2.num_computed_tokens == 0 and r2.num_tokens == 9  # prompt + generated
    assert reqs[0].status == reqs[1].status == Status.FINISHED
    out = sched.schedule(now=2)
    # r2 re-admitted as a new sequence. r1 took r2's tail block (evicted
    # first); its first block is still cached: a prefix-cache hit.
    assert ids(out) == ["r2"] and out.seqs[0].is_new
    assert r2.num_computed_tokens == 4
    assert out.seqs[0].num_tokens == 5 and out.seqs[0].num_prompt_tokens == 4
    sched.update(out, *FakeExecutor()(out), now=2)
    run_to_completion(sched, reqs, now=3)
    assert r2.output_token_ids == create_and_run_alone(r2)
    assert_scheduler_empty(sched)


def create_and_run_alone(req) -> list[int]:
    """The tokens req gets with a huge pool and nobody else."""
    sched = create_scheduler()
    clone = make_request(req.prompt_token_ids, req.stopping.max_new_tokens)
    ex = run_to_completion(sched, [clone])
    return ex.produced[clone.request_id]


def test_recompute_without_prefix_cache_restarts_from_zero():
    sched = create_scheduler("fcfs", num_blocks=4, enable_prefix_caching=False)
    reqs = create_requests(3, prompt_len=4, max_new_tokens=3)
    add_all(sched, reqs)
    step(sched, now=0)
    step(sched, now=1)
    step(sched, now=2)
    out = step(sched, now=3)
    # prompt (4) + 1 generated token recomputed from zero.
    assert ids(out) == ["r2"] and out.seqs[0].num_tokens == 5 and out.seqs[0].num_prompt_tokens == 4
    run_to_completion(sched, reqs, now=4)
    assert reqs[2].output_token_ids == create_and_run_alone(reqs[2])
    assert_scheduler_empty(sched)


def test_swap_preemption_swaps_out_then_in():
    sched = memory_pressure_scheduler("swap")
    reqs = create_requests(3, prompt_len=4, max_new_tokens=3)
    add_all(sched, reqs)
    step(sched, now=0)
    r2 = reqs[2]
    r2_blocks = sched.blocks.block_ids(r2)
    out = step(sched, now=1)
    assert ids(out) == ["r0", "r1"] and out.num_preempted == 1
    assert out.free_seq_ids == []  # the executor keeps r2's state
    assert [d for d, _ in out.swap_out] == r2_blocks
    hosts = [h for _, h in out.swap_out]
    assert r2.status == Status.SWAPPED and sched.swapped == [r2]
    step(sched, now=2)  # r0, r1 finish
    out = step(sched, now=3)
    assert ids(out) == ["r2"]
    (item,) = out.seqs
    assert item.replace_block_table and not item.is_new
    # The host blocks it was swapped out to come back in, in order.
    assert [h for h, _ in out.swap_in] == hosts
    assert item.new_block_ids[: len(out.swap_in)] == [d for _, d in out.swap_in]
    assert len(item.new_block_ids) == 2  # swapped block + one for the new token
    assert item.num_tokens == 1
    run_to_completion(sched, reqs, now=4)
    assert r2.output_token_ids == create_and_run_alone(r2)
    assert_scheduler_empty(sched)


def test_swap_falls_back_to_recompute_when_host_pool_full():
    sched = create_scheduler("fcfs", num_blocks=4, num_swap_blocks=0, preemption_mode="swap")
    reqs = create_requests(3, prompt_len=4, max_new_tokens=3)
    add_all(sched, reqs)
    step(sched, now=0)
    out = step(sched, now=1)
    assert out.num_preempted == 1 and not out.swap_out
    assert out.free_seq_ids == [reqs[2].seq_id] and reqs[2].status == Status.WAITING
    run_to_completion(sched, reqs, now=2)
    assert_scheduler_empty(sched)


def test_static_batches_admit_only_when_idle():
    sched = create_scheduler("static", static_batch_size=2)
    reqs = create_requests(3, prompt_len=2, max_new_tokens=[1, 3, 1])
    add_all(sched, reqs)
    out = step(sched, now=0)
    assert ids(out) == ["r0", "r1"]  # batch of 2
    # r0 finished, r1 still runs: r2 must wait for the whole batch.
    out = step(sched, now=1)
    assert ids(out) == ["r1"]
    out = step(sched, now=2)
    assert ids(out) == ["r1"]
    out = step(sched, now=3)
    assert ids(out) == ["r2"]
    run_to_completion(sched, reqs, now=4)
    assert_scheduler_empty(sched)


def test_static_batch_survives_swap_preemption_without_admitting_others():
    sched = create_scheduler("static", static_batch_size=3, num_blocks=4, num_swap_blocks=8, preemption_mode="swap")
    batch = create_requests(3, prompt_len=4, max_new_tokens=4)
    (late,) = create_requests(1, prompt_len=1, max_new_tokens=1, arrival_start=10, prefix="late")
    add_all(sched, batch + [late])

    def check(s, out):
        if any(item.req is late for item in out.seqs):
            assert not any(item.req in batch for item in out.seqs) and not s.swapped, (
                "a request joined a static batch that had not finished"
            )

    run_to_completion(sched, batch + [late], now=11, on_step=check)
    assert_scheduler_empty(sched)


def test_dynamic_waits_until_full_or_timeout():
    sched = create_scheduler("dynamic", static_batch_size=3, dynamic_max_wait_ms=50)
    a, b = create_requests(2, prompt_len=2, max_new_tokens=1, arrival_start=1.0, arrival_step=0.01)
    add_all(sched, [a, b])
    # Not full and the oldest waited 10 ms: nothing starts.
    assert sched.schedule(now=1.01).is_empty()
    assert sched.policy.next_wakeup(1.01, sched.waiting) == 1.0 + 0.05
    # Oldest has waited 50 ms: the batch starts with what it has.
    out = step(sched, now=1.05)
    assert ids(out) == ["r0", "r1"]
    assert sched.policy.next_wakeup(1.05, sched.waiting) is None
    # A full batch starts at once.
    reqs = create_requests(3, prompt_len=2, max_new_tokens=1, arrival_start=2.0, arrival_step=0.0, prefix="f")
    add_all(sched, reqs)
    out = step(sched, now=2.0)
    assert ids(out) == ["f0", "f1", "f2"]
    assert_scheduler_empty(sched)


def test_finish_from_any_state_frees_blocks():
    sched = create_scheduler("fcfs", num_blocks=4, num_swap_blocks=8, preemption_mode="swap", max_num_batched_tokens=12)
    reqs = create_requests(3, prompt_len=4, max_new_tokens=5)
    (waiting,) = create_requests(1, prompt_len=4, arrival_start=100, prefix="w")
    (prefilling,) = create_requests(1, prompt_len=30, arrival_start=101, prefix="p")
    add_all(sched, reqs)
    step(sched, now=0)
    step(sched, now=1)
    assert reqs[2].status == Status.SWAPPED
    sched.add(waiting)
    # swapped, running, waiting: all released by finish.
    sched.finish(reqs[2], Finish.CANCELLED)
    assert sched.blocks.num_swapped_blocks(reqs[2]) == 0
    sched.finish(waiting, Finish.CANCELLED)
    sched.finish(reqs[0], Finish.CANCELLED)
    sched.finish(reqs[0], Finish.CANCELLED)  # twice: no-op
    out = sched.schedule(now=2)
    assert reqs[0].seq_id in out.free_seq_ids and reqs[2].seq_id in out.free_seq_ids
    sched.update(out, *FakeExecutor()(out), now=2)
    sched.finish(reqs[1], Finish.CANCELLED)
    # Mid-prefill, and aborted between schedule and update.
    sched.add(prefilling)
    out = sched.schedule(now=3)
    assert ids(out) == ["p0"] and sched.blocks.holds(prefilling)
    sched.finish(prefilling, Finish.CANCELLED)
    sched.update(out, *FakeExecutor()(out), now=3)
    assert prefilling.status == Status.FINISHED and not sched.blocks.holds(prefilling)
    assert all(r.finish == Finish.CANCELLED for r in reqs + [waiting, prefilling])
    assert_scheduler_empty(sched)


def test_max_new_tokens_and_eos_finish_in_update():
    sched = create_scheduler("fcfs")
    a, b, c = create_requests(3, prompt_len=3, max_new_tokens=5)
    (d,) = create_requests(1, prompt_len=3, max_new_tokens=5, ignore_eos=True, prefix="d")
    ex = FakeExecutor(eos_at={"r1": 2, "d0": 1})
    run_to_completion(sched, [a, b, c, d], ex)
    assert a.finish == Finish.LENGTH and len(a.output_token_ids) == 5
    assert b.finish == Finish.EOS and b.output_token_ids[-1] == EOS and len(b.output_token_ids) == 3
    assert d.finish == Finish.LENGTH and len(d.output_token_ids) == 5 and d.output_token_ids[1] == EOS
    assert_scheduler_empty(sched)


def test_prefix_hit_on_admission_shares_blocks():
    sched = create_scheduler("fcfs")
    a, b = create_requests(2, prompt_len=10, max_new_tokens=4, same_prompt=True)
    sched.add(a)
    step(sched, now=0)
    sched.add(b)
    out = step(sched, now=1)
    # b reuses a's two full prompt blocks and computes the remaining 2 tokens.
    item = [s for s in out.seqs if s.req is b][0]
    assert item.num_tokens == 2 and b.num_cached_prompt_tokens == 8
    assert sched.blocks.block_ids(b)[:2] == sched.blocks.block_ids(a)[:2]
    run_to_completion(sched, [a, b], now=2)
    assert a.output_token_ids == b.output_token_ids
    assert_scheduler_empty(sched)


def test_reset_releases_everything():
    sched = create_scheduler("fcfs", num_blocks=4, num_swap_blocks=8, preemption_mode="swap")
    reqs = create_requests(4, prompt_len=4, max_new_tokens=5)
    add_all(sched, reqs)
    step(sched, now=0)
    step(sched, now=1)
    released = sched.reset()
    assert sorted(r.request_id for r in released) == ["r0", "r1", "r2", "r3"]
    assert all(r.status == Status.FINISHED for r in reqs)
    assert_scheduler_empty(sched)


def test_sjf_short_prefill_does_not_starve_a_long_decode():
    sched = create_scheduler("sjf", max_num_batched_tokens=4, max_num_seqs=2, sjf_max_wait_s=1000)
    (d,) = create_requests(1, prompt_len=2, max_new_tokens=50, prefix="D")
    sched.add(d)
    step(sched, now=0)
    (p,) = create_requests(1, prompt_len=20, max_new_tokens=1, arrival_start=1, prefix="P")
    sched.add(p)
    for t in range(4):
        out = step(sched, now=1 + t)
        # P is the shorter job and is ranked first, but D's decode token is
        # reserved out of the budget before P's chunk.
        assert sorted(ids(out)) == ["D0", "P0"]
        assert {s.req.request_id: s.num_tokens for s in out.seqs}["D0"] == 1
    sched.finish(d, Finish.CANCELLED)
    run_to_completion(sched, [p], now=10)
    assert_scheduler_empty(sched)


def test_priority_prefill_leaves_budget_for_low_priority_decodes():
    sched = create_scheduler("priority", max_num_batched_tokens=4, max_num_seqs=4)
    low = create_requests(2, prompt_len=1, max_new_tokens=8, priorities=[0, 0])
    add_all(sched, low)
    step(sched, now=0)
    (high,) = create_requests(1, prompt_len=12, max_new_tokens=1, priorities=[5], arrival_start=1, prefix="h")
    sched.add(high)
    for t in range(3):
        out = step(sched, now=1 + t)
        # Decodes r0, r1 (1 token each) are served; h0, admitted after them and
        # then ranked first, still gets only the other 2 tokens.
        assert sorted((i, s.num_tokens) for i, s in zip(ids(out), out.seqs)) == [("h0", 2), ("r0", 1), ("r1", 1)]
    run_to_completion(sched, low + [high], now=2)
    assert_scheduler_empty(sched)


def test_priority_preempts_for_a_seat_in_swap_mode():
    sched = create_scheduler("priority", max_num_seqs=2, num_swap_blocks=16, preemption_mode="swap")
    low = create_requests(2, prompt_len=4, max_new_tokens=10, priorities=[1, 0])
    add_all(sched, low)
    step(sched, now=0)
    (high,) = create_requests(1, prompt_len=4, max_new_tokens=3, priorities=[9], arrival_start=5, prefix="h")
    sched.add(high)
    out = step(sched, now=6)
    # r1 is swapped out and must not be swapped straight back into the seat.
    assert out.num_preempted == 1 and len(out.swap_out) == 1 and not out.swap_in
    assert sorted(ids(out)) == ["h0", "r0"] and low[1].status == Status.SWAPPED
    step(sched, now=7)
    out = step(sched, now=8)
    assert high.status == Status.FINISHED
    run_to_completion(sched, low + [high], now=9)
    assert low[1].output_token_ids == create_and_run_alone(low[1])
    assert_scheduler_empty(sched)


def test_priority_preempts_for_memory_in_swap_mode():
    # 4 blocks: four low-priority 4-token prompts fill the pool.
    sched = create_scheduler("priority", num_blocks=4, num_swap_blocks=16, preemption_mode="swap", max_num_seqs=8)
    low = create_requests(4, prompt_len=4, max_new_tokens=6)
    add_all(sched, low)
    step(sched, now=0)
    (high,) = create_requests(1, prompt_len=4, max_new_tokens=2, priorities=[9], arrival_start=5, prefix="h")
    sched.add(high)
    admitted_at = None
    for t in range(6):
        out = step(sched, now=6 + t)
        if "h0" in ids(out) and admitted_at is None:
            admitted_at = t
    # The high-priority request is served within a couple of iterations, not
    # after every low-priority one has finished.
    assert admitted_at is not None and admitted_at <= 2
    assert high.status == Status.FINISHED
    run_to_completion(sched, low + [high], now=20)
    assert all(len(r.output_token_ids) == 6 for r in low)
    assert_scheduler_empty(sched)


def test_schedule_ahead_plans_the_next_decode_while_one_is_in_flight():
    sched = create_scheduler("fcfs", block_size=4)
    reqs = create_requests(3, prompt_len=3, max_new_tokens=[6, 6, 2])
    add_all(sched, reqs)
    step(sched)  # prefill: every request samples its first token
    r0, r1, r2 = reqs
    inflight = sched.schedule()  # decode of all three, result not back yet
    assert sched.schedule_ahead(SchedulerOutput()) is None  # not a pure decode of every running request
    ahead = sched.schedule_ahead(inflight)
    # r2 reaches max_new_tokens=2 with the in-flight token: not planned again.
    assert [item.req for item in ahead.seqs] == [r0, r1]
    assert all(item.num_tokens == 1 and not item.is_new and not item.num_prompt_tokens for item in ahead.seqs)
    # 3 prompt + 1 output computed by `inflight` = 4 tokens = one full block;
    # the token computed ahead needs a second block.
    assert [len(item.new_block_ids) for item in ahead.seqs] == [1, 1]
    # r1 samples EOS in the in-flight step: its token from `ahead` is ignored
    # and its blocks are released once.
    sched.update(inflight, [r.seq_id for r in reqs], [FIRST_TOKEN, EOS, FIRST_TOKEN + 1], [])
    assert r1.finish == Finish.EOS and r2.finish == Finish.LENGTH
    sched.update(ahead, [r0.seq_id, r1.seq_id], [FIRST_TOKEN + 2, FIRST_TOKEN + 3], [])
    assert r1.output_token_ids[-1] == EOS and len(r1.output_token_ids) == 2
    assert len(r0.output_token_ids) == 3 and r0.num_computed_tokens == 5
    sched.blocks.check_invariants()
    run_to_completion(sched, [])
    assert r0.finish == Finish.LENGTH and len(r0.output_token_ids) == 6
    assert_scheduler_empty(sched)


def test_schedule_ahead_declines_outside_steady_decode():
    sched = create_scheduler("fcfs", block_size=4)
    a, b = create_requests(2, prompt_len=3, max_new_tokens=8)
    add_all(sched, [a])
    first = sched.schedule()
    assert sched.schedule_ahead(first) is None  # a prefill (new sequence) is in flight
    sched.update(first, [a.seq_id], [FIRST_TOKEN], [])
    sched.add(b)
    second = sched.schedule()
    assert sched.schedule_ahead(second) is None  # b was admitted: prefill in flight
    sched.update(second, *FakeExecutor()(second))
    run_to_completion(sched, [])
    assert_scheduler_empty(sched)
    tiny = create_scheduler("fcfs", block_size=4, num_blocks=2)
    (c,) = create_requests(1, prompt_len=3, max_new_tokens=20, prefix="c")
    add_all(tiny, [c])
    step(tiny)
    prev = tiny.schedule()
    while True:  # keep one plan ahead until the next token would need a third block
        nxt = tiny.schedule_ahead(prev)
        tiny.update(prev, [c.seq_id], [FIRST_TOKEN], [])
        tiny.blocks.check_invariants()
        if nxt is None:
            break
        prev = nxt
    assert c.num_computed_tokens == 8 and c.status == Status.RUNNING  # the normal schedule() decides next
    tiny.finish(c, Finish.CANCELLED)
    assert_scheduler_empty(tiny)
