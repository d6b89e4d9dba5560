"""Draft tokens for speculative decoding, proposed from what the router
already holds: every sequence's prompt and output tokens, and (suffix)
recent outputs of other requests.

`ngram` (prompt lookup): the sequence's last n tokens, n from
prompt_lookup_max down to prompt_lookup_min, are looked for earlier in the
same sequence; the tokens that followed the latest such occurrence are the
draft. Outputs that copy spans of the prompt or repeat themselves (extraction,
rewriting, code edits, summaries that quote) get several tokens per step.

`suffix` (SuffixDecoding, Oliaro et al., NeurIPS 2025): the longest suffix of
the sequence (up to suffix_decoding_max_tree_depth tokens) is matched in the
sequence itself and in the outputs of recently finished requests; from each,
the draft follows the continuation seen most often, token by token, while
the share of occurrences that continued that way stays at or above
suffix_decoding_min_token_prob, for at most max_spec_factor x the match
length tokens; the better-scored of the two is proposed. Where SuffixDecoding
keeps suffix trees, the occurrences are found by search (the sequence's
int32 bytes) and by a 3-token index (the cache), the latest 64 of each: the
same counts for all but very frequent suffixes, in bounded memory.

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


# suffix: at most this many occurrences of the matched suffix are read (the
# latest), and the cache of other requests' outputs holds at most this many
# tokens beside suffix_decoding_max_cached_requests (memory: about 280 bytes
# a token with its index: 18 MB at this bound).
MAX_OCCURRENCES = 64
SUFFIX_CACHE_MAX_TOKENS = 1 << 16
_GRAM = 3  # the cache's index: every 3-token run, to where it ends


class SuffixCache:
    """Recent requests' outputs for `suffix` to draw from: each kept as
    int32 tokens, with an index from (scope, every 3-token run) to the
    (output, end) pairs where it occurs (the latest MAX_OCCURRENCES per
    run). A scope (the tenant) sees only its own outputs: as the prefix
    cache, nothing crosses tenants, not even as speed. Bounded by requests
    and tokens over all scopes; the oldest output goes first."""

    def __init__(self, max_requests: int, max_tokens: int = SUFFIX_CACHE_MAX_TOKENS) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.texts: dict[int, tuple[str, array]] = {}  # key -> (scope, tokens); insertion order = age
        self.index: dict[tuple, list[tuple[int, int]]] = {}
        self.num_tokens = 0
        self._next = 0

    def add(self, tokens: list[int], scope: str = "") -> None:
        if self.max_requests <= 0 or len(tokens) <= _GRAM:
            return
        key = self._next
        self._next += 1
        self.texts[key] = (scope, array("i", tokens))
        self.num_tokens += len(tokens)
        for end in range(_GRAM - 1, len(tokens) - 1):  # runs with a token after them
            at = self.index.setdefault((scope, *tokens[end - _GRAM + 1 : end + 1]), [])
            at.append((key, end))
            if len(at) > MAX_OCCURRENCES:
                del at[0]
        while self.texts and (len(self.texts) > self.max_requests or self.num_tokens > self.max_tokens):
            self._evict(next(iter(self.texts)))

    def _evict(self, key: int) -> None:
        scope, tokens = self.texts.pop(key)
        self.num_tokens -= len(tokens)
        for end in range(_GRAM - 1, len(tokens) - 1):
            run = (scope, *tokens[end - _GRAM + 1 : end + 1])
            at = self.index.get(run)
            if at is None:
                continue
            at[:] = [x for x in at if x[0] != key]
            if not at:
                del self.index[run]

    def occurrences(self, context: list[int], depth: int, scope: str = "") -> tuple[int, list[tuple[array, int]]]:
        """The longest suffix of `context` (up to `depth` tokens, at least 3)
        found in the scope's outputs: its length and its occurrences (text, end)."""
        if len(context) < _GRAM:
            return 0, []
        found: list[tuple[array, int]] = []
        best = 0
        for key, end in self.index.get((scope, *context[-_GRAM:]), ()):
            text = self.texts[key][1]
            m = _GRAM
            while m < depth and m < len(context) and end - m >= 0 and text[end - m] == context[-1 - m]:
                m += 1
            if m > best:
                best, found = m, []
            if m == best:
                found.append((text, end))
        return best, found


def _longest_suffix(index: NgramIndex, depth: int) -> tuple[int, list[tuple[array, int]]]:
    """The longest suffix of the sequence (up to `depth` tokens) that also
    occurs earlier in it, and the ends of its latest occurrences."""
    size = len(index.tokens)
    buf = index.buf
    best = 0
    for m in range(1, min(depth, size - 1) + 1):
        suffix = buf[(size - m) * _ITEM :]
        end = (size - 1) * _ITEM
        at = buf.rfind(suffix, 0, end)
        while at >= 0 and at % _ITEM:
            end = at + len(suffix) - 1
            at = buf.rfind(suffix, 0, end)
        if at < 0:
            break
        best = m
    if not best:
        return 0, []
    text = index.tokens
    suffix = buf[(size - best) * _ITEM :]
    ends: list[tuple[array, int]] = []
    end = (size - 1) * _ITEM
    while len(ends) < MAX_OCCURRENCES:
        at = buf.rfind(suffix, 0, end)
        if at < 0:
            break
        if at % _ITEM == 0:
            ends.append((text, at // _ITEM + best - 1))
        end = at + len(suffix) - 1
    return best, ends


def suffix_draft(occurrences: list, match: int, cfg: SpeculativeConfig, k: int) -> tuple[list[int], float]:
    """SuffixDecoding's path: from the occurrences of the matched suffix,
    repeatedly the token that most often came next, while the share of
    occurrences that continued this way (the path's probability) stays at
    or above suffix_decoding_min_token_prob, for at most
    max_spec_factor x the match length (and k) tokens. Returns the draft
    and its score (the sum of the probabilities along it)."""
    limit = min(k, max(1, int(cfg.suffix_decoding_max_spec_factor * match)))
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < limit and occurrences:
        counts: dict[int, int] = {}
        total = 0
        for text, end in occurrences:
            if end + 1 < len(text):
                tok = text[end + 1]
                counts[tok] = counts.get(tok, 0) + 1
                total += 1
        if not total:
            break
        tok = max(counts, key=counts.__getitem__)
        prob *= counts[tok] / total
        if prob < cfg.suffix_decoding_min_token_prob:
            break
        draft.append(tok)
        score += prob
        occurrences = [(text, end + 1) for text, end in occurrences if end + 1 < len(text) and text[end + 1] == tok]
    return draft, score


class Speculator:
    """The `speculative` section at work: which steps draft, and the drafts."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        # suffix: recent outputs of finished requests (one cache per model).
        self.cache = SuffixCache(cfg.suffix_decoding_max_cached_requests) if cfg.method == "suffix" else None

    def finished(self, req: Request) -> None:
        """A request ended: its output joins the suffix cache."""
        if self.cache is not None and req.output_token_ids:
            self.cache.add(req.output_token_ids, req.tenant)

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
        if self.cfg.method == "suffix":
            drafts = self._suffix(req, index, k)
        else:
            drafts = index.propose(self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max, k)
        if drafts and req.matcher is not None:
            drafts = drafts[: req.matcher.validate_tokens(drafts)]
        return drafts

    def _suffix(self, req: Request, index: NgramIndex, k: int) -> list[int]:
        """The better-scored of two drafts: from the request's own tokens and
        from the cache of other requests' outputs (SuffixDecoding's two trees)."""
        depth = self.cfg.suffix_decoding_max_tree_depth
        match, occ = _longest_suffix(index, depth)
        own = suffix_draft(occ, match, self.cfg, k) if match else ([], 0.0)
        if self.cache is None or not self.cache.texts:
            return own[0]
        context = index.tokens[-depth:].tolist()
        match, occ = self.cache.occurrences(context, depth, req.tenant)
        other = suffix_draft(occ, match, self.cfg, k) if match else ([], 0.0)
        return other[0] if other[1] > own[1] else own[0]
