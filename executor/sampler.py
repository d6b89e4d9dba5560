"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition /
presence / frequency penalties, logit bias, min-tokens suppression, seed.

Logits are processed in this order, batched over the rows that ask for each
step (the others pay nothing): logit bias, repetition penalty (HF), presence
and frequency penalties (OpenAI, over the generated tokens), min-tokens
suppression of EOS and stop ids; then greedy rows take the argmax and the
others apply temperature, min-p, top-k and top-p and draw. Logprobs are the
raw model's (before any of it), as vLLM returns them.

Rows are processed as a batch. Randomness is inverse-CDF sampling with one
uniform number per row drawn from a generator seeded by (seed, output index):
the same seed and prompt give the same tokens run after run, whatever else is
in the batch, and a sequence preempted and recomputed continues exactly where
it was.

On a CUDA GPU a step whose rows need no logit processing (no penalties, bias,
min-tokens, grammar mask or logprobs) samples on the device instead
(native/csrc/cuda_sampling.cu): the same algorithm and the same uniform draw,
one block per row, so the tokens are the host's up to rounding at a
boundary, and as seeded and batch-independent; only the token ids cross to
the host.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

import native
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias_ids: tuple[int, ...] = ()
    logit_bias_values: tuple[float, ...] = ()
    min_tokens: int = 0
    suppress_ids: tuple[int, ...] = ()  # not sampled while fewer than min_tokens are out
    top_logprobs: int = 0  # with logprobs: the k best alternatives too
    prompt_logprobs: bool = False  # the prompt tokens' own logprobs (runner.ModelRunner._prompt_logprobs)
    prompt_top_logprobs: int = 0  # and the k best alternatives at each prompt position

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def moves_logits(self) -> bool:
        """Whether anything but temperature / top-k / top-p / min-p changes the logits."""
        return self.needs_history or bool(self.logit_bias_ids) or bool(self.min_tokens and self.suppress_ids)


def uniform_for(seed: int, output_index: int) -> float:
    """The uniform draw of one sampling step: a pure function of its inputs."""
    return random.Random((seed + output_index * _SEED_STRIDE) & _MASK64).random()


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


def _min_p(x: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Masks tokens less probable than min_p times the row's most probable one."""
    if not any(m > 0 for m in min_p):
        return x
    probs = x.softmax(-1)
    floor = probs.max(-1, keepdim=True).values * torch.tensor([[m] for m in min_p], dtype=probs.dtype)
    return x.masked_fill(probs < floor, float("-inf"))


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[list[int] | None],
    output_indices: list[int],
) -> torch.Tensor:
    """Bias, penalties and min-tokens suppression on fp32 host logits [N, V]
    (a new tensor where any row asks for one; `logits` itself otherwise)."""
    vocab = logits.shape[-1]
    if not any(p.moves_logits for p in params):
        return logits
    x = logits.clone()
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in zip(p.logit_bias_ids, p.logit_bias_values) if t < vocab]
    if bias:
        rows, cols, vals = zip(*bias)
        x.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(vals, dtype=x.dtype), accumulate=True)
    flat_x = x.view(-1)
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and histories[i]]
    if rep:
        # Sparse: only the tokens each row has seen, as flat indices row * V + token.
        where, _ = _seen(vocab, rep, [histories[i] for i in rep])
        penalty = torch.tensor([params[i].repetition_penalty for i in range(len(params))], dtype=x.dtype)
        per = penalty.index_select(0, where // vocab)
        v = flat_x.index_select(0, where)
        flat_x.index_copy_(0, where, torch.where(v > 0, v / per, v * per))
    pen = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and histories[i]]
    if pen:
        outs = [histories[i][len(histories[i]) - output_indices[i] :] if output_indices[i] else [] for i in pen]
        where, counts = _seen(vocab, pen, outs)
        if where.numel():
            rows = where // vocab
            freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype).index_select(0, rows)
            pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype).index_select(0, rows)
            flat_x.index_add_(0, where, -(freq * counts.to(x.dtype) + pres))
    held = [
        (i, t) for i, p in enumerate(params) if output_indices[i] < p.min_tokens for t in p.suppress_ids if t < vocab
    ]
    if held:
        rows, cols = zip(*held)
        x.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(float("-inf"), dtype=x.dtype))
    return x


def _seen(vocab: int, rows: list[int], tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of `tokens[j]` in row `rows[j]`, as
    flat indices row * vocab + token (ascending), and how often each occurs."""
    lens = torch.tensor([len(t) for t in tokens])
    row = torch.repeat_interleave(torch.tensor(rows), lens)
    tok = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long)
    keep = tok < vocab  # a logits row narrower than the tokenizer: nothing to penalise there
    return torch.unique(row[keep] * vocab + tok[keep], return_counts=True)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> list[int]:
    temps = torch.tensor([[p.temperature] for p in params], dtype=logits.dtype)
    x = _min_p(logits / temps, [p.min_p for p in params])
    x = _top_k_top_p(x, [p.top_k for p in params], [p.top_p for p in params])
    cdf = x.softmax(-1).cumsum(-1)
    u = torch.tensor([[uniform_for(p.seed, i)] for p, i in zip(params, output_indices)], dtype=cdf.dtype)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=logits.shape[-1] - 1).squeeze(1)
    # A row whose distribution is not finite (overflowing logits, extreme
    # parameters) falls back to greedy instead of failing the whole batch.
    bad = ~torch.isfinite(cdf[:, -1])
    if bool(bad.any()):
        tokens = torch.where(bad, logits.max(dim=-1).indices, tokens)
    return tokens.tolist()


def device_samples(params: list[SamplingParams], allowed: list[bytes | None] | None = None) -> bool:
    """Whether rows with these parameters may sample on a CUDA device: none
    moves its logits, carries a grammar mask or asks for logprobs."""
    return not any(p.moves_logits or p.logprobs for p in params) and not any(allowed or ())


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> list[int]:
    """One token per row of CUDA logits [N, V] by native sample_tokens: greedy
    rows their argmax, the others the host's temperature / min-p / top-k /
    top-p and inverse-CDF draw with the same uniform number."""
    table = [
        [p.temperature for p in params],
        [float(p.top_k) for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
        [0.0 if p.greedy else uniform_for(p.seed, i) for p, i in zip(params, output_indices)],
    ]
    dev = logits.device
    out = torch.empty(len(params), dtype=torch.long, device=dev)
    native._C.sample_tokens(out, logits.contiguous(), torch.tensor(table, dtype=torch.float32).to(dev))
    return out.tolist()


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
    return all(p.greedy and not p.moves_logits and not p.logprobs for p in params)


def apply_allowed(x: torch.Tensor, allowed: list[bytes | None]) -> torch.Tensor:
    """Masks to -inf, in the rows that carry one, every token a structured
    output's grammar does not allow (bit t of little-endian 32-bit word
    t // 32 set = allowed); one batched unpack for all of them."""
    rows = [i for i, a in enumerate(allowed) if a]
    if not rows:
        return x
    vocab = x.shape[-1]
    words = torch.frombuffer(bytearray(b"".join(allowed[i] for i in rows)), dtype=torch.int32).view(len(rows), -1)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    ok = bits.view(len(rows), -1)[:, :vocab].bool()
    idx = torch.tensor(rows)
    x = x.clone()
    x[idx] = x[idx].masked_fill(~ok, float("-inf"))
    return x


def sample(
    logits: torch.Tensor,  # [N, V], any float dtype
    params: list[SamplingParams],
    histories: list[list[int] | None],
    output_indices: list[int],
    allowed: list[bytes | None] | None = None,
    top_out: list | None = None,
    on_device: bool = True,
) -> tuple[list[int], list[float] | None]:
    """Next token for each row, and the raw model log-probability of each
    chosen token when any row asked for logprobs. `allowed`: per row, the
    structured-output mask of the tokens that may be sampled, or None.
    `top_out`, when given, gets per row (ids, logprobs) of its top_logprobs
    most likely tokens in the raw distribution, or None. `on_device`: CUDA
    logits of rows that allow it sample on the GPU (module docstring)."""
    want_logprobs = any(p.logprobs for p in params)
    allowed = allowed or [None] * len(params)
    if greedy_only(params) and not any(allowed):
        # Greedy fast path in the model's dtype: upcasting bf16 is exact, so
        # the maximum and its first index are the same without the fp32 copy.
        return greedy_tokens(logits), None
    if on_device and logits.is_cuda and device_samples(params, allowed) and native.has_cuda():
        return sample_on_device(logits, params, output_indices), None
    # On the host in fp32 whatever the model's device: the same logits give
    # the same tokens on every device (a GPU's rows are [N, V], a few MB).
    logits = logits.to("cpu", torch.float32)
    raw_logprobs = torch.log_softmax(logits, -1) if want_logprobs else None
    logits = apply_allowed(process_logits(logits, params, histories, output_indices), allowed)
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
        if top_out is not None:
            top_out.extend(_top(raw_logprobs, [p.top_logprobs for p in params]))
    return tokens, logprobs


def _top(raw_logprobs: torch.Tensor, ks: list[int]) -> list[tuple[list[int], list[float]] | None]:
    """Each row's k most likely tokens (one topk for the batch), or None where k is 0."""
    kmax = min(max(ks), raw_logprobs.shape[-1])
    if kmax <= 0:
        return [None] * len(ks)
    vals, ids = raw_logprobs.topk(kmax, dim=-1)
    vals, ids = vals.tolist(), ids.tolist()
    return [(ids[i][:k], vals[i][:k]) if k else None for i, k in enumerate(ks)]
