"""A RuleBasedStateMachine over the block manager: allocate / append /
preempt (recompute, swap) / swap in / finish / abort / prefix-hit, with the
pool invariants checked after every rule."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from router.block_manager import BlockManager
from tests.router.router_factories import FIRST_TOKEN, assert_blocks_empty, make_request

# A tiny alphabet so that independently drawn prompts share prefixes too.
tokens = st.lists(st.integers(FIRST_TOKEN, FIRST_TOKEN + 2), min_size=1, max_size=14)
salts = st.sampled_from(["", "", "s1"])


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.sampled_from([1, 2, 4]),
        num_swap_blocks=st.integers(0, 6),
        prefix=st.booleans(),
    )
    def setup(self, num_blocks, block_size, num_swap_blocks, prefix):
        self.bm = BlockManager(num_blocks, block_size, num_swap_blocks, enable_prefix_caching=prefix)
        self.running = {}  # request_id -> Request (holds device blocks)
        self.swapped = {}  # request_id -> Request (holds host blocks)
        self.n = 0

    # -- helpers ---------------------------------------------------------------
    def snapshot(self):
        bm = self.bm
        reqs = list(self.running.values()) + list(self.swapped.values())
        return (
            bm.num_free_blocks,
            tuple(bm.ref_count(b) for b in range(bm.num_blocks)),
            tuple((r.request_id, tuple(bm.block_ids(r)), bm.num_swapped_blocks(r)) for r in reqs),
            tuple(tuple(bm.lookup_prefix(r)) for r in reqs),
        )

    def written_blocks_are_private(self, req, start, end):
        bs = self.bm.block_size
        ids = self.bm.block_ids(req)
        for pos in range(start, end):
            assert self.bm.ref_count(ids[pos // bs]) == 1, "a shared block would be written"

    def admit(self, req):
        hits = self.bm.lookup_prefix(req)
        assert len(hits) * self.bm.block_size < req.num_tokens
        before = self.snapshot()
        chunk = req.num_tokens
        if self.bm.allocate(req, chunk, hits) is None:
            assert self.snapshot() == before, "a failed allocation changed the pool"
            assert not self.bm.holds(req)
            return
        assert self.bm.block_ids(req)[: len(hits)] == hits
        start = len(hits) * self.bm.block_size
        self.written_blocks_are_private(req, start, chunk)
        req.num_computed_tokens = chunk
        self.bm.commit_computed(req)
        self.running[req.request_id] = req

    # -- rules -------------------------------------------------------------------
    @rule(prompt=tokens, salt=salts)
    def allocate(self, prompt, salt):
        self.n += 1
        self.admit(make_request(prompt, request_id=f"n{self.n}", cache_salt=salt))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), salt=salts)
    def prefix_hit(self, data, salt):
        src = data.draw(st.sampled_from(sorted(self.running)))
        toks = self.running[src].all_token_ids
        cut = data.draw(st.integers(1, len(toks)))
        suffix = data.draw(st.lists(st.integers(FIRST_TOKEN, FIRST_TOKEN + 2), max_size=5))
        self.n += 1
        self.admit(make_request(toks[:cut] + suffix, request_id=f"p{self.n}", cache_salt=salt))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), grow=st.integers(1, 6))
    def append(self, data, grow):
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        before = self.snapshot()
        old = req.num_tokens
        if self.bm.allocate(req, old + grow) is None:
            assert self.snapshot() == before, "a failed allocation changed the pool"
            return
        assert len(self.bm.block_ids(req)) == self.bm.blocks_needed(old + grow)
        req.output_token_ids.extend([FIRST_TOKEN + 1] * grow)
        self.written_blocks_are_private(req, old, old + grow)
        req.num_computed_tokens = req.num_tokens
        self.bm.commit_computed(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_recompute(self, data):
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.bm.free(req)
        assert not self.bm.holds(req)
        req.num_computed_tokens = 0
        # Requeued: comes back through the prefix cache.
        self.admit(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_swap(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        if not self.bm.can_swap_out(req):
            assert len(self.bm.block_ids(req)) > self.host_free()
            return
        dev = self.bm.block_ids(req)
        pairs = self.bm.swap_out(req)
        assert [d for d, _ in pairs] == dev
        assert len({h for _, h in pairs}) == len(pairs)
        assert self.bm.num_swapped_blocks(req) == len(dev)
        del self.running[rid]
        self.swapped[rid] = req

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        req = self.swapped[rid]
        n = self.bm.num_swapped_blocks(req)
        if not self.bm.can_swap_in(req):
            assert n > self.bm.num_free_blocks
            return
        pairs = self.bm.swap_in(req)
        assert len(pairs) == n and self.bm.block_ids(req) == [d for _, d in pairs]
        assert all(self.bm.ref_count(d) == 1 for _, d in pairs)
        del self.swapped[rid]
        self.running[rid] = req
        self.bm.commit_computed(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.bm.free(req)
        self.bm.free(req)  # idempotent

    @precondition(lambda self: self.running or self.swapped)
    @rule(data=st.data())
    def abort(self, data):
        pool = self.running if not self.swapped or (self.running and data.draw(st.booleans())) else self.swapped
        req = pool.pop(data.draw(st.sampled_from(sorted(pool))))
        self.bm.free(req)

    # -- invariants -------------------------------------------------------------
    def host_free(self):
        return self.bm.num_swap_blocks - sum(self.bm.num_swapped_blocks(r) for r in self.swapped.values())

    @invariant()
    def pool_is_consistent(self):
        bm = self.bm
        bm.check_invariants()
        holders = [0] * bm.num_blocks
        for r in self.running.values():
            assert bm.holds(r)
            ids = bm.block_ids(r)
            assert len(ids) == len(set(ids))
            assert len(ids) >= bm.blocks_needed(r.num_computed_tokens)
            for b in ids:
                holders[b] += 1
        for r in self.swapped.values():
            assert not bm.holds(r)
        # refcount = number of tables holding the block
        assert [bm.ref_count(b) for b in range(bm.num_blocks)] == holders
        used = {b for b in range(bm.num_blocks) if holders[b]}
        # free and used are disjoint and cover all blocks
        assert bm.num_used_blocks == len(used)
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        assert 0.0 <= bm.usage() <= 1.0
        assert self.host_free() >= 0

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for r in list(self.running.values()) + list(self.swapped.values()):
            self.bm.free(r)
        assert_blocks_empty(self.bm)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
