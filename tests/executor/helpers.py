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


THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (always / madvise / never), None if unknown."""
    try:
        with open(THP, encoding="ascii") as fh:
            return fh.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def anon_huge_kb(lo: int, hi: int) -> int:
    """kB of huge pages (AnonHugePages of /proc/self/smaps) in the mappings
    that overlap the addresses [lo, hi)."""
    huge_kb = 0
    with open("/proc/self/smaps", encoding="ascii") as fh:
        inside = False
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < hi and end > lo
            elif inside and head == "AnonHugePages:":
                huge_kb += int(line.split()[1])
    return huge_kb


def mapping_of(addr: int) -> tuple[int, int]:
    """The [start, end) of the mapping of /proc/self/maps that holds `addr`."""
    with open("/proc/self/maps", encoding="ascii") as fh:
        for line in fh:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= addr < end:
                return start, end
    raise LookupError(hex(addr))
