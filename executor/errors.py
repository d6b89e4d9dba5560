"""The executor's typed errors at its gRPC boundary.

A `PlanError` means the plan contradicts the executor's state (an unknown
sequence, a block id outside the pool, more tokens than are known): the
router sent something wrong, the service answers INVALID_ARGUMENT and counts
a rejected plan. Any other exception during a step (a kernel bug, out of
memory) is the executor's own failure and is answered INTERNAL.
"""


class PlanError(Exception):
    """The plan is inconsistent with the executor's state (bad ids, sizes)."""
