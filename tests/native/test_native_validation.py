"""Every validation rule of the native ops raises a clear Python exception."""

from __future__ import annotations

import importlib
import shutil
import subprocess

import pytest
import torch

import native
from tests.native.helpers import make_batch


def good_attention():
    batch = make_batch([3, 1], [5, 20], hq=4, hkv=2, d=64, block_size=8, extra_cols=0)
    batch["out"] = torch.empty_like(batch["query"])
    batch["scale"] = 0.125
    return batch


def good_cache():
    return dict(
        key=torch.randn(3, 2, 16),
        value=torch.randn(3, 2, 16),
        key_cache=torch.zeros(4, 8, 2, 16),
        value_cache=torch.zeros(4, 8, 2, 16),
        slot_mapping=torch.tensor([0, 9, -1]),
    )


def attention(**over):
    args = good_attention()
    args.update(over)
    native.paged_attention(**args)


def cache(**over):
    args = good_cache()
    args.update(over)
    native.reshape_and_cache(**args)


def test_good_arguments_pass():
    attention()
    cache()


# ---------------------------------------------------------------- attention ---
ATTN_CASES = [
    # (override builder, exception, message regex)
    ("device", lambda a: {"query": a["query"].to("meta")}, ValueError, "same device|unsupported device"),
    (
        "dtype_float",
        lambda a: {"query": a["query"].double(), "out": a["out"].double()},
        TypeError,
        "float32, bfloat16 or float16",
    ),
    (
        "dtype_mismatch",
        lambda a: {"key_cache": a["key_cache"].bfloat16(), "value_cache": a["value_cache"].bfloat16()},
        TypeError,
        "key_cache must have the dtype of query \\(Float\\) or be float8_e5m2",
    ),
    (
        "dtype_caches_differ",
        lambda a: {"key_cache": a["key_cache"].to(torch.float8_e5m2)},
        TypeError,
        "key_cache and value_cache must share one dtype",
    ),
    (
        "dtype_query_fp8",
        lambda a: {"query": a["query"].to(torch.float8_e5m2), "out": a["out"].to(torch.float8_e5m2)},
        TypeError,
        "query must be float32, bfloat16 or float16",
    ),
    ("dtype_out", lambda a: {"out": a["out"].half()}, TypeError, "share one dtype"),
    ("dtype_block_tables", lambda a: {"block_tables": a["block_tables"].long()}, TypeError, "block_tables must be Int"),
    ("dtype_cu", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"].long()}, TypeError, "cu_seqlens_q must be Int"),
    ("dtype_seq_lens", lambda a: {"seq_lens": a["seq_lens"].float()}, TypeError, "seq_lens must be Int"),
    (
        "contiguous",
        lambda a: {"query": a["query"].transpose(0, 1).contiguous().transpose(0, 1)},
        ValueError,
        "query must be contiguous",
    ),
    (
        "contiguous_cache",
        lambda a: {"value_cache": a["value_cache"].transpose(1, 2).contiguous().transpose(1, 2)},
        ValueError,
        "value_cache must be contiguous",
    ),
    (
        "rank_query",
        lambda a: {"query": a["query"].flatten(1), "out": a["out"].flatten(1)},
        ValueError,
        "out must have 3 dimensions|query must have 3 dimensions",
    ),
    ("rank_cache", lambda a: {"key_cache": a["key_cache"][0]}, ValueError, "key_cache must have 4 dimensions"),
    (
        "rank_block_tables",
        lambda a: {"block_tables": a["block_tables"].flatten()},
        ValueError,
        "block_tables must have 2 dimensions",
    ),
    ("rank_cu", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"][None]}, ValueError, "cu_seqlens_q must have 1 dimensions"),
    ("out_shape", lambda a: {"out": a["out"][:-1].contiguous()}, ValueError, "out shape"),
    ("cache_shapes", lambda a: {"value_cache": a["value_cache"][:-1].contiguous()}, ValueError, "shapes differ"),
    (
        "head_dim",
        lambda a: {"query": a["query"][..., :32].contiguous(), "out": a["out"][..., :32].contiguous()},
        ValueError,
        "head_dim mismatch",
    ),
    (
        "gqa",
        lambda a: {"query": a["query"][:, :3].contiguous(), "out": a["out"][:, :3].contiguous()},
        ValueError,
        "multiple of Hkv",
    ),
    ("cu_len", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"][:-1].contiguous()}, ValueError, "B\\+1=3 entries"),
    (
        "table_rows",
        lambda a: {"block_tables": a["block_tables"][:1].contiguous()},
        ValueError,
        "block_tables must have B=2 rows",
    ),
    (
        "cu_start",
        lambda a: {"cu_seqlens_q": torch.tensor([1, 3, 4], dtype=torch.int32)},
        ValueError,
        "cu_seqlens_q\\[0\\] must be 0",
    ),
    (
        "cu_monotone",
        lambda a: {
            "cu_seqlens_q": torch.tensor([0, 5, 4], dtype=torch.int32),
            "seq_lens": torch.tensor([8, 21], dtype=torch.int32),
        },
        ValueError,
        "non-decreasing",
    ),
    (
        "cu_end",
        lambda a: {"cu_seqlens_q": torch.tensor([0, 3, 3], dtype=torch.int32)},
        ValueError,
        "must equal the number of query tokens T=4",
    ),
    (
        "seq_lens_short",
        lambda a: {"seq_lens": torch.tensor([2, 21], dtype=torch.int32)},
        ValueError,
        "smaller than the sequence's query length 3",
    ),
    ("too_few_columns", lambda a: {"seq_lens": torch.tensor([8, 41], dtype=torch.int32)}, IndexError, "needs 6 blocks"),
    (
        "block_id_high",
        lambda a: {"block_tables": _poke(a["block_tables"], 1, 2, a["key_cache"].shape[0])},
        IndexError,
        "block_tables\\[1, 2\\] = \\d+ is out of range",
    ),
    (
        "block_id_negative",
        lambda a: {"block_tables": _poke(a["block_tables"], 0, 0, -1)},
        IndexError,
        "block_tables\\[0, 0\\] = -1 is out of range",
    ),
    ("scale", lambda a: {"scale": float("nan")}, ValueError, "scale must be finite"),
    (
        "out_is_cache",
        lambda a: {"out": a["key_cache"].view(-1, 4, 64)[: a["query"].shape[0]]},
        ValueError,
        "out must not overlap key_cache",
    ),
    ("out_is_query", lambda a: {"out": a["query"]}, ValueError, "out must not overlap query"),
]


def _poke(t, i, j, v):
    t = t.clone()
    t[i, j] = v
    return t


@pytest.mark.parametrize("name,build,exc,msg", ATTN_CASES, ids=[c[0] for c in ATTN_CASES])
def test_attention_rejects(name, build, exc, msg):
    args = good_attention()
    args.update(build(args))
    with pytest.raises(exc, match=msg):
        native.paged_attention(**args)


def test_attention_unused_table_columns_are_not_checked():
    args = good_attention()  # seq 0: 3 + 5 = 8 tokens (1 block), seq 1: 21 tokens (3 blocks)
    table = torch.full((2, 8), 10**6, dtype=torch.int32)
    table[0, 0] = args["block_tables"][0, 0]
    table[1, :3] = args["block_tables"][1, :3]
    args["block_tables"] = table
    native.paged_attention(**args)
    # A sequence with no query tokens this step touches no block at all.
    args["block_tables"] = torch.tensor([[int(table[0, 0])] + [-5] * 7, [-5] * 8], dtype=torch.int32)
    args["cu_seqlens_q"] = torch.tensor([0, 4, 4], dtype=torch.int32)
    args["seq_lens"] = torch.tensor([8, 21], dtype=torch.int32)
    native.paged_attention(**args)


# ------------------------------------------------------------ reshape_and_cache ---
CACHE_CASES = [
    ("device", lambda a: {"slot_mapping": a["slot_mapping"].to("meta")}, ValueError, "same device|unsupported device"),
    (
        "dtype_cache",
        lambda a: {"key_cache": a["key_cache"].double(), "value_cache": a["value_cache"].double()},
        TypeError,
        "key_cache must have the dtype of key and value \\(Float\\) or be float8_e5m2, got Double",
    ),
    ("dtype_mismatch", lambda a: {"key": a["key"].half()}, TypeError, "key and value must share one dtype"),
    (
        "dtype_key_fp8",
        lambda a: {"key": a["key"].to(torch.float8_e5m2), "value": a["value"].to(torch.float8_e5m2)},
        TypeError,
        "key must be float32, bfloat16 or float16",
    ),
    (
        "dtype_caches_differ",
        lambda a: {"value_cache": a["value_cache"].to(torch.float8_e5m2)},
        TypeError,
        "key_cache and value_cache must share one dtype",
    ),
    ("dtype_slots", lambda a: {"slot_mapping": a["slot_mapping"].int()}, TypeError, "slot_mapping must be Long"),
    (
        "contiguous",
        lambda a: {"key": a["key"].transpose(0, 1).contiguous().transpose(0, 1)},
        ValueError,
        "key must be contiguous",
    ),
    ("rank_key", lambda a: {"key": a["key"].flatten(1)}, ValueError, "key must have 3 dimensions"),
    ("rank_cache", lambda a: {"value_cache": a["value_cache"][0]}, ValueError, "value_cache must have 4 dimensions"),
    (
        "rank_slots",
        lambda a: {"slot_mapping": a["slot_mapping"][None]},
        ValueError,
        "slot_mapping must have 1 dimensions",
    ),
    ("kv_shapes", lambda a: {"value": a["value"][:2].contiguous()}, ValueError, "key and value shapes differ"),
    (
        "cache_shapes",
        lambda a: {"value_cache": a["value_cache"][:2].contiguous()},
        ValueError,
        "key_cache and value_cache shapes differ",
    ),
    (
        "head_shape",
        lambda a: {"key": a["key"][:, :1].contiguous(), "value": a["value"][:, :1].contiguous()},
        ValueError,
        "does not match the cache",
    ),
    (
        "slots_len",
        lambda a: {"slot_mapping": a["slot_mapping"][:2].contiguous()},
        ValueError,
        "slot_mapping must have T=3 entries",
    ),
    (
        "slot_high",
        lambda a: {"slot_mapping": torch.tensor([0, 32, 1])},
        IndexError,
        "slot_mapping\\[1\\] = 32 is out of range",
    ),
    ("same_cache", lambda a: {"value_cache": a["key_cache"]}, ValueError, "must not overlap"),
]


@pytest.mark.parametrize("name,build,exc,msg", CACHE_CASES, ids=[c[0] for c in CACHE_CASES])
def test_cache_rejects(name, build, exc, msg):
    args = good_cache()
    kc_before = args["key_cache"].clone()
    args.update(build(args))
    with pytest.raises(exc, match=msg):
        native.reshape_and_cache(**args)
    assert torch.equal(args["key_cache"], kc_before)  # nothing written on error


def test_cuda_tensors_without_cuda_build():
    if native.has_cuda():
        pytest.skip("extension built with CUDA")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device to make CUDA tensors")


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf not installed")
@pytest.mark.parametrize("module", ["native._C", "native._fused"])
def test_extensions_load_the_shared_libstdcxx(module):
    # A copy of libstdc++ linked into an extension crashes the process in the
    # first error message that formats a number (seen on the GPU machine with
    # a compiler wrapper that linked it statically; setup.py now refuses it).
    path = importlib.import_module(module).__file__
    needed = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    assert "libstdc++.so" in needed
    with pytest.raises(IndexError, match=r"block_tables\[0, 0\] = 1000000 is out of range"):
        batch = good_attention()
        batch["block_tables"][0, 0] = 10**6
        native.paged_attention(**batch)
