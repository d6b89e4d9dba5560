import math

from bench.roofline import SMOLLM2, attach_cbserve, measure, param_count, projections


def test_smollm2_param_count():
    p = param_count(SMOLLM2)
    # 30 x (576*576*2 + 576*192*2 + 576*1536*3) + 576*49152 (tied LM head)
    assert p["matmul_params"] == 30 * (576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3) + 576 * 49152
    assert {x.name for x in projections()} >= {"q_proj", "k_proj", "gate_proj", "down_proj", "lm_head"}


def test_measure_tiny_config():
    tiny = dict(hidden=16, intermediate=32, heads=2, kv_heads=1, head_dim=8, layers=2, vocab=64)
    roof = measure(batch=4, dtypes=("float32",), cfg=tiny, min_time_s=0.002)
    assert len(roof["matmuls"]) == len(projections(tiny))
    b = roof["bounds"][0]
    assert b["decode_bound_tok_s"] > 0 and b["gflops_weighted"] > 0
    attach_cbserve(roof, {"float32": b["decode_bound_tok_s"] / 2})
    assert math.isclose(roof["bounds"][0]["share"], 0.5)


def test_step_bytes_counts_weights_and_kv():
    from bench.roofline import step_bytes

    p = param_count(SMOLLM2)["matmul_params"]
    kv_per_token = 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads x 64 dims, bf16
    assert step_bytes(64, 152, "bfloat16") == p * 2 + kv_per_token * 64 * 152
    assert step_bytes(1, 0, "float32") == p * 4


def test_memory_roof_takes_the_lower_bound():
    from bench.roofline import attach_memory_roof, step_bytes

    tiny = dict(hidden=16, intermediate=32, heads=2, kv_heads=1, head_dim=8, layers=2, vocab=64)
    roof = measure(batch=4, dtypes=("float32",), cfg=tiny, min_time_s=0.002)
    b = roof["bounds"][0]
    attach_cbserve(roof, {"float32": 10.0})
    nbytes = step_bytes(4, 100, "float32", tiny)
    # A bandwidth so low that memory is the lower roof, then one so high that compute is.
    slow = nbytes / 1e9 * b["decode_bound_tok_s"] / 4 / 10
    attach_memory_roof(roof, slow, context=100, cfg=tiny)
    assert math.isclose(b["memory_bound_tok_s"], b["decode_bound_tok_s"] / 10, rel_tol=1e-9)
    assert b["roofline_bound_tok_s"] == b["memory_bound_tok_s"]
    assert math.isclose(b["roofline_share"], 10.0 / b["memory_bound_tok_s"])
    attach_memory_roof(roof, slow * 100, context=100, cfg=tiny)
    assert b["roofline_bound_tok_s"] == b["decode_bound_tok_s"]
    # Phase by phase: the matmuls' time plus the K/V stream's, lower than either roof.
    kv_s = step_bytes(4, 100, "float32", tiny, weight_bytes=0) / (slow * 100 * 1e9)
    assert math.isclose(b["kv_stream_ms"], kv_s * 1e3)
    assert math.isclose(b["phase_bound_tok_s"], 4 / (b["step_matmul_ms"] / 1e3 + kv_s))
    assert b["phase_bound_tok_s"] < b["roofline_bound_tok_s"]


def test_stream_bandwidth_is_measured():
    from bench.roofline import stream_gb_s

    assert 0.1 < stream_gb_s(mib=16, reps=2) < 10_000


def test_cli_reports_the_memory_roof(monkeypatch, capsys, tmp_path):
    import json

    import bench.roofline as rl

    tiny = dict(hidden=16, intermediate=32, heads=2, kv_heads=1, head_dim=8, layers=2, vocab=64)
    real = rl.measure
    monkeypatch.setattr(rl, "measure", lambda batch, dtypes, progress: real(batch, dtypes, cfg=tiny, min_time_s=0.002))
    monkeypatch.setattr(rl, "stream_gb_s", lambda: 20.0)
    out = tmp_path / "roof.json"
    assert rl.main(["--dtypes", "float32", "--batch", "4", "--context", "100", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "memory roof" in printed and "roofline bound" in printed and "100 tokens of context" in printed
    b = json.loads(out.read_text())["bounds"][0]
    assert b["roofline_bound_tok_s"] == min(b["memory_bound_tok_s"], b["decode_bound_tok_s"])
    assert math.isclose(b["memory_bound_tok_s"], 4 / (rl.step_bytes(4, 100, "float32") / 20e9))


def test_every_timed_linear_implementation_computes_the_layer():
    """The roof is the fastest implementation of each shape, so each one
    timed must compute that linear layer (a mis-packed native kernel would
    time the wrong work)."""
    import torch

    from bench.roofline import linear_impls, time_linear

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        impls = linear_impls(96, 64, dtype)
        assert impls[0][0] == "F.linear"
        x = torch.randn(5, 96, dtype=dtype)
        want = impls[0][1](x).float()
        for name, call in impls[1:]:
            got = call(x).float()
            assert got.shape == want.shape, name
            assert torch.allclose(got, want, atol=tol * want.abs().max().item(), rtol=tol), name
        s, impl = time_linear(5, 96, 64, dtype, min_time_s=0.002)
        assert s > 0 and impl in {n for n, _ in impls}
