"""Incremental detokenization and stop strings.

Decoding one token at a time breaks multi-byte UTF-8 characters and drops the
leading spaces some tokenizers encode in the previous token, so text is
decoded over a short window (prefix_offset..end) and only what extends the
already-emitted text is released, never a trailing U+FFFD. When stop strings
are set, the last `longest stop - 1` characters are held back until they can
no longer begin a stop string.
"""

from __future__ import annotations

from router.tokenizer import Tokenizer

_WINDOW = 6  # tokens of left context re-decoded each step


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (), min_tokens: int = 0
    ) -> None:
        self.tok = tokenizer
        # Stop strings are matched only in text that arrives once this many
        # output tokens exist (a request's stopping.min_tokens).
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.ids: list[int] = list(prompt_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all output text decoded so far
        self.emitted = 0  # characters of self.text already released
        self.stopped = False

    def add(self, token_ids: list[int]) -> None:
        """Appends tokens; updates self.text and, if a stop string appeared,
        truncates before it and sets self.stopped."""
        self.ids.extend(token_ids)
        self.num_tokens += len(token_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            before = len(self.text)
            self.text += new
            # Keep the window short: the decoded context moves forward.
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            if self.prefix_offset > _WINDOW * 4:
                drop = self.prefix_offset - _WINDOW
                self.ids = self.ids[drop:]
                self.prefix_offset -= drop
                self.read_offset -= drop
            if self.stop and self.num_tokens >= self.min_tokens:
                # The step that reaches min_tokens searches its own text only,
                # none from before min_tokens were out.
                self._check_stop(before, lookback=self.num_tokens - len(token_ids) >= self.min_tokens)

    def _check_stop(self, new_from: int, lookback: bool) -> None:
        """Truncates at the first stop string found from new_from on, or from
        `hold` characters before it when lookback (a stop string split over
        steps)."""
        start = max(0, new_from - self.hold) if lookback else new_from
        cut = -1
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            self.text = self.text[:cut]
            self.stopped = True

    def _flush(self) -> None:
        """At the end of the output: tokens still held back as the start of
        an incomplete UTF-8 character are released as they decode (U+FFFD),
        so the text equals the decode of the output tokens."""
        if self.stopped or self.read_offset >= len(self.ids):
            return
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix):
            self.text += full[len(prefix) :]
        self.read_offset = len(self.ids)

    def take(self, final: bool = False) -> str:
        """The text not yet released; holds back a possible stop-string prefix
        unless final (which also releases an incomplete trailing character)."""
        if final:
            self._flush()
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
