import json
import math

import pytest

from bench.bound import Machine, ModelCost, classic_lengths, fcfs_bound, iteration_s, main

TINY = ModelCost(
    proj_flops=100.0, head_flops=50.0, weight_bytes=1000.0, head_bytes=400.0, kv_bytes=10.0, attn_flops=2.0
)


def test_smollm2_costs():
    c = ModelCost.of()
    decoder = 30 * (576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3)
    assert c.proj_flops == 2 * decoder and c.weight_bytes == 2 * decoder
    assert c.head_bytes == 2 * 576 * 49152
    assert c.kv_bytes == 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads x 64, bf16
    assert c.attn_flops == 4 * 576 * 30


def test_memory_bound_run_counts_every_weight_and_kv_read():
    m = Machine(peak_flops=math.inf, bandwidth=1.0)
    b = fcfs_bound([3], prompt_len=4, budget=8, cost=TINY, m=m)
    # the prompt (no cache yet), then two decode steps over 4 and 5 cached tokens
    assert b.iterations == 3 and b.output_tokens == 3
    assert b.seconds == pytest.approx(3 * (1000 + 400) + 10 * (4 + 5))
    assert b.last_first_token_s == pytest.approx(1400)


def test_compute_bound_run_chunks_prompts_in_arrival_order():
    m = Machine(peak_flops=1.0, bandwidth=math.inf, overhead_s=1.0)
    # budget 4, prompts of 3: request 0 whole and 1 token of request 1, then
    # request 0's decode, request 1's last 2 tokens.
    b = fcfs_bound([2, 1], prompt_len=3, budget=4, cost=TINY, m=m)
    first = 4 * 100 + 50 + 2 * (3 * 2 + 1 * 1) + 1  # one sampled row; pairs 3*(0+2) + 1*(0+1)
    second = 3 * 100 + 2 * 50 + 2 * (3 + 2 * (1 + 1.5)) + 1  # decode over 3 cached + 2 tokens on 1 cached
    assert b.iterations == 2
    assert b.last_first_token_s == pytest.approx(first + second)
    assert b.seconds == pytest.approx(first + second)
    assert iteration_s(TINY, m, tokens=1, sampled=0, kv_tokens=0, pairs=0) == pytest.approx(101)


def test_a_larger_budget_never_needs_more_prompt_iterations():
    lengths = classic_lengths(cap=32, seed=1, num_requests=8, prompt_len=16)
    m = Machine(400e9, 34e9, 3e-4)
    small, large = (fcfs_bound(lengths, 16, b, ModelCost.of(), m) for b in (16, 128))
    assert large.iterations <= small.iterations
    assert large.last_first_token_s < small.last_first_token_s
    with pytest.raises(ValueError):
        fcfs_bound(lengths, 16, 0, ModelCost.of(), m)


def test_cli_sets_measured_runs_beside_the_bound(tmp_path, capsys):
    lengths = classic_lengths(cap=32, seed=3)
    w = {"seed": 3, "cap": 32, "num_requests": 64, "prompt_len": 128, "arrival": "burst"}
    run = {
        "system": "cbserve-fcfs",
        "cap": 32,
        "rate": None,
        "error": "",
        "workload": w,
        "summary": {"duration_s": 4.0},
    }
    # Another workload's runs (8 requests; Poisson arrivals) are not set beside this bound.
    other = [
        dict(run, system="x-fewer", workload=dict(w, num_requests=8)),
        dict(run, system="x-poisson", workload=dict(w, arrival="poisson", rate=2.0)),
        dict(run, system="x-fp32", dtype="float32"),
    ]
    res = {"runs": [run, *other]}
    f = tmp_path / "r.json"
    f.write_text(json.dumps(res))
    assert main(["--caps", "32", "--seeds", "3", "--results", str(f)]) == 0
    out = capsys.readouterr().out
    b = fcfs_bound(lengths, 128, 512, ModelCost.of(), Machine(400e9, 34e9, 3e-4))
    assert f"{sum(lengths)} tokens, bound {b.seconds:.2f} s" in out
    assert f"cbserve-fcfs 4.00 s (runs at {b.seconds / 4.0:.0%} of the bound's speed)" in out
    assert "x-fewer" not in out and "x-poisson" not in out and "x-fp32" not in out
