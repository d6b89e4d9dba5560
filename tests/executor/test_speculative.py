"""Draft verification in the runner (speculative decoding): whatever drafts a
plan carries, right, wrong or partly right, the tokens, logprobs and top
logprobs are those of decoding one token a step, for every output control;
rejected drafts leave no block behind."""

from __future__ import annotations

import pytest
import torch

from cbserve.v1 import executor_pb2 as pb
from executor import model_loader, model_source
from executor.runner import ModelRunner
from tests.executor.helpers import needs_bf16
from tests.small_configs import ARCHS

BS = 4  # small blocks: drafts cross block boundaries often
PROMPT = [5, 9, 3, 17, 5, 9, 3, 17, 5, 9, 22, 41, 7]
N_OUT = 24


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.float32), BS, 128)


class _Seq:
    """The router's side of one sequence: its block table and its pool."""

    def __init__(self, sampling: pb.SeqSampling) -> None:
        self.sampling = sampling
        self.pool = list(range(128))
        self.table: list[int] = []
        self.computed = 0
        self.out: list[int] = []
        self.lps: list[float] = []
        self.tops: list = []

    def grow(self, tokens: int) -> list[int]:
        need = -(-tokens // BS) - len(self.table)
        new = [self.pool.pop(0) for _ in range(max(0, need))]
        self.table += new
        return new

    def cut(self) -> None:
        keep = -(-self.computed // BS)
        self.pool += self.table[keep:]
        del self.table[keep:]

    def take(self, res, counts: list[int]) -> None:
        n = counts[0]
        self.out += list(res.token_ids[:n])
        if res.logprobs:
            self.lps += list(res.logprobs[:n])
        if res.top:
            self.tops += res.top[:n]


def _first(prompt: list[int], sampling: pb.SeqSampling, blocks: list[int], drafts: list[int] = ()) -> pb.Plan:
    """A plan that introduces sequence 1 and computes its whole prompt (and
    drafts after it) in blocks `blocks`."""
    return pb.Plan(
        seqs=[
            pb.ScheduledSeq(
                seq_id=1,
                num_tokens=len(prompt) + len(drafts),
                new_block_ids=blocks,
                new=pb.NewSeq(token_ids=prompt, sampling=sampling),
                draft_token_ids=drafts,
            )
        ]
    )


def _decode(runner: ModelRunner, sampling: pb.SeqSampling, drafts_for=None) -> _Seq:
    """Prefills PROMPT, then decodes N_OUT tokens; `drafts_for(out)` gives
    each step's drafts (None: plain decode)."""
    runner.reset()
    seq = _Seq(sampling)
    res = runner.step(_first(PROMPT, sampling, seq.grow(len(PROMPT))))
    seq.computed = len(PROMPT)
    seq.take(res, [1])
    while len(seq.out) < N_OUT:
        drafts = list(drafts_for(seq.out))[: N_OUT - len(seq.out) - 1] if drafts_for else []
        new = seq.grow(seq.computed + 1 + len(drafts))
        res = runner.step(
            pb.Plan(
                seqs=[pb.ScheduledSeq(seq_id=1, num_tokens=1 + len(drafts), new_block_ids=new, draft_token_ids=drafts)]
            )
        )
        counts = res.token_counts or [1]
        assert 1 <= counts[0] <= len(drafts) + 1
        seq.computed += counts[0]
        seq.take(res, counts)
        if drafts:
            seq.cut()
            assert runner.state.get(1).block_table == seq.table
    runner.reset()
    return seq


SAMPLINGS = {
    "greedy": pb.SeqSampling(),
    "seeded": pb.SeqSampling(temperature=0.9, seed=7, has_seed=True),
    "filters": pb.SeqSampling(temperature=1.3, top_k=20, top_p=0.9, min_p=0.02, seed=3, has_seed=True),
    "penalties": pb.SeqSampling(
        temperature=0.7,
        seed=11,
        has_seed=True,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        logit_bias_ids=[9, 17],
        logit_bias_values=[2.0, -3.0],
    ),
    "min_tokens": pb.SeqSampling(min_tokens=12, suppress_ids=[0, 1, 2, 5, 9]),
    "logprobs": pb.SeqSampling(temperature=0.8, seed=5, has_seed=True, logprobs=True, top_logprobs=3),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_architecture_decodes_the_same_with_drafts(arch):
    """Each architecture's small random model (fp32, sharpened as the
    architecture tests do), greedy and seeded: drafts change nothing."""
    torch.manual_seed(0)
    model = ARCHS[arch]().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    arch_runner = ModelRunner(model, BS, 128)
    for sampling in (SAMPLINGS["greedy"], SAMPLINGS["seeded"]):
        ref = _decode(arch_runner, sampling).out
        step = [0]

        def drafts(out):
            step[0] += 1
            d = ref[len(out) : len(out) + 3]
            if step[0] % 2 and d:
                d[-1] = (d[-1] + 1) % 259
            return d

        assert _decode(arch_runner, sampling, drafts).out == ref


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_drafts_right_wrong_or_partly_right_give_the_plain_decode(runner, name):
    plain = _decode(runner, SAMPLINGS[name])
    ref = plain.out
    step = [0]

    def oracle(out):  # the true continuation, with every third step's second draft wrong
        step[0] += 1
        d = ref[len(out) : len(out) + 4]
        if step[0] % 3 == 0 and len(d) > 1:
            d[1] = (d[1] + 1) % 200
        return d

    def wrong(out):  # never right: every step keeps exactly one token
        return [(t + 1) % 200 for t in ref[len(out) : len(out) + 3]]

    for drafts_for in (oracle, wrong):
        spec = _decode(runner, SAMPLINGS[name], drafts_for)
        assert spec.out == ref
        if plain.lps:
            assert spec.lps == pytest.approx(plain.lps, abs=1e-4)
            assert [ids for ids, _ in spec.tops] == [ids for ids, _ in plain.tops]


def test_right_drafts_take_fewer_steps(runner):
    ref = _decode(runner, SAMPLINGS["greedy"]).out
    steps = [0]

    def oracle(out):
        steps[0] += 1
        return ref[len(out) : len(out) + 4]

    assert _decode(runner, SAMPLINGS["greedy"], oracle).out == ref
    assert steps[0] <= -(-(N_OUT - 1) // 5) + 1  # k + 1 tokens a step


def test_a_grammar_mask_per_position_holds_the_drafts_to_it(runner):
    """Masks for the last token's position and each draft's: a draft the
    mask forbids is never accepted, and the token sampled there obeys it."""
    runner.reset()
    vocab = runner.vocab_size
    words = -(-vocab // 32)
    allow = lambda ids: b"".join(  # noqa: E731
        sum(1 << (t % 32) for t in ids if t // 32 == w).to_bytes(4, "little") for w in range(words)
    )
    seq = _Seq(pb.SeqSampling())
    res = runner.step(_first(PROMPT, pb.SeqSampling(), seq.grow(len(PROMPT))))
    masks = [allow([40, 41]), allow([50]), allow([60, 61])]
    res = runner.step(
        pb.Plan(
            seqs=[
                pb.ScheduledSeq(
                    seq_id=1,
                    num_tokens=3,
                    new_block_ids=seq.grow(len(PROMPT) + 3),
                    draft_token_ids=[41, 51],
                    allowed_tokens=b"".join(masks),
                )
            ]
        )
    )
    # Position 0 allows 40 and 41: draft 41 is kept only if it is the argmax
    # there; draft 51 is outside position 1's mask, so at most one draft.
    toks = list(res.token_ids)
    assert toks[0] in (40, 41)
    if toks[0] == 41:
        assert toks == [41, 50]
    else:
        assert toks == [40]
    runner.reset()


@pytest.mark.parametrize(
    "drafts, want",
    [([5, 999_999], "draft token id 999999 is outside"), ([], None)],
)
def test_a_draft_outside_the_vocabulary_fails_that_sequence_alone(runner, drafts, want):
    runner.reset()
    seqs = [
        pb.ScheduledSeq(
            seq_id=s,
            num_tokens=len(PROMPT),
            new_block_ids=[8 * s + i for i in range(8)],
            new=pb.NewSeq(token_ids=PROMPT),
        )
        for s in (0, 1)
    ]
    runner.step(pb.Plan(seqs=seqs))
    res = runner.step(
        pb.Plan(
            seqs=[
                pb.ScheduledSeq(seq_id=0, num_tokens=1 + len(drafts), draft_token_ids=drafts),
                pb.ScheduledSeq(seq_id=1, num_tokens=1),
            ]
        )
    )
    if want:
        assert res.failed and res.failed[0][0] == 0 and want in res.failed[0][1]
        assert res.seq_ids == [1]
    else:
        assert not res.failed and res.seq_ids == [0, 1]
    runner.reset()


def test_the_verified_tokens_follow_the_model_distribution(runner):
    """The rejection sampler, statistically: one step computes PROMPT plus
    drafts [d1, d2] (d1 the most likely next token) at a low temperature, over
    many seeds. The first emitted token must follow p0 = softmax(logits at
    PROMPT), and the token after an accepted d1 must follow p1 = softmax
    (logits at PROMPT + d1): total-variation distances within the bound for
    the sample size (expected deviation plus a 1e-6-tail McDiarmid margin)."""
    import math

    TEMPERATURE = 0.15  # the random model's logits are flat: sharpen them so d1 is often kept
    vocab = runner.vocab_size

    def dist(prompt):
        runner.reset()
        sampling = pb.SeqSampling(logprobs=True, top_logprobs=vocab)
        res = runner.step(_first(prompt, sampling, list(range(-(-len(prompt) // BS)))))
        ids, lps = res.top[0]
        p = [0.0] * vocab
        for t, lp in zip(ids, lps):  # the raw distribution, at the sampling temperature
            p[t] = math.exp(lp / TEMPERATURE)
        total = sum(p)
        return [q / total for q in p]

    p0 = dist(PROMPT)
    d1 = max(range(vocab), key=p0.__getitem__)
    p1 = dist(PROMPT + [d1])
    d2 = (d1 + 1) % vocab
    n = 3000
    first, second = [0] * vocab, [0] * vocab
    for seed in range(n):
        runner.reset()
        sampling = pb.SeqSampling(temperature=TEMPERATURE, seed=seed, has_seed=True)
        res = runner.step(_first(PROMPT, sampling, list(range(-(-(len(PROMPT) + 2) // BS))), [d1, d2]))
        toks = list(res.token_ids)
        first[toks[0]] += 1
        if toks[0] == d1:
            second[toks[1]] += 1
    runner.reset()

    def check(counts, p):
        m = sum(counts)
        tv = 0.5 * sum(abs(c / m - q) for c, q in zip(counts, p))
        expected = 0.5 * sum(math.sqrt(q * (1 - q) / m) for q in p)
        assert tv <= expected + math.sqrt(math.log(1e6) / (2 * m)), (tv, expected, m)

    assert 0.1 * n < first[d1] < n  # d1 kept often, not always
    check(first, p0)
    check(second, p1)


@needs_bf16
@pytest.mark.parametrize("k", [3, 10])
def test_bf16_drafts_give_bit_identical_logprobs(k):
    """bf16 on the lean forward: the draft rows' logprobs equal one-token
    decoding's to the bit, also for drafts longer than one decode-path
    attention item (they are split into queries of draft_q_len rows)."""
    bf16 = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), BS, 128)
    assert bf16.lean is not None and (k == 3 or k + 1 > bf16.draft_q_len)  # 10: more than one item
    sampling = pb.SeqSampling(logprobs=True, top_logprobs=4)
    plain = _decode(bf16, sampling)
    spec = _decode(bf16, sampling, lambda out: plain.out[len(out) : len(out) + k])
    assert spec.out == plain.out
    assert spec.lps == plain.lps  # exactly
    assert spec.tops == plain.tops
