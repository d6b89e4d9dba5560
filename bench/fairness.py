"""`cbserve bench fairness`: one tenant floods, another sends short requests;
what each scheduling policy gives the light tenant, beside vLLM-CPU.

The load (issue #55), through the OpenAI completions API (streamed, EOS
ignored, greedy), the tenant in the Gateway API Inference Extension's
header `x-gateway-inference-fairness-id` and in the `user` field:

- tenant `heavy` keeps `--heavy-streams` (40) requests in flight, each a
  128-token prompt and 192 output tokens, a new one as soon as one ends;
- tenant `light` sends one request at a time, 32 -> 16 tokens.

Each system runs `--warmup-s` (the flood fills the batch), then is measured
for `--seconds`: the light tenant's TTFT p50/p90/p99 (its requests sent in
the window), each tenant's output tok/s and the total (tokens whose arrival
falls in the window), and Jain's index over the two tenants' throughput
normalised by their max-min fair share (light: what it gets alone, its whole
demand, since it asks for less than half; heavy: the rest of the run's
total). The systems: light alone (fcfs), cbserve fcfs, priority (light's
requests ahead: OpenAI `priority` -1), fair, fair without preemption, fair
without pipelined decode (`scheduler.pipeline_decode: false`), and vLLM-CPU's own
OpenAI server (its default FCFS; it ignores the header). Then `weights`:
two flooding tenants `a` and `b` with `fair.weights` 1 and 3, and the
weighted service the router reports (cbserve_tenant_service_tokens_total,
prompt x 1 + output x 2) for each.

    cbserve bench fairness [--seconds 60] [--systems alone,fcfs,priority,fair,fair-nopreempt,vllm,weights]
                           [--json results.json]   (report: docs/benchmarks-tenants.md)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.http_client import stream_completion
from bench.metrics_scrape import fetch_text
from bench.online import SERVED_NAME, VllmServer, _cpu_model
from bench.runner import REPO, vllm_available
from bench.server import CbserveServer
from bench.stats import RequestRecord, percentiles

HEADER = "x-gateway-inference-fairness-id"
SYSTEMS = ("alone", "fcfs", "priority", "fair", "fair-nopreempt", "fair-nopipeline", "vllm", "weights")
MAX_NUM_SEQS = 8
VOCAB = (100, 40_000)  # random prompt token ids, away from special tokens


def _body(model: str, tenant: str, prompt_len: int, out_len: int, rng: random.Random, priority: int | None) -> dict:
    body = {
        "model": model,
        "prompt": [rng.randrange(*VOCAB) for _ in range(prompt_len)],
        "max_tokens": out_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "user": tenant,
    }
    if priority is not None:
        body["priority"] = priority
    return body


async def _loop(session, url, model, tenant, spec, rng, records, t0, end, priority=None) -> None:
    """Closed loop: one request after the other until `end` (run-relative)."""
    prompt_len, out_len = spec
    while time.perf_counter() - t0 < end:
        rec = RequestRecord(index=len(records), prompt_tokens=prompt_len, max_new_tokens=out_len)
        records.append(rec)
        body = _body(model, tenant, prompt_len, out_len, rng, priority)
        await stream_completion(session, url, body, rec, t0, headers={HEADER: tenant})
        if rec.error:
            await asyncio.sleep(0.2)


async def drive(base_url: str, model: str, tenants: dict[str, dict], total_s: float) -> dict[str, list]:
    """tenants: name -> {streams, prompt, output, priority}. Returns the
    records of each tenant, times relative to the start."""
    url = f"{base_url}/completions"
    records: dict[str, list] = {t: [] for t in tenants}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        tasks = []
        for name, spec in tenants.items():
            for i in range(spec["streams"]):
                rng = random.Random(hash((name, i)) & 0xFFFF)
                tasks.append(
                    _loop(
                        session,
                        url,
                        model,
                        name,
                        (spec["prompt"], spec["output"]),
                        rng,
                        records[name],
                        t0,
                        total_s,
                        spec.get("priority"),
                    )
                )
        await asyncio.gather(*tasks)
    return records


def window_stats(records: list[RequestRecord], lo: float, hi: float) -> dict[str, Any]:
    sent = [r for r in records if lo <= r.send_s < hi]
    ttfts = [r.ttft for r in sent if r.ok and r.token_times]
    tokens = sum(1 for r in records for t in r.token_times if lo <= t < hi)
    return {
        "requests": len(sent),
        "errors": sum(1 for r in sent if not r.ok),
        "ttft": percentiles(ttfts) if ttfts else {},
        "tok_s": tokens / (hi - lo),
    }


def jain(xs: list[float]) -> float:
    s, q = sum(xs), sum(x * x for x in xs)
    return s * s / (len(xs) * q) if q else math.nan


LIGHT = {"streams": 1, "prompt": 32, "output": 16}
HEAVY = {"streams": 40, "prompt": 128, "output": 192}


def _scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(fetch_text(url, timeout=5)):
        for s in fam.samples:
            if s.name == "cbserve_tenant_service_tokens_total":
                key = (s.labels["tenant"], s.labels["kind"])
                out[key] = out.get(key, 0.0) + s.value
    return out


def run_system(name: str, args, workdir: Path) -> dict[str, Any]:
    heavy = dict(HEAVY, streams=args.heavy_streams)
    light = dict(LIGHT)
    tenants: dict[str, dict] = {"heavy": heavy, "light": light}
    sched: dict[str, Any] = {"max_num_seqs": MAX_NUM_SEQS}
    policy = "fcfs"
    if name == "alone":
        tenants = {"light": light}
    elif name == "priority":
        policy = "priority"
        light["priority"] = -1  # the OpenAI API takes vLLM's sense: lower goes first
    elif name == "fair":
        policy = "fair"
    elif name == "fair-nopreempt":
        policy = "fair"
        sched["extra"] = {"scheduler": {"fair": {"preempt": False}}}
    elif name == "fair-nopipeline":  # no decode planned ahead: an arrival waits for one step, not two
        policy = "fair"
        sched["extra"] = {"scheduler": {"pipeline_decode": False}}
    elif name == "weights":
        policy = "fair"
        tenants = {"a": dict(heavy), "b": dict(heavy)}
        sched["extra"] = {"scheduler": {"fair": {"weights": {"a": 1, "b": 3}}}}
    total = args.warmup_s + args.seconds
    here = workdir / name  # each system's config and server log
    here.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    if name == "vllm":
        server = VllmServer(args.model_dir, args.dtype, here, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=512)
        base = lambda s: s.base_url  # noqa: E731
    else:
        server = CbserveServer(here, policy, dtype=args.dtype, config_overrides=sched)
        base = lambda s: f"http://127.0.0.1:{s.http_port}/v1"  # noqa: E731
    scrapes: dict[str, dict] = {}
    with server:
        startup = time.perf_counter() - t_start
        timers = []
        if name == "weights":  # the router's own count of the window's service
            for key, at in (("before", args.warmup_s), ("after", total)):
                timer = threading.Timer(at, lambda k=key: scrapes.__setitem__(k, _scrape(server.metrics_url)))
                timer.start()
                timers.append(timer)
        records = asyncio.run(drive(base(server), SERVED_NAME, tenants, total))
        for timer in timers:
            timer.join()
    before, after = scrapes.get("before", {}), scrapes.get("after", {})
    lo, hi = args.warmup_s, total
    out: dict[str, Any] = {"system": name, "policy": policy, "startup_s": startup}
    out["tenants"] = {t: window_stats(recs, lo, hi) for t, recs in records.items()}
    out["total_tok_s"] = sum(s["tok_s"] for s in out["tenants"].values())
    if name == "weights":
        service = {}
        for t in ("a", "b"):
            got = {k: after.get((t, k), 0.0) - before.get((t, k), 0.0) for k in ("prompt", "output")}
            service[t] = got["prompt"] * 1 + got["output"] * 2
        out["weighted_service"] = service
        out["service_ratio"] = service["b"] / service["a"] if service["a"] else math.nan
    return out


def summarise(results: dict[str, dict]) -> None:
    alone = results.get("alone")
    if alone is None:
        return
    light_alone = alone["tenants"]["light"]["tok_s"]
    for name, r in results.items():
        t = r["tenants"]
        if "heavy" in t and "light" in t and light_alone:
            fair_light = light_alone
            fair_heavy = max(r["total_tok_s"] - fair_light, 1e-9)
            r["jain"] = jain([t["light"]["tok_s"] / fair_light, t["heavy"]["tok_s"] / fair_heavy])


def render(results: dict[str, dict], args, command: str) -> str:
    lines = [
        "## Fair share: a flooding tenant and a light one",
        "",
        f"`{command}` on {_cpu_model()} ({platform.machine()}), nothing else running; SmolLM2-135M {args.dtype},",
        f"`max_num_seqs` {MAX_NUM_SEQS}; tenant `heavy` keeps {args.heavy_streams} streams in flight "
        f"({HEAVY['prompt']} -> {HEAVY['output']} tokens), tenant `light` sends one request at a time "
        f"({LIGHT['prompt']} -> {LIGHT['output']}); {args.warmup_s:.0f} s of flood first, then "
        f"{args.seconds:.0f} s measured. TTFT of the light tenant's requests in seconds; tok/s are output tokens.",
        "",
        "| system | light TTFT p50 | p90 | p99 | light req | light tok/s | heavy tok/s | total tok/s | Jain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if name == "weights":
            continue
        t = r["tenants"]
        lt = t["light"]["ttft"]
        heavy = t.get("heavy", {}).get("tok_s", math.nan)
        lines.append(
            f"| {name} | {lt.get('p50', math.nan):.3f} | {lt.get('p90', math.nan):.3f} | {lt.get('p99', math.nan):.3f} "
            f"| {t['light']['requests']} | {t['light']['tok_s']:.1f} | {heavy:.1f} | {r['total_tok_s']:.1f} "
            f"| {r.get('jain', math.nan):.3f} |"
        )
    w = results.get("weights")
    if w:
        lines += [
            "",
            f"Weights: tenants `a` (weight 1) and `b` (weight 3) each keep {args.heavy_streams} streams in flight "
            f"under `fair`; weighted service in the window (prompt x 1 + output x 2, from "
            f"cbserve_tenant_service_tokens_total): "
            f"a {w['weighted_service']['a']:.0f}, b {w['weighted_service']['b']:.0f}, "
            f"b / a = {w['service_ratio']:.2f} (output tok/s a {w['tenants']['a']['tok_s']:.1f}, "
            f"b {w['tenants']['b']['tok_s']:.1f}).",
        ]
    lines += ["", *targets(results)]
    return "\n".join(lines) + "\n"


def targets(results: dict[str, dict]) -> list[str]:
    out = ["Targets (issue #55):", ""]
    alone, fcfs, fair = results.get("alone"), results.get("fcfs"), results.get("fair")
    if alone and fcfs and fair:
        a = alone["tenants"]["light"]["ttft"].get("p90", math.nan)
        f = fcfs["tenants"]["light"]["ttft"].get("p90", math.nan)
        p = fair["tenants"]["light"]["ttft"].get("p90", math.nan)

        def verdict(ok):
            return "met" if ok else "MISSED"

        out.append(f"- light TTFT p90 under fair {p:.3f} s: <= 2x alone ({2 * a:.3f} s): {verdict(p <= 2 * a)}")
        out.append(f"- ... and <= 0.1x fcfs ({0.1 * f:.3f} s): {verdict(p <= 0.1 * f)}")
        share = fair["total_tok_s"] / fcfs["total_tok_s"]
        out.append(f"- total throughput under fair {share:.1%} of fcfs (>= 95 %): {verdict(share >= 0.95)}")
    w = results.get("weights")
    if w:
        ok = abs(w["service_ratio"] - 3) <= 0.3
        out.append(f"- weights 1:3 served 1:{w['service_ratio']:.2f} (within 10 %): {'met' if ok else 'MISSED'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cbserve bench fairness", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="measured window per system")
    ap.add_argument("--warmup-s", type=float, default=15.0, help="flood before the window")
    ap.add_argument("--heavy-streams", type=int, default=HEAVY["streams"])
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)}")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workdir", type=Path, default=REPO / "bench" / "results" / "fairness")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown systems {bad}; choose from {SYSTEMS}")
    if "vllm" in systems:
        if not vllm_available():
            print("fairness: vLLM-CPU peer not installed (make bench-peers): its row is skipped", file=sys.stderr)
            systems.remove("vllm")
        else:
            from bench.hf_export import export_smollm2_hf

            args.model_dir = str(export_smollm2_hf(verbose=False))
    args.workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for name in systems:
        print(f"fairness: {name} ...", file=sys.stderr, flush=True)
        results[name] = run_system(name, args, args.workdir)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    summarise(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    command = "cbserve bench fairness " + " ".join(argv if argv is not None else sys.argv[1:])
    print(render(results, args, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
