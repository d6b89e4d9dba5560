"""The lean forward's last layer runs attention, o_proj and the MLP on the
rows that sample only (fast_forward.SampledRows): every row's K/V still
reaches the cache, and the sampled tokens stay those of the full forward."""

from __future__ import annotations

import torch

from cbserve.v1 import executor_pb2 as pb
from executor import model_loader, model_source
from executor.runner import ModelRunner
from tests.executor.helpers import needs_bf16


def _prompt(n: int, salt: int) -> list[int]:
    return [(11 * i + 7 * salt) % 250 + 3 for i in range(n)]


def _plans() -> list[pb.Plan]:
    """Chunked prefill beside decode rows: a chunk that samples nothing, a
    chunk that finishes its prompt, a whole prompt joining a decode batch."""
    new = lambda sid, n, prompt, blocks: pb.ScheduledSeq(  # noqa: E731
        seq_id=sid, num_tokens=n, new_block_ids=blocks, new=pb.NewSeq(token_ids=prompt, sampling=pb.SeqSampling())
    )
    more = lambda sid, n: pb.ScheduledSeq(seq_id=sid, num_tokens=n)  # noqa: E731
    plans = [
        pb.Plan(seqs=[new(0, 24, _prompt(40, 0), list(range(0, 4)))]),  # samples nothing
        pb.Plan(seqs=[more(0, 16), new(1, 9, _prompt(9, 1), [4, 5])]),  # both sample
        pb.Plan(seqs=[more(0, 1), more(1, 1), new(2, 30, _prompt(30, 2), [6, 7, 8])]),
    ]
    plans += [pb.Plan(seqs=[more(s, 1) for s in range(3)]) for _ in range(4)]  # decode only
    return plans


@needs_bf16
def test_last_layer_on_sampled_rows_only_keeps_the_cache_and_the_tokens():
    pruned = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), 16, 64)
    full = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), 16, 64)
    assert pruned.lean is not None
    lean_pruned, lean_full = pruned.lean, full.lean
    shapes = []  # (rows in the step, rows sampled or None, rows returned)

    def spy(ids, pos, meta, sampled=None):
        h = lean_pruned(ids, pos, meta, sampled)
        shapes.append((ids.shape[0], None if sampled is None else sampled.rows.numel(), h.shape[0]))
        return h

    def whole(ids, pos, meta, sampled=None):  # every row through every layer, then the sampled ones
        h = lean_full(ids, pos, meta)
        return h if sampled is None else h.index_select(0, sampled.rows)

    pruned.lean, full.lean = spy, whole
    for plan in _plans():
        a, b = pruned.step(plan), full.step(plan)
        assert (a.seq_ids, a.token_ids) == (b.seq_ids, b.token_ids)
        for layer in range(pruned.cache_shape.num_layers):
            assert torch.equal(pruned.kv.key[layer], full.kv.key[layer])
            assert torch.equal(pruned.kv.value[layer], full.kv.value[layer])
    # A chunk that samples nothing returns no rows; a mixed step returns only
    # its sampled rows; a decode-only step takes the whole-batch path.
    assert shapes[:3] == [(24, 0, 0), (25, 2, 2), (32, 3, 3)]
    assert shapes[3:] == [(3, None, 3)] * 4


@needs_bf16
def test_sampled_rows_match_the_full_forward_hidden_states():
    """The sampled rows' final hidden states: the same as the full forward's
    up to the last layer's attention kernel (a one-token query over the whole
    context instead of the chunk's last row)."""
    runner = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), 16, 64)
    lean = runner.lean
    got = {}

    def both(ids, pos, meta, sampled=None):
        if sampled is None:
            return lean(ids, pos, meta)
        h_full = lean(ids, pos, meta).index_select(0, sampled.rows)  # writes the same K/V twice
        h = lean(ids, pos, meta, sampled)
        got["pair"] = (h, h_full)
        return h

    runner.lean = both
    runner.step(
        pb.Plan(
            seqs=[
                pb.ScheduledSeq(
                    seq_id=0,
                    num_tokens=70,
                    new_block_ids=list(range(5)),
                    new=pb.NewSeq(token_ids=_prompt(70, 3), sampling=pb.SeqSampling()),
                )
            ]
        )
    )
    h, h_full = got["pair"]
    assert h.shape == h_full.shape == (1, runner.config.hidden_size)
    torch.testing.assert_close(h.float(), h_full.float(), rtol=0.02, atol=0.04)
