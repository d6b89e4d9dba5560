"""The scheduler with LoRA slots (router/lora.py): never more adapters in a
step than slots, a slot never reassigned while a sequence pins it, every
request served (none starves behind busy adapters), and nothing held once
all ended, under recompute and swap preemption alike."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.lora import LoraAdapter, LoraSlots
from router.request import Status
from tests.router.router_factories import create_requests, create_scheduler, run_to_completion


def _with_slots(max_loras: int, **kw):
    sched = create_scheduler(**kw)
    sched.lora_slots = LoraSlots(max_loras)
    return sched


def _checker(max_loras: int):
    """An on_step check of the executor's view: the plan's slot loads in
    order, each sequence's slot holding its adapter when it runs."""
    slots: dict[int, str] = {}
    holder: dict[int, int] = {}  # seq_id -> the slot the executor holds it with

    def check(sched, out) -> None:
        for seq_id in out.free_seq_ids:
            holder.pop(seq_id, None)
        for slot, name, _ in out.lora_slots:
            assert 1 <= slot <= max_loras
            assert slot not in holder.values(), f"slot {slot} reassigned while a sequence holds it"
            slots[slot] = name
        used = set()
        for item in out.seqs:
            req = item.req
            if item.is_new:
                holder[req.seq_id] = item.lora_slot
            if req.lora is None:
                assert item.lora_slot == 0
                continue
            assert slots.get(holder[req.seq_id]) == req.lora.name
            used.add(req.lora.name)
        assert len(used) <= max_loras

    return check, holder


@settings(max_examples=60, deadline=None)
@given(
    choices=st.lists(st.integers(0, 6), min_size=1, max_size=24),
    max_loras=st.integers(1, 3),
    num_blocks=st.integers(24, 200),
    swap=st.booleans(),
)
def test_slots_bound_the_adapters_of_a_step_and_every_request_ends(choices, max_loras, num_blocks, swap):
    adapters = [LoraAdapter(f"a{i}", f"/p/a{i}") for i in range(6)]
    sched = _with_slots(
        max_loras,
        num_blocks=num_blocks,
        num_swap_blocks=64 if swap else 0,
        preemption_mode="swap" if swap else "recompute",
        max_num_seqs=6,
        max_num_batched_tokens=32,
    )
    reqs = create_requests(len(choices), prompt_len=[5 + (i * 7) % 13 for i in range(len(choices))], max_new_tokens=6)
    for req, c in zip(reqs, choices):
        req.lora = adapters[c - 1] if c else None
    check, _ = _checker(max_loras)
    produced = run_to_completion(sched, reqs, on_step=check)
    assert all(r.status == Status.FINISHED for r in reqs)
    assert all(len(produced.produced[r.request_id]) >= 6 for r in reqs)
    assert not sched.lora_slots.users and all(r.lora_slot == 0 for r in reqs)
    assert sched.blocks.num_free_blocks == num_blocks


def test_a_request_refused_a_slot_is_served_before_later_adapter_requests():
    """One slot, adapter a busy: a request for b waits; a later request for
    a (whose slot is resident) must not overtake it, or b could starve."""
    a, b = LoraAdapter("a", "/a"), LoraAdapter("b", "/b")
    sched = _with_slots(1, max_num_seqs=4)
    first, for_b, late_a, base = create_requests(4, prompt_len=4, max_new_tokens=3)
    first.lora, for_b.lora, late_a.lora = a, b, a
    sched.add(first)
    out = sched.schedule(now=0.0)
    assert out.lora_slots == [(1, "a", "/a")] and first.lora_slot == 1
    sched.update(out, [first.seq_id], [7], [0.0], now=0.0)
    for r in (for_b, late_a, base):
        sched.add(r)
    out = sched.schedule(now=0.1)
    admitted = {item.req.request_id for item in out.seqs if item.is_new}
    assert admitted == {base.request_id}, "only the base request goes on"
    run_to_completion(sched, [first, for_b, late_a, base])
    assert for_b.first_scheduled_time < late_a.first_scheduled_time


def test_lru_eviction_takes_an_unpinned_slot_and_clears_unloaded_ones():
    slots = LoraSlots(2)
    a, b, c = (LoraAdapter(n, f"/{n}") for n in "abc")
    assert slots.acquire(a) == 1 and slots.acquire(b) == 2
    assert slots.acquire(c) is None and not slots.can_acquire("c")
    slots.release("a")
    assert slots.can_acquire("c") and slots.acquire(c) == 1  # a's slot: a pins nothing
    assert slots.take_pending() == [(1, "a", "/a"), (2, "b", "/b"), (1, "c", "/c")]
    slots.release("b")
    slots.evict("b")
    assert slots.take_pending() == [(2, "", "")] and slots.resident == ["c"]
