"""A GGUF file quantised in the test with the `gguf` package (Q4_0, Q4_1,
Q8_0 projections) is served from its blocks where the kernels read them: on
AMX CPUs every type, on other AVX512-BF16 CPUs Q4_0 / Q4_1 for small batches
(Q8_0 keeps the bf16 tiles there, docs/native.md). The runner's greedy tokens
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
from tests.executor.helpers import greedy
from tests.integration.gguf_writer import write_gguf
from tests.small_configs import small

pytestmark = pytest.mark.skipif(not gguf_weights.supported(), reason="needs an AVX512-BF16 CPU")


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    cfg = LlamaConfig(**small(num_hidden_layers=2, head_dim=32, max_position_embeddings=512))
    return LlamaForCausalLM(cfg).eval()


def _hidden_and_tokens(runner: ModelRunner, prompts, steps):
    hidden = []
    lean = runner.lean

    def spy(*args):
        h = lean(*args)
        hidden.append(h.clone())
        return h

    runner.lean = spy
    return greedy(runner, prompts, steps), hidden


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantised_projections_are_served_from_their_blocks_exactly(tmp_path, monkeypatch, model, quant):
    import gguf
    from gguf.quants import dequantize

    monkeypatch.setenv("CBSERVE_CACHE_DIR", str(tmp_path / "cache"))
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
    if gguf_weights.packed_kind(qkv.packed) is None:  # no AMX: the tiles, the blocks for small batches
        assert qkv.kernel_for(2) == "avx512_linear-q4_1" if quant != "Q8_0" else qkv.kernel == "avx512"
    else:
        assert qkv.kernel == ("amx-q8_0" if quant == "Q8_0" else "amx-q4_1")
    modules = {id(m): m for m in [*runner.model.modules(), *runner._lean_modules()]}.values()
    blocks_bytes = sum(m.packed_blocks.nbytes for m in modules if getattr(m, "packed_blocks", None) is not None)
    got = _hidden_and_tokens(runner, prompts, 6)
    weight_bytes = runner.weight_bytes
    del runner
    monkeypatch.setenv(gguf_weights.ENV_SWITCH, "0")
    plain = ModelRunner(model_loader.load_model(source, torch.bfloat16), 16, 64)
    assert plain.lean.layers[0].qkv.__self__.kernel in ("amx", "avx512")
    want = _hidden_and_tokens(plain, prompts, 6)
    # weight_bytes (the "executor ready" line's weights_mb) counts what each holds:
    # without AMX the Q4 blocks beside the tiles, with AMX the blocks instead of them.
    if gguf_weights.packed_kind(qkv.packed) is None:
        assert weight_bytes - plain.weight_bytes == blocks_bytes and (blocks_bytes > 0) == (quant != "Q8_0")
    else:
        assert weight_bytes < plain.weight_bytes
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1]) > 1
    for g, w in zip(got[1], want[1]):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16))
    assert np.isfinite(got[1][-1].float().numpy()).all()
