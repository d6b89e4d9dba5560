"""Token sampling: greedy, temperature, top-k, top-p, repetition penalty, seed.

Randomness is a pure function of (seed, output index): the same seed and
prompt give the same tokens run after run, and a sequence preempted and
recomputed continues exactly where it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SEED_STRIDE = 0x9E3779B97F4A7C15  # golden-ratio stride keeps per-step seeds apart
_MASK64 = (1 << 63) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    repetition_penalty: float = 1.0
    logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> None:
    """In place, HF semantics: divide positive logits, multiply negative ones."""
    if not token_ids:
        return
    idx = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
    scores = logits.index_select(0, idx)
    scores = torch.where(scores > 0, scores / penalty, scores * penalty)
    logits.index_copy_(0, idx, scores)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        drop = (cum - probs) >= top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def sample_one(logits: torch.Tensor, params: SamplingParams, output_index: int) -> int:
    """Samples from one row of float32 logits (already repetition-penalised)."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = _filter_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    probs = scaled.softmax(-1)
    gen = torch.Generator()
    gen.manual_seed((params.seed + output_index * _SEED_STRIDE) & _MASK64)
    return int(torch.multinomial(probs, 1, generator=gen))


def sample(
    logits: torch.Tensor,  # [N, V], any float dtype
    params: list[SamplingParams],
    histories: list[list[int] | None],
    output_indices: list[int],
) -> tuple[list[int], list[float] | None]:
    """Next token for each row, and the raw model log-probability of each
    chosen token when any row asked for logprobs."""
    logits = logits.float()
    want_logprobs = any(p.logprobs for p in params)
    raw_logprobs = torch.log_softmax(logits, -1) if want_logprobs else None
    if all(p.greedy and not p.needs_history for p in params):
        # max() is several times faster than argmax() on CPU and returns the
        # first maximal index too.
        tokens = logits.max(dim=-1).indices.tolist()
    else:
        tokens = []
        for row, (p, hist, idx) in enumerate(zip(params, histories, output_indices)):
            row_logits = logits[row]
            if p.needs_history and hist:
                row_logits = row_logits.clone()
                apply_repetition_penalty(row_logits, hist, p.repetition_penalty)
            tokens.append(sample_one(row_logits, p, idx))
    logprobs = None
    if raw_logprobs is not None:
        chosen = torch.tensor(tokens, dtype=torch.long).unsqueeze(1)
        logprobs = raw_logprobs.gather(1, chosen).squeeze(1).tolist()
    return tokens, logprobs
