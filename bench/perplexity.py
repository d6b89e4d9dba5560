"""Perplexity of a text under a model served by cbserve, computed as
llama.cpp's `llama-perplexity` does, so the two can be compared on the same
GGUF file (docs/quantization.md):

    cbserve bench perplexity --text FILE [--model smollm2] [--ctx 512]
        [--chunk N] [--llama-perplexity PATH/llama-perplexity] [--gguf FILE.gguf]

The text is tokenized once (the model's tokenizer, no special tokens; with
--llama-perplexity, llama.cpp's `llama-tokenize` beside it, so that both
score the same token stream: the two tokenizers split some runs of
whitespace differently) and cut
into chunks of `--ctx` tokens; each chunk is one request (its token ids, with
the BOS token first where the tokenizer adds one, as llama-perplexity does)
whose prompt logprobs score the chunk's second half: position j's
-log p(token j) for j in [ctx/2, ctx). The perplexity is exp of their mean.
With --llama-perplexity the same file is scored by llama.cpp with the same
context (`-c ctx`) and both numbers are printed with their ratio.

--chunk N prefills each chunk N tokens a step (the router's
`long_prefill_token_threshold`), so that its rows go through the kernels of
an N-row decode step: with N <= 16 on a VNNI CPU without AMX, the int8
activations of GGUF blocks (docs/quantization.md), which a whole 512-token
prefill never takes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.server import CbserveServer


def chunks(ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: consecutive runs of ctx tokens, the first
    replaced by BOS where the model adds one; the last partial run dropped."""
    out = []
    for i in range(len(ids) // ctx):
        c = ids[i * ctx : (i + 1) * ctx]
        if bos is not None:
            c = [bos] + c[1:]
        out.append(c)
    return out


def score(http_url: str, model: str, chunk: list[int]) -> list[float]:
    """-log p of tokens ctx/2 .. ctx-1 of the chunk, from the server's prompt logprobs."""
    import httpx

    body = {"model": model, "prompt": chunk, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
    r = httpx.post(f"{http_url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    plp = r.json()["choices"][0]["prompt_logprobs"]
    first = len(chunk) // 2
    return [-plp[j][str(chunk[j])]["logprob"] for j in range(first, len(chunk))]


def llama_tokens(binary: str, gguf: str, text: str) -> list[int]:
    """The text's token ids by llama.cpp's tokenizer (no BOS: the chunks add it)."""
    tokenize = str(Path(binary).with_name("llama-tokenize"))
    out = subprocess.run(
        [tokenize, "-m", gguf, "-f", text, "--ids", "--log-disable", "--no-bos"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_perplexity(binary: str, gguf: str, text: str, ctx: int, threads: int) -> tuple[float, str]:
    """llama.cpp's final estimate for the file and its output's tokenization line."""
    out = subprocess.run(
        [binary, "-m", gguf, "-f", text, "-c", str(ctx), "-t", str(threads), "-b", str(ctx)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    if m is None:
        raise RuntimeError(f"llama-perplexity gave no estimate:\n{log[-3000:]}")
    tok = next((line.strip() for line in log.splitlines() if "tokeniz" in line and "tokens" in line), "")
    return float(m.group(1)), tok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", required=True, help="a plain-text file")
    p.add_argument("--model", default=None, help="cbserve --model (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--max-chunks", type=int, default=0, help="score at most this many chunks (0 = all)")
    p.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity binary")
    p.add_argument("--gguf", default=None, help="the GGUF file llama-perplexity reads (default: the embedded one)")
    p.add_argument("--chunk", type=int, default=0, help="prefill N tokens a step (0: the whole chunk in one)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", default="/tmp/cbserve-perplexity")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from common.model_cache import default_converted_dir
    from executor import model_source

    source = model_source.resolve(args.model)
    gguf = args.gguf or (str(Path(source.path) / source.gguf_file) if source.kind == "gguf" else None)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    text = Path(args.text).read_text(encoding="utf-8")
    result: dict = {"text": args.text, "ctx": args.ctx, "chunk": args.chunk}
    overrides = {"long_prefill_token_threshold": args.chunk} if args.chunk else {}
    with CbserveServer(workdir, "fcfs", dtype="bfloat16", model=args.model, config_overrides=overrides) as server:
        tok = AutoTokenizer.from_pretrained(default_converted_dir() if args.model is None else args.model)
        if args.llama_perplexity:
            ids = llama_tokens(args.llama_perplexity, gguf, args.text)
        else:
            ids = tok(text, add_special_tokens=False)["input_ids"]
        bos = tok.bos_token_id if getattr(tok, "add_bos_token", False) else None
        todo = chunks(ids, args.ctx, bos)
        if args.max_chunks:
            todo = todo[: args.max_chunks]
        t0 = time.perf_counter()
        nll: list[float] = []
        import httpx

        url = f"http://127.0.0.1:{server.http_port}"
        name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        for c in todo:
            nll.extend(score(url, name, c))
        result.update(
            tokens=len(ids),
            chunks=len(todo),
            cbserve_ppl=round(math.exp(sum(nll) / len(nll)), 4),
            cbserve_seconds=round(time.perf_counter() - t0, 1),
        )
    if args.llama_perplexity:
        if args.max_chunks:
            p.error("--max-chunks would score a different span than llama-perplexity's whole file")
        ppl, _ = llama_perplexity(args.llama_perplexity, gguf, args.text, args.ctx, args.threads)
        result.update(llama_ppl=ppl, ratio=round(result["cbserve_ppl"] / ppl, 5))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
