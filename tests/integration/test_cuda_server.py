"""The whole server with the executor on a CUDA GPU (`--device cuda`).

The model, the paged KV pool and the native CUDA kernels run on the GPU; the
router, tokenizer and sampler's host side are the same as on CPU. Skipped
without a GPU (CI has none); run where one exists with `pytest -m cuda`.
"""

from __future__ import annotations

import json

import pytest
import torch

from cbserve.v1 import generation_pb2 as gpb
from executor import model_loader, model_source
from executor.kv_cache import host_available_bytes
from tests.conftest import BLOCK_BYTES_TINY_FP32, start_server
from tests.integration.helpers import gen_request, stub, wait_idle
from tests.integration.test_architectures import NEW, _checkpoint, _hf, _hf_logprobs, _prompts, _reference
from tests.integration.test_faults import _serve_refused
from tests.integration.test_parity import NEW_TOKENS, hf_greedy, served_greedy, tiny_prompts
from tests.integration.test_scheduling import pressure_requests, reconfigure, run_concurrent

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch"),
]


def executor_ready(server) -> dict:
    for line in server.log().splitlines():
        if line.startswith("{") and '"executor ready"' in line:
            return json.loads(line)
    raise AssertionError("no 'executor ready' record in the log")


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_on_the_gpu_matches_hf_on_the_cpu(backend):
    model = model_loader.load_model(model_source.resolve("tiny"), torch.float32)
    prompts = tiny_prompts()
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    server = start_server(
        "tiny", backend=backend, device="cuda", config={"scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 16}}
    )
    try:
        got = served_greedy(server, prompts, NEW_TOKENS)
        ready = executor_ready(server)
        wait_idle(server)
    finally:
        server.stop()
    assert ready["device"] == "cuda:0" and ready["dtype"] == "float32"
    assert got == expected


def test_sliding_windows_and_soft_caps_on_the_gpu_match_hf_on_the_cpu(tmp_path):
    # The CUDA paged attention's window and soft cap through the whole server
    # (transformers layer code on the GPU): Mistral's and Qwen2's windows,
    # Gemma 2's alternating windows with both soft caps, Gemma 3's windowed
    # layers. Prompts several 16-token windows long, chunked prefills, fp32.
    names = ["mistral", "qwen2", "gemma2", "gemma3"]
    entries = [
        {"name": n, "model": str(_checkpoint(tmp_path, n)), "dtype": "float32", "cache": {"num_blocks": 512}}
        for n in names
    ]
    config = {"scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 8}, "models": entries}
    server = start_server("tiny", device="cuda", config=config, timeout=300)
    prompts = _prompts()
    try:
        for name in names:
            ref = _reference(tmp_path / name)
            want = [_hf(ref, p) for p in prompts]
            with server.channel() as ch:
                futures = [
                    stub(ch).Complete.future(gen_request(p, max_new=NEW, logprobs=True, model=name)) for p in prompts
                ]
                results = [f.result(timeout=120) for f in futures]
            assert [list(r.token_ids) for r in results] == want, name
            if name == "gemma2":  # the final-logit cap applies on the GPU too
                want_lp = _hf_logprobs(ref, prompts[0], want[0])
                assert list(results[0].logprobs) == pytest.approx(want_lp, abs=2e-3)
        wait_idle(server)
    finally:
        server.stop()


def test_preemption_with_swap_through_host_memory_is_exact_and_frees_everything():
    # 12 device blocks force preemption; swapped-out KV goes to pinned host
    # memory and back. The reference is the same requests on a large pool.
    big = start_server("tiny", device="cuda")
    try:
        reference = {k: r["ids"] for k, r in run_concurrent(big, pressure_requests()).items()}
    finally:
        big.stop()
    server = start_server(
        "tiny",
        device="cuda",
        config={"cache": {"num_blocks": 12, "block_size": 16, "swap_space_bytes": 64 * BLOCK_BYTES_TINY_FP32}},
    )
    try:
        for mode in ("swap", "recompute"):
            reconfigure(server, {"policy": "fcfs", "preemption_mode": mode})
            m0 = server.metrics()
            res = run_concurrent(server, pressure_requests())
            assert all(r["finish"] == gpb.LENGTH for r in res.values())
            assert {k: r["ids"] for k, r in res.items()} == reference, mode
            m1 = wait_idle(server)
            assert m1["cbserve_num_preemptions_total"] > m0["cbserve_num_preemptions_total"]
            if mode == "swap":
                assert m1["cbserve_num_swaps_total"] > m0["cbserve_num_swaps_total"]
            assert m1["cbserve_swap_usage_ratio"] == 0
    finally:
        server.stop()


def test_bf16_sampling_is_seeded_and_batch_independent_on_the_gpu():
    server = start_server("tiny", dtype="bfloat16", device="cuda")
    prompt = [5, 17, 33, 2, 81, 9, 120]

    def req(seed, **kw):
        return gen_request(
            prompt,
            max_new=16,
            logprobs=True,
            sampling=gpb.SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed),
            **kw,
        )

    try:
        with server.channel() as ch:
            alone = stub(ch).Complete(req(7), timeout=60)
            # The same request among others (different batch shapes each step).
            futures = [stub(ch).Complete.future(req(s)) for s in (1, 7, 2, 3)]
            batched = [f.result(timeout=60) for f in futures]
            greedy = stub(ch).Complete(gen_request(prompt, max_new=16), timeout=60)
        ready = executor_ready(server)
        wait_idle(server)
    finally:
        server.stop()
    assert ready["device"] == "cuda:0" and ready["dtype"] == "bfloat16"
    assert len(alone.token_ids) == 16 and all(lp <= 0 for lp in alone.logprobs)
    assert list(batched[1].token_ids) == list(alone.token_ids)
    assert len({tuple(b.token_ids) for b in batched}) > 1, "different seeds gave the same tokens"
    assert greedy.finish_reason == gpb.LENGTH and len(greedy.token_ids) == 16


def test_a_kv_cache_larger_than_free_gpu_memory_stops_serve_with_a_clear_error(tmp_path):
    # More bytes of blocks than the GPU has free (but fewer than the host has
    # available, so the GPU check is the one that answers): refused before
    # allocating, exit status 2, not restarted.
    gpu_free, _ = torch.cuda.mem_get_info(0)
    want = gpu_free + (1 << 30)
    host_free = host_available_bytes()
    if host_free is not None and want > host_free:
        pytest.skip("the host has less memory available than the GPU has free")
    cfg = tmp_path / "huge.yaml"
    cfg.write_text(f"cache:\n  kv_cache_bytes: {want}\n")
    log = _serve_refused("--device", "cuda", "--config", str(cfg))
    assert "the KV cache does not fit" in log and "GiB free there" in log and "lower cache.kv_cache_bytes" in log
