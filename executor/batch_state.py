"""Persistent per-sequence state (vLLM v1 style): what the executor keeps
between plans so that a plan carries only what changed."""

from __future__ import annotations

from dataclasses import dataclass, field

from executor.errors import PlanError
from executor.sampler import SamplingParams


@dataclass
class SeqState:
    token_ids: list[int]  # every known token: prompt, then sampled output
    num_computed: int  # tokens whose KV is in the cache
    sampling: SamplingParams
    num_output: int  # tokens sampled so far (seeds the next draw)
    block_table: list[int] = field(default_factory=list)
    allowed: bytes | None = None  # this step's structured-output mask, if any
    num_prompt: int = 0  # the prompt's length (token_ids beyond it are output)
    drafts: list[int] = field(default_factory=list)  # this step's draft tokens (speculative decoding)
    lora_slot: int = 0  # the LoRA adapter slot its rows use (0 = none; executor/lora.py)

    def mask(self, j: int) -> bytes | None:
        """The grammar mask of this step's sampled position j (0 = after the
        last known token, j = after draft j), or None."""
        if not self.allowed or not self.drafts:
            return self.allowed
        size = len(self.allowed) // (len(self.drafts) + 1)
        return self.allowed[j * size : (j + 1) * size]


class BatchState:
    def __init__(self) -> None:
        self.seqs: dict[int, SeqState] = {}

    def add(self, seq_id: int, state: SeqState) -> None:
        self.seqs[seq_id] = state

    def get(self, seq_id: int) -> SeqState:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise PlanError(f"sequence {seq_id} is unknown to the executor (never sent as new, or freed)") from None

    def free(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)

    def clear(self) -> None:
        self.seqs.clear()

    def __len__(self) -> int:
        return len(self.seqs)
