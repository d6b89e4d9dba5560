"""A request's life inside the router: tokens, KV progress, and how it ended."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

_SEQ_IDS = itertools.count(1)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Finish(enum.Enum):
    """Mirrors cbserve.v1.FinishReason (values are the proto numbers)."""

    LENGTH = 1
    EOS = 2
    STOP_SEQUENCE = 3
    CANCELLED = 4


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    top_logprobs: int = 0  # with logprobs: the k most likely alternatives too
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs, with k alternatives each


@dataclass(frozen=True)
class Stopping:
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    stopping: Stopping
    priority: int = 0
    expected_output_tokens: int | None = None
    cache_salt: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # monotonic seconds; None = no deadline
    nbytes: int = 0  # serialized size of the request it came from (limits.max_queued_bytes)
    matcher: object = None  # llguidance matcher of a structured-output request (router/structured.py)
    tenant: str = "default"  # who sent it (server.auth_tokens_file)
    group: str | None = None  # siblings of one prompt (OpenAI n > 1): they share its blocks
    # Its SLO class (scheduler.slo_classes), its first token's deadline
    # (monotonic seconds) and its time-per-output-token target; "" / None
    # without a class.
    slo_class: str = ""
    ttft_deadline: float | None = None
    tpot_s: float | None = None
    # The LoRA adapter it runs with (None = the base model), and the executor
    # slot it holds while admitted (0 = none; router/lora.py).
    lora: object = None
    lora_slot: int = 0
    seq_id: int = field(default_factory=lambda: next(_SEQ_IDS))
    # Speculative decoding: false = this request opted out; its draft
    # search state (router/speculative.py); drafts proposed, draft tokens
    # proposed and accepted (the final log line).
    speculative: bool = True
    spec_index: object = None
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted: int = 0

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # With sampling.prompt_logprobs: per prompt position 1.. (index 0 is
    # position 1) (logprob, rank, top ids, top logprobs), as the executor
    # reports them; a recomputed prompt overwrites the same entries.
    prompt_lps: list | None = None
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    # The executor holds this sequence's state (tokens, RNG, block table).
    executor_has_state: bool = False
    # Blocks allocated since the last plan, sent with the next one.
    pending_block_ids: list[int] = field(default_factory=list)
    replace_block_table: bool = False
    num_preemptions: int = 0
    finish: Finish | None = None
    # Set from outside the engine loop; applied at the start of the next iteration.
    abort_status: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed > 1

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.stopping.max_new_tokens

    @property
    def job_size(self) -> int:
        """SJF cost: the expected output (hint, else max_new_tokens) plus the
        remaining prefill."""
        out = self.expected_output_tokens or self.stopping.max_new_tokens
        return max(0, out - len(self.output_token_ids)) + max(0, self.num_uncomputed - 1)
