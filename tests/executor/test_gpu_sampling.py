"""Sampling on the GPU (native sample_tokens, executor/sampler.py).

The device sampler runs the host sampler's algorithm with the host's uniform
draw, one block per row: its tokens are compared with the host sampler's on
the same logits, alone against in a batch, run against run, with the
distribution they should follow, and through the runner's CUDA graphs. What
needs no GPU (which rows may sample on the device; the op refusing CPU
tensors) runs everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch

import native
from cbserve.v1 import executor_pb2 as pb
from executor.runner import ModelRunner
from executor.sampler import SamplingParams, device_samples, sample, sample_on_device
from native import _C
from tests.executor.test_gpu_forward import _drive, _model, _prompts

needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and native.has_cuda()), reason="needs a CUDA GPU and native._C built with CUDA"
)


def test_only_rows_without_logit_processing_sample_on_the_device():
    plain = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=3)
    assert device_samples([plain, SamplingParams()])
    assert not device_samples([plain, SamplingParams(temperature=1.0, repetition_penalty=1.2)])
    assert not device_samples([plain, SamplingParams(presence_penalty=0.5)])
    assert not device_samples([plain, SamplingParams(logit_bias_ids=(1,), logit_bias_values=(2.0,))])
    assert not device_samples([plain, SamplingParams(min_tokens=2, suppress_ids=(0,))])
    assert not device_samples([plain, SamplingParams(logprobs=True)])
    assert not device_samples([plain, plain], [None, b"\xff\xff\xff\xff"])


def test_sample_tokens_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        _C.sample_tokens(torch.empty(2, dtype=torch.long), torch.randn(2, 8), torch.zeros(5, 2))


def _rows(n: int, seed: int) -> list[SamplingParams]:
    """A mix of every parameter the device sampler takes, greedy rows among them."""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    out = []
    for i in range(n):
        out.append(
            SamplingParams(
                temperature=pick([0.0, 0.5, 0.8, 1.0, 1.3]),
                top_k=pick([0, 0, 1, 5, 50]),
                top_p=pick([1.0, 1.0, 0.95, 0.8, 0.3]),
                min_p=pick([0.0, 0.0, 0.05]),
                seed=1000 * seed + i,
            )
        )
    return out


def _logits(n: int, vocab: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a few peaked rows, most spread: top-p cuts at different depths
    scale = torch.rand(n, 1, generator=g) * 6 + 0.5
    return (torch.randn(n, vocab, generator=g) * scale).to(dtype)


def _exact(row: torch.Tensor, p: SamplingParams, u: float) -> tuple[torch.Tensor, float, bool]:
    """The sampling rule in float64 for one sampled row: the normalised CDF
    over the kept tokens (vocabulary order), the draw's target in it, and
    whether the host's sort could cut the top-p set inside a group of equal
    logits (the device keeps such a group whole; the host keeps the part its
    sort puts first)."""
    x = row.double() / p.temperature
    probs = torch.softmax(x, -1)
    if p.min_p > 0:
        x = x.masked_fill(probs < probs.max() * p.min_p, float("-inf"))
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    tie_cut = False
    if 0 < p.top_p < 1:
        sx, _ = torch.sort(x, descending=True)
        sp = torch.softmax(sx, -1)
        kept = (torch.cumsum(sp, -1) - sp) < p.top_p
        last = int(kept.sum()) - 1  # the smallest kept logit is sx[last]
        tie_cut = last + 1 < sx.numel() and bool(sx[last + 1] == sx[last])
        x = x.masked_fill(x < sx[last], float("-inf"))
    cdf = torch.cumsum(torch.softmax(x, -1), -1)
    return cdf, u * float(cdf[-1]), tie_cut


def _slack(cdf: torch.Tensor, target: float, tok: int) -> float:
    """How far the target lies outside token tok's interval of the CDF (0: inside)."""
    lo = float(cdf[tok - 1]) if tok else 0.0
    hi = float(cdf[tok])
    return 1.0 if hi == lo else max(0.0, lo - target, target - hi)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1000, 49152])
def test_device_tokens_are_the_host_samplers(dtype, vocab):
    from executor.sampler import uniform_for

    n = 96
    logits = _logits(n, vocab, dtype, seed=vocab)
    params = _rows(n, seed=vocab % 97)
    outputs = [i % 7 for i in range(n)]
    host, _ = sample(logits, params, [None] * n, outputs, on_device=False)
    dev = sample_on_device(logits.cuda(), params, outputs)
    clear = 0
    for i, p in enumerate(params):
        if p.greedy:
            assert dev[i] == host[i] == int(logits[i].float().argmax())
            continue
        cdf, target, tie_cut = _exact(logits[i].float(), p, uniform_for(p.seed, outputs[i]))
        # The device's token is the exact inverse CDF's up to fp32 rounding.
        assert _slack(cdf, target, dev[i]) <= 1e-4, (i, p, dev[i], host[i])
        # So is the host's, whose fp32 cumsum over a flat 49,152-token row
        # can drift by more than a token's width: where the target is clear
        # of every boundary by more than that and both keep the same tokens,
        # the two tokens are equal.
        near = torch.searchsorted(cdf, torch.tensor([target - 1e-3, target + 1e-3], dtype=cdf.dtype), right=True)
        if int(near[0]) == int(near[1]) and not tie_cut:
            clear += 1
            assert dev[i] == host[i], (i, p, dev[i], host[i])
    assert clear >= n // 4


@needs_gpu
def test_a_row_samples_the_same_token_alone_in_any_batch_and_run_after_run():
    n, vocab = 40, 49152
    logits = _logits(n, vocab, torch.bfloat16, seed=11).cuda()
    params = _rows(n, seed=5)
    outputs = list(range(n))
    batch = sample_on_device(logits, params, outputs)
    assert sample_on_device(logits, params, outputs) == batch
    for i in range(n):
        assert sample_on_device(logits[i : i + 1], [params[i]], [outputs[i]]) == [batch[i]]
    order = list(reversed(range(n)))
    shuffled = sample_on_device(logits[order], [params[i] for i in order], [outputs[i] for i in order])
    assert shuffled == [batch[i] for i in order]


@needs_gpu
def test_draws_follow_the_truncated_distribution():
    # One 8-token row drawn 4,000 times (seeds 0..3999): the frequencies are
    # the softmax at temperature 0.7 restricted to the top-p / top-k set.
    raw = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0])
    t, top_p, top_k, n = 0.7, 0.95, 5, 4000  # top-k drops the 6th token on, top-p the 5th
    probs = torch.softmax(raw / t, -1)  # raw is sorted: top-k is a prefix
    probs[top_k:] = 0.0
    probs = probs / probs.sum()
    keep = ((torch.cumsum(probs, -1) - probs) < top_p) & (probs > 0)
    want = torch.where(keep, probs, torch.zeros_like(probs))
    want = want / want.sum()
    params = [SamplingParams(temperature=t, top_p=top_p, top_k=top_k, seed=s) for s in range(n)]
    got = sample_on_device(raw.repeat(n, 1).cuda(), params, [0] * n)
    freq = torch.bincount(torch.tensor(got), minlength=8).double() / n
    assert all(freq[i] == 0 for i in range(8) if not keep[i])
    for i in range(8):
        if keep[i]:
            sd = math.sqrt(want[i] * (1 - want[i]) / n)
            assert abs(freq[i] - want[i]) < 5 * sd + 1e-3, (i, freq.tolist(), want.tolist())


@needs_gpu
def test_a_row_without_a_finite_distribution_goes_greedy_alone():
    logits = torch.randn(3, 500)
    logits[1, 17] = float("nan")
    logits[1, 40] = 50.0
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(3)]
    dev = sample_on_device(logits.cuda(), params, [0, 0, 0])
    host, _ = sample(logits, params, [None] * 3, [0, 0, 0], on_device=False)
    assert dev[1] == 40
    assert dev[0] == host[0] and dev[2] == host[2]


@needs_gpu
def test_the_runner_samples_on_the_device_what_it_samples_on_the_host():
    model = _model()
    prompts = _prompts(6, seed=9)

    def sampling(i):
        return pb.SeqSampling(temperature=0.8 + 0.1 * i, top_p=0.9, top_k=50 * (i % 2), seed=7 + i)

    host_runner = ModelRunner(model, 16, 512, cuda_graph_max_batch=8)
    host_runner.device_sampling = False
    host = _drive(host_runner, prompts, 10, sampling)
    graphed = _drive(ModelRunner(model, 16, 512, cuda_graph_max_batch=8), prompts, 10, sampling)
    eager = _drive(ModelRunner(model, 16, 512, cuda_graph_max_batch=0), prompts, 10, sampling)
    assert graphed == eager
    # a rounding boundary could make one sequence part ways with the host's
    assert sum(h != g for h, g in zip(host, graphed)) <= 1
