"""Shared helpers of the peer runners (kept free of torch/transformers imports
at module level so the vLLM venv can import it too)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

TORCH_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


def norm_dtype(d: str) -> str:
    try:
        return TORCH_DTYPES[d]
    except KeyError:
        raise ValueError(f"dtype must be bfloat16 or float32, got {d!r}") from None


def result_payload(
    system: str,
    dtype: str,
    workload_dict: dict,
    records: list[dict],
    duration_s: float,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "system": system,
        "dtype": dtype,
        "workload": workload_dict["spec"],
        "duration_s": duration_s,
        "records": records,
        "meta": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **(meta or {}),
        },
    }


def write_json(path: str | Path, obj: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, default=str))
    os.replace(tmp, p)
