"""The GPU report renders what bench/gpu_check.sh writes, and its section of
benchmarks.md survives a suite run."""

from __future__ import annotations

import json

from bench import gpu_report
from bench.report import render_report, section


def _step_row(mode, batch, ms, **extra):
    return {"mode": mode, "batch": batch, "step_ms": ms, "tok_s": round(batch * 1e3 / ms), **extra}


def _serve_run(system, cap, tok_s, share=None):
    metrics = {"router_share": share} if share is not None else {}
    summary = {"output_tokens_per_s": tok_s, "ttft_s": {"p50": 0.05}, "itl_s": {"p50": 0.002}}
    return {"runs": [{"system": system, "cap": cap, "summary": summary, "metrics": metrics}]}


def _write(tmp_path):
    kernels = [{"kernel": "paged_attention_kernel", "us_per_step": 500.0, "calls_per_step": 30}]
    step = {
        "gpu": "NVIDIA H200",
        "torch": "2.11.0",
        "rows": [
            _step_row("transformers", 1, 16.0),
            _step_row("transformers", 64, 17.0),
            _step_row("graphs", 1, 1.4, replay_gpu_ms=1.3, kernels=kernels, capture={"buckets": 8, "max_batch": 64}),
            _step_row("graphs", 64, 3.2, replay_gpu_ms=3.0, kernels=kernels),
        ],
        "agreement": {"graphs": {"first_divergence": [32, 32]}},
    }
    serve = {
        f"x/{s}-{c}.json": _serve_run(s, c, t, share)
        for s, c, t, share in [("cbserve-fcfs", 32, 3000.0, 0.1), ("hf-static", 32, 200.0, None)]
    }
    results = tmp_path / "results"
    results.mkdir()
    (results / "gpu_step.json").write_text(json.dumps(step))
    (results / "serve.json").write_text(json.dumps(serve))
    return results


def test_the_report_states_targets_ratios_and_the_router_share(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    text = gpu_report.render(_write(tmp_path), docs, "2026-11-26")
    assert "on an NVIDIA H200" in text
    assert "batch 1: at most 1.5 ms per step: 1.40 ms, met" in text
    assert "batch 64: at most 3.0 ms per step: 3.20 ms, not met" in text
    assert "| 32 | 3,000 | 200 | 15.0x | 2.0x | 10% |" in text
    assert "- cap 32: at least vLLM's published 2.0x HF static: 15.0x, met" in text
    assert "- cap 32: at least 5x the transformers path's 487 tok/s (H100, 2026-11-22): 3,000 tok/s, 6.2x, met" in text
    assert "| 500.0 | 30 | `paged_attention_kernel` |" in text


def test_the_gpu_section_survives_a_suite_run(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    results = _write(tmp_path)
    gpu_report.render(results, docs, "2026-11-26")
    gpu_report.render(results, docs, "2026-11-27")
    page = docs / "benchmarks.md"
    assert page.read_text().count("## On a GPU") == 1 and "2026-11-27" in page.read_text()
    render_report({"runs": []}, docs)
    assert "15.0x" in section(page.read_text(), "gpu") and page.read_text().startswith("# cbserve benchmarks")


def test_the_report_names_a_second_run_and_a_baseline_it_did_not_run(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    results = _write(tmp_path)
    step = json.loads((results / "gpu_step.json").read_text())
    step["rows"] += [
        _step_row("graphs, general attention", 64, 3.5),
        _step_row("graphs, sampled, host", 64, 30.0),
        _step_row("graphs, sampled, device", 64, 3.4),
    ]
    (results / "gpu_step.json").write_text(json.dumps(step))
    other = tmp_path / "other"
    other.mkdir()
    (other / "serve.json").write_text(json.dumps({"a": _serve_run("cbserve-fcfs", 128, 5000.0, 0.2)}))
    text = gpu_report.render(results, docs, "2026-11-27", serve_dir=other)
    assert "from two runs of `bench/gpu_check.sh`" in text and "from that run" not in text
    assert "| 128 | 5,000 | not run | - | 3.7x | 20% |" in text
    order = [text.index(f"| {m} |") for m in gpu_report.MODE_ORDER if f"| {m} |" in text]
    assert len(order) == 5 and order == sorted(order)
    same = gpu_report.render(results, docs, "2026-11-27", serve_dir=other, same_machine=True)
    assert "one after the other on one machine" in same and "machines of one kind" not in same
    assert "- cap 128: at least 5x the transformers path's 614 tok/s (H100, 2026-11-22): 5,000 tok/s, 8.1x, met" in same
