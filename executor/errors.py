"""The executor's typed errors at its gRPC boundary.

A `PlanError` means the plan contradicts the executor's state (an unknown
sequence, a block id outside the pool, more tokens than are known): the
router sent something wrong, the service answers INVALID_ARGUMENT and counts
a rejected plan. Any other exception during a step (a kernel bug, out of
memory) is the executor's own failure and is answered INTERNAL. A
`SeqError` concerns one sequence only: it is dropped from the step and named
in the result's failed_seq_ids, and the rest of the batch runs.
"""


class PlanError(Exception):
    """The plan is inconsistent with the executor's state (bad ids, sizes)."""


class SeqError(Exception):
    """One sequence's inputs cannot run (a token id outside the model's
    embedding, a grammar mask of the wrong size): that sequence is left out
    of the step and reported failed; the others run."""
