"""SLO classes and the `slo` policy: deadlines first, for goodput.

A request's class (`scheduler.slo_classes`) gives it a TTFT target (its
first token's deadline is arrival + ttft_ms) and a TPOT target. `slo`:

- Order: `priority` bands stay strict; within a band, earliest TTFT
  deadline first (EDF); requests without a class after every classed one,
  first come first served. A waiting request that can no longer meet its
  deadline (now plus its own prefill time at the measured step rate is past
  it) goes after every one that still can (`slo.on_miss: deprioritize`), or
  is ended at once with RESOURCE_EXHAUSTED (`reject`), as is a new request
  that cannot meet it even if scheduled at once. Nothing is refused that
  could still make its deadline.
- TPOT: the batch and the token budget keep the tightest running request's
  TPOT: a step time model (least squares of step seconds over tokens
  computed, with forgetting) caps the seats and the budget of a step at what
  it predicts fits in that TPOT (never below one decode per running request
  plus one prefill token, so everything progresses).
- The token budget goes to the tightest TPOT first; the victim of a memory
  preemption is the loosest TPOT, newest request.

`fair` orders by the same deadlines within a tenant (fair across tenants,
deadlines within one): see router/policies/fair.py.
"""

from __future__ import annotations

import math

from router.policies.base import Policy
from router.request import Request

INF = math.inf


class StepModel:
    """Step seconds ~ a + b * tokens, by least squares over the observed
    steps with exponential forgetting (old steps fade: the host's speed and
    the contexts change)."""

    MIN_SAMPLES = 8.0

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.n = self.sx = self.sxx = self.sy = self.sxy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """One step's tokens and seconds; empty or untimed steps are skipped."""
        if tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        self.n = d * self.n + 1.0
        self.sx = d * self.sx + tokens
        self.sxx = d * self.sxx + tokens * tokens
        self.sy = d * self.sy + seconds
        self.sxy = d * self.sxy + tokens * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None before MIN_SAMPLES steps."""
        if self.n < self.MIN_SAMPLES:
            return None
        det = self.n * self.sxx - self.sx * self.sx
        if det <= 1e-9 * max(1.0, self.n * self.sxx):  # every step the same size: a mean per token
            per = self.sy / self.sx if self.sx else 0.0
            return 0.0, per
        b = max(0.0, (self.n * self.sxy - self.sx * self.sy) / det)
        a = max(0.0, (self.sy - b * self.sx) / self.n)
        return a, b

    def predict(self, tokens: int) -> float | None:
        c = self.coefficients()
        return None if c is None else c[0] + c[1] * tokens

    def tokens_within(self, seconds: float) -> float:
        """The most tokens a step may compute to last at most `seconds`."""
        c = self.coefficients()
        if c is None or c[1] <= 0:
            return INF
        return (seconds - c[0]) / c[1]

    def budget_within(self, seconds: float, least: int, most: int) -> int:
        """A step's token budget so it lasts at most `seconds`: at least
        `least`, at most `most` (all of `most` before the model has data)."""
        fits = self.tokens_within(seconds)
        return most if fits == INF else int(max(least, min(most, math.floor(fits))))


def rejects_misses(sched) -> bool:
    """Whether the scheduler ends requests that cannot meet their TTFT."""
    return sched.cfg.slo.on_miss == "reject" and isinstance(sched.policy, SloPolicy)


def miss_message(req: Request) -> str:
    return f"slo_class {req.slo_class!r}: its time to first token can no longer be met (scheduler.slo.on_miss: reject)"


def deadline(req: Request) -> float:
    return INF if req.ttft_deadline is None else req.ttft_deadline


class SloPolicy(Policy):
    name = "slo"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.steps = StepModel()
        self._sched = None

    def attach(self, scheduler) -> None:
        self._sched = scheduler

    def adopt(self, old: Policy) -> None:
        if isinstance(old, SloPolicy):
            self.steps = old.steps

    def on_step(self, tokens: int, seconds: float) -> None:
        self.steps.observe(tokens, seconds)

    # -- deadlines ----------------------------------------------------------------
    def prefill_seconds(self, req: Request) -> float:
        """The least time its prompt takes to compute from now: its chunks at
        the full budget, at the measured step rate (0 before any measure)."""
        budget = self.cfg.max_num_batched_tokens
        remaining = max(1, req.num_uncomputed)
        chunks = math.ceil(remaining / budget)
        per = self.steps.predict(min(remaining, budget))
        return 0.0 if per is None else chunks * per

    def cannot_meet(self, req: Request, now: float) -> bool:
        """True when even scheduled now it would miss its TTFT deadline."""
        if req.ttft_deadline is None or req.first_token_time is not None:
            return False
        return now + self.prefill_seconds(req) > req.ttft_deadline

    def waiting_key(self, req: Request, now: float):
        return (-req.priority, self.cannot_meet(req, now), deadline(req), req.arrival_time, req.seq_id)

    def running_key(self, req: Request):
        tpot = INF if req.tpot_s is None else req.tpot_s
        return (-req.priority, tpot, req.arrival_time, req.seq_id)

    # -- TPOT ---------------------------------------------------------------------
    def _tightest_tpot(self, extra: Request | None = None) -> float:
        reqs = list(self._sched.running) if self._sched is not None else []
        if extra is not None:
            reqs.append(extra)
        return min((r.tpot_s for r in reqs if r.tpot_s is not None), default=INF)

    def admission_limit(self, num_running: int, waiting: list[Request], now: float) -> float:
        if not waiting:
            return INF
        tpot = self._tightest_tpot(min(waiting, key=lambda r: self.waiting_key(r, now)))
        if tpot == INF:
            return INF
        # Seats such that a decode step of the whole batch fits in the TPOT.
        fits = self.steps.tokens_within(tpot)
        if fits == INF:
            return INF
        seats = math.floor(fits)
        return max(0, seats - num_running) if num_running else max(1, seats)

    def token_budget(self, num_running: int) -> int:
        budget = self.cfg.max_num_batched_tokens
        tpot = self._tightest_tpot()
        if tpot == INF:
            return budget
        return self.steps.budget_within(tpot, num_running + 1, budget)
