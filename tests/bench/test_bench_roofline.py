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
