"""BlockManager: allocation on demand, check-then-act, the one release path,
swap accounting and prefix caching."""

from __future__ import annotations

import pytest

from router.block_manager import BlockManager
from tests.router.router_factories import FIRST_TOKEN, assert_blocks_empty, make_request

BS = 4


def prompt(n: int, base: int = 0) -> list[int]:
    return [FIRST_TOKEN + base + i for i in range(n)]


def snapshot(bm: BlockManager, reqs) -> tuple:
    """Everything a caller can observe about the pool."""
    return (
        bm.num_free_blocks,
        bm.num_used_blocks,
        bm.usage(),
        tuple(bm.ref_count(b) for b in range(bm.num_blocks)),
        tuple(
            (r.request_id, bm.holds(r), tuple(bm.block_ids(r)), bm.num_swapped_blocks(r), bm.can_swap_out(r))
            for r in reqs
        ),
        bm.prefix_queries,
        bm.prefix_hits,
    )


def computed(bm: BlockManager, req, n: int | None = None) -> None:
    """The executor computed the first n (default: all) of req's tokens."""
    req.num_computed_tokens = req.num_tokens if n is None else n
    bm.commit_computed(req)


def test_allocate_on_demand_as_sequence_grows():
    bm = BlockManager(8, BS)
    req = make_request(prompt(5))
    assert bm.blocks_needed(5) == 2
    first = bm.allocate(req, 5)
    assert len(first) == 2 and bm.block_ids(req) == first
    # Growing within the last block allocates nothing.
    assert bm.allocate(req, 8) == []
    # Crossing a block boundary allocates exactly one more.
    third = bm.allocate(req, 9)
    assert len(third) == 1 and bm.block_ids(req) == first + third
    assert bm.num_used_blocks == 3 and bm.usage() == pytest.approx(3 / 8)
    assert all(bm.ref_count(b) == 1 for b in bm.block_ids(req))
    bm.free(req)
    assert_blocks_empty(bm)


def test_failed_allocate_returns_none_and_changes_nothing():
    bm = BlockManager(4, BS, num_swap_blocks=2)
    a, b, c = make_request(prompt(8)), make_request(prompt(4, 100)), make_request(prompt(20, 200))
    bm.allocate(a, 8)
    computed(bm, a)
    bm.allocate(b, 4)
    before = snapshot(bm, [a, b, c])
    # New request too big for the pool.
    assert not bm.can_allocate(c, 20)
    assert bm.allocate(c, 20) is None
    assert snapshot(bm, [a, b, c]) == before
    # Growth of an existing table beyond the pool.
    assert bm.allocate(b, 4 * BS) is None
    assert snapshot(bm, [a, b, c]) == before
    # Fits, but not with the reserve.
    assert bm.can_allocate(c, 4) and not bm.can_allocate(c, 4, reserve=1)
    assert bm.allocate(c, 4, reserve=1) is None
    assert snapshot(bm, [a, b, c]) == before
    bm.check_invariants()
    for r in (a, b, c):
        bm.free(r)
    assert_blocks_empty(bm)


def test_failed_allocate_with_cached_prefix_changes_nothing():
    bm = BlockManager(4, BS)
    a = make_request(prompt(12))
    bm.allocate(a, 12)
    computed(bm, a)
    bm.free(a)  # 3 cached blocks, refcount 0, still in the free pool
    b = make_request(prompt(12) + prompt(9, 500))
    hits = bm.lookup_prefix(b)
    assert len(hits) == 3
    before = snapshot(bm, [a, b])
    # 3 revived + 3 fresh > 4 free.
    assert not bm.can_allocate(b, 21, hits)
    assert bm.allocate(b, 21, hits) is None
    assert snapshot(bm, [a, b]) == before
    assert bm.lookup_prefix(b) == hits  # nothing evicted
    bm.check_invariants()
    bm.free(b)
    assert_blocks_empty(bm)


def test_free_is_idempotent_and_the_only_release_path():
    bm = BlockManager(4, BS, num_swap_blocks=4)
    a = make_request(prompt(6))
    bm.allocate(a, 6)
    bm.free(a)
    bm.free(a)
    assert not bm.holds(a)
    assert_blocks_empty(bm)
    # Free of a swapped-out request returns its host blocks; twice is fine.
    bm.allocate(a, 6)
    bm.swap_out(a)
    assert bm.num_swapped_blocks(a) == 2
    bm.free(a)
    bm.free(a)
    assert bm.num_swapped_blocks(a) == 0
    assert_blocks_empty(bm)
    # A request never seen.
    bm.free(make_request(prompt(3)))
    assert_blocks_empty(bm)


def test_usage():
    bm = BlockManager(10, BS)
    assert bm.usage() == 0.0
    reqs = [make_request(prompt(BS, 100 * i)) for i in range(10)]
    for i, r in enumerate(reqs, 1):
        bm.allocate(r, BS)
        assert bm.usage() == pytest.approx(i / 10)
    assert bm.usage() == 1.0
    assert bm.allocate(make_request(prompt(1, 5000)), 1) is None
    for r in reqs:
        bm.free(r)
    assert_blocks_empty(bm)


def test_swap_round_trip_accounts_host_pool():
    bm = BlockManager(6, BS, num_swap_blocks=3)
    a = make_request(prompt(10))
    dev = bm.allocate(a, 10)
    assert bm.can_swap_out(a)
    out_pairs = bm.swap_out(a)
    assert [d for d, _ in out_pairs] == dev
    hosts = [h for _, h in out_pairs]
    assert len(set(hosts)) == 3 and all(0 <= h < 3 for h in hosts)
    assert not bm.holds(a) and bm.num_swapped_blocks(a) == 3
    assert bm.num_free_blocks == 6
    bm.check_invariants()
    # Host pool now full: nobody else can swap out.
    b = make_request(prompt(1, 100))
    bm.allocate(b, 1)
    assert not bm.can_swap_out(b)
    assert bm.can_swap_in(a) and not bm.can_swap_in(a, reserve=3)
    in_pairs = bm.swap_in(a)
    assert [h for h, _ in in_pairs] == hosts
    assert bm.block_ids(a) == [d for _, d in in_pairs]
    assert bm.num_swapped_blocks(a) == 0
    assert bm.can_swap_out(b)  # host blocks returned
    bm.check_invariants()
    bm.free(a)
    bm.free(b)
    assert_blocks_empty(bm)


def test_can_swap_out_false_when_host_pool_too_small():
    bm = BlockManager(8, BS, num_swap_blocks=2)
    a = make_request(prompt(12))
    bm.allocate(a, 12)
    assert not bm.can_swap_out(a)
    assert not bm.can_swap_out(make_request(prompt(1)))  # holds nothing
    bm.free(a)
    assert_blocks_empty(bm)


def test_prefix_hit_shares_full_blocks_refcounted():
    bm = BlockManager(16, BS)
    a = make_request(prompt(10))
    bm.allocate(a, 10)
    computed(bm, a)
    b = make_request(prompt(10))
    hits = bm.lookup_prefix(b)
    # Two full blocks (tokens 0..7) are shared; the half block is not hashed.
    assert hits == bm.block_ids(a)[:2]
    new = bm.allocate(b, 10, hits)
    assert new[:2] == hits and len(new) == 3
    assert bm.block_ids(b)[:2] == bm.block_ids(a)[:2]
    assert bm.block_ids(b)[2] != bm.block_ids(a)[2]
    assert [bm.ref_count(x) for x in hits] == [2, 2]
    assert bm.prefix_hits == 2 * BS
    bm.free(a)
    assert [bm.ref_count(x) for x in hits] == [1, 1]
    bm.check_invariants()
    bm.free(b)
    assert_blocks_empty(bm)


def test_fully_cached_prompt_leaves_last_block_to_compute():
    bm = BlockManager(16, BS)
    a = make_request(prompt(8))
    bm.allocate(a, 8)
    computed(bm, a)
    b = make_request(prompt(8))
    hits = bm.lookup_prefix(b)
    # Both blocks are cached, but the last one is dropped: b must compute
    # (and write) token 7 itself, never in a shared block.
    assert hits == bm.block_ids(a)[:1]
    new = bm.allocate(b, 8, hits)
    assert bm.block_ids(b)[1] not in bm.block_ids(a)
    assert len(new) == 2
    bm.free(a)
    bm.free(b)
    assert_blocks_empty(bm)


def test_single_block_prompt_fully_cached_gets_no_hit():
    bm = BlockManager(4, BS)
    a = make_request(prompt(4))
    bm.allocate(a, 4)
    computed(bm, a)
    assert bm.lookup_prefix(make_request(prompt(4))) == []
    bm.free(a)
    assert_blocks_empty(bm)


def test_prompts_diverging_mid_block_share_only_full_blocks_before():
    bm = BlockManager(16, BS)
    a = make_request(prompt(12))
    bm.allocate(a, 12)
    computed(bm, a)
    # Same first 6 tokens, then different: block 0 shared, block 1 not.
    b = make_request(prompt(6) + prompt(6, 1000))
    hits = bm.lookup_prefix(b)
    assert hits == bm.block_ids(a)[:1]
    bm.allocate(b, 12, hits)
    assert bm.ref_count(bm.block_ids(a)[0]) == 2
    assert bm.ref_count(bm.block_ids(a)[1]) == 1
    bm.free(a)
    bm.free(b)
    assert_blocks_empty(bm)


def test_cached_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, BS)
    a = make_request(prompt(8))
    bm.allocate(a, 8)
    computed(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4  # refcount 0 blocks count as free
    # Still cached: a new identical request hits.
    assert len(bm.lookup_prefix(make_request(prompt(9)))) == 2
    # Uncached blocks are used before cached ones.
    c = make_request(prompt(8, 500))
    bm.allocate(c, 8)
    assert len(bm.lookup_prefix(make_request(prompt(9)))) == 2
    bm.free(c)
    # c's blocks were never computed: still no eviction of a's blocks.
    bm.free(c)
    d = make_request(prompt(12, 900))
    bm.allocate(d, 12)  # 3 fresh blocks: 2 uncached + 1 evicted cached
    # LRU, tail first: a's last block (tokens 4..7) was evicted, block 0 remains.
    assert len(bm.lookup_prefix(make_request(prompt(9)))) == 1
    bm.allocate(d, 16)
    assert bm.lookup_prefix(make_request(prompt(9))) == []
    bm.free(d)
    assert_blocks_empty(bm)


def test_lru_evicts_least_recently_freed_first():
    bm = BlockManager(4, BS)
    a, b = make_request(prompt(5)), make_request(prompt(5, 100))
    bm.allocate(a, 5)
    bm.allocate(b, 5)
    computed(bm, a)
    computed(bm, b)
    bm.free(a)  # a's block 0 cached first -> older
    bm.free(b)
    c = make_request(prompt(4, 500))
    bm.allocate(c, 4)  # an uncached block: no eviction
    assert len(bm.lookup_prefix(make_request(prompt(5)))) == 1
    assert len(bm.lookup_prefix(make_request(prompt(5, 100)))) == 1
    bm.allocate(c, 8)  # one more uncached
    bm.allocate(c, 12)  # evicts a's cached block (least recently used)
    assert bm.lookup_prefix(make_request(prompt(5))) == []
    assert len(bm.lookup_prefix(make_request(prompt(5, 100)))) == 1
    bm.free(c)
    assert_blocks_empty(bm)


def test_prefix_hit_revives_refcount_zero_block():
    bm = BlockManager(4, BS)
    a = make_request(prompt(9))
    bm.allocate(a, 9)
    computed(bm, a)
    bm.free(a)
    b = make_request(prompt(9))
    hits = bm.lookup_prefix(b)
    assert len(hits) == 2
    bm.allocate(b, 9, hits)
    assert [bm.ref_count(x) for x in hits] == [1, 1]
    assert bm.num_free_blocks == 1
    bm.check_invariants()
    bm.free(b)
    assert_blocks_empty(bm)


def test_different_cache_salt_never_shares():
    bm = BlockManager(16, BS)
    a = make_request(prompt(9), cache_salt="tenant-a")
    bm.allocate(a, 9)
    computed(bm, a)
    assert bm.lookup_prefix(make_request(prompt(9), cache_salt="tenant-b")) == []
    assert bm.lookup_prefix(make_request(prompt(9))) == []
    assert len(bm.lookup_prefix(make_request(prompt(9), cache_salt="tenant-a"))) == 2
    bm.free(a)
    assert_blocks_empty(bm)


def test_commit_computed_registers_only_full_computed_blocks():
    bm = BlockManager(16, BS)
    a = make_request(prompt(11))
    bm.allocate(a, 11)
    probe = make_request(prompt(11))
    computed(bm, a, 3)
    assert bm.lookup_prefix(probe) == []
    computed(bm, a, 4)
    assert len(bm.lookup_prefix(probe)) == 1
    computed(bm, a, 7)
    assert len(bm.lookup_prefix(probe)) == 1
    computed(bm, a, 11)  # block 2 (tokens 8..10) is not full
    assert len(bm.lookup_prefix(probe)) == 2
    # Generated tokens fill block 2: then it is hashed too.
    a.output_token_ids.append(FIRST_TOKEN + 99)
    bm.allocate(a, 12)
    computed(bm, a)
    longer = make_request(prompt(11) + [FIRST_TOKEN + 99, 7])
    assert len(bm.lookup_prefix(longer)) == 3
    bm.free(a)
    assert_blocks_empty(bm)


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_request(prompt(9))
    bm.allocate(a, 9)
    computed(bm, a)
    assert bm.lookup_prefix(make_request(prompt(9))) == []
    bm.free(a)
    assert_blocks_empty(bm)


def test_swap_in_after_cached_eviction_recommits_hashes():
    bm = BlockManager(4, BS, num_swap_blocks=4)
    a = make_request(prompt(8))
    bm.allocate(a, 8)
    computed(bm, a)
    bm.swap_out(a)
    bm.swap_in(a)
    computed(bm, a)
    assert len(bm.lookup_prefix(make_request(prompt(9)))) == 2
    bm.free(a)
    assert_blocks_empty(bm)
