"""Where a GGUF file's dequantised Hugging Face checkpoint is kept: the
executor writes it on the file's first load (weights, config, tokenizer);
the router loads the tokenizer from it on later starts, which spares it
transformers' GGUF conversion (and the torch import that comes with it)."""

from __future__ import annotations

import hashlib
import os

# Written last into a converted checkpoint: its presence means complete.
EXPORT_STAMP = ".cbserve-export.json"


def cache_dir() -> str:
    return os.environ.get("CBSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cbserve")


def default_converted_dir() -> str:
    """The embedded default's converted checkpoint (kept under its old name)."""
    return os.path.join(cache_dir(), "smollm2-hf")


def gguf_converted_dir(gguf_path: str) -> str:
    """The converted checkpoint of the GGUF file at `gguf_path`: one
    directory per file (its absolute path, size and modification time, so a
    rewritten file converts again)."""
    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    name = os.path.basename(path).removesuffix(".gguf")
    return os.path.join(cache_dir(), f"gguf-{name}-{key}")


def converted_complete(dest: str) -> bool:
    return os.path.isfile(os.path.join(dest, EXPORT_STAMP))
