"""The policy interface: ordering and admission only. Budgets, blocks and
preemption mechanics live in the scheduler core and are shared by all."""

from __future__ import annotations

import math
from typing import Any, Protocol

from router.block_manager import BlockManager
from router.config import SchedulerConfig
from router.request import Request


class Queues(Protocol):
    """What a policy may read of the scheduler it serves (Policy.attach):
    its queues and block manager, never to be changed by the policy."""

    running: list[Request]
    waiting: list[Request]
    swapped: list[Request]
    blocks: BlockManager

    def admission_fits(self, req: Request, cached: list[int] | None = None) -> bool:
        """Whether admission could start waiting `req` now, by memory."""
        ...


class Policy:
    """Subclass and override; every method has a continuous-batching default."""

    name = "base"
    # May a waiting request preempt running ones (memory or max_num_seqs)?
    preemptive = False
    # Does running_key order the running requests the same way for as long
    # as they run? Where it does not (fair share: the tenants' counters
    # move), memory preemption could evict two requests in turn, each losing
    # what it had computed, forever; so while the running requests' next
    # blocks do not all fit, the scheduler orders them by seniority instead
    # (band, then arrival: the oldest is never evicted for a younger one).
    stable_running_order = True

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg

    def waiting_key(self, req: Request, now: float) -> Any:
        """Sort key of the waiting queue: smallest is admitted first."""
        return (req.arrival_time, req.seq_id)

    def running_key(self, req: Request) -> Any:
        """Sort key of the running set: smallest gets the token budget first;
        the largest is preempted first when memory runs out."""
        return (req.arrival_time, req.seq_id)

    def admission_limit(self, num_running: int, waiting: list[Request], now: float) -> float:
        """How many waiting requests may start this iteration."""
        return math.inf

    def attach(self, scheduler: Queues) -> None:
        """Called when the policy starts serving `scheduler` (at start and
        after a reload, with requests possibly already queued)."""

    def adopt(self, old: "Policy") -> None:
        """A reload replaces `old` by this policy: carry over what should
        survive it (fair share's counters)."""

    def begin_iteration(self) -> None:
        """Called at the start of every Scheduler.schedule."""

    def on_arrival(self, req: Request) -> None:
        """Called for every request that enters the queue."""

    def on_finished(self, req: Request) -> None:
        """Called once for every request that ends, whatever way."""

    def on_service(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        """Called after each step with the prompt tokens it computed for
        `req` (recomputation included) and the tokens it generated."""

    def on_step(self, tokens: int, seconds: float) -> None:
        """Called after each step: the tokens it computed and its share of
        the wall clock (from its plan, or from the previous result)."""

    def token_budget(self, num_running: int) -> int:
        """The token budget of the next iteration (at least num_running + 1)."""
        return self.cfg.max_num_batched_tokens

    def prefill_reserve(self, req: Request) -> int:
        """Tokens a running request's prefill chunk leaves in this step's
        budget for waiting requests (admitted after the running ones)."""
        return 0

    def on_claimed(self, req: Request) -> None:
        """Called for a waiting request that priority preemption keeps a seat
        for in this iteration (it is admitted after the running requests, and
        on_admitted follows when it starts)."""

    def on_admitted(self, req: Request) -> None:
        """Called for every waiting request that starts running."""

    def on_preempted(self, req: Request) -> None:
        """Called for every running request sent back to the queue."""

    def next_wakeup(self, now: float, waiting: list[Request]) -> float | None:
        """When idle with requests waiting, the time to look again (dynamic
        batching's timer); None = only on new events."""
        return None

    def outranks(self, waiting: Request, running: Request) -> bool:
        """True if `waiting` may preempt `running` (preemptive policies only)."""
        return False
