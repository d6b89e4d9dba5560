"""Markdown tables and PNG plots (matplotlib, Agg) from benchmark results.

Input is the suite's results dict (see bench.suite): runs (one per system x
cap [x dtype]), optional roofline, overheads and rate sweep, plus machine and
version facts. `render_report(results, out_dir)` writes benchmarks.md and the
PNGs next to it and returns the markdown path.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.stats import lower_middle  # noqa: E402
from bench.targets import alone_rows, evaluate, limits_text, phase_rows, run_ratio  # noqa: E402

# Row order of the classic table.
SYSTEM_ORDER = ["hf-static", "hf-cb", "vllm-cpu", "cbserve-static", "cbserve-dynamic", "cbserve-fcfs"]
SYSTEM_LABELS = {
    "hf-static": "HF generate() static batches",
    "hf-cb": "HF continuous batching",
    "vllm-cpu": "vLLM-CPU",
    "cbserve-static": "cbserve static",
    "cbserve-dynamic": "cbserve dynamic",
    "cbserve-fcfs": "cbserve fcfs (continuous)",
}
BASELINE = "hf-static"


def _fmt(v: Any, nd: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        if abs(v) >= 100:
            return f"{v:.0f}"
        return f"{v:.{nd}f}"
    return str(v)


def _ms(v: float | None) -> str:
    return (
        "–"
        if v is None or (isinstance(v, float) and math.isnan(v))
        else f"{v * 1000:.0f}"
        if v >= 0.1
        else f"{v * 1000:.1f}"
    )


def _order(systems: Iterable[str]) -> list[str]:
    s = list(dict.fromkeys(systems))
    return [x for x in SYSTEM_ORDER if x in s] + sorted(x for x in s if x not in SYSTEM_ORDER)


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _runs_by(runs: list[dict], dtype: str | None = None) -> dict[tuple[str, int], dict]:
    out = {}
    for r in runs:
        if dtype is not None and r.get("dtype") != dtype:
            continue
        out[(r["system"], int(r["cap"]))] = r
    return out


def spread_table(runs: list[dict], dtype: str) -> str:
    """Every repeat's output tokens/s (min / median / max over the repeats).
    The throughput table shows the median run, and its ratios are the median
    over the repeats of each repeat's ratio (the same workload, side by
    side)."""
    # (Empty for single runs.)
    by = _runs_by(runs, dtype)
    if not any(r.get("repeat_tok_s") for r in by.values()):
        return ""
    caps = sorted({c for (_, c) in by})
    rows = []
    for sys_ in _order(s for (s, _) in by):
        row = [SYSTEM_LABELS.get(sys_, sys_)]
        for c in caps:
            v = sorted(x for x in (by.get((sys_, c)) or {}).get("repeat_tok_s") or [] if x is not None)
            row.append(f"{_fmt(v[0])} / {_fmt(lower_middle(v))} / {_fmt(v[-1])} ({len(v)})" if v else "–")
        rows.append(row)
    return _table(["system"] + [f"tok/s cap {c}: min / median / max (runs)" for c in caps], rows)


def throughput_table(runs: list[dict], dtype: str) -> str:
    by = _runs_by(runs, dtype)
    caps = sorted({c for (_, c) in by})
    systems = _order(s for (s, _) in by)
    header = ["system"] + [f"tok/s cap {c}" for c in caps] + [f"× HF static cap {c}" for c in caps]
    rows = []
    for s in systems:
        row = [SYSTEM_LABELS.get(s, s)]
        for c in caps:
            r = by.get((s, c))
            if r is None:
                row.append("–")
            elif r.get("error"):
                row.append("failed")
            else:
                row.append(_fmt(r["summary"]["output_tokens_per_s"]))
        for c in caps:
            r, b = by.get((s, c)), by.get((BASELINE, c))
            ratio = run_ratio(r, b) if r is not None and not r.get("error") else math.nan
            row.append(_fmt(ratio, 2) + ("×" if not math.isnan(ratio) else ""))
        rows.append(row)
    return _table(header, rows)


def latency_table(runs: list[dict], dtype: str) -> str:
    by = _runs_by(runs, dtype)
    header = [
        "system",
        "cap",
        "tok/s",
        "req/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "e2e p50 s",
        "mean batch",
        "KV usage mean/max",
        "errors",
    ]
    rows = []
    for c in sorted({c for (_, c) in by}):
        for s in _order(x for (x, cc) in by if cc == c):
            r = by[(s, c)]
            if r.get("error"):
                rows.append([SYSTEM_LABELS.get(s, s), str(c)] + ["–"] * 9 + [r["error"][:60]])
                continue
            sm = r["summary"]
            m = r.get("metrics") or {}
            occ = m.get("mean_batch_occupancy", r.get("meta", {}).get("mean_batch_occupancy"))
            kv = f"{_fmt(m.get('kv_usage_mean'), 2)}/{_fmt(m.get('kv_usage_max'), 2)}" if m.get("available") else "–"
            rows.append(
                [
                    SYSTEM_LABELS.get(s, s),
                    str(c),
                    _fmt(sm["output_tokens_per_s"]),
                    _fmt(sm["requests_per_s"], 2),
                    _ms(sm["ttft_s"]["p50"]),
                    _ms(sm["ttft_s"]["p99"]),
                    _ms(sm["itl_s"]["p50"]),
                    _ms(sm["itl_s"]["p99"]),
                    _fmt(sm["e2e_s"]["p50"], 2),
                    _fmt(occ),
                    kv,
                    str(sm["num_errors"]),
                ]
            )
    return _table(header, rows)


def roofline_table(roof: dict) -> str:
    rows = []
    for m in roof.get("matmuls", []):
        rows.append([m["name"], f"{m['m']}×{m['k']}×{m['n']}", m["dtype"], _fmt(m["gflops"]), _fmt(m["ms"], 3)])
    return _table(["projection", "M×K×N", "dtype", "GFLOP/s", "ms/call"], rows)


def _share(v) -> str:
    return _fmt(100 * v, 1) + " %" if v is not None and not math.isnan(v) else "–"


def roofline_bounds_table(roof: dict) -> str:
    rows = []
    for b in roof.get("bounds", []):
        rows.append(
            [
                b["dtype"],
                _fmt(b.get("gflops_576x1536")),
                _fmt(b.get("simple_bound_tok_s")),
                _fmt(b["gflops_weighted"]),
                _fmt(b["decode_bound_tok_s"]),
                _fmt(b.get("cbserve_decode_tok_s")),
                _share(b.get("share")),
            ]
        )
    return _table(
        [
            "dtype",
            "GFLOP/s 64×576×1536",
            "simple bound tok/s",
            "GFLOP/s all shapes (FLOP-weighted)",
            "decode bound tok/s",
            "cbserve decode tok/s @64",
            "share of bound",
        ],
        rows,
    )


def memory_roof_table(roof: dict) -> str:
    """The memory roof: bytes a decode step at batch 64 reads (weights + K/V
    at the overhead run's mean context) at the measured stream bandwidth, and
    the roofline bound, the lower of the two roofs."""
    if roof.get("stream_gb_s") is None:
        return ""
    rows = []
    for b in roof.get("bounds", []):
        rows.append(
            [
                b["dtype"],
                _fmt(roof["stream_gb_s"]),
                str(roof.get("context", "–")),
                _fmt(b.get("step_mb")),
                _fmt(b.get("memory_bound_tok_s")),
                _fmt(b["decode_bound_tok_s"]),
                _fmt(b.get("roofline_bound_tok_s")),
                _fmt(b.get("cbserve_decode_tok_s")),
                _share(b.get("roofline_share")),
            ]
        )
    return _table(
        [
            "dtype",
            "stream GB/s",
            "context",
            "MB read per step",
            "memory bound tok/s",
            "compute bound tok/s",
            "roofline bound tok/s",
            "cbserve decode tok/s @64",
            "share of roofline",
        ],
        rows,
    )


def overhead_table(ov: list[dict]) -> str:
    """Per iteration: the router's whole cycle, the executor's Step (plan in,
    tokens out) and the model forward inside it. Router + transport = iteration
    - executor step (scheduling, plan building, serialisation, gRPC, result
    handling, detokenisation); outside the forward adds the executor's own
    per-step work (metadata, sampling). Router / client CPU: CPU time of the
    router process and of the load generator per iteration (from /proc);
    their share of the iteration is how long one of the executor's two
    threads was, on a 2-core machine, off its core: that cost lands inside the
    forward, where the timers above do not separate it."""
    rows = []
    for o in ov:
        rows.append(
            [
                str(o["batch"]),
                _fmt(o.get("decode_tok_s")),
                _ms(o.get("iteration_mean_s")),
                _ms(o.get("executor_step_mean_s")),
                _ms(o.get("inner_mean_s")),
                o.get("inner_metric", "–"),
                _share(o.get("router_share")),
                _share(o.get("overhead_share")),
                _fmt(o.get("router_cpu_ms"), 2),
                _fmt(o.get("client_cpu_ms"), 2),
                _share(o.get("side_cpu_share")),
                o.get("note", ""),
            ]
        )
    return _table(
        [
            "batch",
            "decode tok/s",
            "iteration ms",
            "executor step ms",
            "inner ms",
            "inner metric",
            "router + transport",
            "outside the forward",
            "router CPU ms",
            "client CPU ms",
            "router + client CPU / iteration",
            "note",
        ],
        rows,
    )


def rate_table(sweep: list[dict]) -> str:
    rows = []
    for r in sweep:
        sm = r["summary"]
        rows.append(
            [
                r["system"],
                _fmt(r["rate"], 2),
                _fmt(sm["requests_per_s"], 2),
                _fmt(sm["output_tokens_per_s"]),
                _ms(sm["ttft_s"]["p50"]),
                _ms(sm["ttft_s"]["p99"]),
                _ms(sm["itl_s"]["p50"]),
                _ms(sm["itl_s"]["p99"]),
                _fmt(sm["e2e_s"]["p50"], 2),
                _fmt(sm["e2e_s"]["p99"], 2),
            ]
        )
    return _table(
        [
            "system",
            "rate req/s",
            "achieved req/s",
            "tok/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "ITL p50 ms",
            "ITL p99 ms",
            "e2e p50 s",
            "e2e p99 s",
        ],
        rows,
    )


# ---------------------------------------------------------------- plots


def plot_throughput_vs_cap(runs: list[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    dtypes = sorted({r.get("dtype", "") for r in runs})
    for dt in dtypes:
        by = _runs_by(runs, dt)
        for s in _order(x for (x, _) in by):
            pts = sorted(
                (c, r["summary"]["output_tokens_per_s"]) for (x, c), r in by.items() if x == s and not r.get("error")
            )
            if not pts:
                continue
            ls = "-" if dt == "bfloat16" else "--"
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                ls,
                marker="o",
                label=f"{SYSTEM_LABELS.get(s, s)} ({dt})" if len(dtypes) > 1 else SYSTEM_LABELS.get(s, s),
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("generation cap (tokens)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput vs generation cap")
    return _save(fig, ax, path)


def _save(fig, ax, path):
    """Grid, legend, layout; writes the PNG and frees the figure."""
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ecdf(ax, vals, label):
    v = sorted(x for x in vals if not math.isnan(x))
    if not v:
        return
    n = len(v)
    ax.step([x * 1000 for x in v], [(i + 1) / n for i in range(n)], where="post", label=label)


def plot_latency_distributions(runs: list[dict], path: Path, cap: int | None = None, dtype: str | None = None) -> Path:
    from bench.stats import RequestRecord

    sel = [
        r
        for r in runs
        if r.get("records")
        and not r.get("error")
        and (cap is None or int(r["cap"]) == cap)
        and (dtype is None or r.get("dtype") == dtype)
    ]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in sorted(sel, key=lambda r: SYSTEM_ORDER.index(r["system"]) if r["system"] in SYSTEM_ORDER else 99):
        recs = [RequestRecord.from_dict(d) if isinstance(d, dict) else d for d in r["records"]]
        recs = [x for x in recs if x.ok]
        lab = SYSTEM_LABELS.get(r["system"], r["system"])
        _ecdf(a1, [x.ttft for x in recs], lab)
        _ecdf(a2, [g for x in recs for g in x.itls()], lab)
    a1.set_xlabel("TTFT (ms)")
    a2.set_xlabel("inter-token latency (ms)")
    for a in (a1, a2):
        a.set_ylabel("CDF")
        a.set_xscale("log")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(f"TTFT / ITL distributions{f' (cap {cap})' if cap else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_vs_rate(sweep: list[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in _order(r["system"] for r in sweep):
        pts = sorted((r["rate"], r["summary"]) for r in sweep if r["system"] == s)
        rates = [p[0] for p in pts]
        lab = SYSTEM_LABELS.get(s, s)
        ax.plot(rates, [p[1]["e2e_s"]["p50"] for p in pts], "-o", label=f"{lab} e2e p50")
        ax.plot(rates, [p[1]["e2e_s"]["p99"] for p in pts], "--o", label=f"{lab} e2e p99")
        ax.plot(rates, [p[1]["ttft_s"]["p50"] for p in pts], ":s", label=f"{lab} TTFT p50")
    ax.set_xlabel("arrival rate (requests/s, Poisson)")
    ax.set_ylabel("latency (s)")
    ax.set_yscale("log")
    ax.set_title("Latency vs arrival rate")
    return _save(fig, ax, path)


# ---------------------------------------------------------------- document


def alone_table(results: dict) -> str:
    """The batch-1 and batch-64 overhead runs' decode steps again, through
    the executor's model runner alone (bench/standalone.py: same batch,
    128-token prompts, 48 tokens each, so the same contexts; no router, gRPC
    or load generator), against the memory roof of each step (every weight
    and the batch's K/V read once at the measured stream bandwidth) and the
    same batch in the server."""
    rows = []
    for r in alone_rows(results):
        rows.append(
            [
                str(r["batch"]),
                _fmt(r["decode_tok_s"]),
                _fmt(r["step_ms"], 1),
                _fmt(r["forward_ms"], 1),
                _fmt(r["step_mb"]),
                _fmt(r.get("memory_roof_tok_s")),
                _share(r.get("memory_roof_share")),
                _fmt(r.get("served_tok_s")),
                _share(r.get("served_over_alone")),
            ]
        )
    return _table(
        [
            "batch",
            "decode tok/s alone",
            "step ms",
            "forward ms",
            "MB read per step",
            "memory roof tok/s",
            "share of memory roof",
            "decode tok/s in the server",
            "server / alone",
        ],
        rows,
    )


def phase_table(results: dict) -> str:
    """Where the executor-alone batch-64 decode step goes, call by call
    (bench/standalone.phase_profile: the lean forward's calls and the LM head
    wrapped in timers, summed per phase over the decode steps; the rest is
    what the untimed steps take beyond them), each phase against its roof
    where it has one: the matmuls at the roofline's time for the same
    shapes over all layers, attention at the batch's K/V read once at the
    stream bandwidth. The last two columns: the same step over the opt-in
    fp8 e5m2 KV cache (cache.kv_cache_dtype), where measured; its attention
    roof is half the bf16 one."""
    f8 = {r["phase"]: r for r in phase_rows(results, kv_fp8=True)}
    rows = []
    for r in phase_rows(results):
        row = [
            r["label"],
            _fmt(r["ms"], 2),
            _share(r["share"]),
            _fmt(r["roof_ms"], 2),
            _fmt(r["ms"] / r["roof_ms"], 2) if r["roof_ms"] else "–",
        ]
        if f8:
            g = f8.get(r["phase"], {})
            row += [_fmt(g.get("ms"), 2), _fmt(g.get("roof_ms"), 2) if r["phase"] == "attention" else "–"]
        rows.append(row)
    head = ["phase", "ms per step", "share of step", "roof ms", "× roof"]
    if f8:
        head += ["fp8 KV cache: ms per step", "fp8 roof ms"]
    return _table(head, rows) if rows else ""


def targets_table(rows: list[dict]) -> str:
    return _table(
        ["target", "measured in this run", "status"], [[r["target"], r["measured"], r["status"]] for r in rows]
    )


def render_report(
    results: dict, out_dir: str | Path, md_name: str = "benchmarks.md", plot_prefix: str = "bench_"
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = results.get("runs", [])
    lines: list[str] = [f"# cbserve benchmarks{(' — ' + results['title']) if results.get('title') else ''}", ""]
    lines += [
        f"_Generated by `{results.get('command', 'python -m bench suite')}` on "
        f"{results.get('date', '?')}; every number below comes from that one run._",
        "",
        "Online serving through the OpenAI API against `vllm serve` (`python -m bench online`): "
        "[benchmarks-online.md](benchmarks-online.md).",
        "Tenants and SLO classes (`cbserve bench fairness`, `cbserve bench goodput`): "
        "[benchmarks-tenants.md](benchmarks-tenants.md). Quantized GGUF files (`cbserve bench quant`): "
        "[benchmarks-quant.md](benchmarks-quant.md). Runs on earlier machines and commits: "
        "[benchmark-notes.md](benchmark-notes.md), the log.",
        "",
    ]
    mach = results.get("machine", {})
    vers = results.get("versions", {})
    lines += [
        "## Setup",
        "",
        f"- Machine: {mach.get('cpu_model', '?')}, {mach.get('cores', '?')} cores "
        f"({mach.get('flags', '')}), {mach.get('mem_gb', '?')} GB RAM, {mach.get('os', '')}; "
        f"load average start/end {mach.get('loadavg_start_end', '?')}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()),
        f"- Model: {results.get('model', 'SmolLM2-135M-Instruct')}",
        f"- Workload: {results.get('workload_text', '')}",
        "",
    ]
    if results.get("notes"):
        lines += [f"- {n}" for n in results["notes"]] + [""]
    dtypes = sorted({r.get("dtype") for r in runs}, key=lambda d: (d != "bfloat16", d))
    if runs:
        lines += ["## Continuous vs static batching (the classic experiment, scaled for CPU)", ""]
        for dt in dtypes:
            lines += [f"### Output tokens/s, {dt}", "", throughput_table(runs, dt), ""]
            spread = spread_table(runs, dt)
            if spread:
                lines += [" ".join(spread_table.__doc__.split()), "", spread, ""]
        p = plot_throughput_vs_cap(runs, out / f"{plot_prefix}throughput_vs_cap.png")
        lines += [f"![throughput vs cap]({p.name})", ""]
        for dt in dtypes:
            lines += [f"### Latency and occupancy, {dt}", "", latency_table(runs, dt), ""]
        lines += [
            "TTFT counts from the request's arrival (queueing included); ITL is every gap between "
            "consecutive output tokens. HF static returns a batch only when its longest member is done "
            "(e2e), its tokens are timestamped as produced. Mean batch: cbserve reads "
            "`cbserve_batch_size` (_sum/_count deltas) or samples `cbserve_num_requests_running`; "
            "peers' numbers come from the runner.",
            "",
        ]
        caps = sorted({int(r["cap"]) for r in runs})
        if caps:
            cap = caps[len(caps) // 2]
            p = plot_latency_distributions(
                runs, out / f"{plot_prefix}latency_distributions.png", cap=cap, dtype=dtypes[0]
            )
            lines += [f"![TTFT/ITL distributions]({p.name})", ""]
    if results.get("rate_sweep"):
        lines += ["## Latency vs arrival rate (Poisson arrivals)", "", rate_table(results["rate_sweep"]), ""]
        p = plot_latency_vs_rate(results["rate_sweep"], out / f"{plot_prefix}latency_vs_rate.png")
        lines += [f"![latency vs rate]({p.name})", ""]
    if results.get("roofline"):
        roof = results["roofline"]
        lines += [
            "## Roofline",
            "",
            roof.get("text", ""),
            "",
            roofline_table(roof),
            "",
            roofline_bounds_table(roof),
            "",
        ]
        mem = memory_roof_table(roof)
        if mem:
            lines += [" ".join(memory_roof_table.__doc__.split()), "", mem, ""]
    if results.get("overheads"):
        lines += [
            "## Per-iteration overhead outside the model forward",
            "",
            " ".join(overhead_table.__doc__.split()),
            "",
            overhead_table(results["overheads"]),
            "",
        ]
    if results.get("standalone"):
        lines += ["## The executor alone", "", " ".join(alone_table.__doc__.split()), "", alone_table(results), ""]
        phases = phase_table(results)
        if phases:
            lines += [" ".join(phase_table.__doc__.split()), "", phases, ""]
    targets = evaluate(results)
    if targets:
        lines += ["## Targets", "", targets_table(targets), ""] + [p + "\n" for p in limits_text(results)]
    if results.get("errors"):
        lines += ["## Problems during this run", ""] + [f"- {e}" for e in results["errors"]] + [""]
    if results.get("commands"):
        lines += ["## Reproduce", "", "```", *results["commands"], "```", ""]
    path = out / md_name
    # `bench online` and `bench.gpu_report` keep their sections in this page
    # between markers; a new suite run carries them over.
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    kept = [k for k in (section(old, name) for name in KEPT_SECTIONS) if k]
    path.write_text("\n".join(lines) + "".join(f"\n{k}\n" for k in kept))
    return path


# Sections of benchmarks.md written by other commands than the suite.
KEPT_SECTIONS = ("online", "gpu")


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- bench {name}: begin -->", f"<!-- bench {name}: end -->"


def section(text: str, name: str) -> str:
    """The `name` block of a report page (markers included), or ""."""
    begin, end = _markers(name)
    i, j = text.find(begin), text.find(end)
    return text[i : j + len(end)] if 0 <= i < j else ""


def online_section(text: str) -> str:
    """The `bench online` block of a report page (markers included), or ""."""
    return section(text, "online")


def splice_section(page: Path, name: str, body: str) -> None:
    """Puts `body` between the `name` markers of `page`, replacing any earlier block."""
    text = page.read_text(encoding="utf-8") if page.exists() else ""
    old = section(text, name)
    begin, end = _markers(name)
    block = f"{begin}\n{body.strip()}\n{end}"
    text = text.replace(old, block) if old else text.rstrip() + "\n\n" + block + "\n"
    page.write_text(text, encoding="utf-8")


def splice_online_section(page: Path, body: str) -> None:
    splice_section(page, "online", body)
