"""Iteration-level first-come-first-served (Orca): admit in arrival order,
preempt the latest arrival when memory runs out."""

from router.policies.base import Policy


class FCFSPolicy(Policy):
    name = "fcfs"
