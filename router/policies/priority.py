"""Priority scheduling with preemption: larger `priority` first, FCFS within a
level. A waiting request preempts lower-priority running ones when memory or
max_num_seqs stands in its way; victims are the lowest priority, latest
arrival first."""

from __future__ import annotations

from router.policies.base import Policy
from router.request import Request


class PriorityPolicy(Policy):
    name = "priority"
    preemptive = True

    def waiting_key(self, req: Request, now: float):
        return (-req.priority, req.arrival_time, req.seq_id)

    def running_key(self, req: Request):
        return (-req.priority, req.arrival_time, req.seq_id)

    def outranks(self, waiting: Request, running: Request) -> bool:
        return waiting.priority > running.priority
