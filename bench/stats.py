"""Per-request records and the aggregates every report uses.

Times are seconds on one monotonic clock (time.perf_counter) per run.
TTFT = first token time - send time. ITL = every gap between consecutive
output tokens of one request; when one streamed message carries k > 1 tokens
arriving dt after the previous token, it counts as k gaps of dt / k (the same
convention for every system, so streamed multi-token deltas are not hidden as
zero gaps nor as one long gap).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    max_new_tokens: int
    send_s: float = math.nan  # when the request left the client (run-relative)
    token_times: list[float] = field(default_factory=list)  # one per output token
    end_s: float = math.nan
    output_tokens: int = 0
    finish_reason: str = ""
    error: str = ""
    arrival_s: float = 0.0  # scheduled arrival (workload), <= send_s

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send_s if self.token_times else math.nan

    @property
    def e2e(self) -> float:
        return self.end_s - self.send_s

    def itls(self) -> list[float]:
        t = self.token_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]

    def add_tokens(self, n: int, now: float) -> None:
        """Records a delta of n tokens received at `now` (spreads multi-token
        deltas evenly over the gap since the previous token)."""
        if n <= 0:
            return
        prev = self.token_times[-1] if self.token_times else None
        if prev is None:
            # The first message: its tokens all arrive now (the first one is
            # the TTFT token).
            self.token_times.extend([now] * n)
        else:
            step = (now - prev) / n
            self.token_times.extend(prev + step * (i + 1) for i in range(n))
        self.output_tokens += n

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestRecord":
        return cls(**d)


def lower_middle(ordered: Sequence[Any]) -> Any:
    """The median element of an already sorted, non-empty sequence: the
    lower of the middle two for an even count (always one of the values)."""
    return ordered[(len(ordered) - 1) // 2]


def percentiles(values: Sequence[float] | np.ndarray, ps: Iterable[float] = PERCENTILES) -> dict[str, float]:
    """Linear-interpolated percentiles ("p50", ...); NaN for an empty input."""
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    out = {}
    for p in ps:
        out[f"p{p:g}"] = float(np.percentile(arr, p)) if arr.size else math.nan
    out["mean"] = float(arr.mean()) if arr.size else math.nan
    return out


def summarize(records: Sequence[RequestRecord], duration_s: float | None = None) -> dict[str, Any]:
    """Aggregates of one run. duration_s defaults to first send -> last end."""
    ok = [r for r in records if r.ok]
    if duration_s is None:
        if ok:
            duration_s = max(r.end_s for r in ok) - min(r.send_s for r in ok)
        else:
            duration_s = math.nan
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    itls = [g for r in ok for g in r.itls()]
    dur_ok = duration_s and duration_s > 0 and not math.isnan(duration_s)
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "output_tokens": out_tok,
        "prompt_tokens": in_tok,
        "expected_output_tokens": sum(r.max_new_tokens for r in records),
        "output_tokens_per_s": out_tok / duration_s if dur_ok else math.nan,
        "total_tokens_per_s": (out_tok + in_tok) / duration_s if dur_ok else math.nan,
        "requests_per_s": len(ok) / duration_s if dur_ok else math.nan,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "itl_s": percentiles(itls),
        "e2e_s": percentiles([r.e2e for r in ok]),
        "tpot_s": percentiles([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
    }
