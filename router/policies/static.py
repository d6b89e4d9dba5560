"""Request-level baselines from the literature, on the same engine.

static: admit up to `static_batch_size` requests only when nothing is
running, then admit nothing until the whole batch has finished.
dynamic: the same, but a batch starts only once it is full or its oldest
request has waited `dynamic_max_wait_ms`.
"""

from __future__ import annotations

import math

from router.policies.base import Policy
from router.request import Request, Status


class StaticPolicy(Policy):
    name = "static"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self._slots = 0  # admissions left in the current batch

    def _batch_may_start(self, waiting: list[Request], now: float) -> bool:
        return bool(waiting)

    def admission_limit(self, num_running: int, waiting: list[Request], now: float) -> float:
        if num_running == 0 and self._slots == 0 and self._batch_may_start(waiting, now):
            self._slots = min(self.cfg.static_batch_size, len(waiting))
        return self._slots

    def on_admitted(self, req: Request) -> None:
        self._slots = max(0, self._slots - 1)

    def on_preempted(self, req: Request) -> None:
        # A recomputed victim goes back to the waiting queue and needs its
        # seat again; a swapped-out one comes back through swap-in, which is
        # not an admission, so it must not open a seat for a newcomer.
        if req.status == Status.WAITING:
            self._slots += 1


class DynamicPolicy(StaticPolicy):
    name = "dynamic"

    def _batch_may_start(self, waiting: list[Request], now: float) -> bool:
        if len(waiting) >= self.cfg.static_batch_size:
            return True
        oldest = min((r.arrival_time for r in waiting), default=math.inf)
        return bool(waiting) and (now - oldest) * 1000.0 >= self.cfg.dynamic_max_wait_ms

    def next_wakeup(self, now: float, waiting: list[Request]) -> float | None:
        if not waiting:
            return None
        oldest = min(r.arrival_time for r in waiting)
        return oldest + self.cfg.dynamic_max_wait_ms / 1000.0
