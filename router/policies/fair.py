"""Per-tenant fair share: the Virtual Token Counter (Sheng et al., "Fairness
in Serving Large Language Models", OSDI 2024), with priority bands and
preemption.

Every tenant has a counter, charged as service is delivered: prompt tokens
computed times `fair.prompt_weight` plus output tokens generated times
`fair.output_weight`, divided by the tenant's weight (`fair.weights`, 1 if
not named). The rules:

- Order: requests' `priority` stays strict (bands); within a band, the
  oldest waiting request of the backlogged tenant with the smallest counter
  goes first (ties: the tenant with fewer running requests, then age);
  within a tenant, requests of an SLO class by TTFT deadline first (fair
  across tenants, deadlines within one). The token budget goes first to the
  least-served tenants' running requests.
- Lift: a tenant that becomes backlogged (had no request waiting, swapped or
  running) has its counter raised to at least the smallest counter among
  the backlogged tenants, or to the virtual time when none is: idle time
  earns no credit.
- Virtual time: the smallest backlogged counter, never lowered; counters
  only grow, so it is monotone.
- Preemption (`fair.preempt`, default on): when the batch is full (seats or
  KV blocks), a waiting request of tenant X takes the place of the newest
  running request of the most over-served tenant Y (recompute or swap, as
  `preemption_mode` says) when X's counter is at most Y's and, after the
  move, Y still holds at least X's weighted share of the running seats:
  (seats(Y) - 1) / w(Y) >= (seats(X) + 1) / w(X). That hysteresis rules out
  ping-pong: the move back would need the opposite inequality.
- Short steps (`fair.max_step_ratio`, default 1.5): a tenant that becomes
  backlogged is admitted at the next step, so it waits for the step in
  flight; a step that computes a long prefill beside the decodes can last
  several decode steps. While requests decode and compete for the seats
  (running + waiting >= max_num_seqs), the token budget is cut so a step's
  predicted time (a + b * tokens, fitted to the observed steps) stays
  within the ratio times a decode-only step of the running batch: prefill
  goes in chunks that ride along with the decodes, at the cost of more steps
  to a long prompt's first token. A tenant holding fewer weighted seats than
  another has its prompt computed whole (the budget grows to fit it, and
  other tenants' chunks leave it room): its first token is what the short
  steps are for.
- Memory: a tenant's state is dropped once it is idle and its counter is no
  more than the virtual time (its lift would give it back), and the idle
  ones kept beyond MAX_IDLE_TENANTS go oldest first.

The counters live in the policy; a SIGHUP reload that keeps `fair` carries
them over (`adopt`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from router.policies.base import Policy, Queues
from router.policies.slo import StepModel, deadline
from router.request import Request, Status

# Idle tenants remembered at most (their counters above the virtual time).
MAX_IDLE_TENANTS = 1024


@dataclass
class TenantState:
    counter: float = 0.0
    # Requests of this tenant waiting, swapped or running (0 = idle).
    active: int = 0


class FairPolicy(Policy):
    name = "fair"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.preemptive = bool(cfg.fair.preempt)
        self.tenants: dict[str, TenantState] = {}
        self.vtime = 0.0
        # Idle tenants with state, oldest first (bounded memory).
        self._idle: OrderedDict[str, None] = OrderedDict()
        self._sched: Queues | None = None
        self._seat_cache: dict[str, int] = {}
        self.steps = StepModel()
        self._protected: tuple[str, int, bool] = ("", 0, False)
        self._claims: dict[str, int] = {}  # seats priority preemption kept this iteration

    # -- state ------------------------------------------------------------------
    def weight(self, tenant: str) -> float:
        return float(self.cfg.fair.weights.get(tenant, 1.0))

    def counter(self, tenant: str) -> float:
        t = self.tenants.get(tenant)
        return self.vtime if t is None else t.counter

    def counters(self) -> dict[str, float]:
        """Every tenant's counter (the ones with state: active or recently)."""
        return {name: t.counter for name, t in self.tenants.items()}

    def _min_active(self, exclude: str | None = None) -> float | None:
        counters = [t.counter for name, t in self.tenants.items() if t.active and name != exclude]
        return min(counters) if counters else None

    def _advance_vtime(self) -> None:
        low = self._min_active()
        if low is not None and low > self.vtime:
            self.vtime = low

    def _activate(self, tenant: str) -> None:
        t = self.tenants.get(tenant)
        if t is None:
            t = self.tenants[tenant] = TenantState(counter=self.vtime)
        if t.active == 0:
            self._idle.pop(tenant, None)
            low = self._min_active(exclude=tenant)
            t.counter = max(t.counter, self.vtime if low is None else low)
        t.active += 1

    def _deactivate(self, tenant: str) -> None:
        t = self.tenants.get(tenant)
        if t is None or t.active == 0:
            return
        if t.active == 1:
            self._advance_vtime()  # while this tenant still counts as backlogged
        t.active -= 1
        if t.active == 0:
            self._idle[tenant] = None
            self._forget()

    def _forget(self) -> None:
        """Drops idle tenants whose lift would restore their counter, then the
        oldest idle ones beyond the bound."""
        for name in [n for n in self._idle if self.tenants[n].counter <= self.vtime]:
            del self._idle[name], self.tenants[name]
        while len(self._idle) > MAX_IDLE_TENANTS:
            name, _ = self._idle.popitem(last=False)
            del self.tenants[name]

    def _seats(self) -> dict[str, int]:
        seats: dict[str, int] = {}
        if self._sched is not None:
            for r in self._sched.running:
                seats[r.tenant] = seats.get(r.tenant, 0) + 1
        return seats

    # -- Policy hooks -------------------------------------------------------------
    def attach(self, scheduler: Queues) -> None:
        """Learns the requests already queued or running (a policy installed
        by a reload under load): tenants it knows keep their counters, new
        ones start at the virtual time."""
        self._sched = scheduler
        counts: dict[str, int] = {}
        for r in scheduler.waiting + scheduler.running + scheduler.swapped:
            counts[r.tenant] = counts.get(r.tenant, 0) + 1
        for t in self.tenants.values():
            t.active = 0
        for tenant, n in counts.items():
            self.tenants.setdefault(tenant, TenantState(counter=self.vtime)).active = n
        self._idle = OrderedDict((name, None) for name, t in self.tenants.items() if t.active == 0)
        self._forget()
        self.begin_iteration()

    def adopt(self, old: Policy) -> None:
        if isinstance(old, FairPolicy):
            self.tenants = old.tenants
            self.vtime = old.vtime
            self._idle = old._idle
            self.steps = old.steps

    def on_arrival(self, req: Request) -> None:
        self._activate(req.tenant)

    def on_finished(self, req: Request) -> None:
        self._deactivate(req.tenant)

    def on_service(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        t = self.tenants.get(req.tenant)
        if t is None:  # finished and forgotten while the step ran
            return
        f = self.cfg.fair
        t.counter += (f.prompt_weight * prompt_tokens + f.output_weight * output_tokens) / self.weight(req.tenant)

    def on_step(self, tokens: int, seconds: float) -> None:
        self.steps.observe(tokens, seconds)

    def token_budget(self, num_running: int) -> int:
        budget = self.cfg.max_num_batched_tokens
        ratio = self.cfg.fair.max_step_ratio
        # Only while requests compete for the seats: with seats to spare a
        # long prompt keeps its big chunks (a cap beside a few short decode
        # steps would cut it into slivers).
        if not ratio or num_running == 0 or self._sched is None:
            return budget
        if num_running + len(self._sched.waiting) < self.cfg.max_num_seqs:
            return budget
        decode = self.steps.predict(num_running)
        if decode is None:  # too few steps observed yet
            return budget
        cap = self.steps.budget_within(ratio * decode, num_running + 1, budget)
        # A tenant with few seats gets its prompt whole: its first token is
        # what the short steps are for.
        return min(budget, max(cap, num_running + self._protected[1]))

    def prefill_reserve(self, req: Request) -> int:
        # Other tenants' prefill chunks leave room for the protected waiting
        # prompt (admitted after the running requests), while a seat is free
        # for it: budget left for nobody would break work conservation.
        tenant, tokens, waiting = self._protected
        if not waiting or req.tenant == tenant or self._sched is None:
            return 0
        return tokens if len(self._sched.running) < self.cfg.max_num_seqs else 0

    def _protected_prompt(self) -> tuple[str, int, bool]:
        """(tenant, prompt tokens left, waiting) of the prompt the short
        steps protect: a running prefill, else the waiting request admission
        takes first, of a tenant that holds fewer weighted seats than
        another active tenant; ("", 0, False) when there is none."""
        sched = self._sched
        if sched is None or not self.cfg.fair.max_step_ratio:
            return "", 0, False
        share = {n: self._seat_cache.get(n, 0) / self.weight(n) for n, t in self.tenants.items() if t.active}
        if len(share) < 2:
            return "", 0, False
        top = max(share.values())
        for r in sched.running:
            if r.is_prefill and share.get(r.tenant, top) < top:
                return r.tenant, r.num_uncomputed, False
        if not sched.waiting:
            return "", 0, False
        now = time.monotonic()
        r = min(sched.waiting, key=lambda w: self.waiting_key(w, now))
        if share.get(r.tenant, top) >= top:
            return "", 0, False
        cached = sched.blocks.lookup_prefix(r)
        # Only a prompt that admission could start now: budget held for one
        # that waits for blocks, or behind a swapped request that waits for
        # them, would leave the running prefills none, while they hold the
        # blocks it waits for, forever.
        if not sched.admission_fits(r, cached):
            return "", 0, False
        # What the prefix cache holds is not computed again.
        return r.tenant, r.num_tokens - len(cached) * sched.blocks.block_size, True

    def begin_iteration(self) -> None:
        self._seat_cache = self._seats()
        self._claims = {}
        self._protected = self._protected_prompt()

    def waiting_key(self, req: Request, now: float):
        seats = self._seat_cache.get(req.tenant, 0)
        # Within a tenant (same counter and seats), SLO deadlines first.
        return (-req.priority, self.counter(req.tenant), seats, deadline(req), req.arrival_time, req.seq_id)

    # The counters move as service is charged (Policy.stable_running_order).
    stable_running_order = False

    def running_key(self, req: Request):
        # Smallest first gets the budget; the largest is the victim: lowest
        # band, most over-served tenant, newest request.
        return (-req.priority, self.counter(req.tenant), req.arrival_time, req.seq_id)

    def outranks(self, waiting: Request, running: Request) -> bool:
        if waiting.priority != running.priority:
            return waiting.priority > running.priority
        x, y = waiting.tenant, running.tenant
        if x == y:
            return False
        if running.status == Status.SWAPPED:
            # A swapped request holds no seat: it comes back first unless the
            # waiting one's tenant is strictly less served.
            return self.counter(x) < self.counter(y)
        if self.counter(x) > self.counter(y):
            return False

        def seats(t: str) -> int:
            return self._seat_cache.get(t, 0) + self._claims.get(t, 0)

        return (seats(y) - 1) / self.weight(y) >= (seats(x) + 1) / self.weight(x)

    def on_claimed(self, req: Request) -> None:
        # Counted by outranks alone: the next candidate of this tenant must
        # outrank with the claimed seat held. The waiting order (and so which
        # request admission takes) stays that of the running seats.
        self._claims[req.tenant] = self._claims.get(req.tenant, 0) + 1

    def on_admitted(self, req: Request) -> None:
        self._seat_cache[req.tenant] = self._seat_cache.get(req.tenant, 0) + 1

    def on_preempted(self, req: Request) -> None:
        self._seat_cache[req.tenant] = max(0, self._seat_cache.get(req.tenant, 0) - 1)
