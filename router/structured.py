"""Structured outputs through llguidance: JSON Schema, any JSON object,
regular expressions, context-free grammars (Lark or GBNF) and a choice among
strings.

The router compiles a request's constraint into an llguidance grammar
(validated against the model's tokenizer, cached by its text) and keeps one
matcher per request. For each step that samples a constrained sequence it
puts the matcher's allowed-token bitmask into the plan; the executor masks
the logits with it; the sampled token advances the matcher, and the output
ends when the grammar is complete. Compilation runs on the tokenizer threads
with the rest of a request's validation, never on the event loop.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from cbserve.v1 import generation_pb2 as gpb

_CACHE_SIZE = 256
# JSON as json.dumps writes it (", " and ": "), not any run of whitespace
# between tokens: a model cannot wander off into endless newlines.
_JSON_OPTIONS = {"whitespace_flexible": False}


class ConstraintError(ValueError):
    """A constraint that cannot compile: the message says why."""


class Structured:
    """Compiles constraints for one tokenizer (model vocabulary of
    `vocab_size` tokens, end-of-sequence `eos`)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos: int | None) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = eos
        self._tok = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, str] = OrderedDict()  # constraint text -> validated grammar

    def _tokenizer(self):
        with self._lock:  # built once, on first use (a large vocabulary takes a while)
            if self._tok is None:
                import llguidance.hf

                self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self._eos)
            return self._tok

    def grammar(self, spec: gpb.StructuredOutput) -> str:
        """The validated llguidance grammar of `spec`; ConstraintError names
        the constraint and what is wrong with it."""
        import llguidance

        kind = spec.WhichOneof("constraint")
        key = f"{kind}\0{_text(spec, kind)}"
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            grammar = _compile(spec, kind)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ConstraintError(f"{kind}: {exc}") from None
        err = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer())
        if err:
            raise ConstraintError(f"{kind}: {err.strip()}")
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: str) -> "Matcher":
        """A fresh matcher at the start of `grammar`."""
        import llguidance

        m = llguidance.LLMatcher(self._tokenizer(), grammar)
        if m.is_error():
            raise ConstraintError(m.get_error())
        return Matcher(m, 4 * -(-self.vocab_size // 32))


class Matcher:
    """An llguidance matcher whose bitmask covers exactly the model's
    vocabulary, in 32-bit words, as the plan protocol defines it (llguidance
    allocates vocab // 32 + 1 words: one too many for a vocabulary that is a
    multiple of 32, such as SmolLM2's 49,152)."""

    def __init__(self, matcher, mask_bytes: int) -> None:
        self._m = matcher
        self.mask_bytes = mask_bytes

    def compute_bitmask(self) -> bytes:
        return self._m.compute_bitmask()[: self.mask_bytes]

    def __getattr__(self, name: str):
        return getattr(self._m, name)


def _text(spec: gpb.StructuredOutput, kind: str) -> str:
    if kind == "choice":
        return json.dumps(list(spec.choice.choices))
    return str(getattr(spec, kind))


def _compile(spec: gpb.StructuredOutput, kind: str) -> str:
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    if kind == "json_schema":
        try:
            schema = json.loads(spec.json_schema)
        except ValueError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON Schema is an object or a boolean")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "regex":
        if not spec.regex:
            raise ValueError("the regular expression is empty")
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "grammar":
        if not spec.grammar.strip():
            raise ValueError("the grammar is empty")
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))
    if kind == "choice":
        choices = list(spec.choice.choices)
        if not choices or any(not c for c in choices):
            raise ValueError("give one or more non-empty strings")
        # Lark string literals take JSON's escapes.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    raise ValueError("set one of json_schema, json_object, regex, grammar, choice")
