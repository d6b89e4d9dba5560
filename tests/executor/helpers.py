"""What several executor tests do with a ModelRunner."""

from __future__ import annotations

import pytest
import torch

from executor.cpu.packed_linear import supported
from executor.runner import greedy_generate as greedy  # noqa: F401

# The bf16 fast paths (prepacked linears, the lean forward) run only here:
# natively, or on AVX2 CPUs over avx2_f32_linear's bf16 panels.
needs_bf16 = pytest.mark.skipif(
    not supported(torch.bfloat16, torch.device("cpu")), reason="no bf16 fast path here (neither native bf16 nor AVX2)"
)


def count_fused_calls(monkeypatch, names: tuple[str, ...] = ("rope_cache", "rope_split")) -> dict[str, int]:
    """Wraps native._fused's `names` so each call is counted in the returned dict."""
    import native._fused as fused

    calls = {name: 0 for name in names}
    for name in names:
        real = getattr(fused, name)

        def counted(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)

        monkeypatch.setattr(fused, name, counted)
    return calls


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


def greedy_with_hidden(runner, prompts: list[list[int]], steps: int):
    """Each prompt's greedy tokens and every step's final hidden states (the
    lean forward's output, spied on)."""
    hidden = []
    lean = runner.lean

    def spy(*args):
        h = lean(*args)
        hidden.append(h.clone())
        return h

    runner.lean = spy
    return greedy(runner, prompts, steps), hidden


def avx512_bf16() -> bool:
    """Whether native._fused runs its AVX512-BF16 kernels here (avx512_linear,
    amx_linear): the CPUs whose GGUF path reads blocks through them."""
    try:
        import native._fused as fused
    except ImportError:
        return False
    return bool(fused.avx512_linear_supported())
