"""--max-model-len caps the context the router enforces; cache.memory_fraction
sizes the KV pool from the memory available; bad values stop serve with 2."""

from __future__ import annotations

import grpc
import pytest
import yaml

from cbserve.v1 import generation_pb2 as gpb
from executor.kv_cache import CacheShape, host_available_bytes
from executor.model_source import TINY_CONFIG
from tests.conftest import start_server
from tests.integration.helpers import gen_request, stub, wait_idle
from tests.integration.test_faults import _serve_refused


def test_max_model_len_caps_the_served_context():
    server = start_server("tiny", extra_args=["--max-model-len", "256"])
    try:
        with server.channel() as ch:
            s = stub(ch)
            assert s.ModelInfo(gpb.ModelInfoRequest()).max_context_length == 256
            with pytest.raises(grpc.RpcError) as err:
                s.Complete(gen_request([5] * 300, max_new=2), timeout=30)  # fits the model's 2048, not 256
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in err.value.details()
            assert len(s.Complete(gen_request([5] * 200, max_new=8), timeout=30).token_ids) == 8
        wait_idle(server)
    finally:
        server.stop()


def test_a_max_model_len_beyond_the_model_stops_serve():
    log = _serve_refused("--device", "cpu", "--max-model-len", "5000")
    assert "--max-model-len 5000 is beyond the model's context (2048 positions)" in log


def test_memory_fraction_sizes_the_pool_from_available_memory():
    server = start_server("tiny", config={"cache": {"num_blocks": 0, "memory_fraction": 0.02, "swap_space_bytes": 0}})
    try:
        with server.channel() as ch:
            blocks = stub(ch).ModelInfo(gpb.ModelInfoRequest()).num_kv_blocks
        cfg = TINY_CONFIG
        shape = CacheShape(cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"], 16, _dtype())
        free = host_available_bytes()
        # What was available when the executor measured it, within what the
        # machine's other processes moved since.
        assert abs(blocks * shape.bytes_per_block - 0.02 * free) < 0.25 * 0.02 * free
        assert blocks != shape.blocks_for(1 << 30)  # not the kv_cache_bytes default
    finally:
        server.stop()


def _dtype():
    import torch

    return torch.float32  # start_server's default dtype


def test_a_memory_fraction_out_of_range_is_refused(tmp_path):
    from tests.integration.helpers import run_serve

    cfg = tmp_path / "frac.yaml"
    cfg.write_text(yaml.safe_dump({"cache": {"memory_fraction": 1.5}}))
    out = run_serve("--config", str(cfg))
    assert out.returncode == 2 and "cache.memory_fraction: must be in [0, 0.95]" in out.stderr
