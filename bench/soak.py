"""`cbserve bench soak`: a bounded run of mixed traffic with faults, which
fails if anything is lost.

Against one `cbserve serve` (the tiny model by default), for `--minutes`:
valid streams and unary calls, clients that cancel after their first token,
short deadlines, invalid and oversized inputs, slow readers, and Poisson
bursts above capacity; meanwhile the executor is SIGKILLed twice and
SIGSTOPped once (past `executor.step_timeout_s`, so the supervisor kills it).
Every request's outcome is recorded, and the router's and the executor's
RSS every second. It fails (exit 1) if a request ends with a status outside
the defined ones, if anything is running, waiting or holding KV blocks once
traffic stops, or if the router's RSS (or the last executor's) grew more
than `--max-rss-growth` (10 %) between the first and the last quarter of its
samples after the first 30 s (allocator arenas and caches fill while traffic
ramps up; the router's ~110 MB start would read that as growth in a short
run). A run of a few minutes has every executor restart inside that window,
and the router's native heap settles over minutes, not seconds: such a run
needs a looser bound (docs/operations.md, "Soak").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import grpc

# The ways a request may end under this traffic and these faults.
DEFINED = {
    "OK",
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "INVALID_ARGUMENT",
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "ALREADY_EXISTS",
}
KINDS = ("stream", "unary", "cancel", "deadline", "invalid", "oversized", "slow_reader", "burst")


async def _one(stub, kind: str, rng: random.Random, gpb) -> str:
    def req(n: int, **kw):
        r = gpb.GenerateRequest(stopping=gpb.StoppingCriteria(max_new_tokens=n, ignore_eos=True), **kw)
        if "text" not in kw and "token_ids" not in kw:
            r.token_ids.ids.extend(rng.randrange(3, 259) for _ in range(rng.randint(1, 40)))
        return r

    try:
        if kind in ("stream", "burst"):
            async for _ in stub.Generate(req(rng.randint(1, 48)), timeout=120):
                pass
        elif kind == "unary":
            await stub.Complete(req(rng.randint(1, 48)), timeout=120)
        elif kind == "cancel":
            call = stub.Generate(req(200), timeout=120)
            await call.read()
            call.cancel()
            return "CANCELLED"
        elif kind == "deadline":
            await stub.Complete(req(500), timeout=rng.uniform(0.05, 0.5))
        elif kind == "invalid":
            bad = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[5, 10**6]))
            await stub.Complete(bad, timeout=30)
        elif kind == "oversized":
            await stub.Complete(req(1, text="x" * 1_200_000), timeout=30)
        elif kind == "slow_reader":
            async for _ in stub.Generate(req(64), timeout=120):
                await asyncio.sleep(0.05)
        return "OK"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    except asyncio.CancelledError:
        return "CANCELLED"


def _rss(pid: int | None) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            return int(fh.read().split("VmRSS:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError, TypeError):
        return None


def _executor_pid(router_pid: int) -> int | None:
    import psutil

    try:
        for c in psutil.Process(router_pid).children(recursive=True):
            if "executor" in " ".join(c.cmdline()):
                return c.pid
    except psutil.Error:
        pass
    return None


SAMPLE_EVERY_S = 1.0
WARM_UP_SAMPLES = round(30 / SAMPLE_EVERY_S)


def _growth(samples: list[int]) -> float:
    """Mean of the last quarter over the mean of the first, minus 1, of the
    samples after the warm-up (all of them in a run too short to drop it)."""
    if len(samples) >= 2 * WARM_UP_SAMPLES:
        samples = samples[WARM_UP_SAMPLES:]
    q = max(1, len(samples) // 4)
    first, last = statistics.mean(samples[:q]), statistics.mean(samples[-q:])
    return last / first - 1.0


async def run(minutes: float, rate: float, seed: int, out: Path, max_rss_growth: float = 0.10) -> dict:
    from bench.metrics_scrape import scrape
    from bench.server import CbserveServer
    from cbserve.v1 import generation_pb2 as gpb
    from cbserve.v1 import generation_pb2_grpc as gpb_grpc

    extra = {"executor": {"step_timeout_s": 3.0}, "limits": {"max_queued_requests": 64}}
    server = CbserveServer(
        out.parent / "soak-work", "fcfs", model="tiny", dtype="float32", config_overrides={"extra": extra}
    )
    server.start()
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    rss: dict[str, list] = {"router": [], "executor": []}
    exe_pids: list[int] = []
    t0 = time.monotonic()
    end = t0 + minutes * 60
    faults = [(0.25, "kill"), (0.45, "stop"), (0.6, "kill")]
    done_faults: list[str] = []
    try:
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = gpb_grpc.GenerationStub(ch)
            tasks: set[asyncio.Task] = set()

            async def record(kind: str) -> None:
                outcomes[(kind, await _one(stub, kind, rng, gpb))] += 1

            next_sample = t0
            while time.monotonic() < end:
                now = time.monotonic()
                frac = (now - t0) / (end - t0)
                if faults and frac >= faults[0][0]:
                    _, fault = faults.pop(0)
                    pid = _executor_pid(server.proc.pid)
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                        done_faults.append(f"{fault} at {now - t0:.0f}s")
                if now >= next_sample:
                    pid = _executor_pid(server.proc.pid)
                    if pid is not None and (not exe_pids or exe_pids[-1] != pid):
                        exe_pids.append(pid)
                        rss["executor"].append([])
                    rss["router"].append(_rss(server.proc.pid))
                    snap = await asyncio.to_thread(scrape, server.metrics_url)
                    up = snap is not None and snap.values.get("cbserve_executor_up") == 1
                    if pid is not None and up:  # serving: its start-up (loading the model) is not growth
                        rss["executor"][-1].append(_rss(pid))
                    next_sample = now + SAMPLE_EVERY_S
                kind = rng.choice(KINDS)
                n = rng.randint(20, 40) if kind == "burst" and rng.random() < 0.05 else 1  # above capacity
                for _ in range(n):
                    t = asyncio.ensure_future(record(kind))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                await asyncio.sleep(rng.expovariate(rate))
            if tasks:
                await asyncio.wait(tasks, timeout=180)
        # Traffic has stopped: nothing may be left behind.
        deadline = time.monotonic() + 60
        m: dict = {}
        while time.monotonic() < deadline:
            snap = scrape(server.metrics_url)
            m = snap.values if snap is not None else {}
            if (
                m.get("cbserve_num_requests_running", 1) == 0
                and m.get("cbserve_num_requests_waiting", 1) == 0
                and m.get("cbserve_kv_cache_usage_ratio", 1) == 0
            ):
                break
            await asyncio.sleep(0.5)
        leftover = {
            k: m.get(k)
            for k in (
                "cbserve_num_requests_running",
                "cbserve_num_requests_waiting",
                "cbserve_kv_cache_usage_ratio",
                "cbserve_num_requests_swapped",
            )
        }
    finally:
        server.stop()
    router_rss = [r for r in rss["router"] if r]
    # The last incarnation's samples once serving, less its first steps' warm-up.
    exe_rss = [r for r in (rss["executor"][-1] if rss["executor"] else []) if r][3:]
    undefined = {f"{k}:{s}": n for (k, s), n in outcomes.items() if s not in DEFINED}
    result = {
        "minutes": minutes,
        "requests": sum(outcomes.values()),
        "outcomes": {f"{k}:{s}": n for (k, s), n in sorted(outcomes.items())},
        "faults": done_faults,
        "executor_incarnations": len(exe_pids),
        "leftover": leftover,
        "router_rss_mb": [round(r / 2**20, 1) for r in router_rss],
        "executor_rss_mb": [round(r / 2**20, 1) for r in exe_rss],
        "router_rss_growth": round(_growth(router_rss), 4) if len(router_rss) >= 4 else None,
        "executor_rss_growth": round(_growth(exe_rss), 4) if len(exe_rss) >= 4 else None,
        "undefined": undefined,
    }
    problems = []
    if undefined:
        problems.append(f"requests ended with undefined statuses: {undefined}")
    if any(v for k, v in leftover.items() if v):
        problems.append(f"left behind once traffic stopped: {leftover}")
    for name in ("router_rss_growth", "executor_rss_growth"):
        if result[name] is not None and result[name] > max_rss_growth:
            problems.append(f"{name} {result[name]:.1%} is above {max_rss_growth:.0%}")
    result["problems"] = problems
    out.write_text(json.dumps(result, indent=1))
    return result


def plot(result: dict, path: Path) -> None:
    """The router's and the last executor's RSS over the run (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(result["router_rss_mb"], label="router")
    exe = result["executor_rss_mb"]
    ax.plot(range(len(result["router_rss_mb"]) - len(exe), len(result["router_rss_mb"])), exe, label="last executor")
    ax.set_xlabel("seconds (samples)")
    ax.set_ylabel("RSS, MiB")
    ax.set_title(
        f"cbserve bench soak: {result['minutes']:g} min, {result['requests']} requests, faults: "
        f"{len(result['faults'])}",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cbserve bench soak", description=__doc__)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=8.0, help="mean request arrivals per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/soak.json")
    p.add_argument("--plot", default="", help="also write the RSS curve here (PNG)")
    p.add_argument(
        "--max-rss-growth",
        type=float,
        default=0.10,
        help="fail above this RSS growth, first to last quarter after the warm-up (0.10 = 10 %%)",
    )
    a = p.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(a.minutes, a.rate, a.seed, out, a.max_rss_growth))
    if a.plot:
        plot(result, Path(a.plot))
    sys.stdout.write(
        f"{result['requests']} requests in {a.minutes} min; faults: {', '.join(result['faults'])}; "
        f"router RSS growth {result['router_rss_growth']}, executor {result['executor_rss_growth']}\n"
    )
    for k, v in result["outcomes"].items():
        sys.stdout.write(f"  {k}: {v}\n")
    for problem in result["problems"]:
        sys.stdout.write(f"PROBLEM: {problem}\n")
    sys.stdout.write(f"wrote {out}\n")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
