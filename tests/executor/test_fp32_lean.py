"""fp32 on the lean forward, where its projections run avx2_f32_linear (CPUs
without native bf16; CBSERVE_FP32_PREPACK=1 asks for it on any AVX2 CPU):
the fused modules and the lean forward in fp32, their native passes within
a few ulp of torch's, the same greedy tokens and logprobs as the
transformers forward, and the switches that turn it off."""

from __future__ import annotations

import copy

import pytest
import torch

from executor.cpu import fast_forward, packed_linear
from executor.cpu.fast_forward import QkvPart
from executor.cpu.fused_modules import FusedMLP, FusedRMSNorm, _fused_norm
from executor.cpu.huge_pages import module_tensors
from executor.cpu.packed_linear import PackedLinear, fp32_lean, same_output
from executor.runner import ModelRunner
from tests.executor.helpers import greedy
from tests.executor.test_fast_paths import LEAN_KINDS, MOE_KINDS, _llama_like, _prompt_logprobs

needs_avx2_f32 = pytest.mark.skipif(
    packed_linear._fused() is None
    or not packed_linear._fused().avx2_f32_linear_supported()
    or not torch.backends.mkldnn.is_available(),
    reason="no AVX2 + FMA here",
)
CPU = torch.device("cpu")


@pytest.fixture
def lean_env(monkeypatch):
    """fp32 on avx2_f32_linear (and so on the lean forward) on any AVX2 CPU."""
    monkeypatch.setenv("CBSERVE_FP32_PREPACK", "1")
    for name in ("CBSERVE_FP32_LINEAR", "CBSERVE_FP32_LEAN"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@needs_avx2_f32
def test_fp32_takes_the_lean_forward_only_on_the_avx2_kernel_and_the_switches_turn_it_off(lean_env):
    assert fp32_lean(torch.float32, CPU)
    assert not fp32_lean(torch.bfloat16, CPU) and not fp32_lean(torch.float16, CPU)
    assert not fp32_lean(torch.float32, torch.device("meta"))
    lean_env.setenv("CBSERVE_FP32_LEAN", "0")
    assert not fp32_lean(torch.float32, CPU)
    lean_env.delenv("CBSERVE_FP32_LEAN")
    lean_env.setenv("CBSERVE_FP32_LINEAR", "onednn")
    assert not fp32_lean(torch.float32, CPU)
    lean_env.delenv("CBSERVE_FP32_LINEAR")
    lean_env.setenv("CBSERVE_FP32_PREPACK", "0")
    assert not fp32_lean(torch.float32, CPU)


def test_probes_accept_fp32_sum_order_and_refuse_another_formula():
    torch.manual_seed(0)
    want = torch.randn(8, 64) * torch.logspace(-2, 2, 8).unsqueeze(1)
    ulp = want * (1 + 2 * torch.finfo(torch.float32).eps)  # two ulp off: the order of a sum
    assert same_output(ulp, want) and same_output(want, want)
    assert not same_output(want * 1.001, want) and not same_output(want[:4], want)
    # bf16 keeps the model's rounding points: bit for bit only.
    b = want.bfloat16()
    bits = b.view(torch.int16).clone()
    bits[0, 0] += 1  # one bf16 ulp in one element
    assert same_output(b, b.clone()) and not same_output(bits.view(torch.bfloat16), b)


@needs_avx2_f32
def test_the_fp32_norm_probe_swaps_llamas_norm_but_not_gemmas():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    llama, gemma = LlamaRMSNorm(96, eps=1e-6), Gemma2RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        llama.weight.copy_(torch.randn(96))
        gemma.weight.copy_(torch.randn(96) * 0.3)
    assert isinstance(_fused_norm(llama), FusedRMSNorm)
    assert _fused_norm(gemma) is None  # scales by 1 + weight


@needs_avx2_f32
def test_plain_weight_unpacks_the_avx2_panels_exactly(lean_env):
    torch.manual_seed(0)
    for n, k in ((200, 96), (16, 7), (1, 3), (961, 64)):
        linear = torch.nn.Linear(k, n)
        w = linear.weight.detach().clone()
        packed = PackedLinear(linear)
        assert packed.weight.device.type == "meta"
        assert torch.equal(packed.plain_weight(), w)
    lean_env.setenv("CBSERVE_FP32_LINEAR", "onednn")
    with pytest.raises(ValueError, match="oneDNN"):
        PackedLinear(torch.nn.Linear(8, 8)).plain_weight()


@needs_avx2_f32
@pytest.mark.parametrize("kind", ["llama", *LEAN_KINDS])
def test_each_architecture_runs_the_fp32_lean_forward_with_the_transformers_tokens(lean_env, kind):
    model = _llama_like(kind).float()
    lean = ModelRunner(copy.deepcopy(model), 16, 64)
    lean_env.setenv("CBSERVE_FP32_LEAN", "0")
    hf = ModelRunner(copy.deepcopy(model), 16, 64)
    stock = ModelRunner(copy.deepcopy(model), 16, 64, prepack=False)
    assert lean.lean is not None and hf.lean is None and stock.lean is None
    layer = lean.model.model.layers[0]
    if kind in MOE_KINDS:
        assert all(isinstance(L.moe, torch.nn.Module) and L.act is None for L in lean.lean.layers)
    else:
        assert isinstance(layer.mlp, FusedMLP) and layer.mlp.kernel.startswith("avx2_f32 + silu_and_mul")
    assert all(m.kernel == "avx2_f32" for m in lean.model.modules() if isinstance(m, PackedLinear))
    assert all(L.qkv.__self__.kernel == "avx2_f32" for L in lean.lean.layers)
    prompts = [[(7 * i + 5 * L) % 250 + 3 for i in range(L)] for L in (1, 9, 40, 70)]
    want = greedy(stock, prompts, 12)
    # fp32 everywhere: the same tokens as the transformers forward, with the
    # packed projections alone and with the whole lean forward.
    assert greedy(hf, prompts, 12) == want
    assert greedy(lean, prompts, 12) == want
    prompt = prompts[-1]
    torch.testing.assert_close(_prompt_logprobs(lean, prompt), _prompt_logprobs(stock, prompt), rtol=0, atol=1e-4)
    # The model's own q/k/v are columns of the fused projection now (held
    # once), and the transformers layer code still runs through them.
    if not hasattr(layer.self_attn, "qkv_proj"):
        assert all(isinstance(getattr(layer.self_attn, n), QkvPart) for n in ("q_proj", "k_proj", "v_proj"))
    lean.lean = None
    assert greedy(lean, prompts, 12) == want


def _held_bytes(runner: ModelRunner) -> int:
    """Bytes of the distinct tensors the model and its lean forward hold."""
    held = {}
    for t in module_tensors([*runner.model.modules(), *runner.lean.modules()]):
        if t.device.type != "meta":
            held[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(held.values())


@needs_avx2_f32
def test_the_lean_forward_holds_the_attention_projections_once(lean_env):
    model = _llama_like("qwen2").float()  # q/k/v biases too
    attns = [layer.self_attn for layer in model.model.layers]
    qkv_bytes = sum(getattr(a, n).weight.numel() * 4 for a in attns for n in ("q_proj", "k_proj", "v_proj"))
    shared = ModelRunner(copy.deepcopy(model), 16, 64)
    lean_env.setattr(fast_forward, "_share_qkv", lambda attn, fused: None)
    twice = ModelRunner(copy.deepcopy(model), 16, 64)
    assert isinstance(twice.model.model.layers[0].self_attn.q_proj, PackedLinear)
    assert _held_bytes(twice) - _held_bytes(shared) >= qkv_bytes
    part = shared.model.model.layers[0].self_attn.k_proj
    x = torch.randn(5, part.in_features)
    want = twice.model.model.layers[0].self_attn.k_proj(x)
    torch.testing.assert_close(part(x), want, rtol=1e-5, atol=1e-6)


@needs_avx2_f32
@pytest.mark.parametrize("inter", [1, 7, 8, 13, 1536])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_fp32_act_and_mul_pass_is_torchs_to_fp32_rounding(inter, activation):
    """The AVX2 act(gate) * up of fp32 MLPs (8 lanes and a scalar tail)
    against the activation in float64, row by row to within a few ulp of
    each row's scale (GELU-tanh's far negative tail is ~0 either way)."""
    import native._fused as fused

    act = (
        torch.nn.functional.silu if activation == "silu" else lambda x: torch.nn.functional.gelu(x, approximate="tanh")
    )
    torch.manual_seed(inter)
    gu = torch.randn(37, 2 * inter) * torch.logspace(-3, 1.3, 37).unsqueeze(1)
    gu[0, : min(inter, 3)] = torch.tensor([-200.0, 200.0, 0.0])[: min(inter, 3)]
    got = fused.silu_and_mul(gu, activation).double()
    want = act(gu[:, :inter].double()) * gu[:, inter:].double()
    scale = want.abs() + 1e-6 * want.abs().amax(-1, keepdim=True) + 1e-30
    assert ((got - want).abs() / scale).max() < 2e-6
