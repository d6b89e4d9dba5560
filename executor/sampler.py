"""Token sampling: greedy, temperature, top-k, top-p, repetition penalty, seed.

Rows are processed as a batch. Randomness is inverse-CDF sampling with one
uniform number per row drawn from a generator seeded by (seed, output index):
the same seed and prompt give the same tokens run after run, whatever else is
in the batch, and a sequence preempted and recomputed continues exactly where
it was.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from native._fused import argmax as native_argmax

_SEED_STRIDE = 0x9E3779B97F4A7C15  # golden-ratio stride keeps per-step seeds apart
_MASK64 = (1 << 64) - 1


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


def uniform_for(seed: int, output_index: int) -> float:
    """The uniform draw of one sampling step: a pure function of its inputs."""
    return random.Random((seed + output_index * _SEED_STRIDE) & _MASK64).random()


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> None:
    """In place on one row, HF semantics: divide positive logits, multiply
    negative ones, for every token already in the sequence."""
    if not token_ids:
        return
    idx = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
    scores = logits.index_select(0, idx)
    scores = torch.where(scores > 0, scores / penalty, scores * penalty)
    logits.index_copy_(0, idx, scores)


def _top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks (to -inf) what top-k and top-p exclude, row by row, batched."""
    vocab = x.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if min(ks) < vocab:
        kmax = max(k for k in ks if k < vocab)
        top = torch.topk(x, kmax, dim=-1).values  # [N, kmax], descending
        kth = top.gather(1, torch.tensor([[min(k, kmax) - 1] for k in ks]))
        keep_all = torch.tensor([[k >= vocab] for k in ks])
        x = torch.where(keep_all | (x >= kth), x, torch.full_like(x, float("-inf")))
    if any(0.0 < p < 1.0 for p in top_p):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        p = torch.tensor([[q if 0.0 < q < 1.0 else 2.0] for q in top_p])
        sorted_x = sorted_x.masked_fill(mass_before >= p, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)
    return x


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> list[int]:
    temps = torch.tensor([[p.temperature] for p in params], dtype=logits.dtype)
    x = _top_k_top_p(logits / temps, [p.top_k for p in params], [p.top_p for p in params])
    cdf = x.softmax(-1).cumsum(-1)
    u = torch.tensor([[uniform_for(p.seed, i)] for p, i in zip(params, output_indices)], dtype=cdf.dtype)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=logits.shape[-1] - 1).squeeze(1)
    # A row whose distribution is not finite (overflowing logits, extreme
    # parameters) falls back to greedy instead of failing the whole batch.
    bad = ~torch.isfinite(cdf[:, -1])
    if bool(bad.any()):
        tokens = torch.where(bad, logits.max(dim=-1).indices, tokens)
    return tokens.tolist()


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """First index of each row's maximum, as `logits.max(-1).indices`. On CPU
    the native pass (native._fused.argmax) reads each row once, where torch's
    max() makes several passes."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.is_contiguous():
        return native_argmax(logits).tolist()
    return logits.max(dim=-1).indices.tolist()


def greedy_only(params: list[SamplingParams]) -> bool:
    """Whether every row takes its argmax and nobody asked for logprobs: then
    the logits are needed only for their argmax."""
    return all(p.greedy and not p.needs_history and not p.logprobs for p in params)


def sample(
    logits: torch.Tensor,  # [N, V], any float dtype
    params: list[SamplingParams],
    histories: list[list[int] | None],
    output_indices: list[int],
) -> tuple[list[int], list[float] | None]:
    """Next token for each row, and the raw model log-probability of each
    chosen token when any row asked for logprobs."""
    want_logprobs = any(p.logprobs for p in params)
    if greedy_only(params):
        # Greedy fast path in the model's dtype: upcasting bf16 is exact, so
        # the maximum and its first index are the same without the fp32 copy.
        return greedy_tokens(logits), None
    # On the host in fp32 whatever the model's device: the same logits give
    # the same tokens on every device (a GPU's rows are [N, V], a few MB).
    logits = logits.to("cpu", torch.float32)
    raw_logprobs = torch.log_softmax(logits, -1) if want_logprobs else None
    penalised = [i for i, (p, h) in enumerate(zip(params, histories)) if p.needs_history and h]
    if penalised:
        logits = logits.clone()
        for i in penalised:
            apply_repetition_penalty(logits[i], histories[i], params[i].repetition_penalty)
    tokens = greedy_tokens(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        picked = _sample_rows(logits[rows], [params[i] for i in rows], [output_indices[i] for i in rows])
        for i, tok in zip(rows, picked):
            tokens[i] = tok
    logprobs = None
    if raw_logprobs is not None:
        chosen = torch.tensor(tokens, dtype=torch.long).unsqueeze(1)
        logprobs = raw_logprobs.gather(1, chosen).squeeze(1).tolist()
    return tokens, logprobs
