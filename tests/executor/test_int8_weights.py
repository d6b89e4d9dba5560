"""`--quantization int8` (executor/cpu/int8_weights.py): a checkpoint's
projections as int8 weights with per-channel scales, served from those
bytes by the block kernels. The served model is the one whose weights are
bf16(s * q): the runner over the int8 blocks gives its hidden states and
tokens bit for bit (against the same weights served as bf16 tiles); against
the original bf16 model it differs by the quantisation, which the test bounds."""

from __future__ import annotations

import pytest
import torch

from executor import model_loader, model_source
from executor.cpu import gguf_weights, int8_weights
from executor.runner import ModelRunner
from tests.executor.helpers import avx512_bf16, greedy_with_hidden

pytestmark = pytest.mark.skipif(not avx512_bf16(), reason="needs an AVX512-BF16 CPU")


@pytest.fixture(autouse=True)
def _bf16_block_activations(monkeypatch):
    # Bit-for-bit against bf16 tiles holds under bf16 activations; the int8
    # ones (the default on VNNI CPUs without AMX) are tested in
    # test_gguf_int8_activations.py.
    monkeypatch.setenv(gguf_weights.ACTIVATIONS_SWITCH, "bf16")


SPEC = 'tiny:{"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}'


def test_rows_quantize_symmetrically_per_channel():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * torch.logspace(-3, 1, 48)[:, None]  # rows over four decades
    w[5] = 0.0  # an all-zero row
    bw = int8_weights.quantize_rows(w.bfloat16())
    assert bw.kind == "q8_0" and bw.q.dtype == torch.int8 and int(bw.q.abs().max()) <= 127
    assert torch.equal(bw.d, bw.d[:, :1].expand_as(bw.d))  # one scale a row
    assert bw.q.abs().amax(dim=1)[torch.arange(48) != 5].min() >= 126  # each row's range used
    err = (bw.dequantize() - w.bfloat16().float()).abs()
    assert (err <= bw.d.float()[:, :1] * 0.5 * 1.01 + 1e-12).all()  # half a step at most
    assert torch.equal(bw.dequantize()[5], torch.zeros(96))


def test_int8_projections_are_served_from_their_bytes_exactly(monkeypatch):
    source = model_source.resolve(SPEC)
    prompts = [list(range(5, 45)), [7, 8, 9]]  # a prefill, then decode steps of 2 rows
    runner = ModelRunner(model_loader.load_model(source, torch.bfloat16, quantization="int8"), 16, 64)
    qkv = runner.lean.layers[0].qkv.__self__
    assert qkv.kernel in ("avx512-q8_0", "amx-q8_0")
    assert runner.model.model.layers[0].mlp.down.kernel == qkv.kernel
    assert runner.model.lm_head.kernel in ("avx512", "amx")  # the head stays bf16
    got = greedy_with_hidden(runner, prompts, 6)
    int8_bytes = runner.weight_bytes
    del runner
    # The same int8 model served from bf16 tiles of its dequantised weights.
    monkeypatch.setenv(gguf_weights.ENV_SWITCH, "0")
    tiles = ModelRunner(model_loader.load_model(source, torch.bfloat16, quantization="int8"), 16, 64)
    assert tiles.lean.layers[0].qkv.__self__.kernel in ("avx512", "amx")
    want = greedy_with_hidden(tiles, prompts, 6)
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1]):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16))
    # The projections' bytes: 8.5 bits a weight instead of 16 (the bf16 embedding and head are common to both).
    fresh = model_loader.load_model(source, torch.bfloat16).named_modules()
    proj = sum(m.weight.numel() for n, m in fresh if n.endswith(int8_weights._TARGETS))
    assert tiles.weight_bytes - int8_bytes >= proj * (2 - 8.5 / 8) * 0.95
    # Against the unquantised model: the same hidden states up to the quantisation's error.
    monkeypatch.delenv(gguf_weights.ENV_SWITCH)
    plain = greedy_with_hidden(ModelRunner(model_loader.load_model(source, torch.bfloat16), 16, 64), prompts, 6)
    h_int8, h_bf16 = got[1][0].float(), plain[1][0].float()
    assert (h_int8 - h_bf16).norm() / h_bf16.norm() < 0.05


def test_what_int8_cannot_serve_is_refused(tmp_path):
    with pytest.raises(model_loader.ModelNotServable, match="bfloat16"):
        model_loader.load_model(model_source.resolve(SPEC), torch.float32, quantization="int8")
    with pytest.raises(model_loader.ModelNotServable, match="not one of none, int8"):
        model_loader.load_model(model_source.resolve(SPEC), torch.bfloat16, quantization="int4")
