"""CBSERVE_NATIVE_ISA caps the instruction set of both extensions: native._C's
attention dispatch and native._fused's linear kernels (AMX off under
`avx512`, the AVX512-BF16 kernels off under `avx2` / `generic`, the AVX2 fp32
kernel off under `generic`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import native
import native._fused as fused
from tests.conftest import REPO

_ISAS = ("generic", "avx2", "avx512", "amx")  # the order of cpu_features()["supported"]


def _runs(isa: str) -> bool:
    return bool(native.cpu_features()["supported"][_ISAS.index(isa)])


_PROBE = (
    "import json, native, native._fused as f; "
    "print(json.dumps({'isa': native.cpu_features()['isa'], "
    "'amx': f.amx_linear_supported(), 'avx512_bf16': f.avx512_linear_supported(), "
    "'avx2_f32': f.avx2_f32_linear_supported()}))"
)


def _probe(isa: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CBSERVE_NATIVE_ISA"}
    if isa is not None:
        env["CBSERVE_NATIVE_ISA"] = isa
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_unset_both_extensions_take_what_the_cpu_offers():
    got = _probe(None)
    assert got["isa"] == native.cpu_features()["best_isa"]
    assert got["amx"] == fused.amx_linear_supported()
    assert got["avx512_bf16"] == fused.avx512_linear_supported()
    assert got["avx2_f32"] == fused.avx2_f32_linear_supported()


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_a_cap_below_avx512_turns_every_bf16_linear_kernel_off(isa):
    if not _runs(isa):
        pytest.skip(f"this CPU does not run {isa}")
    got = _probe(isa)
    # The AVX2 fp32 kernel stays on under `avx2` (where the CPU has it), off under `generic`.
    assert got == {"isa": isa, "amx": False, "avx512_bf16": False, "avx2_f32": isa == "avx2" and _runs("avx2")}


def test_avx512_turns_amx_off_in_both_extensions():
    if not _runs("avx512"):
        pytest.skip("this CPU does not run the avx512 kernels")
    got = _probe("avx512")
    assert got["isa"] == "avx512" and got["amx"] is False
    assert got["avx512_bf16"] == fused.avx512_linear_supported()
