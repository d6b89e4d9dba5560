"""cache.kv_cache_dtype: fp8_e5m2 through `cbserve serve`: the executor sizes
twice the blocks from the same bytes, serves concurrent streams with swap
preemption over the 8-bit pool and frees every block (SmolLM2 over it:
test_smollm2.py)."""

from __future__ import annotations

import subprocess
import sys
import threading

from cbserve.v1 import generation_pb2 as gpb
from tests.conftest import REPO, start_server
from tests.integration.helpers import gen_request, stub, wait_idle


def _fp8_block_bytes() -> int:
    import torch

    from executor import model_loader, model_source

    cfg = model_loader.load_model(model_source.resolve("tiny"), torch.float32).config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * head_dim  # one byte per value


def test_fp8_pool_doubles_the_blocks_and_survives_swap_preemption():
    block = _fp8_block_bytes()
    # The 8-bit pool has CPU kernels only (refused on a GPU: test_kv_pool.py),
    # so this server stays on the CPU also under CBSERVE_TEST_DEVICE=cuda.
    server = start_server(
        "tiny",
        device="cpu",
        config={
            "cache": {
                "kv_cache_dtype": "fp8_e5m2",
                "num_blocks": 0,
                "kv_cache_bytes": 24 * block + 5,
                "swap_space_bytes": 64 * block,
            },
            "scheduler": {"preemption_mode": "swap", "max_num_batched_tokens": 256},
        },
        share_executor=False,  # the executor's own log lines are read below
    )
    try:
        with server.channel() as ch:
            info = stub(ch).ModelInfo(gpb.ModelInfoRequest())
            assert info.num_kv_blocks == 24  # bytes // (one-byte values), twice the fp16/bf16 count
            # Four sequences of 150 tokens need 40 blocks: some must be swapped out and back.
            results: dict[int, list[int]] = {}

            def run(i):
                prompt = [(7 * j + i) % 250 + 3 for j in range(30)]
                msgs = list(stub(ch).Generate(gen_request(prompt, max_new=120)))
                results[i] = [t for m in msgs for t in m.token_ids]

            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        assert sorted(results) == [0, 1, 2, 3] and all(len(r) == 120 for r in results.values())
        m = wait_idle(server)
        assert m.get("cbserve_num_preemptions_total", 0) >= 1
        assert "kv_cache_dtype" in server.log() and "float8_e5m2" in server.log()
    finally:
        server.stop()


def test_a_kv_cache_dtype_it_does_not_know_is_refused_before_starting(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("cache:\n  kv_cache_dtype: int8\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            "--model",
            "tiny",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--http-port",
            "0",
            "--config",
            str(cfg),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "cache.kv_cache_dtype: 'int8' must be one of auto, fp8_e5m2" in out.stderr
