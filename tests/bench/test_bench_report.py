"""Report rendering (markdown + PNGs) from synthetic results, and the CLI wiring."""

import json

import pytest

from bench.report import render_report, throughput_table
from bench.runner import _static_occupancy, decode_rate, make_run
from bench.stats import RequestRecord
from bench.workload import WorkloadSpec, materialise


def _fake_run(system, cap, tok_s_scale, dtype="bfloat16", rate=None):
    spec = WorkloadSpec(
        num_requests=4, prompt_len=8, cap=cap, seed=1, arrival="poisson" if rate else "burst", rate=rate
    )
    w = materialise(spec)
    recs = []
    for r in w.requests:
        rec = RequestRecord(index=r.index, prompt_tokens=8, max_new_tokens=r.max_new_tokens, send_s=0.0)
        for k in range(r.max_new_tokens):
            rec.add_tokens(1, 0.1 + k * 0.01 / tok_s_scale)
        rec.end_s = rec.token_times[-1]
        rec.finish_reason = "LENGTH"
        recs.append(rec)
    metrics = (
        {"available": True, "mean_batch_occupancy": 3.5, "kv_usage_mean": 0.1, "kv_usage_max": 0.2}
        if system.startswith("cbserve")
        else {}
    )
    run = make_run(system, dtype, w, recs, None, metrics=metrics)
    run["summary"]["output_tokens_per_s"] = 10.0 * tok_s_scale
    if rate:
        run["rate"] = rate
    return run


def test_render_report(tmp_path):
    runs = [_fake_run(s, c, k) for s, k in (("hf-static", 1), ("hf-cb", 2), ("cbserve-fcfs", 4)) for c in (8, 16)]
    runs.append(dict(_fake_run("vllm-cpu", 8, 1), error="vLLM venv missing"))
    sweep = [_fake_run("cbserve-fcfs", 8, 1, rate=r) for r in (1.0, 2.0)]
    results = {
        "title": "test",
        "date": "today",
        "command": "python -m bench suite --out X",
        "machine": {"cpu_model": "Test CPU", "cores": 2},
        "versions": {"torch": "x"},
        "runs": runs,
        "rate_sweep": sweep,
        "roofline": {
            "text": "roof",
            "matmuls": [
                {"name": "gate_proj", "m": 64, "k": 576, "n": 1536, "dtype": "bfloat16", "gflops": 300.0, "ms": 0.4}
            ],
            "bounds": [
                {
                    "dtype": "bfloat16",
                    "gflops_weighted": 250.0,
                    "decode_bound_tok_s": 900.0,
                    "cbserve_decode_tok_s": 300.0,
                    "share": 1 / 3,
                    "step_mb": 490.0,
                    "memory_bound_tok_s": 1200.0,
                    "roofline_bound_tok_s": 900.0,
                    "roofline_share": 1 / 3,
                }
            ],
            "stream_gb_s": 23.5,
            "context": 152,
        },
        "overheads": [
            {
                "batch": 1,
                "decode_tok_s": 20.0,
                "iteration_mean_s": 0.05,
                "inner_mean_s": 0.045,
                "inner_metric": "cbserve_executor_forward_seconds",
                "overhead_share": 0.1,
                "router_cpu_ms": 1.25,
                "client_cpu_ms": 0.5,
                "side_cpu_share": 0.035,
            },
            {"batch": 64, "note": "absent"},
        ],
        "errors": ["vllm-cpu skipped"],
        "commands": ["make bench"],
    }
    md = render_report(results, tmp_path)
    text = md.read_text()
    assert "Test CPU" in text and "make bench" in text
    assert "HF generate() static batches" in text and "cbserve fcfs (continuous)" in text
    assert "4.00×" in text  # cbserve 40 tok/s vs HF static 10
    assert "failed" in text
    assert "33.3 %" in text and "10.0 %" in text
    # The memory roof and the CPU the router and the client took.
    assert "| bfloat16 | 23.5 | 152 | 490 | 1200 | 900 | 900 | 300 | 33.3 % |" in text
    assert "| 1.25 | 0.50 | 3.5 % |" in text
    for png in ("bench_throughput_vs_cap.png", "bench_latency_distributions.png", "bench_latency_vs_rate.png"):
        p = tmp_path / png
        assert p.exists() and p.stat().st_size > 1000
        assert png in text
    t = throughput_table(runs, "bfloat16")
    assert t.splitlines()[0].startswith("| system | tok/s cap 8 | tok/s cap 16")


def test_decode_rate_and_static_occupancy():
    recs = []
    for i in range(4):
        r = RequestRecord(index=i, prompt_tokens=1, max_new_tokens=10, send_s=0.0)
        for k in range(10):
            r.add_tokens(1, 1.0 + 0.01 * i + 0.1 * k)
        r.end_s = r.token_times[-1]
        recs.append(r)
    assert decode_rate(recs) == pytest.approx(40.0, rel=0.15)
    w = materialise(WorkloadSpec(num_requests=4, prompt_len=1, output_dist="fixed", cap=5))
    assert _static_occupancy(w, 2) == 2.0


def test_cli_run_against_fake_server(tmp_path):
    """`bench run --target` drives a running server (here the fake one)."""
    from concurrent import futures

    import grpc

    from bench.cli import main
    from cbserve.v1 import generation_pb2 as pb
    from cbserve.v1 import generation_pb2_grpc as pbg

    class SyncFake(pbg.GenerationServicer):
        def Generate(self, request, context):  # noqa: N802
            n = request.stopping.max_new_tokens
            for i in range(n):
                yield pb.GenerateResponse(
                    request_id=request.request_id,
                    token_ids=[i],
                    finish_reason=pb.LENGTH if i == n - 1 else pb.FINISH_REASON_UNSPECIFIED,
                )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pbg.add_GenerationServicer_to_server(SyncFake(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out = tmp_path / "r.json"
    try:
        rc = main(
            [
                "run",
                "--system",
                "cbserve-fcfs",
                "--target",
                f"127.0.0.1:{port}",
                "-n",
                "6",
                "--prompt-len",
                "8",
                "--cap",
                "12",
                "--rates",
                "50,100",
                "--out",
                str(out),
                "--plots",
                str(tmp_path / "plots"),
                "--no-progress",
            ]
        )
    finally:
        server.stop(None)
    assert rc == 0
    d = json.loads(out.read_text())
    assert [r["rate"] for r in d["runs"]] == [50.0, 100.0]
    assert all(r["summary"]["num_ok"] == 6 for r in d["runs"])
    assert (tmp_path / "plots" / "r_latency_vs_rate.png").exists()
