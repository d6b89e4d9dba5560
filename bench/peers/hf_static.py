"""Hugging Face `generate()` in static batches (the "HF pipelines" row).

Requests are taken in arrival order in batches of `batch_size`; each batch is
left-padded and runs until its longest member is done (members that asked for
fewer tokens keep occupying their row: that is the waste continuous batching
removes). EOS is ignored (no eos token id given to generate). A streamer
timestamps every step; a request's e2e ends when its batch returns (what a
client of a static server sees), its tokens are timestamped as produced. Only
the tokens each request asked for are counted.
"""

from __future__ import annotations

import math
import time
from typing import Any

from bench.stats import RequestRecord
from bench.workload import Workload


class _StepClock:
    """A generate() streamer that records the time of every decoding step."""

    def __init__(self):
        self.calls = 0
        self.times: list[float] = []

    def put(self, value):  # first call carries the prompt
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter())

    def end(self):
        pass


def run_hf_static(
    workload: Workload,
    model_dir: str,
    dtype: str = "bfloat16",
    batch_size: int = 16,
    progress: bool = True,
    num_threads: int | None = None,
    model=None,
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from bench.peers.common import norm_dtype

    dtype = norm_dtype(dtype)
    if num_threads:
        torch.set_num_threads(num_threads)
    t_load = time.perf_counter()
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    load_s = time.perf_counter() - t_load
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    gen_kw = dict(
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=None,
        use_cache=True,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    model.generation_config.eos_token_id = None  # EOS ignored

    def generate(batch, n, clock=None):
        L = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, L - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, L - len(r.prompt_ids) :] = 1
        with torch.inference_mode():
            return model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=n,
                min_new_tokens=n,
                streamer=clock,
                **gen_kw,
            )

    # Warm-up (excluded): one small batch.
    generate(workload.requests[: min(2, len(workload.requests))], 2)

    reqs = sorted(workload.requests, key=lambda r: (r.arrival_s, r.index))
    batches = [reqs[i : i + batch_size] for i in range(0, len(reqs), batch_size)]
    records = {
        r.index: RequestRecord(
            index=r.index, prompt_tokens=len(r.prompt_ids), max_new_tokens=r.max_new_tokens, arrival_s=r.arrival_s
        )
        for r in workload.requests
    }
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(reqs), desc=f"hf-static B={batch_size} {dtype}", unit="req", leave=False)
    t0 = time.perf_counter()
    steps_total = 0
    for batch in batches:
        # A static server starts a batch once its last member has arrived.
        start_at = max(r.arrival_s for r in batch)
        now = time.perf_counter() - t0
        if start_at > now:
            time.sleep(start_at - now)
        n = max(r.max_new_tokens for r in batch)
        clock = _StepClock()
        generate(batch, n, clock)
        end = time.perf_counter() - t0
        steps_total += n
        for r in batch:
            rec = records[r.index]
            rec.send_s = r.arrival_s  # latency counts from arrival (queueing included)
            rec.token_times = [t - t0 for t in clock.times[: r.max_new_tokens]]
            rec.output_tokens = len(rec.token_times)
            rec.end_s = end
            rec.finish_reason = "LENGTH"
            if rec.output_tokens != r.max_new_tokens:
                rec.error = f"produced {rec.output_tokens} of {r.max_new_tokens} tokens"
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    duration = time.perf_counter() - t0
    recs = [records[r.index] for r in workload.requests]
    useful = sum(r.max_new_tokens for r in workload.requests)
    slots = sum(len(b) * max(r.max_new_tokens for r in b) for b in batches)
    return {
        "records": recs,
        "duration_s": duration,
        "meta": {
            "batch_size": batch_size,
            "load_s": load_s,
            "num_batches": len(batches),
            "padding_waste": 1 - useful / slots if slots else math.nan,
            "torch_threads": torch.get_num_threads(),
        },
    }
