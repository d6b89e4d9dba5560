"""lora_add (native/csrc/linear/lora_linear.cpp), the LoRA deltas of a
step's rows by slot, on each instruction set (CBSERVE_NATIVE_ISA caps this
CPU to AVX2 or portable code in child processes): against a float64
reference, in fp32 and bf16, with ranks below the stacks' 16, a projection
one slot's adapter leaves alone, column offsets and widths that end inside
a vector; each row's delta is the same alone as in a batch of mixed slots,
bit for bit; rows of slot 0 are left as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

_CHILD = r"""
import json, torch
import native._fused as f

torch.manual_seed(0)
S, R, out = 3, 32, {}
for dtype in (torch.float32, torch.bfloat16):
    for K, N, col0 in ((576, 192, 0), (100, 77, 5), (1536, 576, 64)):
        at = torch.zeros(S, K, R)
        bt = torch.zeros(S, R, N)
        ranks = torch.tensor([16, 0, 24], dtype=torch.int32)  # slot 2 leaves this projection alone
        for s, r in enumerate(ranks.tolist()):
            at[s, :, :r] = torch.randn(K, r) / K**0.5
            bt[s, :r] = torch.randn(r, N) * 0.1
        scales = torch.tensor([2.0, 1.0, 0.5])
        T = 21
        x = torch.randn(T, K).to(dtype)
        slots = torch.tensor([(i * 7) % 4 for i in range(T)], dtype=torch.int32)
        base = torch.randn(T, col0 + N + 3).to(dtype)
        got = base.clone()
        f.lora_add(x, got, col0, slots, at, bt, ranks, scales)
        want = base.double().clone()
        for t in range(T):
            s = int(slots[t])
            if s and ranks[s - 1]:
                d = (x[t].double() @ at[s - 1].double()) @ bt[s - 1].double() * float(scales[s - 1])
                want[t, col0 : col0 + N] += d
        err = (got.double() - want).abs().max().item()
        scale = want.abs().max().item()
        untouched = all(torch.equal(got[t], base[t]) for t in range(T) if int(slots[t]) in (0, 2))
        alone = True
        for t in range(T):  # each row alone, in a batch of one
            one = base[t : t + 1].clone()
            f.lora_add(x[t : t + 1].contiguous(), one, col0, slots[t : t + 1].clone(), at, bt, ranks, scales)
            alone = alone and torch.equal(one[0], got[t])
        out[f"{dtype}-{K}-{N}"] = {"err": err, "scale": scale, "untouched": untouched, "alone": alone}
print(json.dumps(out))
"""


@pytest.mark.parametrize("isa", ["", "avx2", "generic"])
def test_lora_add_on_each_instruction_set(isa):
    env = {k: v for k, v in os.environ.items() if k != "CBSERVE_NATIVE_ISA"}
    if isa:
        env["CBSERVE_NATIVE_ISA"] = isa
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, r in results.items():
        tol = 1e-5 if "float32" in case else 2**-7  # bf16: one rounding of the sum
        assert r["err"] <= tol * max(1.0, r["scale"]), (case, r)
        assert r["untouched"] and r["alone"], (case, r)
