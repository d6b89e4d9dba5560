"""A GGUF file quantised in the test with the `gguf` package (Q4_0, Q4_1,
Q8_0 projections; Q4_K, Q6_K and a Q4_K_M mix of the two by the test
writer's own quantisers, as gguf-py cannot write them) is served from its
blocks on AVX512-BF16 CPUs, AMX or not: every type at every batch size, from
the blocks alone (with CBSERVE_GGUF_TILES=1, Q4_0 / Q4_1 / Q8_0 keep bf16
copies beside: without AMX Q4_0 / Q4_1 blocks for small batches beside the
bf16 tiles and Q8_0 the tiles alone; on AMX the plain weight for long chunks
and Q4_1's feature-major copy, docs/quantization.md). The runner's greedy tokens
and hidden states equal, bit for bit, those of the same file served from the
bf16 weights transformers dequantises it to (`CBSERVE_GGUF_BLOCKS=0`), and
those dequantised weights are gguf-py's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor import model_loader, model_source
from executor.cpu import gguf_weights
from executor.runner import ModelRunner
from tests.executor.helpers import avx512_bf16, greedy_with_hidden
from tests.integration.gguf_writer import write_gguf
from tests.small_configs import small

pytestmark = pytest.mark.skipif(not avx512_bf16(), reason="needs an AVX512-BF16 CPU")


@pytest.fixture(autouse=True)
def _bf16_block_activations(monkeypatch):
    # Bit-for-bit against bf16 tiles holds under bf16 activations; the int8
    # ones (the default on VNNI CPUs without AMX) are tested in
    # test_gguf_int8_activations.py.
    monkeypatch.setenv(gguf_weights.ACTIVATIONS_SWITCH, "bf16")


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    # Every projection's K a multiple of 256, a Q4_K super-block.
    cfg = LlamaConfig(**small(num_hidden_layers=2, hidden_size=256, intermediate_size=512, max_position_embeddings=512))
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize(
    "quant,tiles",
    [(q, "0") for q in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q4_K_M")] + [("Q4_1", "1"), ("Q8_0", "1")],
)
def test_quantised_projections_are_served_from_their_blocks_exactly(tmp_path, monkeypatch, model, quant, tiles):
    import gguf
    from gguf.quants import dequantize

    monkeypatch.setenv("CBSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(gguf_weights.TILES_SWITCH, tiles)
    path = tmp_path / f"tiny-{quant}.gguf"
    write_gguf(model, str(path), quant=quant)
    source = model_source.resolve(str(path))
    # transformers' fp32 weights are gguf-py's dequantisation of the file.
    fp32 = model_loader.load_model(source, torch.float32)
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_down.weight")
    assert torch.equal(
        fp32.model.layers[1].mlp.down_proj.weight, torch.from_numpy(dequantize(t.data, t.tensor_type)).float()
    )
    del fp32
    prompts = [list(range(5, 45)), [7, 8, 9]]  # a prefill over the tiles, then decode steps of 2 rows
    runner = ModelRunner(model_loader.load_model(source, torch.bfloat16), 16, 64)
    qkv = runner.lean.layers[0].qkv.__self__
    mlp = runner.model.model.layers[0].mlp
    amx = qkv.kernel.startswith("amx")
    k_quant = quant.startswith(("Q4_K", "Q6_K"))
    beside = tiles == "1" and not k_quant  # CBSERVE_GGUF_TILES=1: bf16 tiles beside the blocks
    if not amx and quant == "Q4_K_M":  # v (Q6_K) apart from q and k (Q4_K): no bf16 copy to fuse them
        assert qkv.kernel == "avx512-q4_k | avx512-q4_k | avx512-q6_k"
        assert mlp.kernel == "avx512_linear_silu_mul-q4_k" and mlp.down.kernel == "avx512-q6_k"
    elif not amx and not beside:  # the blocks alone, at every batch size
        kind = {"Q4_0": "q4_1"}.get(quant, quant.lower())
        assert qkv.kernel == f"avx512-{kind}" and qkv.kernel_for(64) == f"avx512_linear-{kind}"
        assert mlp.kernel == f"avx512_linear_silu_mul-{kind}" and mlp.down.kernel == f"avx512-{kind}"
    elif not amx:  # the tiles, the blocks for small batches
        assert qkv.kernel_for(2) == "avx512_linear-q4_1" if quant != "Q8_0" else qkv.kernel == "avx512"
    elif quant == "Q4_K_M":
        assert qkv.kernel == "amx-q4_k | amx-q4_k | amx-q6_k"
        assert mlp.kernel == "amx_linear_silu_mul-q4_k" and mlp.down.kernel == "amx-q6_k"
    else:  # AMX: amx_linear over the blocks; held alone, at every row count, unless beside
        kind = {"Q4_0": "q4_1"}.get(quant, quant.lower())
        assert qkv.kernel == f"amx-{kind}" and mlp.kernel == f"amx_linear_silu_mul-{kind}"
        assert qkv.kernel_for(400) == ("F.linear" if beside else "amx_linear")
        assert (qkv.kernel_for(2) == "amx_q4_rows_linear") == (beside and kind == "q4_1")
        assert (qkv.weight.device.type == "meta") == (not beside)
    modules = {id(m): m for m in [*runner.model.modules(), *runner._lean_modules()]}.values()
    blocks_bytes = sum(m.packed_blocks.nbytes for m in modules if getattr(m, "packed_blocks", None) is not None)
    got = greedy_with_hidden(runner, prompts, 6)
    weight_bytes = runner.weight_bytes
    del runner
    monkeypatch.setenv(gguf_weights.ENV_SWITCH, "0")
    plain = ModelRunner(model_loader.load_model(source, torch.bfloat16), 16, 64)
    assert plain.lean.layers[0].qkv.__self__.kernel in ("amx", "avx512")
    want = greedy_with_hidden(plain, prompts, 6)
    # weight_bytes (the "executor ready" line's weights_mb) counts what each holds:
    # without AMX the Q4 blocks beside the tiles, with AMX the blocks instead of them.
    if not amx and beside:
        assert weight_bytes - plain.weight_bytes == blocks_bytes and (blocks_bytes > 0) == (quant != "Q8_0")
    else:
        assert weight_bytes < plain.weight_bytes
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1]) > 1
    for g, w in zip(got[1], want[1]):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16))
    assert np.isfinite(got[1][-1].float().numpy()).all()


@pytest.mark.parametrize(
    "quant,embeddings,tied",
    [("Q4_1", "Q8_0", True), ("Q4_K_M", "Q6_K", False), ("Q4_K", "Q4_K", True)],
)
def test_a_quantised_file_is_served_in_about_its_own_size(tmp_path, monkeypatch, quant, embeddings, tied):
    """Every weight quantised, the embedding too (SmolLM2's mix: Q4_1
    projections, a tied Q8_0 embedding; a Q4_K_M-like mix with an untied Q6_K
    head): the embedding is looked up in its blocks (the tied head's own),
    the weights take at most 1.15x the file's tensors, and the tokens and
    hidden states equal the bf16 expansion's bit for bit."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    from executor.cpu.gguf_weights import BlockEmbedding

    monkeypatch.setenv(gguf_weights.TILES_SWITCH, "0")  # as for a model of 1B and up (AUTO_TILES_MAX_BYTES)
    torch.manual_seed(5)
    cfg = small(num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=272, tie_word_embeddings=tied)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    monkeypatch.setenv("CBSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{quant}-{embeddings}.gguf"
    write_gguf(model, str(path), quant=quant, embeddings=embeddings)
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    source = model_source.resolve(str(path))
    runner = ModelRunner(model_loader.load_model(source, torch.bfloat16), 16, 64)
    assert isinstance(runner.model.model.embed_tokens, BlockEmbedding)
    isa = "amx" if runner.model.lm_head.kernel.startswith("amx") else "avx512"
    assert runner.model.lm_head.kernel == f"{isa}-{embeddings.lower()}"
    if tied:  # one copy of the table: the head's blocks
        assert runner.model.model.embed_tokens.packed is runner.model.lm_head.packed
    assert runner.weight_bytes <= 1.15 * file_bytes, (runner.weight_bytes, file_bytes)
    prompts = [list(range(5, 45)), [7, 8, 271]]
    got = greedy_with_hidden(runner, prompts, 6)
    del runner
    monkeypatch.setenv(gguf_weights.ENV_SWITCH, "0")
    plain = ModelRunner(model_loader.load_model(source, torch.bfloat16), 16, 64)
    assert type(plain.model.model.embed_tokens) is torch.nn.Embedding
    assert plain.weight_bytes > 2.5 * file_bytes  # the bf16 expansion
    want = greedy_with_hidden(plain, prompts, 6)
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1]):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16))


def test_tiles_beside_the_blocks_follow_the_models_size(monkeypatch):
    """CBSERVE_GGUF_TILES unset: bf16 copies beside the blocks for a model
    whose tiles take less than AUTO_TILES_MAX_BYTES, blocks alone above, and
    on AMX CPUs blocks alone at any size; 0 / 1 decide for any size."""
    import native._fused as fused

    small_model, big_model = gguf_weights.AUTO_TILES_MAX_BYTES - 1, gguf_weights.AUTO_TILES_MAX_BYTES
    monkeypatch.delenv(gguf_weights.TILES_SWITCH, raising=False)
    assert gguf_weights.keep_tiles(small_model) == (not fused.amx_linear_supported())
    assert not gguf_weights.keep_tiles(big_model)
    monkeypatch.setattr(fused, "amx_linear_supported", lambda: False)
    assert gguf_weights.keep_tiles(small_model)
    monkeypatch.setattr(fused, "amx_linear_supported", lambda: True)
    assert not gguf_weights.keep_tiles(small_model)
    for value, keep in (("0", False), ("1", True)):
        monkeypatch.setenv(gguf_weights.TILES_SWITCH, value)
        assert gguf_weights.keep_tiles(small_model) == gguf_weights.keep_tiles(big_model) == keep
