"""The linear-kernel table of docs/kernels.md (bench/linear_kernels.py): its
GB/s column divides the bytes the fastest kernel's weights take (GGUF blocks
are smaller than bf16 tiles), and the random blocks it times have the layout
the kernels read."""

from __future__ import annotations

import torch

from bench import linear_kernels as lk


def test_gb_s_uses_the_fastest_kernels_bytes():
    rows = [
        {
            "rows": 1,
            "ms": {"F.linear": 20.0, "amx_linear": 10.0, "amx_linear GGUF blocks": 8.0},
            "weight_mb": {"F.linear": 270.0, "amx_linear": 270.0, "amx_linear GGUF blocks": 96.0},
            "packed_linear": "amx_linear",
        },
        {
            "rows": 512,
            "ms": {"F.linear": 100.0, "amx_linear": 120.0, "amx_linear GGUF blocks": 115.0},
            "weight_mb": {"F.linear": 270.0, "amx_linear": 270.0, "amx_linear GGUF blocks": 96.0},
            "packed_linear": "F.linear",
        },
    ]
    lines = lk.table(rows).splitlines()
    assert lines[2] == "| 1 | 20.00 | 10.00 | 8.00 | 12.0 | amx_linear GGUF blocks | amx_linear |"
    assert lines[3] == "| 512 | 100.00 | 120.00 | 115.00 | 2.7 | F.linear | F.linear |"
    assert "270 MB of bf16 weights, 96 MB as GGUF blocks" in lines[-1]


def test_random_blocks_have_the_packed_layouts():
    g = torch.Generator().manual_seed(0)
    q4 = lk._random_blocks(64, 64, "q4_1", g)
    q8 = lk._random_blocks(32, 96, "q8_0", g)
    assert q4.pack().dtype == q8.pack().dtype == torch.uint8
    assert tuple(q4.pack().shape) == (4, 2, 320) and tuple(q8.pack().shape) == (2, 3, 544)
    assert tuple(q4.pack_rows().shape) == (2, 2, 2, 320) and q8.pack_rows() is None
    assert not torch.equal(q4.pack(), lk._random_blocks(64, 64, "q4_1", g).pack())  # drawn, not constant
