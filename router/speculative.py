"""Draft tokens for speculative decoding, proposed from what the router
already holds: every sequence's prompt and output tokens.

`ngram` (prompt lookup): the sequence's last n tokens, n from
prompt_lookup_max down to prompt_lookup_min, are looked for earlier in the
same sequence; the tokens that followed the latest such occurrence are the
draft. Outputs that copy spans of the prompt or repeat themselves (extraction,
rewriting, code edits, summaries that quote) get several tokens per step.

The executor verifies a draft as more rows of the sequence's query and keeps
it up to the first token that differs from what decoding would have sampled
(executor/runner.py `_verify`), so drafts change speed, never outputs.
"""

from __future__ import annotations

from array import array

from router.config import SpeculativeConfig
from router.request import Request

_ITEM = 4  # bytes per token in the search buffer (int32)


class NgramIndex:
    """A sequence's tokens as one int32 byte string, searched from the end
    with bytes.rfind (C speed, 4 bytes a token, nothing else kept)."""

    def __init__(self) -> None:
        self.tokens = array("i")
        self.buf = b""

    def sync(self, prompt: list[int], output: list[int]) -> None:
        """Appends what is new of prompt + output (they only grow)."""
        have = len(self.tokens)
        if have == len(prompt) + len(output):
            return
        if have < len(prompt):
            self.tokens.extend(prompt[have:])
            have = len(prompt)
        self.tokens.extend(output[have - len(prompt) :])
        self.buf = self.tokens.tobytes()

    def propose(self, n_min: int, n_max: int, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the
        longest suffix (n_max..n_min tokens) found; [] if none."""
        size = len(self.tokens)
        buf = self.buf
        for n in range(min(n_max, size - 1), n_min - 1, -1):
            suffix = buf[(size - n) * _ITEM :]
            # A match must end before the last token, so something follows it.
            end = (size - 1) * _ITEM
            while True:
                at = buf.rfind(suffix, 0, end)
                if at < 0:
                    break
                if at % _ITEM == 0:  # token-aligned
                    start = at // _ITEM + n
                    return self.tokens[start : start + k].tolist()
                end = at + len(suffix) - 1
        return []


class Speculator:
    """The `speculative` section at work: which steps draft, and the drafts."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg

    def drafting(self, batch_size: int) -> bool:
        """Whether a step with this many running sequences carries drafts."""
        return batch_size < self.cfg.disable_by_batch_size

    def propose(self, req: Request, room: int) -> list[int]:
        """At most `room` (and num_speculative_tokens) draft tokens to follow
        req's last token; [] when it opted out or nothing matches. A
        structured-output request's drafts end where its grammar would
        refuse one."""
        k = min(room, self.cfg.num_speculative_tokens)
        if k <= 0 or not req.speculative:
            return []
        index = req.spec_index
        if index is None:
            index = req.spec_index = NgramIndex()
        index.sync(req.prompt_token_ids, req.output_token_ids)
        drafts = index.propose(self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max, k)
        if drafts and req.matcher is not None:
            drafts = drafts[: req.matcher.validate_tokens(drafts)]
        return drafts
