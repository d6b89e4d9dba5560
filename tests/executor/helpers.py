"""What several executor tests do with a ModelRunner."""

from __future__ import annotations

from cbserve.v1 import executor_pb2 as pb
from executor.runner import ModelRunner


def greedy(runner: ModelRunner, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """Prefills every prompt in one plan (greedy sampling, contiguous blocks
    from 0), then runs `n_new` decode steps of the whole batch; returns each
    prompt's first `n_new` sampled tokens."""
    seqs, nb = [], 0
    for i, p in enumerate(prompts):
        need = (len(p) + n_new + 15) // 16
        seqs.append(pb.ScheduledSeq(seq_id=i, num_tokens=len(p), new_block_ids=list(range(nb, nb + need)),
                                    new=pb.NewSeq(token_ids=p, sampling=pb.SeqSampling())))
        nb += need
    out = {i: [] for i in range(len(prompts))}
    res = runner.step(pb.Plan(seqs=seqs))
    for _ in range(n_new):
        for s, t in zip(res.seq_ids, res.token_ids):
            out[s].append(t)
        res = runner.step(pb.Plan(seqs=[pb.ScheduledSeq(seq_id=i, num_tokens=1) for i in range(len(prompts))]))
    return [out[i] for i in range(len(prompts))]
