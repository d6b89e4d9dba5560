"""Host memory on transparent huge pages, for what a CPU decode step streams:
the KV pool (executor/kv_cache.py) and the model's weights.

A decode step reads every weight once and each sequence's K/V blocks. On
4 KB pages those reads keep walking page tables (SmolLM2's 96 MB of packed
block weights are 24k pages, far more than the TLBs hold) and the hardware
prefetcher stops at every page boundary. 2 MB pages take both away (what that
buys a decode step: docs/operations.md, "Memory"). Where the kernel offers no
transparent huge pages (`never`) the same mappings get 4 KB pages and nothing
else changes.
"""

from __future__ import annotations

import mmap
from typing import Iterable

import torch

ALIGN = 64  # bytes: a cache line, and a multiple of every element size


def huge_buffer(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """A uint8 tensor of `nbytes` in a private anonymous mapping marked for
    transparent huge pages, not yet touched (the pages are committed where it
    is first written), and the mapping; the tensor holds a reference to it."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP unsupported or disabled: 4 KB pages
            pass
    return torch.frombuffer(buf, dtype=torch.uint8), buf


def movable(t: torch.Tensor, min_bytes: int = 1 << 16) -> bool:
    """Whether t is a dense CPU tensor over a storage of `min_bytes` or more.
    Opaque tensors (oneDNN's prepacked weights on CPUs without AMX) have no
    storage to move and stay where oneDNN put them."""
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_mkldnn
        and t.untyped_storage().nbytes() >= min_bytes
    )


def _storages(tensors: Iterable[torch.Tensor], min_bytes: int) -> dict[int, list[torch.Tensor]]:
    """Movable tensors by the storage they view (data pointer of its start);
    a tensor object once."""
    out: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen or not movable(t, min_bytes):
            continue
        seen.add(id(t))
        out.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    return out


@torch.no_grad()
def move_to_huge_pages(tensors: Iterable[torch.Tensor], min_bytes: int = 1 << 16) -> int:
    """Copies the storages of `tensors` (those of `min_bytes` or more) into
    one mapping on huge pages and points every given tensor that views them
    there (`Tensor.set_`, same offset, sizes and strides): every reference to
    those tensor objects sees the new memory, and the old storage is freed
    unless something else still holds it. Returns the bytes moved."""
    groups = _storages(tensors, min_bytes)
    sizes = {ptr: views[0].untyped_storage().nbytes() for ptr, views in groups.items()}
    offsets, total = {}, 0
    for ptr, n in sizes.items():
        offsets[ptr] = total
        total += -(-n // ALIGN) * ALIGN
    if total == 0:
        return 0
    arena, _ = huge_buffer(total)
    storage = arena.untyped_storage()
    for ptr, views in groups.items():
        off, n = offsets[ptr], sizes[ptr]
        old = torch.empty(0, dtype=torch.uint8).set_(views[0].untyped_storage())
        arena[off : off + n].copy_(old)
        del old
        for t in views:
            elem = t.element_size()
            t.set_(storage, off // elem + t.storage_offset(), t.size(), t.stride())
    return total


def module_tensors(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """Every tensor the modules hold directly: parameters, buffers and plain
    tensor attributes (prepacked weights, kept biases)."""
    out = []
    for mod in modules:
        out += [p for p in mod._parameters.values() if p is not None]
        out += [b for b in mod._buffers.values() if b is not None]
        out += [v for v in vars(mod).values() if isinstance(v, torch.Tensor)]
    return out


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under `tensors` (any device; meta and
    opaque oneDNN tensors hold none that can be counted): what a model's
    weights take in memory once loaded and packed."""
    sizes: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t.device.type == "meta" or t.layout != torch.strided or t.is_mkldnn:
            continue
        st = t.untyped_storage()
        sizes[(str(t.device), st.data_ptr())] = st.nbytes()
    return sum(sizes.values())
