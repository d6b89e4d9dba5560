"""The targets check and the executor-alone measurement behind the report's
"The executor alone" and "Targets" sections."""

import math

import pytest
import torch

from bench import standalone
from bench.report import render_report
from bench.roofline import param_count, step_bytes
from bench.targets import alone_rows, attach_alone, evaluate, limits_text
from executor.model_loader import load_model
from executor.model_source import resolve
from executor.runner import ModelRunner


def _run(system, cap, tok_s, itl_p50=0.02, batch=20.0):
    return {"system": system, "cap": cap, "dtype": "bfloat16",
            "summary": {"output_tokens_per_s": tok_s, "itl_s": {"p50": itl_p50}},
            "metrics": {"mean_batch_occupancy": batch} if system.startswith("cbserve") else {}}


def _results(fcfs512=700.0, server64=1500.0, alone64=1800.0, router_share=0.025):
    runs = [_run("hf-static", 32, 90.0), _run("cbserve-fcfs", 32, 280.0), _run("vllm-cpu", 32, 250.0),
            _run("hf-static", 128, 95.0), _run("cbserve-fcfs", 128, 600.0), _run("vllm-cpu", 128, 400.0),
            _run("hf-static", 512, 85.0), _run("cbserve-fcfs", 512, fcfs512), _run("vllm-cpu", 512, 480.0),
            _run("cbserve-static", 512, 240.0, itl_p50=0.018)]
    roofline_bound = 3000.0
    return {
        "runs": runs,
        "roofline": {"stream_gb_s": 23.5, "bounds": [
            {"dtype": "bfloat16", "roofline_bound_tok_s": roofline_bound, "cbserve_decode_tok_s": server64,
             "roofline_share": server64 / roofline_bound, "step_matmul_ms": 18.0, "kv_stream_ms": 9.6,
             "phase_bound_tok_s": 64 / 0.0276}]},
        "overheads": [
            {"batch": 1, "dtype": "bfloat16", "decode_tok_s": 70.0, "router_share": 0.01},
            {"batch": 64, "dtype": "bfloat16", "decode_tok_s": server64, "router_share": router_share,
             "iteration_mean_s": 0.054, "router_cpu_ms": 4.2, "client_cpu_ms": 2.9}],
        "standalone": {"dtype": "bfloat16", "rows": [
            {"batch": 1, "mean_context": 152.5, "decode_tok_s": 78.0, "step_ms": 12.8, "forward_ms": 12.6},
            {"batch": 64, "mean_context": 152.5, "decode_tok_s": alone64, "step_ms": 35.0, "forward_ms": 34.5}]},
    }


def _status(rows, prefix):
    (row,) = [r for r in rows if r["target"].startswith(prefix)]
    return row["status"], row["measured"]


def test_targets_met_and_missed_from_the_run():
    res = _results()
    attach_alone(res)
    rows = evaluate(res)
    assert _status(rows, "cbserve fcfs / HF static at cap 32") == ("met", "3.11×")
    assert _status(rows, "cbserve fcfs / HF static at cap 512") == ("missed", "8.24×")
    assert _status(rows, "cbserve fcfs / vLLM-CPU at cap 128") == ("met", "1.50×")
    assert _status(rows, "cbserve fcfs / vLLM-CPU at cap 512")[0] == "missed"
    status, measured = _status(rows, "decode at batch 64")
    assert status == "missed" and "50.0 % in the server" in measured and "executor alone: 60.0 %" in measured
    assert _status(rows, "router + transport") == ("met", "2.5 %")
    # Caps without a target (the reduced suite's 256) get no row; vLLM has none at cap 32.
    assert not any("cap 256" in r["target"] or "vLLM-CPU at cap 32" in r["target"] for r in rows)


def test_targets_flip_with_the_numbers():
    res = _results(fcfs512=900.0, server64=1900.0, router_share=0.06)
    rows = evaluate(res)
    assert _status(rows, "cbserve fcfs / HF static at cap 512")[0] == "met"
    assert _status(rows, "decode at batch 64")[0] == "met"
    assert _status(rows, "router + transport")[0] == "missed"
    # Nothing measured, nothing claimed.
    assert evaluate({"runs": []}) == []


def test_alone_rows_memory_roof_and_server_ratio():
    res = _results()
    rows = {r["batch"]: r for r in alone_rows(res)}
    mb1 = step_bytes(1, 152, "bfloat16") / 1e6
    assert rows[1]["step_mb"] == pytest.approx(mb1)
    assert rows[1]["memory_roof_tok_s"] == pytest.approx(1 / (mb1 * 1e6 / 23.5e9))
    assert rows[64]["served_over_alone"] == pytest.approx(1500.0 / 1800.0)
    # Without a stream measurement there is no memory roof, the rest stays.
    del res["roofline"]["stream_gb_s"]
    assert alone_rows(res)[0]["memory_roof_tok_s"] is None


def test_limits_text_explains_only_missed_targets_with_run_numbers():
    res = _results()
    attach_alone(res)
    text = " ".join(limits_text(res))
    assert "1800 tok/s = 60.0 %" in text and "1500 tok/s = 50.0 %" in text and "7.1 ms of CPU per 54 ms" in text
    assert "ITL p50 18.0 ms against 12.8 ms" in text
    assert "the bound is 2319 tok/s: alone 78 %, in the server 65 % of it" in text
    # 1800 / 1500: a 20 % longer served step, within what the CPU share and the waiting explain.
    assert "on 1.78 cores in the server" in text and "longer served step of this run" not in text
    res = _results(server64=1300.0)
    attach_alone(res)
    text = " ".join(limits_text(res))
    assert ("of the 38 % longer served step of this run, roughly 11 % is the CPU share, 8 % the extra waiting "
            "and 15 % the work itself") in text
    assert "are memory-bound" in text and "90 % of the stream bandwidth" in text
    # Weights streamed as 4-bit blocks: the same step time is far from the memory roof.
    res["standalone"]["weight_bytes"] = 96_000_000
    rows = {r["batch"]: r for r in alone_rows(res)}
    assert rows[1]["step_mb"] == pytest.approx(96.0 + (step_bytes(1, 152, "bfloat16") - 2 * param_count()["matmul_params"]) / 1e6,
                                               rel=1e-9)
    text = " ".join(limits_text(res))
    assert "no longer memory-bound" in text and f"reads {rows[1]['step_mb']:.0f} MB" in text
    good = _results(fcfs512=900.0, server64=1900.0, alone64=2000.0)
    good["runs"] = [r for r in good["runs"] if r["system"] != "vllm-cpu"]
    attach_alone(good)
    assert limits_text(good) == []


def test_report_has_alone_and_targets_sections(tmp_path):
    res = _results()
    attach_alone(res)
    # The throughput and roofline tables have their own tests (test_bench_report.py).
    res["runs"] = []
    bound = res["roofline"]["bounds"][0]
    bound.update(gflops_weighted=900.0, decode_bound_tok_s=3400.0)
    md = render_report(res, tmp_path).read_text()
    assert "## The executor alone" in md and "## Targets" in md
    assert "| 64 | 1800 | 35.0 | 34.5 |" in md
    assert "| decode at batch 64 ≥ 60 % of the roofline bound |" in md


def test_standalone_runner_measures_decode_steps():
    model = load_model(resolve("tiny"), torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, standalone.BLOCK_SIZE, num_blocks=4 * 3)
    out = standalone.measure_runner(runner, batch=4, prompt_len=20, decode_tokens=9, prefill_seqs_per_step=3)
    assert out["decode_steps"] == 8 and out["batch"] == 4 and out["mean_context"] == 25.0
    assert out["decode_tok_s"] > 0 and 0 < out["forward_ms"] <= out["step_ms"]
    assert len(runner.state.seqs) == 0  # reset after the measurement
    # The runner is left empty and reusable.
    again = standalone.measure_runner(runner, batch=4, prompt_len=20, decode_tokens=9)
    assert again["decode_steps"] == 8
    with pytest.raises(ValueError, match="need 16 blocks"):
        standalone.measure_runner(runner, batch=4, prompt_len=40, decode_tokens=9)
    assert not math.isnan(out["step_ms"])
