"""Hugging Face transformers' own continuous batching
(`transformers.generation.continuous_batching`, used through the manager that
`model.init_continuous_batching()` returns: per-request max_new_tokens, EOS
disabled with eos_token_id=-1, per-token timestamps from record_timestamps).
Requests are added at their arrival offsets; warm-up is excluded.
"""

from __future__ import annotations

import math
import time
from typing import Any

from bench.stats import RequestRecord
from bench.workload import Workload


def run_hf_cb(
    workload: Workload,
    model_dir: str,
    dtype: str = "bfloat16",
    progress: bool = True,
    max_batch_tokens: int | None = None,
    num_threads: int | None = None,
    model=None,
    attn_implementation: str | None = None,
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from bench.peers.common import norm_dtype

    dtype = norm_dtype(dtype)
    if num_threads:
        torch.set_num_threads(num_threads)
    t_load = time.perf_counter()
    if model is None:
        kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), **kw).eval()
    load_s = time.perf_counter() - t_load
    cap = max(r.max_new_tokens for r in workload.requests)
    gen_cfg = GenerationConfig(
        do_sample=False, max_new_tokens=cap, eos_token_id=-1, pad_token_id=model.config.pad_token_id or 0
    )
    # On CPU the manager would size its KV cache from 90 % of *system* RAM
    # (psutil): give it what the workload needs instead (blocks of page_size
    # tokens, whole-model), with headroom.
    page = 256
    per_req = max(math.ceil((len(r.prompt_ids) + r.max_new_tokens + 1) / page) for r in workload.requests)
    cb_kw: dict[str, Any] = {"num_blocks": len(workload.requests) * per_req + 8, "page_size": page}
    if max_batch_tokens:
        cb_kw["max_batch_tokens"] = max_batch_tokens
    cb_cfg = ContinuousBatchingConfig(**cb_kw)
    t_init = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    if not getattr(manager, "warmed_up", True):
        manager.warmup()
    manager.start()
    init_s = time.perf_counter() - t_init

    records = {
        f"bench-{r.index}": RequestRecord(
            index=r.index, prompt_tokens=len(r.prompt_ids), max_new_tokens=r.max_new_tokens, arrival_s=r.arrival_s
        )
        for r in workload.requests
    }
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(records), desc=f"hf-cb {dtype}", unit="req", leave=False)
    try:
        # Warm-up request (excluded from the measurement).
        manager.add_request(workload.requests[0].prompt_ids, request_id="warmup", max_new_tokens=2, eos_token_id=-1)
        while True:
            res = manager.get_result(timeout=60)
            if res is None:
                raise RuntimeError("HF continuous batching: warm-up request did not finish")
            if res.request_id == "warmup" and res.is_finished():
                break

        pending = sorted(workload.requests, key=lambda r: (r.arrival_s, r.index))
        t0 = time.perf_counter()
        done = 0
        i = 0
        while done < len(records):
            now = time.perf_counter() - t0
            while i < len(pending) and pending[i].arrival_s <= now:
                r = pending[i]
                rid = f"bench-{r.index}"
                records[rid].send_s = time.perf_counter() - t0
                manager.add_request(
                    r.prompt_ids,
                    request_id=rid,
                    max_new_tokens=r.max_new_tokens,
                    record_timestamps=True,
                    eos_token_id=-1,
                )
                i += 1
            wait = 0.5 if i >= len(pending) else max(0.0, min(0.5, pending[i].arrival_s - now))
            res = manager.get_result(timeout=wait) if wait > 0 else None
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching thread stopped")
                continue
            rec = records.get(res.request_id)
            if rec is None or not res.is_finished():
                continue
            end = time.perf_counter() - t0
            ts = res.timestamps or []
            rec.token_times = [t - t0 for t in ts]
            rec.output_tokens = len(res.generated_tokens)
            if len(rec.token_times) != rec.output_tokens:  # no timestamps: mark end only
                rec.token_times = [end] * rec.output_tokens
            rec.end_s = rec.token_times[-1] if rec.token_times else end
            rec.finish_reason = "LENGTH"
            if res.error:
                rec.error = str(res.error)
            elif rec.output_tokens != rec.max_new_tokens:
                rec.error = f"produced {rec.output_tokens} of {rec.max_new_tokens} tokens"
            done += 1
            if bar is not None:
                bar.update(1)
        duration = time.perf_counter() - t0
    finally:
        if bar is not None:
            bar.close()
        manager.stop(block=True, timeout=10)
    recs = [records[f"bench-{r.index}"] for r in workload.requests]
    return {
        "records": recs,
        "duration_s": duration,
        "meta": {
            "load_s": load_s,
            "init_s": init_s,
            "torch_threads": torch.get_num_threads(),
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "max_batch_tokens": max_batch_tokens,
        },
    }
