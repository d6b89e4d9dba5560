"""Reads the router's Prometheus text endpoint during a run.

Gauges (`cbserve_num_requests_running`, `cbserve_kv_cache_usage_ratio`, ...)
are sampled periodically by a background thread; histograms
(`cbserve_batch_size`, `cbserve_iteration_tokens`, `cbserve_iteration_seconds`,
`cbserve_executor_step_seconds`, ...) are read as _sum/_count deltas between a
snapshot before and after the run, which gives exact means over the run.
Missing metrics are reported as absent, never as zero.
"""

from __future__ import annotations

import math
import threading
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

GAUGES = (
    "cbserve_num_requests_running",
    "cbserve_num_requests_waiting",
    "cbserve_kv_cache_usage_ratio",
)
HISTOGRAMS = (
    "cbserve_batch_size",
    "cbserve_iteration_tokens",
    "cbserve_iteration_seconds",
    "cbserve_executor_step_seconds",
    "cbserve_executor_forward_seconds",
    "cbserve_time_to_first_token_seconds",
    "cbserve_inter_token_latency_seconds",
)
COUNTERS = ("cbserve_num_preemptions_total",)


@dataclass
class Snapshot:
    """Flattened view of one scrape: plain values (gauges / counters, summed
    over label sets) and histogram (sum, count) pairs."""

    values: dict[str, float] = field(default_factory=dict)
    hists: dict[str, tuple[float, float]] = field(default_factory=dict)


def parse_metrics(text: str) -> Snapshot:
    snap = Snapshot()
    for fam in text_string_to_metric_families(text):
        if fam.type in ("histogram", "summary"):
            s = c = 0.0
            seen = False
            for sample in fam.samples:
                if sample.name.endswith("_sum"):
                    s += sample.value
                    seen = True
                elif sample.name.endswith("_count"):
                    c += sample.value
                    seen = True
            if seen:
                snap.hists[fam.name] = (s, c)
        else:
            for sample in fam.samples:
                # counters: the parser strips _total from the family name but
                # keeps it on the sample; index both spellings.
                if sample.name.endswith("_created"):
                    continue
                snap.values[sample.name] = snap.values.get(sample.name, 0.0) + sample.value
                if sample.name != fam.name and fam.type == "counter":
                    snap.values[fam.name] = snap.values.get(fam.name, 0.0) + sample.value
    return snap


def fetch_text(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (local URL)
        return resp.read().decode("utf-8", "replace")


def scrape(url: str, timeout: float = 2.0) -> Snapshot | None:
    try:
        return parse_metrics(fetch_text(url, timeout))
    except Exception:
        return None


def hist_delta(before: Snapshot | None, after: Snapshot | None, name: str) -> dict[str, float] | None:
    """Mean / count / sum of a histogram over the interval; None when absent."""
    if after is None or name not in after.hists:
        return None
    s1, c1 = after.hists[name]
    s0, c0 = before.hists.get(name, (0.0, 0.0)) if before is not None else (0.0, 0.0)
    ds, dc = s1 - s0, c1 - c0
    return {"sum": ds, "count": dc, "mean": ds / dc if dc > 0 else math.nan}


class MetricsSampler:
    """Samples gauges every `interval_s` in a thread, brackets the run with two
    snapshots. Use as a context manager; call `summary()` afterwards."""

    def __init__(self, url: str | None, interval_s: float = 0.5):
        self.url = url
        self.interval_s = interval_s
        self.samples: dict[str, list[float]] = {g: [] for g in GAUGES}
        self.before: Snapshot | None = None
        self.after: Snapshot | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            snap = scrape(self.url)
            if snap is None:
                continue
            for g in GAUGES:
                if g in snap.values:
                    self.samples[g].append(snap.values[g])

    def __enter__(self) -> "MetricsSampler":
        if self.url:
            self.before = scrape(self.url)
            self._thread = threading.Thread(target=self._loop, name="metrics-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self.after = scrape(self.url)

    def summary(self) -> dict[str, Any]:
        if not self.url:
            return {"available": False}
        out: dict[str, Any] = {"available": self.after is not None}
        gauges = {}
        for g, vals in self.samples.items():
            if vals:
                # Mean over the samples taken while work was in flight is what
                # "occupancy" means; idle tail samples (0) are dropped for
                # running-requests but kept in the raw mean.
                busy = [v for v in vals if v > 0] or vals
                gauges[g] = {
                    "mean": sum(vals) / len(vals),
                    "mean_busy": sum(busy) / len(busy),
                    "max": max(vals),
                    "n": len(vals),
                }
        out["gauges"] = gauges
        hists = {}
        for h in HISTOGRAMS:
            d = hist_delta(self.before, self.after, h)
            if d is not None:
                hists[h] = d
        out["histograms"] = hists
        counters = {}
        for c in COUNTERS:
            if self.after is not None and c in self.after.values:
                v0 = self.before.values.get(c, 0.0) if self.before else 0.0
                counters[c] = self.after.values[c] - v0
        out["counters"] = counters
        # Headline derived numbers.
        bs = hists.get("cbserve_batch_size")
        out["mean_batch_occupancy"] = (
            bs["mean"] if bs else (gauges.get("cbserve_num_requests_running", {}).get("mean_busy", math.nan))
        )
        out["mean_batch_occupancy_source"] = (
            "cbserve_batch_size histogram"
            if bs
            else "cbserve_num_requests_running gauge samples"
            if "cbserve_num_requests_running" in gauges
            else "absent"
        )
        kv = gauges.get("cbserve_kv_cache_usage_ratio")
        out["kv_usage_mean"] = kv["mean_busy"] if kv else math.nan
        out["kv_usage_max"] = kv["max"] if kv else math.nan
        it, st = hists.get("cbserve_iteration_seconds"), hists.get("cbserve_executor_step_seconds")
        fw = hists.get("cbserve_executor_forward_seconds")
        if it and (st or fw):
            inner = fw or st
            out["iteration_mean_s"] = it["mean"]
            out["inner_mean_s"] = inner["mean"]
            out["inner_metric"] = "cbserve_executor_forward_seconds" if fw else "cbserve_executor_step_seconds"
            out["overhead_share"] = (it["mean"] - inner["mean"]) / it["mean"] if it["mean"] > 0 else math.nan
            if st:
                # router-side share: scheduling, plan serialisation, gRPC, detokenisation
                out["executor_step_mean_s"] = st["mean"]
                out["router_share"] = (it["mean"] - st["mean"]) / it["mean"] if it["mean"] > 0 else math.nan
        return out
