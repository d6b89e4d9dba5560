"""The paged KV cache: one block pool per layer, plus a host pool for swap.

Layout per layer, for K and for V: `[num_blocks, block_size, num_kv_heads,
head_dim]`; `slot = block_id * block_size + offset`. The router owns every
block table; this module only owns memory.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from executor.cpu.huge_pages import huge_buffer
from executor.errors import PlanError
from executor.preflight import host_available_bytes


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def blocks_for(self, num_bytes: int) -> int:
        return max(0, num_bytes // self.bytes_per_block)


def cache_dtype(name: str, model_dtype: torch.dtype, device: str) -> torch.dtype:
    """The KV blocks' dtype for `cache.kv_cache_dtype`: 'auto' is the model's,
    'fp8_e5m2' one byte per value (vLLM's CPU fp8 cache format: the upper byte
    of an fp16, rounded to nearest even; the native kernels widen it exactly
    as they read it). ValueError where this build cannot serve it."""
    if name == "auto":
        return model_dtype
    if name == "fp8_e5m2":
        if torch.device(device).type != "cpu":
            raise ValueError(f"cache.kv_cache_dtype: fp8_e5m2 has CPU kernels only; {device} needs 'auto'")
        return torch.float8_e5m2
    raise ValueError(f"cache.kv_cache_dtype: {name!r} must be 'auto' or 'fp8_e5m2'")


def copyable(t: torch.Tensor) -> torch.Tensor:
    """t, or for an fp8 tensor its bytes: torch has no CPU index_copy_ for fp8."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e5m2, torch.float8_e4m3fn) else t


class KVCacheTooLarge(ValueError):
    """The configured pool cannot be allocated on its device (or the swap
    pool on the host)."""


def _check_fits(device: str, device_bytes: int, host_bytes: int) -> None:
    """Refuses a pool larger than the memory free for it now, before
    allocating (an allocation the kernel overcommits would fail later, on
    first touch, by the OOM killer)."""
    kind = torch.device(device).type
    on_host = host_bytes + (device_bytes if kind == "cpu" else 0)
    free = host_available_bytes()
    if free is not None and on_host > free:
        raise KVCacheTooLarge(
            f"the KV cache does not fit: it needs {on_host / 2**30:.2f} GiB of host memory "
            f"({device_bytes} bytes of blocks on {device}, {host_bytes} of swap), "
            f"{free / 2**30:.2f} GiB are available; lower cache.kv_cache_bytes / "
            f"cache.num_blocks / cache.swap_space_bytes"
        )
    if kind == "cuda":
        gpu_free, _ = torch.cuda.mem_get_info(torch.device(device))
        if device_bytes > gpu_free:
            raise KVCacheTooLarge(
                f"the KV cache does not fit: {device_bytes / 2**30:.2f} GiB of blocks on "
                f"{device}, {gpu_free / 2**30:.2f} GiB free there; lower cache.kv_cache_bytes "
                f"or cache.num_blocks"
            )


def available_bytes(device: str) -> int | None:
    """Memory a KV pool on `device` could take now: free GPU memory, or the
    host's available memory (within a cgroup limit) for the CPU."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    return host_available_bytes()


def cpu_pool(count: int, dims: tuple[int, ...], dtype: torch.dtype) -> tuple[list[torch.Tensor], mmap.mmap | None]:
    """`count` zeroed CPU tensors of shape `dims` in one private anonymous
    mapping marked for transparent huge pages (where the kernel offers them),
    and the mapping (None for an empty pool; the tensors hold a reference to
    it, so it lives as long as they do).

    The router hands out blocks from anywhere in the pool, so a sequence's
    blocks end up scattered over it (~1 GB for SmolLM2 by default). With 4 KB
    pages nearly every block read by attention then starts with a page walk
    that misses the caches; 2 MB pages take the walks away (docs/operations.md,
    "Memory"). The pages are
    touched here, so the memory is committed at start-up as before."""
    per = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
    if count * per == 0:
        return [torch.zeros(dims, dtype=dtype) for _ in range(count)], None
    flat, buf = huge_buffer(count * per)
    flat.zero_()  # commit now (and fault in the huge pages), not on a block's first use
    pool = flat.view(dtype).view(count, *dims)
    return list(pool.unbind(0)), buf


class KVCache:
    def __init__(self, shape: CacheShape, num_blocks: int, num_swap_blocks: int = 0, device: str = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block: raise cache.kv_cache_bytes")
        self.shape = shape
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        dims = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        host = (num_swap_blocks, *dims[1:])
        pin = device != "cpu" and torch.cuda.is_available()
        _check_fits(device, num_blocks * shape.bytes_per_block, num_swap_blocks * shape.bytes_per_block)
        try:
            if torch.device(device).type == "cpu":
                pool, _ = cpu_pool(2 * shape.num_layers, dims, shape.dtype)
                self.key, self.value = pool[: shape.num_layers], pool[shape.num_layers :]
            else:
                self.key = [torch.zeros(dims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
                self.value = [torch.zeros(dims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
            self.host_key = [torch.zeros(host, dtype=shape.dtype, pin_memory=pin) for _ in range(shape.num_layers)]
            self.host_value = [torch.zeros(host, dtype=shape.dtype, pin_memory=pin) for _ in range(shape.num_layers)]
        except (RuntimeError, OSError) as exc:  # torch.OutOfMemoryError and a refused mapping included
            raise KVCacheTooLarge(
                f"the KV cache does not fit: {num_blocks} blocks on {device} and {num_swap_blocks} swap blocks "
                f"on the host, {shape.bytes_per_block} bytes each ({exc.__class__.__name__}: "
                f"{str(exc).splitlines()[0][:200]}); lower cache.kv_cache_bytes / cache.num_blocks / "
                f"cache.swap_space_bytes"
            ) from None

    def _check(self, pairs: list[tuple[int, int]], src_n: int, dst_n: int, what: str) -> None:
        for src, dst in pairs:
            if not (0 <= src < src_n and 0 <= dst < dst_n):
                raise PlanError(f"{what}: block copy {src}->{dst} out of range")

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copies device blocks to host blocks (src device id, dst host id)."""
        if not pairs:
            return
        self._check(pairs, self.num_blocks, self.num_swap_blocks, "swap_out")
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        for dev, host in ((self.key, self.host_key), (self.value, self.host_value)):
            for layer in range(len(dev)):
                d = copyable(dev[layer])
                copyable(host[layer]).index_copy_(0, dst, d.index_select(0, src.to(d.device)).cpu())

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copies host blocks back to device blocks (src host id, dst device id)."""
        if not pairs:
            return
        self._check(pairs, self.num_swap_blocks, self.num_blocks, "swap_in")
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        for dev, host in ((self.key, self.host_key), (self.value, self.host_value)):
            for layer in range(len(dev)):
                d = copyable(dev[layer])
                d.index_copy_(0, dst.to(d.device), copyable(host[layer]).index_select(0, src).to(d.device))
