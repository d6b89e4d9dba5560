"""The GPU report: docs/benchmarks-gpu.md, and its summary in docs/benchmarks.md.

`python -m bench.gpu_report DIR` reads what `bench/gpu_check.sh` wrote to
DIR (gpu_step.json from `python -m bench.gpu_step`; serve.json from the
classic workload through `cbserve serve --device cuda` and through HF
generate() static batches on the same GPU) and renders both pages;
`--serve DIR2` takes serve.json from another run (the page says so).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from bench.report import splice_section

# The published continuous-batching experiment (an A100, OPT-13B): vLLM's
# output throughput over HF static batching at caps 32 / 128 / 512.
PUBLISHED_RATIO = {32: 2.0, 128: 3.7, 512: 9.5}
STEP_TARGET_MS = {1: 1.5, 64: 3.0}
# The whole server on the transformers path (an H100, 2026-11-22, before the
# lean forward): the serve targets ask for 5x these.
BEFORE_TOK_S = {32: 487, 128: 614, 512: 766}
SERVE_SPEEDUP = 5.0
CHECK = "bench/gpu_check.sh build test bench server serve"
MODE_ORDER = (
    "transformers",
    "lean",
    "graphs, general attention",
    "graphs",
    "graphs, sampled, host",
    "graphs, sampled, device",
)


def _steps(step: dict) -> dict[tuple[str, int], dict]:
    return {(r["mode"], r["batch"]): r for r in step["rows"]}


def _serve(serve: dict) -> dict[tuple[str, int], dict]:
    out = {}
    for blob in serve.values():
        for run in blob["runs"]:
            out[(run["system"], int(run["cap"]))] = run
    return out


def step_table(step: dict) -> list[str]:
    rows = _steps(step)
    batches = sorted({b for _, b in rows})
    lines = [
        "| executor | " + " | ".join(f"batch {b}: step ms" for b in batches) + f" | batch {batches[-1]}: tok/s |",
        "| --- | " + " | ".join("---" for _ in batches) + " | --- |",
    ]
    for mode in MODE_ORDER:
        if (mode, batches[-1]) not in rows:
            continue
        cells = [f"{rows[(mode, b)]['step_ms']:.2f}" if (mode, b) in rows else "-" for b in batches]
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {rows[(mode, batches[-1])]['tok_s']:,} |")
    return lines


def target_lines(step: dict) -> list[str]:
    rows = _steps(step)
    out = []
    for b, target in STEP_TARGET_MS.items():
        r = rows.get(("graphs", b))
        if r:
            met = "met" if r["step_ms"] <= target else "not met"
            out.append(f"- batch {b}: at most {target} ms per step: {r['step_ms']:.2f} ms, {met}")
    return out


def serve_table(serve: dict) -> list[str]:
    runs = _serve(serve)
    lines = [
        "| cap | cbserve tok/s | HF static tok/s | cbserve / HF | vLLM / HF, published (A100, OPT-13B) "
        "| router share of an iteration | cbserve TTFT p50 ms | cbserve ITL p50 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cap in sorted({c for _, c in runs}):
        cb, hf = runs.get(("cbserve-fcfs", cap)), runs.get(("hf-static", cap))
        if not cb:
            continue
        cb_s = cb["summary"]["output_tokens_per_s"]
        hf_cells = (
            "not run | -"
            if not hf
            else "{0:,.0f} | {1:.1f}x".format(
                hf["summary"]["output_tokens_per_s"], cb_s / hf["summary"]["output_tokens_per_s"]
            )
        )
        share = (cb.get("metrics") or {}).get("router_share")
        lines.append(
            f"| {cap} | {cb_s:,.0f} | {hf_cells} | {PUBLISHED_RATIO.get(cap, float('nan'))}x | "
            f"{share:.0%} | {cb['summary']['ttft_s']['p50'] * 1e3:.0f} | {cb['summary']['itl_s']['p50'] * 1e3:.1f} |"
            if share is not None
            else f"| {cap} | {cb_s:,.0f} | {hf_cells} | {PUBLISHED_RATIO.get(cap)}x | ? | ? | ? |"
        )
    return lines


def serve_target_lines(serve: dict) -> list[str]:
    runs = _serve(serve)
    out = []
    for cap in sorted({c for _, c in runs}):
        cb, hf = runs.get(("cbserve-fcfs", cap)), runs.get(("hf-static", cap))
        if not cb:
            continue
        tok_s = cb["summary"]["output_tokens_per_s"]
        if cap in BEFORE_TOK_S:
            x = tok_s / BEFORE_TOK_S[cap]
            met = "met" if x >= SERVE_SPEEDUP else "not met"
            out.append(
                f"- cap {cap}: at least {SERVE_SPEEDUP:.0f}x the transformers path's {BEFORE_TOK_S[cap]} tok/s "
                f"(H100, 2026-11-22): {tok_s:,.0f} tok/s, {x:.1f}x, {met}"
            )
        if hf and cap in PUBLISHED_RATIO:
            x = tok_s / hf["summary"]["output_tokens_per_s"]
            met = "met" if x >= PUBLISHED_RATIO[cap] else "not met"
            out.append(f"- cap {cap}: at least vLLM's published {PUBLISHED_RATIO[cap]}x HF static: {x:.1f}x, {met}")
    return out


def kernel_lines(step: dict) -> list[str]:
    lines = []
    for r in step["rows"]:
        if not r.get("kernels"):
            continue
        lines += [
            "",
            f"Batch {r['batch']} ({r['replay_gpu_ms']:.2f} ms of GPU time per replay):",
            "",
            "| GPU us per step | launches | kernel |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {k['us_per_step']:.1f} | {k['calls_per_step']} | `{k['kernel']}` |" for k in r["kernels"]]
    return lines


def render(results: Path, docs: Path, date: str, serve_dir: Path | None = None, same_machine: bool = False) -> str:
    step = json.loads((results / "gpu_step.json").read_text())
    serve = json.loads(((serve_dir or results) / "serve.json").read_text())
    gpu = f"{step['gpu']}, torch {step['torch']}"
    capture = next((r["capture"] for r in step["rows"] if r.get("capture")), {})
    agree = step.get("agreement", {}).get("graphs", {})
    if serve_dir is None:
        provenance = f"from one run of `{CHECK}` on {date}, on an {gpu}; every number below comes from that run._"
    elif same_machine:
        provenance = (
            f"on {date} from two runs of `bench/gpu_check.sh` one after the other on one machine ({gpu}): the "
            "decode step from one, the classic workload through the whole server from the other._"
        )
    else:
        provenance = (
            f"on {date} from two runs of `bench/gpu_check.sh` on machines of one kind ({gpu}): the decode step "
            "from one, the classic workload through the whole server from the other._"
        )
    lines = [
        "# cbserve on a GPU",
        "",
        f"_Generated by `python -m bench.gpu_report` {provenance}",
        "",
        "## The decode step",
        "",
        "`python -m bench.gpu_step`: a SmolLM2-shaped random Llama (30 layers, hidden 576, 9 query / 3 KV heads, "
        "vocabulary 49,152) in bf16, its `ModelRunner` alone driven with the router's plans: 128-token prompts "
        "prefilled, then 128 decode steps of the whole batch (mean context 192). A step is plan in, tokens on the "
        "host; median of three runs. `transformers`: the transformers layer code with the native paged attention "
        "(the GPU path before the lean forward); `lean`: executor/gpu/lean_forward.py, eager; `graphs`: its decode "
        "steps replayed from CUDA graphs, as `cbserve serve --device cuda` runs (decode attention in the decode "
        "kernel); `graphs, general attention`: the same, captured with the general paged-attention kernel for "
        "decode; `graphs, sampled`: the graphed steps with every request sampled (temperature 0.8, top-p 0.95, "
        "top-k 50, seeded), with the host sampler and on the device.",
        "",
        *step_table(step),
        "",
        "Targets:",
        "",
        *target_lines(step),
        "",
        f"Capture of {capture.get('buckets', '?')} buckets up to batch {capture.get('max_batch', '?')}: "
        f"{capture.get('seconds', '?')} s, {capture.get('bytes', 0) / 2**20:.0f} MiB. Greedy tokens of 8 prompts "
        f"x 32 tokens, graphs vs transformers: first divergence per prompt {agree.get('first_divergence')} "
        "(bf16: the fused q|k|v and gate|up GEMMs round differently from three and two separate ones).",
        "",
        "GPU time of one graphed decode step by kernel (torch.profiler over 20 replays, context 257):",
        *kernel_lines(step),
        "",
        "## The classic workload through the whole server",
        "",
        "64 prompts x 128 random token ids, output lengths exponential (mean cap / 3) capped at 32 / 128 / 512, "
        "EOS ignored, all submitted at t = 0. cbserve: `cbserve serve --device cuda` (FCFS, CUDA graphs), driven "
        "over gRPC by `python -m bench run --system cbserve-fcfs --device cuda`; HF static: `generate()` in "
        "static batches of 16 on the same GPU (`--system hf-static --device cuda`). Router share: the part of an "
        "iteration outside the executor's step (scheduling, the plan, gRPC, detokenisation), from the servers' "
        "metrics.",
        "",
        *serve_table(serve),
        "",
        "Targets:",
        "",
        *serve_target_lines(serve),
        "",
        "## Reproduce",
        "",
        "On a machine with an NVIDIA GPU and a CUDA build of torch (carry the wheels it lacks in `.whl/`):",
        "",
        "```",
        f"OUT=build/gpu-check {CHECK}",
        "python -m bench.gpu_report build/gpu-check",
        "```",
        "",
    ]
    text = "\n".join(lines)
    (docs / "benchmarks-gpu.md").write_text(text, encoding="utf-8")
    summary = [
        "## On a GPU",
        "",
        f"{gpu}, {date} ([benchmarks-gpu.md](benchmarks-gpu.md): commands, per-kernel GPU time).",
        "",
        *step_table(step),
        "",
        *serve_table(serve),
    ]
    splice_section(docs / "benchmarks.md", "gpu", "\n".join(summary))
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_report", description=__doc__)
    p.add_argument("results", help="the directory bench/gpu_check.sh wrote (its OUT)")
    p.add_argument("--docs", default="docs")
    p.add_argument("--date", default=dt.date.today().isoformat())
    p.add_argument("--serve", default="", help="read serve.json from this directory (another run) instead")
    p.add_argument("--same-machine", action="store_true", help="--serve's run was on the same machine, just before")
    a = p.parse_args(argv)
    render(Path(a.results), Path(a.docs), a.date, Path(a.serve) if a.serve else None, a.same_machine)
    sys.stdout.write(f"wrote {a.docs}/benchmarks-gpu.md and its section of {a.docs}/benchmarks.md\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
