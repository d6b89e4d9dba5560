"""Speculative decoding's speed, measured through the OpenAI API
(docs/speculative.md):

    cbserve bench speculative [--model smollm2] [--concurrency 1,4,8]
        [--spec '{"method": "ngram", "num_speculative_tokens": 3}' ...]
        [--requests 8] [--max-tokens 128] [--rounds 2] [--text FILE]

One server with speculation off and one per `--spec` JSON (the config's
`speculative` section) run side by side; they are driven one at a time, in
alternating rounds, so each round sees the same machine. Tasks:
  copy     chat: repeat a passage of the text word for word
  extract  chat: list the sentences of a passage that name something
  random   random prompt token ids, sampled at temperature 1 (seeded) to
           max_tokens: little to copy, so what drafts cost where they
           seldom match
copy and extract are greedy. `identical` counts the outputs equal to the
plain server's, seeded sampling included: all of them at one stream; in
batches, bf16 steps of different row counts can round differently and
flip a near-tie (the plain server alone does so between batch sizes). Per task, concurrency and variant: the
median over rounds of output tokens/s, the mean tokens/s one request sees,
and the draft tokens accepted / proposed (the servers' counters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from bench.server import CbserveServer

REPO = Path(__file__).resolve().parents[1]
TASKS = ("copy", "extract", "random")


def passages(path: Path, n: int, words: int = 90) -> list[str]:
    """n passages of about `words` words from the text's paragraphs."""
    text = " ".join(path.read_text(encoding="utf-8").split())
    ws = [w for w in text.split(" ") if w and not w.startswith(("|", "`", "#", "!", "["))]
    step = max(1, (len(ws) - words) // max(1, n))
    return [" ".join(ws[i * step : i * step + words]) for i in range(n)]


def bodies(task: str, model: str, texts: list[str], max_tokens: int, seed: int) -> list[dict]:
    if task == "random":
        rng = random.Random(seed)
        return [
            {
                "model": model,
                "prompt": [rng.randrange(100, 40_000) for _ in range(128)],
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "seed": seed * 1000 + i,
                "ignore_eos": True,
            }
            for i, _ in enumerate(texts)
        ]
    ask = {
        "copy": "Repeat the following text exactly, word for word:\n\n",
        "extract": "Copy out, unchanged, every sentence of this text that names a program or a file:\n\n",
    }[task]
    return [
        {
            "model": model,
            "messages": [{"role": "user", "content": ask + t}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        for t in texts
    ]


async def drive(url: str, reqs: list[dict], concurrency: int) -> tuple[float, list[tuple[str, int, float]]]:
    """Sends every request, at most `concurrency` at once; returns the wall
    time and per request (text, output tokens, seconds)."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    out: list = [None] * len(reqs)

    async def one(i: int, body: dict, client) -> None:
        async with sem:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            t0 = time.perf_counter()
            r = await client.post(url + path, json=body, timeout=600)
            r.raise_for_status()
            j = r.json()
            c = j["choices"][0]
            text = c["message"]["content"] if "message" in c else c["text"]
            out[i] = (text, j["usage"]["completion_tokens"], time.perf_counter() - t0)

    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, b, client) for i, b in enumerate(reqs)))
        return time.perf_counter() - t0, out


def counters(server: CbserveServer) -> tuple[float, float]:
    """(draft tokens proposed, accepted) so far."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    got = {"cbserve_spec_decode_num_draft_tokens": 0.0, "cbserve_spec_decode_num_accepted_tokens": 0.0}
    for fam in text_string_to_metric_families(httpx.get(server.metrics_url, timeout=10).text):
        for s in fam.samples:
            if s.name.removesuffix("_total") in got and s.name.endswith("_total"):
                got[s.name.removesuffix("_total")] += s.value
    return got["cbserve_spec_decode_num_draft_tokens"], got["cbserve_spec_decode_num_accepted_tokens"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="cbserve --model (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--spec", action="append", default=None, help="a speculative section as JSON (repeatable)")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--requests", type=int, default=8, help="requests per task, concurrency and round")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--text", default=str(REPO / "docs" / "architecture.md"), help="where the passages come from")
    p.add_argument("--workdir", default="/tmp/cbserve-bench-speculative")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    specs = [json.loads(s) for s in args.spec or ['{"method": "ngram"}']]
    levels = [int(x) for x in args.concurrency.split(",")]
    tasks = [t for t in args.tasks.split(",") if t]
    texts = passages(Path(args.text), args.requests)
    variants = [("off", {"speculative": {"method": ""}})]
    variants += [(json.dumps(s, separators=(",", ":")), {"speculative": s}) for s in specs]
    servers = []
    try:
        for i, (_, extra) in enumerate(variants):
            servers.append(
                CbserveServer(
                    Path(args.workdir) / f"v{i}",
                    "fcfs",
                    model=args.model,
                    dtype=args.dtype,
                    config_overrides={"extra": extra} if extra else None,
                ).start()
            )
        import httpx

        url0 = f"http://127.0.0.1:{servers[0].http_port}"
        model = httpx.get(f"{url0}/v1/models", timeout=30).json()["data"][0]["id"]
        # cell -> variant -> per round (tok/s, mean request tok/s, proposed, accepted, texts)
        runs: dict = {}
        for rnd in range(args.rounds):
            for task in tasks:
                reqs = bodies(task, model, texts, args.max_tokens, seed=rnd)
                for c in levels:
                    order = list(enumerate(servers)) if rnd % 2 == 0 else list(enumerate(servers))[::-1]
                    for vi, server in order:
                        before = counters(server)
                        wall, out = asyncio.run(drive(f"http://127.0.0.1:{server.http_port}", reqs, c))
                        after = counters(server)
                        toks = sum(n for _, n, _ in out)
                        runs.setdefault((task, c), {}).setdefault(vi, []).append(
                            (
                                toks / wall,
                                statistics.mean(n / s for _, n, s in out),
                                after[0] - before[0],
                                after[1] - before[1],
                                [t for t, _, _ in out],
                            )
                        )
        rows = []
        for (task, c), per in runs.items():
            plain = per[0]
            for vi, rs in per.items():
                proposed = sum(r[2] for r in rs)
                pairs = [(x, y) for r, q in zip(rs, plain) for x, y in zip(r[4], q[4])]
                same, total = sum(x == y for x, y in pairs), len(pairs)
                row = {
                    "task": task,
                    "concurrency": c,
                    "variant": variants[vi][0],
                    "tok_s": round(statistics.median(r[0] for r in rs), 1),
                    "request_tok_s": round(statistics.median(r[1] for r in rs), 1),
                    "acceptance": round(sum(r[3] for r in rs) / proposed, 3) if proposed else None,
                    "identical": f"{same}/{total}",
                }
                row["speedup"] = round(row["tok_s"] / statistics.median(r[0] for r in plain), 3)
                if not row["identical"]:  # the first pair that differs, for --out
                    row["differs"] = next((x, y) for r, q in zip(rs, plain) for x, y in zip(r[4], q[4]) if x != y)
                rows.append(row)
        cpu = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in open("/proc/cpuinfo", encoding="ascii")
                if ln.startswith("model name")
            ),
            "?",
        )
        print(f"# {cpu}; {args.requests} requests x {args.max_tokens} tokens, {args.rounds} rounds, medians")
        print("| task | conc | variant | tok/s | request tok/s | speedup | acceptance | identical |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['task']} | {r['concurrency']} | {r['variant']} | {r['tok_s']} | {r['request_tok_s']} "
                f"| {r['speedup']} | {r['acceptance']} | {r['identical']} |"
            )
        if args.out:
            Path(args.out).write_text(json.dumps({"cpu": cpu, "args": vars(args), "rows": rows}, indent=1))
        return 0
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
