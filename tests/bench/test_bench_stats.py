import math

import numpy as np

from bench.stats import RequestRecord, percentiles, summarize


def test_percentiles_match_numpy_and_handle_empty():
    vals = list(np.random.default_rng(0).random(101))
    p = percentiles(vals)
    for k in (50, 90, 99):
        assert p[f"p{k}"] == np.percentile(vals, k)
    assert p["mean"] == np.mean(vals)
    assert percentiles([1.0, 2.0, 3.0])["p50"] == 2.0
    e = percentiles([])
    assert math.isnan(e["p50"]) and math.isnan(e["mean"])
    assert percentiles([1.0, math.nan, 3.0])["p50"] == 2.0


def test_record_ttft_itl_and_multi_token_deltas():
    r = RequestRecord(index=0, prompt_tokens=4, max_new_tokens=5, send_s=1.0)
    r.add_tokens(1, 1.5)
    r.add_tokens(1, 1.7)
    r.add_tokens(3, 2.3)  # three tokens in one delta: three gaps of 0.2
    r.end_s = 2.3
    assert r.output_tokens == 5
    assert math.isclose(r.ttft, 0.5)
    assert np.allclose(r.itls(), [0.2, 0.2, 0.2, 0.2])
    assert math.isclose(r.e2e, 1.3)
    r2 = RequestRecord.from_dict(r.to_dict())
    assert r2.token_times == r.token_times


def test_summarize():
    recs = []
    for i in range(4):
        r = RequestRecord(index=i, prompt_tokens=10, max_new_tokens=3, send_s=0.0)
        for k in range(3):
            r.add_tokens(1, 0.1 * (i + 1) + 0.05 * k)
        r.end_s = r.token_times[-1]
        recs.append(r)
    bad = RequestRecord(index=9, prompt_tokens=10, max_new_tokens=3, send_s=0.0, end_s=0.1, error="UNAVAILABLE: x")
    s = summarize(recs + [bad])
    assert s["num_ok"] == 4 and s["num_errors"] == 1 and s["errors"] == ["UNAVAILABLE: x"]
    assert s["output_tokens"] == 12
    assert math.isclose(s["duration_s"], 0.5)
    assert math.isclose(s["output_tokens_per_s"], 24.0)
    assert math.isclose(s["itl_s"]["p50"], 0.05)
    assert math.isclose(s["ttft_s"]["p50"], 0.25)
    s2 = summarize(recs, duration_s=2.0)
    assert math.isclose(s2["output_tokens_per_s"], 6.0)
