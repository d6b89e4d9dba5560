"""The sampler on real tensors: greedy, temperature, top-k, top-p, repetition
penalty, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from executor.sampler import SamplingParams, sample


def _logits(n=4, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 3


def test_greedy_is_the_first_maximum_in_any_dtype():
    x = _logits()
    x[1, 7] = x[1, 9] = x[1].max() + 1  # a tie: the first index wins
    for dtype in (torch.float32, torch.bfloat16):
        toks, lps = sample(x.to(dtype), [SamplingParams()] * 4, [None] * 4, [0] * 4)
        assert toks == x.to(dtype).float().argmax(-1).tolist()
        assert toks[1] == 7 and lps is None


def test_same_seed_same_tokens_independent_of_batch_company():
    x = _logits(n=3)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(x[:1], [p], [None], [i])[0][0] for i in range(20)]
    with_others = [
        sample(x, [p, SamplingParams(temperature=0.7, seed=1), SamplingParams()], [None] * 3, [i, 0, 0])[0][0]
        for i in range(20)
    ]
    assert alone == with_others
    other_seed = [sample(x[:1], [SamplingParams(temperature=1.0, seed=43)], [None], [i])[0][0] for i in range(20)]
    assert alone != other_seed


def test_top_k_restricts_to_the_k_most_likely():
    x = _logits(n=1, v=100)
    top3 = set(torch.topk(x[0], 3).indices.tolist())
    got = {sample(x, [SamplingParams(temperature=5.0, top_k=3, seed=s)], [None], [0])[0][0] for s in range(200)}
    assert got <= top3 and len(got) >= 2


def test_top_p_keeps_the_smallest_set_reaching_p():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    got = {sample(x, [SamplingParams(temperature=1.0, top_p=0.7, seed=s)], [None], [0])[0][0] for s in range(300)}
    assert got == {0, 1}  # 0.5 alone < 0.7; 0.5 + 0.3 reaches it


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    x = torch.log(probs).unsqueeze(0)
    counts = torch.zeros(3)
    for s in range(3000):
        counts[sample(x, [SamplingParams(temperature=1.0, seed=s)], [None], [0])[0][0]] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.04)


def test_repetition_penalty_demotes_seen_tokens():
    x = torch.tensor([[2.0, 1.9, -1.0, -1.1]])
    assert sample(x, [SamplingParams()], [None], [0])[0] == [0]
    toks, _ = sample(x, [SamplingParams(repetition_penalty=1.5)], [[0]], [0])
    assert toks == [1]  # 2.0 / 1.5 < 1.9
    toks, _ = sample(torch.tensor([[-1.0, -1.2]]), [SamplingParams(repetition_penalty=2.0)], [[0]], [0])
    assert toks == [1]  # negative logits are multiplied: -2.0 < -1.2


def test_logprobs_are_the_raw_model_log_probabilities():
    x = _logits(n=2)
    toks, lps = sample(
        x, [SamplingParams(logprobs=True), SamplingParams(temperature=0.8, seed=3, logprobs=True)], [None, None], [0, 0]
    )
    ref = torch.log_softmax(x, -1)
    for row, (t, lp) in enumerate(zip(toks, lps)):
        assert math.isclose(lp, ref[row, t].item(), rel_tol=1e-5)


def test_non_finite_distribution_falls_back_to_greedy_for_that_row_only():
    x = _logits(n=2)
    x[0, 5] = float("inf")
    toks, _ = sample(
        x, [SamplingParams(temperature=1e-30, seed=1), SamplingParams(temperature=1.0, seed=2)], [None, None], [0, 0]
    )
    assert toks[0] == 5
    assert toks[1] == sample(x[1:], [SamplingParams(temperature=1.0, seed=2)], [None], [0])[0][0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_greedy_matches_torch_max_with_ties_inf_and_nan(dtype):
    from executor.sampler import greedy_tokens

    torch.manual_seed(3)
    x = torch.randn(11, 49152).to(dtype)
    x[1, 100] = x[1, 200] = 50.0  # tie: the first index wins
    x[2, -1] = 99.0  # in the vector tail
    x[3] = float("-inf")
    x[4, 777] = float("nan")  # NaN counts as the maximum, as in torch.max
    x[5, 0] = 1e4
    assert greedy_tokens(x) == x.max(dim=-1).indices.tolist()
    odd = torch.randn(3, 37).to(dtype)  # vocab not a multiple of the vector width
    assert greedy_tokens(odd) == odd.max(dim=-1).indices.tolist()


def _reference_processed(logits, p: SamplingParams, history: list[int], num_output: int):
    """One row, the slow way: bias, HF's repetition penalty over the whole
    sequence, OpenAI penalties over the output tokens, min-tokens suppression."""
    x = logits.clone()
    for t, b in zip(p.logit_bias_ids, p.logit_bias_values):
        x[t] += b
    for t in set(history):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    out = history[len(history) - num_output :] if num_output else []
    for t in set(out):
        x[t] -= p.presence_penalty + p.frequency_penalty * out.count(t)
    if num_output < p.min_tokens:
        for t in p.suppress_ids:
            x[t] = float("-inf")
    return x


def test_bias_penalties_and_min_tokens_match_a_row_by_row_reference():
    from executor.sampler import process_logits

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 40, generator=g) * 2
    params = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(),  # untouched in the company of the others
        SamplingParams(logit_bias_ids=(3, 9), logit_bias_values=(5.0, -100.0)),
        SamplingParams(min_tokens=4, suppress_ids=(1, 2)),
        SamplingParams(min_tokens=2, suppress_ids=(1,), frequency_penalty=-1.5),  # past its minimum
        SamplingParams(presence_penalty=-2.0, logit_bias_ids=(7,), logit_bias_values=(2.5,)),
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.4),
        SamplingParams(repetition_penalty=0.8),
    ]
    histories = [torch.randint(0, 40, (20,), generator=g).tolist() for _ in params]
    num_output = [8, 3, 0, 2, 5, 12, 7, 0]
    got = process_logits(logits, params, histories, num_output)
    for i, p in enumerate(params):
        want = _reference_processed(logits[i], p, histories[i], num_output[i])
        torch.testing.assert_close(got[i], want)
    assert torch.equal(got[1], logits[1])


def test_min_tokens_suppression_ends_at_the_minimum_and_greedy_rows_obey_it():
    logits = torch.zeros(2, 10)
    logits[:, 2] = 5.0  # EOS would win
    p = SamplingParams(min_tokens=3, suppress_ids=(2,))
    early, _ = sample(logits, [p, p], [None, None], [0, 2])
    late, _ = sample(logits, [p, p], [None, None], [3, 4])
    assert 2 not in early and late == [2, 2]


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for seed in range(300):
        toks, _ = sample(logits, [SamplingParams(temperature=1.0, min_p=0.25, seed=seed)], [None], [0])
        seen.update(toks)
    assert seen == {0, 1, 2}  # 0.05 < 0.25 * 0.5: never drawn


def test_the_penalties_keep_seeded_sampling_batch_independent():
    logits = _logits(n=3, v=30, seed=5)
    p = SamplingParams(temperature=0.8, seed=11, presence_penalty=1.0, frequency_penalty=0.5)
    hist = [list(range(10)) + [3, 3, 4], [1, 2], list(range(5))]
    alone, _ = sample(logits[:1], [p], hist[:1], [6])
    together, _ = sample(logits, [p, SamplingParams(temperature=0.5, seed=2), p], hist, [6, 1, 2])
    assert together[0] == alone[0]


def test_grammar_masks_unpack_little_endian_words_and_compose_with_sampling():
    from executor.sampler import apply_allowed

    vocab = 70  # not a multiple of 32: the last word is partly padding
    allowed_ids = [0, 31, 32, 63, 69]  # bit 31 of a word is its sign bit
    words = [0, 0, 0]
    for t in allowed_ids:
        words[t // 32] |= 1 << (t % 32)
    mask = b"".join(w.to_bytes(4, "little") for w in words)
    logits = torch.randn(3, vocab)
    out = apply_allowed(logits, [mask, None, mask])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == allowed_ids
    assert torch.equal(out[1], logits[1])
    for seed in range(20):
        p = SamplingParams(temperature=1.5, seed=seed, presence_penalty=1.0)
        toks, _ = sample(logits, [p, SamplingParams(), p], [[5, 5], None, [0]], [2, 0, 1], [mask, None, mask])
        assert toks[0] in allowed_ids and toks[2] in allowed_ids
    greedy, _ = sample(logits, [SamplingParams()] * 3, [None] * 3, [0] * 3, [mask, None, None])
    assert greedy[0] == max(allowed_ids, key=lambda t: logits[0, t]) and greedy[1] == int(logits[1].argmax())
