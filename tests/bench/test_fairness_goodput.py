"""The fairness and goodput benchmarks' arithmetic on synthetic records:
Jain's index, the measured window, an SLO class met or missed, the arrival
stream, and the target verdicts of the reports."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from bench import fairness, goodput
from bench.stats import RequestRecord


def rec(send, times, error=""):
    r = RequestRecord(index=0, prompt_tokens=8, max_new_tokens=len(times))
    r.send_s = send
    for t in times:
        r.add_tokens(1, t)
    r.end_s = times[-1] if times else send
    r.finish_reason = "length" if not error else ""
    r.error = error
    return r


def test_jain_index():
    assert fairness.jain([1.0, 1.0]) == pytest.approx(1.0)
    assert fairness.jain([1.0, 0.0]) == pytest.approx(0.5)
    assert fairness.jain([0.5, 1.0]) == pytest.approx(2.25 / 2.5)
    assert math.isnan(fairness.jain([0.0, 0.0]))


def test_window_counts_sends_and_tokens_inside_it():
    records = [rec(1.0, [1.2, 1.4]), rec(5.0, [5.5, 11.0]), rec(12.0, [12.5])]
    w = fairness.window_stats(records, 2.0, 12.0)
    assert w["requests"] == 1 and w["errors"] == 0  # only the one sent at 5.0
    assert w["tok_s"] == pytest.approx(2 / 10.0)  # 5.5 and 11.0 fall inside
    assert w["ttft"]["p50"] == pytest.approx(0.5)


def test_a_class_is_met_only_within_both_targets():
    assert goodput.met("interactive", rec(0.0, [0.9, 0.99, 1.08]))  # TTFT 0.9, TPOT 0.09
    assert not goodput.met("interactive", rec(0.0, [1.1, 1.2]))  # TTFT over 1 s
    assert not goodput.met("interactive", rec(0.0, [0.5, 0.7, 0.9]))  # TPOT 0.2 > 0.1
    assert goodput.met("batch", rec(0.0, [19.0, 19.4]))
    assert not goodput.met("batch", rec(0.0, [1.0], error="HTTP 429"))


def test_arrivals_are_poisson_at_the_rate_and_half_of_each_class():
    a = goodput.arrivals(10.0, 200.0, seed=1)
    assert a == goodput.arrivals(10.0, 200.0, seed=1)
    assert abs(len(a) / 200.0 - 10.0) < 0.8
    assert all(0 <= t < 200 for t, _ in a) and [t for t, _ in a] == sorted(t for t, _ in a)
    share = sum(c == "interactive" for _, c in a) / len(a)
    assert 0.45 < share < 0.55


def test_the_reports_state_each_target_met_or_missed():
    def system(light_p90, total, light_tok=40.0):
        return {
            "tenants": {"light": {"ttft": {"p90": light_p90}, "tok_s": light_tok, "requests": 10}},
            "total_tok_s": total,
        }

    results = {
        "alone": system(0.05, 70.0, 70.0),
        "fcfs": system(20.0, 300.0),
        "fair": system(0.09, 290.0),
        "weights": {"service_ratio": 2.6},
    }
    lines = "\n".join(fairness.targets(results))
    assert "<= 2x alone (0.100 s): met" in lines and "<= 0.1x fcfs (2.000 s): met" in lines
    assert "96.7% of fcfs (>= 95 %): met" in lines and "1:2.60 (within 10 %): MISSED" in lines

    def load(g):
        return {"goodput": g, "interactive": {"met": 1, "requests": 2, "ttft": {}}, "batch": {"met": 1, "requests": 2}}

    res = {
        "base_rate": 10.0,
        "systems": {
            "fcfs": {"1.0": load(5.0), "1.5": load(4.0), "2.0": load(3.0)},
            "slo": {"1.0": load(4.95), "1.5": load(6.5), "2.0": load(4.0)},
            "vllm": {"1.0": load(3.0), "1.5": load(3.0), "2.0": load(2.0)},
        },
    }
    args = SimpleNamespace(send_s=30.0, prompt_len=128, output_len=64, dtype="bfloat16")
    text = goodput.render(res, args, "cbserve bench goodput")
    assert "1.5x: slo / cbserve fcfs goodput 1.62 (>= 1.5): met" in text
    assert "2.0x: slo / cbserve fcfs goodput 1.33 (>= 1.5): MISSED" in text
    assert "2.0x: slo / best vLLM-CPU goodput 2.00 (>= 2): met" in text
    assert "1.0x: slo at 99.0% of fcfs's goodput (>= 98 %): met" in text
