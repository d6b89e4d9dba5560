"""Shortest job first with aging.

Job size is the request's `expected_output_tokens` hint (else its
max_new_tokens) plus its remaining prefill. A request that has waited
`sjf_max_wait_s` goes before every younger one, so a steady stream of short
jobs cannot starve a long one beyond that bound.
"""

from __future__ import annotations

from router.policies.base import Policy
from router.request import Request


class SJFPolicy(Policy):
    name = "sjf"

    def waiting_key(self, req: Request, now: float):
        aged = now - req.arrival_time >= self.cfg.sjf_max_wait_s
        if aged:
            return (0, req.arrival_time, 0, req.seq_id)
        return (1, req.job_size, req.arrival_time, req.seq_id)

    def running_key(self, req: Request):
        # The longest remaining job is preempted first.
        return (req.job_size, req.arrival_time, req.seq_id)
