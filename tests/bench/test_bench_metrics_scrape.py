import math
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from bench.metrics_scrape import MetricsSampler, hist_delta, parse_metrics

TEXT_A = """# HELP cbserve_num_requests_running Running requests
# TYPE cbserve_num_requests_running gauge
cbserve_num_requests_running 3.0
# HELP cbserve_kv_cache_usage_ratio KV usage
# TYPE cbserve_kv_cache_usage_ratio gauge
cbserve_kv_cache_usage_ratio 0.25
# HELP cbserve_num_preemptions_total Preemptions
# TYPE cbserve_num_preemptions_total counter
cbserve_num_preemptions_total 2.0
# HELP cbserve_batch_size Sequences per iteration
# TYPE cbserve_batch_size histogram
cbserve_batch_size_bucket{le="1.0"} 1.0
cbserve_batch_size_bucket{le="64.0"} 10.0
cbserve_batch_size_bucket{le="+Inf"} 10.0
cbserve_batch_size_count 10.0
cbserve_batch_size_sum 100.0
# HELP cbserve_iteration_seconds Iteration time
# TYPE cbserve_iteration_seconds histogram
cbserve_iteration_seconds_bucket{le="+Inf"} 10.0
cbserve_iteration_seconds_count 10.0
cbserve_iteration_seconds_sum 1.0
# HELP cbserve_executor_step_seconds Executor step time
# TYPE cbserve_executor_step_seconds histogram
cbserve_executor_step_seconds_bucket{le="+Inf"} 10.0
cbserve_executor_step_seconds_count 10.0
cbserve_executor_step_seconds_sum 0.8
"""

TEXT_B = (
    TEXT_A.replace("cbserve_batch_size_count 10.0", "cbserve_batch_size_count 30.0")
    .replace("cbserve_batch_size_sum 100.0", "cbserve_batch_size_sum 900.0")
    .replace("cbserve_iteration_seconds_count 10.0", "cbserve_iteration_seconds_count 30.0")
    .replace("cbserve_iteration_seconds_sum 1.0", "cbserve_iteration_seconds_sum 3.0")
    .replace("cbserve_executor_step_seconds_count 10.0", "cbserve_executor_step_seconds_count 30.0")
    .replace("cbserve_executor_step_seconds_sum 0.8", "cbserve_executor_step_seconds_sum 2.4")
    .replace("cbserve_num_preemptions_total 2.0", "cbserve_num_preemptions_total 5.0")
)


def test_parse_and_delta():
    a, b = parse_metrics(TEXT_A), parse_metrics(TEXT_B)
    assert a.values["cbserve_num_requests_running"] == 3.0
    assert a.values["cbserve_kv_cache_usage_ratio"] == 0.25
    assert a.values["cbserve_num_preemptions_total"] == 2.0
    assert a.hists["cbserve_batch_size"] == (100.0, 10.0)
    d = hist_delta(a, b, "cbserve_batch_size")
    assert d == {"sum": 800.0, "count": 20.0, "mean": 40.0}
    assert hist_delta(a, b, "cbserve_missing") is None
    assert hist_delta(None, a, "cbserve_batch_size")["mean"] == 10.0


def test_sampler_against_http_endpoint():
    state = {"text": TEXT_A}

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = state["text"].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), H)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        url = f"http://127.0.0.1:{srv.server_port}/metrics"
        sampler = MetricsSampler(url, interval_s=0.02)
        with sampler:
            import time

            time.sleep(0.15)
            state["text"] = TEXT_B
            time.sleep(0.05)
        s = sampler.summary()
    finally:
        srv.shutdown()
    assert s["available"]
    assert s["mean_batch_occupancy"] == 40.0
    assert s["mean_batch_occupancy_source"] == "cbserve_batch_size histogram"
    assert s["kv_usage_max"] == 0.25
    assert s["gauges"]["cbserve_num_requests_running"]["max"] == 3.0
    assert s["counters"]["cbserve_num_preemptions_total"] == 3.0
    assert math.isclose(s["overhead_share"], 0.2)


def test_sampler_without_endpoint():
    s = MetricsSampler(None).summary()
    assert s == {"available": False}
    with MetricsSampler("http://127.0.0.1:1/metrics", interval_s=0.01) as m:
        pass
    out = m.summary()
    assert out["available"] is False and math.isnan(out["mean_batch_occupancy"])
