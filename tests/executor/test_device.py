"""The executor's device and dtype choice, and the KV pool's memory check."""

from __future__ import annotations

import pytest
import torch

from executor import model_loader
from executor.kv_cache import CacheShape, KVCache, KVCacheTooLarge, host_available_bytes


def test_auto_is_the_first_gpu_when_torch_sees_one_else_the_cpu():
    want = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert model_loader.pick_device("auto") == want
    assert model_loader.pick_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "", "mps"])
def test_devices_that_are_not_cpu_or_cuda_are_refused(name):
    with pytest.raises(ValueError, match="is not auto|cpu|cuda|cuda:N"):
        model_loader.pick_device(name)


def test_a_gpu_index_torch_does_not_see_is_refused():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"torch sees {count} CUDA device"):
        model_loader.pick_device(f"cuda:{count}")
    if count == 0:
        with pytest.raises(ValueError, match="torch sees 0 CUDA device"):
            model_loader.pick_device("cuda")


def test_auto_dtype_depends_on_the_device():
    assert model_loader.pick_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    native_bf16 = model_loader.cpu_has_native_bf16()
    assert model_loader.pick_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native_bf16 else torch.float32)
    assert model_loader.pick_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype 'int8'"):
        model_loader.pick_dtype("int8")


def test_a_pool_larger_than_available_memory_is_refused_before_allocating():
    shape = CacheShape(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    free = host_available_bytes()
    assert free is not None and free > 0
    # Twice what is available: MemAvailable moves between the two reads (a
    # margin of one block failed once when other processes freed memory).
    too_many = 2 * free // shape.bytes_per_block
    # The up-front check's message (an allocation failure reads differently).
    with pytest.raises(KVCacheTooLarge, match="does not fit: it needs .* GiB of host memory"):
        KVCache(shape, too_many, 0)
    # The swap pool counts too.
    with pytest.raises(KVCacheTooLarge, match="of swap"):
        KVCache(shape, 4, too_many)
    pool = KVCache(shape, 4, 2)
    assert pool.key[0].shape == (4, 16, 2, 64) and pool.host_key[0].shape == (2, 16, 2, 64)


def _fake_root(tmp_path, meminfo_kb, files):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kb} kB\n")
    for rel, text in files.items():
        path = tmp_path / "sys" / "fs" / "cgroup" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize(
    "files, want",
    [
        ({}, 8 << 30),  # no cgroup files: MemAvailable
        ({"memory.max": "max\n", "memory.current": "123\n"}, 8 << 30),  # v2, no limit
        ({"memory.max": str(3 << 30), "memory.current": str(1 << 30)}, 2 << 30),  # v2 pod limit
        ({"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "5"}, 8 << 30),
        ({"memory/memory.limit_in_bytes": str(4 << 30), "memory/memory.usage_in_bytes": str(3 << 30)}, 1 << 30),
        ({"memory.max": str(1 << 30), "memory.current": str(2 << 30)}, 0),  # over its limit already
    ],
)
def test_available_memory_honours_a_cgroup_limit(tmp_path, files, want):
    assert host_available_bytes(_fake_root(tmp_path, 8 << 20, files)) == want


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_pool_larger_than_free_gpu_memory_is_refused_before_allocating():
    shape = CacheShape(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    gpu_free, _ = torch.cuda.mem_get_info(0)
    host_free = host_available_bytes()
    too_many = gpu_free // shape.bytes_per_block + (1 << 30) // shape.bytes_per_block  # 1 GiB over
    if host_free is not None and too_many * shape.bytes_per_block > host_free:
        pytest.skip("the host has less memory available than the GPU: the host check would answer first")
    allocated = torch.cuda.memory_allocated(0)
    with pytest.raises(KVCacheTooLarge, match=r"GiB of blocks on cuda:0, .* GiB free there"):
        KVCache(shape, too_many, 0, device="cuda:0")
    assert torch.cuda.memory_allocated(0) == allocated  # refused before allocating anything
    pool = KVCache(shape, 4, 2, device="cuda:0")
    assert pool.key[0].device.type == "cuda" and pool.host_key[0].device.type == "cpu"
    assert pool.host_key[0].is_pinned()
