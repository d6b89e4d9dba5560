"""Observability (issue #7): after a scripted load every metric is present
with the values the load implies, the JSON logs carry one summary line per
request and the request id on every line about it, the log level from the
config works, ModelInfo reports the serving facts, and docs/metrics.md lists
exactly the metrics the router exports."""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time

import grpc
import pytest

from cbserve.v1 import generation_pb2 as gpb
from tests.conftest import REPO, start_server
from tests.integration.helpers import gen_request, stub, wait_idle

N = 20
PROMPTS = [[3 + (i * 7 + j) % 250 for j in range(4 + i)] for i in range(N)]
MAX_NEW = [3 + i % 5 for i in range(N)]
IDS = [f"obs-req-{i:02d}-x" for i in range(N)]
CANCEL_IDS = ["obs-cancel-0-x", "obs-cancel-1-x"]
CANCEL_PROMPTS = [[100, 101, 102, 103, 104, 105], [110, 111, 112, 113, 114, 115, 116, 117, 118, 119]]
INVALID = [
    gen_request(text="", request_id="obs-bad-0-x"),
    gen_request([5, 259], request_id="obs-bad-1-x"),
    gen_request([5, 6], request_id="obs-bad-2-x", sampling=gpb.SamplingParams(temperature=math.nan)),
]


@pytest.fixture(scope="module")
def load():
    """A fresh server (so every counter starts at 0) and the scripted load:
    N completed requests (half streamed, several at once), 2 cancelled
    streams, 3 invalid requests. Returns (server, facts the client saw)."""
    server = start_server(
        "tiny",
        config={
            "scheduler": {"policy": "sjf", "max_num_batched_tokens": 256},
            "cache": {"num_blocks": 300, "block_size": 8},
            "logging": {"level": "debug"},
        },
        share_executor=False,  # both processes' logs are read
    )
    seen = {"tokens": {}, "cancelled_tokens": {}, "invalid": [], "errors": []}
    try:
        with server.channel() as ch:
            s = stub(ch)

            def run(i):
                try:
                    req = gen_request(PROMPTS[i], max_new=MAX_NEW[i], request_id=IDS[i])
                    if i % 2:
                        msgs = list(s.Generate(req, timeout=60))
                        assert msgs[-1].finish_reason == gpb.LENGTH
                        seen["tokens"][IDS[i]] = sum(len(m.token_ids) for m in msgs)
                    else:
                        r = s.Complete(req, timeout=60)
                        assert r.finish_reason == gpb.LENGTH
                        seen["tokens"][IDS[i]] = len(r.token_ids)
                except Exception as exc:  # reported by the tests
                    seen["errors"].append(repr(exc))

            for start in range(0, N, 5):  # five at a time: batches bigger than one
                threads = [threading.Thread(target=run, args=(i,)) for i in range(start, start + 5)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
            for rid, prompt in zip(CANCEL_IDS, CANCEL_PROMPTS):
                call = s.Generate(gen_request(prompt, max_new=2000, request_id=rid), timeout=60)
                first = next(call)
                call.cancel()
                seen["cancelled_tokens"][rid] = len(first.token_ids)
            for req in INVALID:
                try:
                    s.Complete(req, timeout=30)
                    seen["invalid"].append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    seen["invalid"].append(exc.code())
        wait_idle(server, timeout=30)
        yield server, seen
    finally:
        server.stop()


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.strip():
            obj = json.loads(line)  # raises on a line that is not JSON
            assert isinstance(obj, dict), line
            out.append(obj)
    return out


def _finished_lines(server) -> dict[str, list[dict]]:
    by_id: dict[str, list[dict]] = {}
    for obj in _json_lines(server.log()):
        if obj.get("event") == "request finished":
            by_id.setdefault(obj.get("request_id"), []).append(obj)
    return by_id


def test_startup_heap_is_frozen(load):
    """Both processes move what they built at start-up out of the cyclic GC,
    so that a full collection never walks the model's (or the tokenizer's)
    objects in the middle of serving."""
    server, _ = load
    ready = {
        obj["event"]: obj
        for obj in _json_lines(server.log())
        if obj.get("event") in ("router listening", "executor ready")
    }
    assert ready["executor ready"]["frozen_objects"] > 50_000, ready
    # After handing freed heap pages back, the executor logs its resident set.
    assert 10 < ready["executor ready"]["rss_mb"] < 64_000, ready
    # ... and what its weights take of it (a GGUF source adds the file's size).
    assert 0 <= ready["executor ready"]["weights_mb"] <= ready["executor ready"]["rss_mb"], ready
    assert "gguf_file_mb" not in ready["executor ready"], ready
    assert ready["router listening"]["frozen_objects"] > 10_000, ready


# -- metrics --------------------------------------------------------------------------
def test_load_ran_as_scripted(load):
    server, seen = load
    assert not seen["errors"], seen["errors"]
    assert seen["tokens"] == dict(zip(IDS, MAX_NEW))
    assert all(n >= 1 for n in seen["cancelled_tokens"].values())
    assert seen["invalid"] == [grpc.StatusCode.INVALID_ARGUMENT] * 3


def test_counters_match_the_load(load):
    server, seen = load
    m = server.metrics()
    fin = _finished_lines(server)
    cancelled_out = {rid: fin[rid][0]["output_tokens"] for rid in CANCEL_IDS}
    for rid, n in seen["cancelled_tokens"].items():
        assert cancelled_out[rid] >= n  # the server may have made more than the client read
    admitted = N + len(CANCEL_IDS)
    total_tokens = sum(MAX_NEW) + sum(cancelled_out.values())

    assert m["cbserve_generation_tokens_total"] == total_tokens
    assert m["cbserve_prompt_tokens_total"] == sum(map(len, PROMPTS)) + sum(map(len, CANCEL_PROMPTS))
    assert 0 < m["cbserve_prompt_tokens_computed_total"] <= m["cbserve_prompt_tokens_total"]
    assert m["cbserve_requests_total{finish_reason=LENGTH,status=OK}"] == N
    assert m["cbserve_requests_total{finish_reason=CANCELLED,status=CANCELLED}"] == len(CANCEL_IDS)
    assert sum(v for k, v in m.items() if k.startswith("cbserve_requests_total{")) == admitted
    # Refused requests are counted by status and never as finished requests.
    assert m["cbserve_request_errors_total{status=INVALID_ARGUMENT}"] == len(INVALID)
    assert sum(v for k, v in m.items() if k.startswith("cbserve_request_errors_total{")) == len(INVALID)
    assert m["cbserve_num_preemptions_total"] == 0
    assert m["cbserve_executor_reconnects_total"] == 0
    assert 0 <= m["cbserve_prefix_cache_hits_total"] <= m["cbserve_prefix_cache_queries_total"]
    assert m["cbserve_prefix_cache_queries_total"] > 0


def test_histograms_match_the_load(load):
    server, _ = load
    m = server.metrics()
    fin = _finished_lines(server)
    admitted = N + len(CANCEL_IDS)
    total_tokens = sum(MAX_NEW) + sum(fin[rid][0]["output_tokens"] for rid in CANCEL_IDS)

    assert m["cbserve_time_to_first_token_seconds_count"] == admitted  # every one produced a token
    assert m["cbserve_e2e_request_latency_seconds_count"] == admitted
    assert m["cbserve_queue_time_seconds_count"] == admitted
    # One inter-token latency per step that gave a request tokens: a step's
    # accepted draft tokens arrive with the token sampled after them.
    accepted = m.get("cbserve_spec_decode_num_accepted_tokens_total", 0)
    assert m["cbserve_inter_token_latency_seconds_count"] == total_tokens - admitted - accepted
    steps = m["cbserve_iteration_tokens_count"]
    assert steps > 0
    for name in (
        "cbserve_batch_size",
        "cbserve_iteration_seconds",
        "cbserve_executor_step_seconds",
        "cbserve_executor_forward_seconds",
    ):
        assert m[f"{name}_count"] == steps, name
    # Every computed token was a prompt token or a fed-back output token.
    assert m["cbserve_iteration_tokens_sum"] >= m["cbserve_prompt_tokens_computed_total"] + total_tokens - admitted
    assert m["cbserve_batch_size_sum"] >= steps
    assert m["cbserve_batch_size_sum"] > steps, "the concurrent requests never shared a batch"
    for name in (
        "cbserve_time_to_first_token_seconds",
        "cbserve_e2e_request_latency_seconds",
        "cbserve_queue_time_seconds",
        "cbserve_inter_token_latency_seconds",
        "cbserve_iteration_tokens",
        "cbserve_batch_size",
        "cbserve_iteration_seconds",
        "cbserve_executor_step_seconds",
        "cbserve_executor_forward_seconds",
    ):
        assert m[f"{name}_bucket{{le=+Inf}}"] == m[f"{name}_count"], name
        assert m[f"{name}_sum"] >= 0, name
    assert m["cbserve_time_to_first_token_seconds_sum"] <= m["cbserve_e2e_request_latency_seconds_sum"]
    assert m["cbserve_executor_forward_seconds_sum"] <= m["cbserve_executor_step_seconds_sum"] + 1e-6


def test_gauges_back_to_idle(load):
    server, _ = load
    m = server.metrics()
    assert m["cbserve_num_requests_running"] == 0
    assert m["cbserve_num_requests_waiting"] == 0
    assert m["cbserve_num_requests_swapped"] == 0
    assert m["cbserve_kv_cache_usage_ratio"] == 0
    assert m["cbserve_executor_up"] == 1


# -- logs -----------------------------------------------------------------------------
def test_every_log_line_is_json(load):
    server, _ = load
    lines = _json_lines(server.log())
    assert lines
    for obj in lines:
        assert {"event", "level", "timestamp", "process"} <= obj.keys(), obj
    assert {obj["process"] for obj in lines} == {"router", "executor"}


def test_stdlib_log_records_are_json_too():
    """grpc, asyncio and transformers log through the stdlib: with format json
    their records (tracebacks included) are JSON lines as well."""
    import subprocess
    import sys

    code = (
        "import logging\n"
        "from common.logging_setup import configure_logging\n"
        "configure_logging('info', 'json', process='router')\n"
        "try:\n    1/0\nexcept ZeroDivisionError:\n"
        "    logging.getLogger('grpc._server').exception('Exception calling application')\n"
        "logging.getLogger('asyncio').info('below the stdlib level')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    lines = _json_lines(out.stderr)
    assert len(lines) == 1, out.stderr
    assert lines[0]["level"] == "error" and lines[0]["logger"] == "grpc._server"
    assert "ZeroDivisionError" in lines[0]["exception"] and lines[0]["process"] == "router"


def test_one_summary_line_per_request(load):
    server, _ = load
    fin = _finished_lines(server)
    for rid, prompt, max_new in zip(IDS, PROMPTS, MAX_NEW):
        assert len(fin.get(rid, [])) == 1, rid
        line = fin[rid][0]
        assert line["prompt_tokens"] == len(prompt) and line["output_tokens"] == max_new
        assert line["finish_reason"] == "LENGTH" and line["status"] == "OK"
        assert line["level"] == "info" and line["process"] == "router"
        for key in ("queue_s", "ttft_s", "e2e_s"):
            assert isinstance(line[key], (int, float)) and line[key] >= 0, (rid, key)
        assert line["queue_s"] <= line["ttft_s"] <= line["e2e_s"]
    for rid, prompt in zip(CANCEL_IDS, CANCEL_PROMPTS):
        assert len(fin.get(rid, [])) == 1, rid
        line = fin[rid][0]
        assert line["finish_reason"] == "CANCELLED" and line["status"] == "CANCELLED"
        assert line["prompt_tokens"] == len(prompt) and line["output_tokens"] >= 1
    assert not any(rid.startswith("obs-bad-") for rid in fin), "refused requests were never admitted"
    assert len(fin) == N + len(CANCEL_IDS)


def test_every_line_about_a_request_carries_its_id(load):
    server, _ = load
    text = server.log()
    ours = IDS + CANCEL_IDS
    started = set()
    for line in text.splitlines():
        mentioned = [rid for rid in ours if rid in line]
        if not mentioned:
            continue
        obj = json.loads(line)
        assert len(mentioned) == 1 and obj.get("request_id") == mentioned[0], line
        if obj["event"] in ("generate started", "complete started"):
            started.add(obj["request_id"])
    assert started == set(ours), "the debug line of each RPC carries the request id"


def test_log_level_from_config():
    server = start_server("tiny", config={"logging": {"level": "warning"}})
    try:
        with server.channel() as ch:
            r = stub(ch).Complete(gen_request([5, 6, 7], max_new=3, request_id="quiet-1"), timeout=30)
        assert len(r.token_ids) == 3
        wait_idle(server)
        lines = _json_lines(server.log())
    finally:
        server.stop()
    router = [obj for obj in lines if obj["process"] == "router"]
    assert not any(obj["level"] in ("debug", "info") for obj in router), router[:5]
    assert not any(obj.get("event") == "request finished" for obj in lines)


# -- ModelInfo ------------------------------------------------------------------------
def test_model_info_reports_serving_facts(load):
    from router import __version__

    server, _ = load
    with server.channel() as ch:
        info = stub(ch).ModelInfo(gpb.ModelInfoRequest(), timeout=10)
    assert info.model == "tiny-random-llama" and info.dtype == "float32"
    assert info.max_context_length == 2048 and info.vocab_size == 259
    assert info.block_size == 8 and info.num_kv_blocks == 300  # from this server's config
    assert info.policy == "sjf" and info.version == __version__ and info.version
    assert info.max_new_tokens_limit == 4096 and info.attention_backend == "native"


# -- docs/metrics.md --------------------------------------------------------------------
DOC = os.path.join(REPO, "docs", "metrics.md")
_ROW = re.compile(r"^\|\s*`((?:cbserve_|vllm:)[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|([^|]*)\|([^|]*)\|\s*$")


def _exported():
    """(exported name, type, labels) of every metric family of the router."""
    from router.metrics import METRIC_NAMES, Metrics

    out = {}
    for fam in Metrics().registry.collect():
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        labels = set()
        for s in fam.samples:
            labels |= set(s.labels) - {"le"}
        out[name] = (fam.type, labels)
    assert set(out) <= METRIC_NAMES
    return out


def test_metrics_doc_lists_exactly_the_exported_metrics():
    # Labelled metrics export no sample until first used: take labels from the
    # Metrics object's label names instead.
    from router.metrics import Metrics

    metrics = Metrics()
    labelnames = {}
    for attr in vars(metrics).values():
        names = getattr(attr, "_labelnames", None)
        if names is not None:
            labelnames[attr._name] = set(names)
    exported = {}
    for name, (typ, labels) in _exported().items():
        base = name[: -len("_total")] if typ == "counter" else name
        exported[name] = (typ, labels | labelnames.get(base, set()))

    with open(DOC, encoding="utf-8") as fh:
        rows = [_ROW.match(line) for line in fh]
    documented = {}
    for r in filter(None, rows):
        labels = {x.strip(" `") for x in r.group(3).split(",") if x.strip(" `-")}
        assert r.group(4).strip(), f"{r.group(1)}: no meaning given"
        assert r.group(1) not in documented, f"{r.group(1)} listed twice"
        documented[r.group(1)] = (r.group(2), labels)
    missing = set(exported) - set(documented)
    stale = set(documented) - set(exported)
    assert not missing and not stale, f"docs/metrics.md: missing {sorted(missing)}, stale {sorted(stale)}"
    for name, (typ, labels) in exported.items():
        assert documented[name] == (typ, labels), f"{name}: doc says {documented[name]}, code {(typ, labels)}"


def test_executor_process_serves_its_own_metrics():
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from tests.conftest import free_port, start_server
    from tests.integration.helpers import gen_request, stub

    port = free_port()
    server = start_server("tiny", extra_args=["--executor-metrics-port", str(port)])
    try:
        with server.channel() as ch:
            for n in (3, 5):
                stub(ch).Complete(gen_request([5, 6, 7, 8], max_new=n))
        end = time.monotonic() + 10
        while True:  # the plan freeing the last request's state follows its final token
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
            samples = {s.name: s.value for f in fams.values() for s in f.samples}
            if samples["cbserve_executor_sequences"] == 0 or time.monotonic() > end:
                break
            time.sleep(0.1)
        import psutil

        listening = [
            c.laddr for c in psutil.Process(server.executor_pid()).net_connections("inet") if c.status == "LISTEN"
        ]
        assert [a.ip for a in listening if a.port == port] == ["127.0.0.1"]  # loopback unless told otherwise
    finally:
        server.stop()
    assert samples["cbserve_executor_sampled_tokens_total"] == 8
    # Each request: one prefill step (4 tokens) and n - 1 decode steps; the
    # plan that frees the first request's state may ride with the second's
    # prefill or go alone, the second's goes alone.
    steps = samples["cbserve_executor_steps_total"]
    assert steps == samples["cbserve_executor_step_duration_seconds_count"] and steps in (9, 10)
    assert samples["cbserve_executor_step_tokens_sum"] == 4 * 2 + 2 + 4
    assert samples["cbserve_executor_sequences"] == 0
