"""The router picks a checkpoint's tokenizer class as AutoTokenizer does,
without importing torch (AutoTokenizer's config classes pull it in)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from router import tokenizer as rt
from tests.conftest import REPO

# Declared classes a checkpoint may carry: the generic ones, each family's,
# a Fast alias, one transformers lacks, none at all, and LlamaTokenizer
# (left to AutoTokenizer: its choice depends on the pre-tokenizer).
HUB_CLASSES = [
    "TokenizersBackend",
    "PreTrainedTokenizerFast",
    "GPT2Tokenizer",
    "Qwen2TokenizerFast",
    "GemmaTokenizer",
    "NoSuchTokenizer",
    None,
    "LlamaTokenizerFast",
]


def test_the_tables_are_transformers_own():
    from transformers.models.auto import tokenization_auto as ta

    for model_type, registered in rt.REGISTERED_TOKENIZER.items():
        assert ta.TOKENIZER_MAPPING_NAMES.get(model_type) == registered, model_type
        distrusted = model_type in ta.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        assert distrusted == (model_type in rt.HUB_CLASS_DISTRUSTED), model_type


def _checkpoint(path, model_type: str, hub: str | None):
    rt.build_tiny_tokenizer().save_pretrained(path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("tokenizer_class", None)
    if hub is not None:
        cfg["tokenizer_class"] = hub
    cfg_path.write_text(json.dumps(cfg))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(path)


@pytest.mark.parametrize("model_type", sorted(rt.REGISTERED_TOKENIZER))
def test_the_class_is_the_one_autotokenizer_builds(tmp_path, model_type):
    from transformers import AutoTokenizer

    text = "Grüße, <s> world </s> 123"
    messages = [{"role": "user", "content": "hi"}]
    for i, hub in enumerate(HUB_CLASSES):
        path = _checkpoint(tmp_path / str(i), model_type, hub)
        name = rt.tokenizer_class_name(path)
        if hub is None or hub.startswith("LlamaTokenizer"):
            assert name is None, hub
            continue
        auto = AutoTokenizer.from_pretrained(path)
        assert name == type(auto).__name__, hub
        ours = rt._hf_from_dir(path)
        assert type(ours) is type(auto)
        for use in (lambda t: t(text)["input_ids"], lambda t: t.apply_chat_template(messages, tokenize=False)):
            assert _outcome(use, ours) == _outcome(use, auto), hub


def _outcome(use, tok):
    """What `use(tok)` returns, or the error it raises (some classes rebuild
    the test's byte tokenizer and need tokens it lacks: both sides alike)."""
    try:
        return use(tok)
    except Exception as exc:  # noqa: BLE001
        return (type(exc).__name__, str(exc))


def test_other_checkpoints_are_left_to_autotokenizer(tmp_path):
    assert rt.tokenizer_class_name(_checkpoint(tmp_path / "a", "gpt2", "TokenizersBackend")) is None
    for i, word in enumerate(["AutoModelForCausalLM", "LlamaConfig", "is_torch_available"]):
        assert rt.tokenizer_class_name(_checkpoint(tmp_path / f"x{i}", "llama", word)) is None  # never built here
    path = _checkpoint(tmp_path / "b", "llama", "TokenizersBackend")
    assert rt.tokenizer_class_name(path) == "TokenizersBackend"
    tok_cfg = tmp_path / "b" / "tokenizer_config.json"
    cfg = json.loads(tok_cfg.read_text())
    tok_cfg.write_text(json.dumps({**cfg, "auto_map": {"AutoTokenizer": ["x", "y"]}}))
    assert rt.tokenizer_class_name(path) is None  # custom code: AutoTokenizer decides (and refuses)
    (tmp_path / "b" / "tokenizer.json").unlink()
    tok_cfg.write_text(json.dumps(cfg))
    assert rt.tokenizer_class_name(path) is None


def test_loading_a_checkpoint_tokenizer_does_not_import_torch(tmp_path):
    path = _checkpoint(tmp_path / "q", "qwen2", "Qwen2Tokenizer")
    code = (
        "import sys; from router.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({path!r}); "
        "assert type(t.hf).__name__ == 'Qwen2Tokenizer', type(t.hf); "
        "assert t.encode('abc'); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
