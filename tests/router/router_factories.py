"""Factories and checks shared by the scheduler and block-manager tests
(in the style of vLLM's tests/v1/core: create_scheduler, create_requests,
assert_scheduler_empty)."""

from __future__ import annotations

import hashlib
import itertools
import struct
from dataclasses import dataclass

from router.block_manager import BlockManager
from router.config import SchedulerConfig
from router.policies import make_policy
from router.request import Request, Sampling, Status, Stopping
from router.scheduler import Scheduler, SchedulerOutput

EOS = 2
# Tokens the fake executor produces are >= FIRST_TOKEN, so never EOS.
FIRST_TOKEN = 3
HUGE_CONTEXT = 1 << 20

_ids = itertools.count()


def make_request(
    prompt: list[int],
    max_new_tokens: int = 4,
    *,
    request_id: str | None = None,
    arrival_time: float = 0.0,
    priority: int = 0,
    expected_output_tokens: int | None = None,
    cache_salt: str = "",
    ignore_eos: bool = False,
) -> Request:
    return Request(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling=Sampling(),
        stopping=Stopping(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos),
        priority=priority,
        expected_output_tokens=expected_output_tokens,
        cache_salt=cache_salt,
        arrival_time=arrival_time,
    )


_distinct = itertools.count()


def distinct_request(prompt_len: int, max_new_tokens: int, now: float, *, prefix: str, priority: int = 0) -> Request:
    """A request `<prefix><n>` arriving at `now` whose prompt shares no block
    with the last 500 made here (no prefix-cache hits between them)."""
    i = next(_distinct)
    return make_request(
        [10 + 1000 * (i % 500) + j for j in range(prompt_len)],
        max_new_tokens,
        request_id=f"{prefix}{i}",
        arrival_time=now,
        priority=priority,
    )


def create_requests(
    num: int,
    prompt_len: int | list[int] = 4,
    max_new_tokens: int | list[int] = 4,
    *,
    priorities: list[int] | None = None,
    expected_output_tokens: list[int | None] | None = None,
    arrival_start: float = 0.0,
    arrival_step: float = 1.0,
    same_prompt: bool = False,
    cache_salt: str = "",
    ignore_eos: bool = False,
    prefix: str = "r",
) -> list[Request]:
    """num requests named r0, r1, ... arriving arrival_step apart. Prompts are
    distinct (no accidental prefix sharing) unless same_prompt."""
    reqs = []
    for i in range(num):
        plen = prompt_len[i] if isinstance(prompt_len, list) else prompt_len
        mnt = max_new_tokens[i] if isinstance(max_new_tokens, list) else max_new_tokens
        base = 0 if same_prompt else (i + 1) * 10_000
        prompt = [FIRST_TOKEN + base + j for j in range(plen)]
        reqs.append(
            make_request(
                prompt,
                mnt,
                request_id=f"{prefix}{i}",
                arrival_time=arrival_start + i * arrival_step,
                priority=priorities[i] if priorities else 0,
                expected_output_tokens=expected_output_tokens[i] if expected_output_tokens else None,
                cache_salt=cache_salt,
                ignore_eos=ignore_eos,
            )
        )
    return reqs


def create_scheduler(
    policy: str = "fcfs",
    *,
    num_blocks: int = 1000,
    block_size: int = 4,
    num_swap_blocks: int = 0,
    enable_prefix_caching: bool = True,
    watermark: float = 0.0,
    max_context: int = HUGE_CONTEXT,
    **sched_kwargs,
) -> Scheduler:
    sched_kwargs.setdefault("max_num_seqs", 16)
    sched_kwargs.setdefault("max_num_batched_tokens", 64)
    cfg = SchedulerConfig(policy=policy, **sched_kwargs)
    blocks = BlockManager(num_blocks, block_size, num_swap_blocks, enable_prefix_caching, watermark)
    return Scheduler(cfg, blocks, make_policy(cfg), [EOS], max_context)


def token_for(req: Request, position: int) -> int:
    """The fake model: a pure function of (prompt, position), so a recomputed
    sequence samples the same tokens again."""
    h = hashlib.blake2b(
        struct.pack(f"<{len(req.prompt_token_ids)}i", *req.prompt_token_ids) + struct.pack("<i", position),
        digest_size=4,
    ).digest()
    return FIRST_TOKEN + int.from_bytes(h, "little") % 30_000


@dataclass
class FakeExecutor:
    """Samples one token for every scheduled sequence that reaches the end of
    its known tokens; records what it produced per request id."""

    eos_at: dict[str, int] | None = None  # request_id -> output index that samples EOS

    def __post_init__(self) -> None:
        self.produced: dict[str, list[int]] = {}

    def __call__(self, out: SchedulerOutput) -> tuple[list[int], list[int], list[float]]:
        seq_ids, toks, lps = [], [], []
        for item in out.seqs:
            req = item.req
            if req.num_computed_tokens + item.num_tokens != req.num_tokens:
                continue
            position = req.num_tokens  # index of the token being sampled
            tok = token_for(req, position)
            if self.eos_at and self.eos_at.get(req.request_id) == len(req.output_token_ids):
                tok = EOS
            seq_ids.append(req.seq_id)
            toks.append(tok)
            lps.append(-0.5)
            self.produced.setdefault(req.request_id, []).append(tok)
        return seq_ids, toks, lps


def step(sched: Scheduler, execute: FakeExecutor | None = None, now: float | None = None) -> SchedulerOutput:
    """One engine iteration: schedule, execute, update."""
    execute = execute or FakeExecutor()
    out = sched.schedule(now=now)
    assert out.num_tokens <= sched.cfg.max_num_batched_tokens
    assert len(out.seqs) <= sched.cfg.max_num_seqs
    seq_ids, toks, lps = execute(out)
    sched.update(out, seq_ids, toks, lps, now=now)
    sched.blocks.check_invariants()
    return out


def run_to_completion(
    sched: Scheduler,
    reqs: list[Request],
    execute: FakeExecutor | None = None,
    max_iters: int = 10_000,
    now: float = 0.0,
    dt: float = 0.01,
    on_step=None,
) -> FakeExecutor:
    """Drives schedule/update until every request finished; fails on livelock.
    The clock starts at `now` and advances `dt` per iteration."""
    execute = execute or FakeExecutor()
    for r in reqs:
        if r.status != Status.FINISHED and r.seq_id not in sched.by_seq:
            sched.add(r)
    for _ in range(max_iters):
        if not sched.has_work():
            break
        out = step(sched, execute, now)
        now += dt
        if on_step is not None:
            on_step(sched, out)
    else:
        raise AssertionError(
            f"livelock: {max_iters} iterations, waiting={[r.request_id for r in sched.waiting]} "
            f"running={[r.request_id for r in sched.running]} swapped={[r.request_id for r in sched.swapped]}"
        )
    return execute


def assert_host_pool_full(bm: BlockManager) -> None:
    if bm.num_swap_blocks == 0:
        return
    # Probe: a request of exactly num_swap_blocks blocks can be swapped out.
    probe = make_request([FIRST_TOKEN] * bm.block_size, request_id="__probe__")
    if bm.num_free_blocks < bm.num_swap_blocks or bm.num_blocks < bm.num_swap_blocks:
        return
    assert bm.allocate(probe, bm.num_swap_blocks * bm.block_size) is not None
    assert bm.can_swap_out(probe), "host pool is not full"
    bm.free(probe)


def assert_blocks_empty(bm: BlockManager) -> None:
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.num_used_blocks == 0
    assert bm.usage() == 0.0
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    assert_host_pool_full(bm)
    bm.check_invariants()


def assert_scheduler_empty(sched: Scheduler) -> None:
    """No requests left, every block free, every refcount zero, host pool
    full; the next plan only frees executor state."""
    assert not sched.waiting and not sched.running and not sched.swapped
    assert not sched.by_seq
    out = sched.schedule(now=1e9)
    assert not out.seqs and not out.swap_in and not out.swap_out
    assert not sched.has_work()
    assert sched.schedule(now=1e9).is_empty()
    assert_blocks_empty(sched.blocks)
