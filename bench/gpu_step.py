"""The executor's decode step on a CUDA GPU (`python -m bench.gpu_step`).

A SmolLM2-shaped random Llama (same shapes and work as SmolLM2-135M, EOS
never sampled on purpose: the steps are timed, not the text; `--arch
mistral` or `qwen2` the same shapes as that architecture) in bf16, its
`ModelRunner` driven alone with the plans the router would send: 128-token
prompts prefilled, then decode steps of the whole batch. Three executors on
the same weights:

- `transformers`: the transformers layer code with the native paged
  attention, launched op by op (the GPU path before the lean forward);
- `lean`: the GPU lean forward (executor/gpu/lean_forward.py), eager;
- `graphs`: the lean forward's decode steps replayed from CUDA graphs
  (executor/gpu/graphs.py), as `cbserve serve --device cuda` runs.

Steps are greedy; the graphed executor is timed again with sampled requests
(temperature 0.8, top-p 0.95, top-k 50, seeded), once sampling on the device
(`sampled, device`) and once with the host sampler (`sampled, host`); and
captured again with the general attention kernel in place of the decode
kernel (`graphs, general attention`).

Per executor and batch size: the step's wall time (plan in, tokens on the
host; median of `--repeats`), and for `graphs` the GPU time of one replay
alone (CUDA events); plus how many greedy tokens the three agree on.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from bench.architectures import SMOLLM2_SHAPE
from bench.standalone import first_divergence, measure_runner
from cbserve.v1 import executor_pb2 as pb
from executor.model_loader import load_model
from executor.model_source import resolve
from executor.runner import ModelRunner, greedy_generate

MODES = ("transformers", "lean", "graphs")
BLOCK_SIZE = 16
SAMPLED = pb.SeqSampling(temperature=0.8, top_p=0.95, top_k=50, seed=1)


def _runner(model, mode: str, num_blocks: int, max_batch: int) -> ModelRunner:
    return ModelRunner(
        model,
        BLOCK_SIZE,
        num_blocks,
        lean_forward=mode != "transformers",
        cuda_graph_max_batch=max_batch if mode == "graphs" else 0,
    )


def _replay_ms(runner: ModelRunner, batch: int, n: int = 200) -> float:
    """GPU time of one replay of the batch's graph (static buffers as the last step left them)."""
    g = runner.graphs.graphs[runner.graphs.bucket_for(batch)]
    for _ in range(10):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def _kernel_profile(runner: ModelRunner, batch: int, n: int = 20, top: int = 10) -> list[dict]:
    """GPU time per replay of the batch's graph by kernel (torch.profiler),
    the `top` kernels first."""
    from torch.profiler import ProfilerActivity, profile

    g = runner.graphs.graphs[runner.graphs.bucket_for(batch)]
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            g.replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:90], "us_per_step": round(us / n, 1), "calls_per_step": e.count // n})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def _timed(runner: ModelRunner, mode: str, batch: int, args: tuple, sampling=None) -> dict:
    """One table row: the median step of `repeats` runs of `batch` sequences
    (args: prompt_len, decode_tokens, repeats)."""
    prompt_len, decode_tokens, repeats = args
    steps = [
        measure_runner(runner, batch, prompt_len, decode_tokens, sampling=sampling)["step_ms"] for _ in range(repeats)
    ]
    return {
        "mode": mode,
        "batch": batch,
        "step_ms": round(statistics.median(steps), 3),
        "step_ms_all": [round(s, 3) for s in steps],
        "tok_s": round(batch * 1e3 / statistics.median(steps)),
    }


def _variants(runner: ModelRunner, batches: list[int], args: tuple) -> list:
    """The graphed executor's step with sampled requests, sampling on the
    device and with the host sampler."""
    rows = []
    for name, on_device in (("graphs, sampled, device", True), ("graphs, sampled, host", False)):
        runner.device_sampling = on_device
        for batch in batches:
            rows.append(_timed(runner, name, batch, args, SAMPLED))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    runner.device_sampling = True
    return rows


def _general_attention(model, num_blocks: int, batches: list[int], args: tuple) -> list:
    """The graphed executor with decode launches on the general attention
    kernel (captured with it: a graph keeps the kernels of its capture)."""
    from native import _C

    _C.set_cuda_decode_kernel(False)
    try:
        runner = _runner(model, "graphs", num_blocks, max(batches))
        rows = []
        for batch in batches:
            rows.append(_timed(runner, "graphs, general attention", batch, args))
            rows[-1]["replay_gpu_ms"] = round(_replay_ms(runner, batch), 3)
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        return rows
    finally:
        _C.set_cuda_decode_kernel(True)


def _model(arch: str, device: torch.device = torch.device("cuda")):
    """SmolLM2's shapes as `arch` (bench.architectures' names), random bf16
    weights on `device`; a non-Llama architecture goes through a checkpoint
    directory, as `--model DIR` would load it."""
    torch.manual_seed(0)
    if arch == "llama":
        return load_model(resolve("tiny:" + json.dumps(SMOLLM2_SHAPE)), torch.bfloat16, device)
    import tempfile

    from bench.architectures import random_model

    hf = random_model(arch)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        del hf
        return load_model(resolve(tmp), torch.bfloat16, device)


def run(batches: list[int], prompt_len: int, decode_tokens: int, repeats: int, arch: str = "llama") -> dict:
    model = _model(arch)
    per_seq = -(-(prompt_len + decode_tokens) // BLOCK_SIZE)
    num_blocks = max(batches) * per_seq + 8
    out: dict = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "arch": arch,
        "rows": [],
        "agreement": {},
    }
    prompts = [torch.randint(3, SMOLLM2_SHAPE["vocab_size"], (prompt_len,)).tolist() for _ in range(8)]
    tokens: dict[str, list[list[int]]] = {}
    args = (prompt_len, decode_tokens, repeats)
    for mode in MODES:
        t0 = time.perf_counter()
        runner = _runner(model, mode, num_blocks, max(batches))
        built = time.perf_counter() - t0
        tokens[mode] = greedy_generate(runner, prompts, 32)
        for batch in batches:
            row = {**_timed(runner, mode, batch, args), "start_s": round(built, 2)}
            if mode == "graphs":
                row["replay_gpu_ms"] = round(_replay_ms(runner, batch), 3)
                row["capture"] = runner.graph_capture
                try:
                    row["kernels"] = _kernel_profile(runner, batch)
                except Exception as exc:  # noqa: BLE001  (a profiler that cannot trace graphs: no breakdown)
                    row["kernels"] = [{"kernel": f"profiler failed: {exc}"[:90], "us_per_step": 0, "calls_per_step": 0}]
            out["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        if mode == "graphs":
            out["rows"] += _variants(runner, batches, args)
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    out["rows"] += _general_attention(model, num_blocks, batches, args)
    for mode in MODES[1:]:
        div = first_divergence(tokens["transformers"], tokens[mode])
        out["agreement"][mode] = {"first_divergence": div, "identical": div == [32] * len(prompts)}
    return out


def render(result: dict) -> str:
    lines = [
        f"GPU: {result['gpu']}, torch {result['torch']}, {result.get('arch', 'llama')} at SmolLM2's shapes",
        "| executor | batch | step ms | tok/s | GPU ms per replay |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        gpu = r.get("replay_gpu_ms", "")
        lines.append(f"| {r['mode']} | {r['batch']} | {r['step_ms']} | {r['tok_s']} | {gpu} |")
    for r in result["rows"]:
        if r.get("kernels"):
            lines.append(f"GPU time per graphed step at batch {r['batch']}, by kernel (us, calls):")
            lines += [f"  {k['us_per_step']:8.1f} {k['calls_per_step']:4d}  {k['kernel']}" for k in r["kernels"]]
    for mode, a in result["agreement"].items():
        lines.append(f"greedy tokens vs transformers, {mode}: first divergence per prompt {a['first_divergence']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_step", description=__doc__)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=129)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="", help="write the result as JSON here")
    p.add_argument(
        "--arch",
        default="llama",
        choices=("llama", "mistral", "qwen2"),
        help="the architecture at SmolLM2's shapes (the GPU lean forward's family)",
    )
    p.add_argument(
        "--export",
        default="",
        metavar="DIR",
        help="only write the model as an HF checkpoint to DIR (for the HF peers) and print its cbserve --model spec",
    )
    args = p.parse_args(argv)
    if args.export:
        spec = "tiny:" + json.dumps(SMOLLM2_SHAPE, separators=(",", ":"))
        load_model(resolve(spec), torch.bfloat16).save_pretrained(args.export)
        sys.stdout.write(spec + "\n")
        return 0
    if not torch.cuda.is_available():
        sys.stderr.write("bench.gpu_step needs a CUDA GPU\n")
        return 2
    result = run(
        [int(b) for b in args.batches.split(",")], args.prompt_len, args.decode_tokens, args.repeats, args.arch
    )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    sys.stdout.write(render(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
