"""What the CPU computes natively, read from /proc/cpuinfo: a leaf module
that model loading and the packed layers both ask, so neither imports the
other."""

from __future__ import annotations


def cpu_has_native_bf16() -> bool:
    """bf16 dot products in hardware (AVX512-BF16 or AMX): `--dtype auto` is
    bf16 there, fp32 elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = fh.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
