"""OpenTelemetry tracing end to end: the router exports one span per request
over OTLP/gRPC to a collector the test runs on loopback."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from tests.conftest import free_port, start_server  # noqa: E402
from tests.integration.helpers import gen_request, stub  # noqa: E402


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name")
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.append((service, span))
        return trace_service_pb2.ExportTraceServiceResponse()


def _attrs(span):
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value if v.HasField("string_value") else v.int_value
    return out


def test_each_request_is_one_span_with_its_life_events():
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    cb = start_server(
        "tiny",
        config={
            "tracing": {
                "exporter": "otlp",
                "otlp_endpoint": f"http://127.0.0.1:{port}",
                "service_name": "cbserve-test",
            },
            "scheduler": {"max_num_batched_tokens": 32, "max_num_seqs": 8},
        },
    )
    try:
        with cb.channel() as ch:
            s = stub(ch)
            s.Complete(gen_request([5] * 70, max_new=4, request_id="traced-1"))  # 70 tokens: 3 chunks of <= 32
            with pytest.raises(grpc.RpcError):
                s.Complete(gen_request([5, 6], max_new=1500, request_id="traced-2"), timeout=0.5)
        end = time.monotonic() + 15
        while time.monotonic() < end:
            with collector.lock:
                ids = {_attrs(sp).get("cbserve.request_id") for _, sp in collector.spans}
            if {"traced-1", "traced-2"} <= ids:
                break
            time.sleep(0.2)
    finally:
        cb.stop()
        server.stop(0)
    spans = {_attrs(sp)["cbserve.request_id"]: (svc, sp) for svc, sp in collector.spans}
    svc, span = spans["traced-1"]
    assert svc == "cbserve-test" and span.name == "cbserve.request"
    a = _attrs(span)
    assert a["cbserve.prompt_tokens"] == 70 and a["cbserve.output_tokens"] == 4
    assert a["cbserve.finish_reason"] == "LENGTH" and a["cbserve.status"] == "OK"
    events = [e.name for e in span.events]
    assert events[0] == "queued" and events[-1] == "finished"
    assert events.count("prefill_chunk") == 3 and "first_token" in events
    assert events.index("first_token") > max(i for i, e in enumerate(events) if e == "prefill_chunk")
    assert span.end_time_unix_nano > span.start_time_unix_nano
    _, late = spans["traced-2"]
    assert _attrs(late)["cbserve.status"] == "DEADLINE_EXCEEDED"
