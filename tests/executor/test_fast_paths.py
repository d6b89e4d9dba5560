"""The CPU fast paths (prepacked bf16 linears, fused RMSNorm and MLP) give
the same tokens as the stock transformers modules. They run where bf16 is
native and, on AVX2 CPUs without it, over avx2_f32_linear's bf16 panels
(packed_linear.avx2_bf16); these tests run on either."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import native
from executor import model_loader, model_source
from executor.cpu.fused_modules import FusedExperts, FusedMLP, FusedRMSNorm
from executor.cpu.packed_linear import PackedLinear, fp32_lean, native_bf16
from executor.runner import ModelRunner
from tests.conftest import REPO
from tests.executor.helpers import count_fused_calls, greedy, needs_bf16


def _assert_greedy_agrees(got, ref):
    """Two bf16 paths whose matmuls may sum in another order: a rare near-tie
    flip late in a sequence is allowed, but the first tokens must agree."""
    assert [g[:3] for g in got] == [r[:3] for r in ref]
    agree = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r)) / sum(len(r) for r in ref)
    assert agree >= 0.9


@needs_bf16
def test_modules_are_swapped_in_bf16_only():
    bf = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), 16, 64)
    layer = bf.model.model.layers[0]
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and isinstance(layer.mlp, FusedMLP)
    # The lean forward's fused q|k|v holds the attention weights; the model's
    # q/k/v are its columns (QkvPart).
    assert isinstance(layer.self_attn.q_proj.fused, PackedLinear) and isinstance(bf.model.lm_head, PackedLinear)
    f32 = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.float32), 16, 64)
    # fp32 keeps the stock modules except where its linears run avx2_f32_linear.
    fused32 = fp32_lean(torch.float32, torch.device("cpu"))
    assert (type(f32.model.model.layers[0].mlp).__name__ == "LlamaMLP") == (not fused32)


@needs_bf16
def test_fast_paths_match_stock_modules_in_bf16():
    prompts = [[(5 * i + 3 * L) % 250 + 3 for i in range(L)] for L in (1, 7, 33, 90)]
    fast = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), 16, 64)
    stock = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), 16, 64, prepack=False)
    # bf16 matmul blocking may differ between oneDNN paths.
    _assert_greedy_agrees(greedy(fast, prompts, 10), greedy(stock, prompts, 10))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_split_is_bit_exact_with_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaRotaryEmbedding, apply_rotary_pos_emb

    import native._fused as fused

    torch.manual_seed(0)
    T, hq, hkv, D = 37, 9, 3, 64
    cfg = LlamaConfig(
        hidden_size=hq * D, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=D, rope_theta=100000.0
    )
    qkv = torch.randn(T, (hq + 2 * hkv) * D).to(dtype)
    cos, sin = LlamaRotaryEmbedding(cfg)(qkv, (torch.arange(T) * 7 + 3)[None])
    q, k, v = fused.rope_split(qkv, cos[0].contiguous(), sin[0].contiguous(), hq, hkv, D)
    q_ref, k_ref = apply_rotary_pos_emb(
        qkv[:, : hq * D].view(1, T, hq, D).transpose(1, 2),
        qkv[:, hq * D : (hq + hkv) * D].view(1, T, hkv, D).transpose(1, 2),
        cos,
        sin,
    )
    assert torch.equal(q, q_ref[0].transpose(0, 1))
    assert torch.equal(k, k_ref[0].transpose(0, 1))
    assert torch.equal(v, qkv[:, (hq + hkv) * D :].view(T, hkv, D))
    with pytest.raises(RuntimeError, match="qkv must be"):
        fused.rope_split(qkv[:, 1:].contiguous(), cos[0].contiguous(), sin[0].contiguous(), hq, hkv, D)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_split_turns_the_first_dims_of_a_partial_rotary_as_transformers(dtype):
    """Phi-4-mini's partial rotary: the table covers R < D dims of each head;
    those turn (rotate-half over R), the others pass unchanged."""
    from transformers.models.phi3.modeling_phi3 import Phi3Config, Phi3RotaryEmbedding, apply_rotary_pos_emb

    import native._fused as fused

    torch.manual_seed(0)
    T, hq, hkv, D = 29, 6, 2, 32
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    cfg = Phi3Config(hidden_size=hq * D, num_attention_heads=hq, num_key_value_heads=hkv, rope_parameters=rope)
    qkv = torch.randn(T, (hq + 2 * hkv) * D).to(dtype)
    cos, sin = Phi3RotaryEmbedding(cfg)(qkv, (torch.arange(T) * 5 + 1)[None])
    assert cos.shape[-1] == 24
    q, k, v = fused.rope_split(qkv, cos[0].contiguous(), sin[0].contiguous(), hq, hkv, D)
    q_ref, k_ref = apply_rotary_pos_emb(
        qkv[:, : hq * D].view(1, T, hq, D).transpose(1, 2),
        qkv[:, hq * D : (hq + hkv) * D].view(1, T, hkv, D).transpose(1, 2),
        cos,
        sin,
    )
    assert torch.equal(q, q_ref[0].transpose(0, 1)) and torch.equal(k, k_ref[0].transpose(0, 1))
    assert torch.equal(v, qkv[:, (hq + hkv) * D :].view(T, hkv, D))
    with pytest.raises(RuntimeError, match="at most head_dim"):
        wide = torch.cat([cos[0], cos[0]], -1).contiguous()
        fused.rope_split(qkv, wide, wide, hq, hkv, D)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_cache_equals_rope_split_then_reshape_and_cache(dtype):
    import native._fused as fused
    from native import _C

    torch.manual_seed(2)
    T, hq, hkv, D, nb, bs = 41, 9, 3, 64, 12, 16
    qkv = torch.randn(T, (hq + 2 * hkv) * D).to(dtype)
    cos, sin = torch.randn(T, D).to(dtype), torch.randn(T, D).to(dtype)
    kc, vc = torch.randn(nb, bs, hkv, D).to(dtype), torch.randn(nb, bs, hkv, D).to(dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    # Scattered slots (decode-like), one token skipped by a negative slot.
    slots = torch.randperm(nb * bs)[:T].long()
    slots[5] = -1
    q = fused.rope_cache(qkv, cos, sin, hq, hkv, D, kc, vc, slots)
    q_ref, k_ref, v_ref = fused.rope_split(qkv, cos, sin, hq, hkv, D)
    _C.reshape_and_cache(k_ref, v_ref, kc_ref, vc_ref, slots)
    assert torch.equal(q, q_ref)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    # Contiguous slots (a prompt's), and no tokens at all.
    seq = torch.arange(T, dtype=torch.long) + 7
    fused.rope_cache(qkv, cos, sin, hq, hkv, D, kc, vc, seq)
    assert torch.equal(kc.view(-1, hkv, D)[7 : 7 + T], k_ref) and torch.equal(vc.view(-1, hkv, D)[7 : 7 + T], v_ref)
    empty = fused.rope_cache(qkv[:0], cos[:0], sin[:0], hq, hkv, D, kc, vc, seq[:0])
    assert empty.shape == (0, hq, D)


def test_rope_cache_rejects_bad_arguments_without_writing():
    import native._fused as fused

    T, hq, hkv, D = 4, 2, 1, 8
    qkv, cos, sin = torch.randn(T, (hq + 2 * hkv) * D), torch.randn(T, D), torch.randn(T, D)
    kc, vc = torch.zeros(2, 4, hkv, D), torch.zeros(2, 4, hkv, D)
    with pytest.raises(IndexError, match="out of range"):
        fused.rope_cache(qkv, cos, sin, hq, hkv, D, kc, vc, torch.tensor([0, 1, 8, 2]))
    assert not kc.any() and not vc.any()  # checked before anything is written
    with pytest.raises(RuntimeError, match="num_blocks, block_size, Hkv, D"):
        fused.rope_cache(qkv, cos, sin, hq, hkv, D, torch.zeros(2, 4, 2, D), torch.zeros(2, 4, 2, D), torch.arange(T))
    with pytest.raises(RuntimeError, match="dtype"):
        fused.rope_cache(qkv, cos, sin, hq, hkv, D, kc.bfloat16(), vc.bfloat16(), torch.arange(T))
    with pytest.raises(RuntimeError, match="int64"):
        fused.rope_cache(qkv, cos, sin, hq, hkv, D, kc, vc, torch.arange(T, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="shapes differ"):
        fused.rope_cache(qkv, cos, sin, hq, hkv, D, kc, torch.zeros(3, 4, hkv, D), torch.arange(T))


@needs_bf16
def test_lean_forward_fuses_the_cache_write_for_the_native_backend_only(monkeypatch):
    calls = count_fused_calls(monkeypatch)
    prompts = [[(3 * i + L) % 250 + 3 for i in range(L)] for L in (5, 30)]
    native_rt = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), 16, 64)
    got = greedy(native_rt, prompts, 6)
    assert calls["rope_cache"] > 0 and calls["rope_split"] == 0
    calls.update(rope_cache=0, rope_split=0)
    torch_rt = ModelRunner(
        model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), 16, 64, attention_backend="torch"
    )
    ref = greedy(torch_rt, prompts, 6)
    assert calls["rope_split"] > 0 and calls["rope_cache"] == 0
    _assert_greedy_agrees(got, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_matches_residual_add_then_llama_rmsnorm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    import native._fused as fused

    torch.manual_seed(1)
    x, res = torch.randn(19, 576).to(dtype), torch.randn(19, 576).to(dtype)
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
    want_res = res + x
    want = norm(want_res)
    got = fused.add_rms_norm(x, res, norm.weight.detach(), 1e-5)
    assert torch.equal(res, want_res)  # updated in place
    if dtype == torch.bfloat16:  # the executor's case: bit-exact
        assert torch.equal(got, want)
    else:  # portable loop: its own fp32 summation order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="same shape"):
        fused.add_rms_norm(x[:3].contiguous(), res, norm.weight.detach(), 1e-5)


@needs_bf16
def test_lean_forward_runs_in_bf16_and_matches_the_transformers_forward():
    prompts = [[(7 * i + 5 * L) % 250 + 3 for i in range(L)] for L in (1, 9, 40, 70)]
    lean = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), 16, 64)
    hf = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), 16, 64, lean_forward=False)
    assert lean.lean is not None and hf.lean is None
    # Same weights and rounding points; only the fused q|k|v matmul may block
    # its reduction differently from three separate ones.
    _assert_greedy_agrees(greedy(lean, prompts, 12), greedy(hf, prompts, 12))
    f32 = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.float32), 16, 64)
    # fp32 keeps the transformers forward (the parity tests' reference) unless it runs avx2_f32_linear.
    assert (f32.lean is None) == (not fp32_lean(torch.float32, torch.device("cpu")))


@needs_bf16
def test_greedy_lm_head_argmax_gives_the_tokens_of_logits_then_argmax(monkeypatch):
    """The runner takes the LM head's argmax straight from its accumulators
    when every row is greedy (amx CPUs); the tokens are those of the logits."""
    fused_rt = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), 16, 64)
    head = fused_rt.model.lm_head
    if not isinstance(head, PackedLinear) or head.kernel != "amx":
        pytest.skip("the fused greedy head runs on AMX CPUs")
    calls = []
    real = PackedLinear.greedy_argmax
    monkeypatch.setattr(PackedLinear, "greedy_argmax", lambda self, x: calls.append(x.shape[0]) or real(self, x))
    prompts = [[5, 6, 7, 8, 9], [11, 3], [42] * 20]
    fused_tokens = greedy(fused_rt, prompts, 8)
    assert calls and calls[0] == 3
    monkeypatch.setattr(PackedLinear, "greedy_argmax", lambda self, x: None)
    plain_rt = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), 16, 64)
    assert fused_tokens == greedy(plain_rt, prompts, 8)


def _llama_like(kind: str) -> torch.nn.Module:
    """A tiny random Mistral (window 16), Qwen2 (q/k/v biases, windows on
    its upper layers), Qwen3 (per-head q/k norms), OLMo 2, or another of
    tests/small_configs.ARCHS, or the tiny Llama, in bf16, weights sharpened
    so windows change tokens."""
    from transformers import (
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from tests.small_configs import ARCHS, small

    common = small(sliding_window=16)
    torch.manual_seed(1)
    if kind == "llama":
        model = model_loader.load_model(model_source.resolve("tiny"), torch.float32)
    elif kind in ("granite", "phi3", "phi4_mini", "gemma2", "gemma3", *MOE_KINDS):
        model = ARCHS[kind]()
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**small()))
    elif kind == "olmo2":
        from transformers import Olmo2Config, Olmo2ForCausalLM

        model = Olmo2ForCausalLM(Olmo2Config(**small()))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, max_window_layers=2))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0 if p.dim() == 2 else 1.0).add_(0.05 if p.dim() == 1 else 0.0)
    return model.to(torch.bfloat16).eval()


LEAN_KINDS = [
    *("mistral", "qwen2", "qwen3", "olmo2", "granite", "phi3", "phi4_mini", "gemma2", "gemma3"),
    *("mixtral", "qwen2_moe", "qwen3_moe"),
]
MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")


@needs_bf16
@pytest.mark.parametrize("kind", LEAN_KINDS)
def test_lean_forward_runs_each_architecture_like_its_transformers_forward(kind):
    import copy

    from executor.cpu.fast_forward import build

    model = _llama_like(kind)
    prompts = [[(7 * i + 5 * L) % 250 + 3 for i in range(L)] for L in (1, 9, 40, 70)]
    lean = ModelRunner(copy.deepcopy(model), 16, 64)
    hf = ModelRunner(copy.deepcopy(model), 16, 64, lean_forward=False)
    assert lean.lean is not None and hf.lean is None
    layers = lean.lean.layers
    windows = {"mistral": [16] * 4, "qwen2": [0, 0, 16, 16], "gemma2": [16, 0] * 2, "gemma3": [16, 0] * 2}
    assert [L.window for L in layers] == windows.get(kind, [0] * 4)
    assert all((L.qk_norm is not None) == (kind in ("qwen3", "qwen3_moe")) for L in layers)
    assert all((L.moe is not None) == (kind in MOE_KINDS) == (L.act is None) for L in layers)
    if kind in MOE_KINDS:
        assert all(isinstance(L.moe.experts, FusedExperts) for L in layers)
    assert all((L.post is not None) == (L.qk_full_norm is not None) == (kind == "olmo2") for L in layers)
    assert all((L.sandwich is not None) == kind.startswith("gemma") for L in layers)
    assert all((L.qk_head_norm is not None) == (kind == "gemma3") for L in layers)
    assert [L.softcap for L in layers] == [1.5 if kind == "gemma2" else 0.0] * 4
    assert [L.residual_scale for L in layers] == [0.3 if kind == "granite" else 1.0] * 4
    assert lean.lean.embed_scale == (6.0 if kind == "granite" else 1.0)
    if kind == "gemma3":  # each layer type rotates with its own table
        assert [L.rope for L in layers] == ["sliding_attention", "full_attention"] * 2
    if kind.startswith("gemma"):
        assert layers[0].down.__self__.__class__.__name__ == "PackedLinear"
        assert "gelu_tanh" in lean.model.model.layers[0].mlp.kernel
    _assert_greedy_agrees(greedy(lean, prompts, 12), greedy(hf, prompts, 12))
    assert build(_llama_like(kind).float()) is None  # fp32: no fused modules, the transformers forward


def _prompt_logprobs(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """The runner's logprob of each prompt token after the first (one
    prefill of the whole prompt: every row through every layer)."""
    from cbserve.v1 import executor_pb2 as pb

    seq = pb.ScheduledSeq(
        seq_id=0,
        num_tokens=len(prompt),
        new_block_ids=list(range(-(-(len(prompt) + 1) // runner.block_size))),
        new=pb.NewSeq(token_ids=prompt, sampling=pb.SeqSampling(prompt_logprobs=True)),
    )
    out = runner.step(pb.Plan(seqs=[seq]))
    runner.reset()
    return torch.tensor(out.prompt_logprobs[0].logprobs)


@needs_bf16
@pytest.mark.parametrize("kind", ["llama", *LEAN_KINDS])
def test_bf16_lean_forward_logprobs_are_within_tolerance_of_the_fp32_reference(kind):
    """The stated bf16 tolerance: over three 90-token prompts, each prompt
    token's logprob from the bf16 lean forward is within 0.15 nats of the
    fp32 transformers model's (0.03 on average), and no further from it than
    the bf16 transformers forward with its stock modules is, plus 0.01, on
    average and at the 95th percentile. (One prompt's largest error is one
    token's rounding luck: two correct bf16 forwards that round at different
    points trade it back and forth from prompt to prompt.)"""
    import copy

    model = _llama_like(kind).float()
    bf = copy.deepcopy(model).to(torch.bfloat16)
    lean_runner = ModelRunner(copy.deepcopy(bf), 16, 64)
    stock_runner = ModelRunner(bf, 16, 64, prepack=False)
    assert lean_runner.lean is not None
    lean, stock = [], []
    for k in range(3):
        prompt = [(11 * i + 7 + 13 * k * (i % 5)) % 250 + 3 for i in range(90)]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].float()
        ref = logits.log_softmax(-1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
        lean.append((_prompt_logprobs(lean_runner, prompt) - ref).abs())
        stock.append((_prompt_logprobs(stock_runner, prompt) - ref).abs())
    lean, stock = torch.cat(lean), torch.cat(stock)
    assert lean.max() <= 0.15 and lean.mean() <= 0.03
    assert lean.mean() <= stock.mean() + 0.01
    assert lean.quantile(0.95) <= stock.quantile(0.95) + 0.01


def _qwen3_qk_norm_mismatches() -> dict[str, int]:
    """How many values of the lean forward's Qwen3 q/k norm (rms_norm_w32_
    with a weight row per head and round_first, in place on the q and k heads
    of a fused projection) differ from Qwen3RMSNorm applied per head, in bf16
    and fp32; and whether the v columns beside them stayed untouched."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    import native._fused as fused

    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        qn, kn = Qwen3RMSNorm(64, eps=1e-6), Qwen3RMSNorm(64, eps=1e-6)
        with torch.no_grad():
            qn.weight.copy_(torch.randn(64))
            kn.weight.copy_(torch.randn(64))
        qn, kn = qn.to(dtype), kn.to(dtype)
        t, hq, hkv = 37, 9, 3
        scale = torch.logspace(-2, 2, t).unsqueeze(1)
        qkv = (torch.randn(t, (hq + 2 * hkv) * 64) * scale).to(dtype)  # q | k | v
        heads = qkv[:, : (hq + hkv) * 64].view(t, hq + hkv, 64)
        want = torch.cat([qn(heads[:, :hq].contiguous()), kn(heads[:, hq:].contiguous())], 1)
        v = qkv[:, (hq + hkv) * 64 :].clone()
        w = torch.cat([qn.weight.detach().expand(hq, -1), kn.weight.detach().expand(hkv, -1)]).float().contiguous()
        fused.rms_norm_w32_(heads, w, 1e-6, heads, True)
        if dtype == torch.bfloat16:
            out["bf16"] = int((heads != want).sum())
        else:  # no final rounding to absorb the kernel's order of summation
            out["fp32"] = int(((heads - want).abs() > 1e-6 + 1e-6 * want.abs()).sum())
        out["v_touched"] = out.get("v_touched", 0) + int((qkv[:, (hq + hkv) * 64 :] != v).sum())
    return out


def test_the_lean_q_k_norm_is_qwen3s_per_head_norm_bit_for_bit():
    assert _qwen3_qk_norm_mismatches() == {"bf16": 0, "fp32": 0, "v_touched": 0}


def test_the_lean_q_k_norm_is_qwen3s_on_the_generic_kernel_too():
    """The same check where no vector code runs (CBSERVE_NATIVE_ISA=generic):
    the portable loop rounds as the AVX-512 one does."""
    probe = (
        "import json; from tests.executor.test_fast_paths import _qwen3_qk_norm_mismatches as m; print(json.dumps(m()))"
    )
    env = dict(os.environ, CBSERVE_NATIVE_ISA="generic")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"bf16": 0, "fp32": 0, "v_touched": 0}


def test_per_head_norm_weights_must_match_the_heads():
    import native._fused as fused

    x = torch.randn(4, 3, 8)
    with pytest.raises(RuntimeError, match=r"\[B, H\]"):
        fused.rms_norm_w32_(x, torch.ones(2, 8), 1e-6, x)
    with pytest.raises(RuntimeError, match=r"\[B, H\]"):
        fused.rms_norm_w32_(x.view(12, 8), torch.ones(3, 8), 1e-6, x.view(12, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_w32_is_olmo2s_and_gemmas_norm_bit_for_bit(dtype):
    """The fp32-weight RMSNorm of the OLMo 2 lean forward against the
    modules it stands for, in place on strided rows (a slice of a fused
    projection) as the forward calls it, and with Gemma's 1 + weight."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    import native._fused as fused

    torch.manual_seed(0)
    olmo, gemma = Olmo2RMSNorm(96, eps=1e-6), Gemma2RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        olmo.weight.copy_(torch.randn(96))
        gemma.weight.copy_(torch.randn(96) * 0.3)
    olmo, gemma = olmo.to(dtype), gemma.to(dtype)
    fused_proj = (torch.randn(37, 96 + 40) * torch.logspace(-2, 2, 37).unsqueeze(1)).to(dtype)
    rows = fused_proj[:, :96]
    want_olmo, want_gemma = olmo(rows.contiguous()), gemma(rows.contiguous())
    out = torch.empty_like(want_olmo)
    # bf16 (where the lean forward runs) bit for bit; fp32 has no final
    # rounding to absorb the kernel's own order of summation.
    same = torch.equal if dtype == torch.bfloat16 else lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    fused.rms_norm_w32_(rows, (1.0 + gemma.weight.detach().float()).contiguous(), 1e-6, out)
    assert same(out, want_gemma)
    tail = fused_proj[:, 96:].clone()
    fused.rms_norm_w32_(rows, olmo.weight.detach().float().contiguous(), 1e-6, rows)
    assert same(rows, want_olmo) and torch.equal(fused_proj[:, 96:], tail)
    with pytest.raises(RuntimeError, match="fp32"):
        fused.rms_norm_w32_(rows, olmo.weight.detach().half(), 1e-6, rows)


@needs_bf16
def test_only_norms_that_round_like_llamas_are_swapped():
    """Gemma's (1 + weight) norms and OLMo 2's fp32-weight norms keep their
    modules (the native Llama norm would change their output); their MLPs
    still fuse where they are SiLU-gated."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tests.small_configs import small

    torch.manual_seed(0)
    gemma = ModelRunner(Gemma2ForCausalLM(Gemma2Config(**small())).to(torch.bfloat16), 16, 64)
    layer = gemma.model.model.layers[0]
    assert not isinstance(layer.input_layernorm, FusedRMSNorm)
    assert not isinstance(gemma.model.model.norm, FusedRMSNorm)
    # The lean forward runs Gemma's norms itself (rms_norm_w32_, with 1 + weight).
    assert gemma.lean is not None and isinstance(layer.mlp, FusedMLP) and layer.mlp.activation == "gelu_tanh"
    olmo = ModelRunner(_llama_like("olmo2"), 16, 64)
    assert isinstance(olmo.model.model.layers[0].mlp, FusedMLP)
    assert not isinstance(olmo.model.model.layers[0].post_attention_layernorm, FusedRMSNorm)
    tiny = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16), 16, 64)
    assert isinstance(tiny.model.model.layers[0].input_layernorm, FusedRMSNorm)


@needs_bf16
@pytest.mark.parametrize("kernel", ["silu_and_mul", "amx_linear_silu_mul", "avx512_linear_silu_mul"])
def test_gelu_tanh_gated_mlp_kernels_match_torch(kernel):
    """Gemma's gelu_pytorch_tanh(gate) * up in each native pass. The kernels
    compute GELU as g / (1 + exp(-2a)), which torch's 0.5 g (1 + tanh(a))
    equals but for its cancellation at large negative g: element-wise
    silu_and_mul agrees to one bf16 rounding step (or 1e-5 where GELU is ~0);
    the matmul passes, whose gate and up may round differently from torch's
    matmul, to two more."""
    import native._fused as fused

    torch.manual_seed(0)
    M, K, inter = 37, 96, 64
    x = torch.randn(M, K).to(torch.bfloat16)
    w = (torch.randn(2 * inter, K) * 0.4).to(torch.bfloat16)
    gate_up = (x @ w.t()).contiguous()
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    if kernel == "silu_and_mul":
        got, rtol = fused.silu_and_mul(gate_up, "gelu_tanh"), 2**-8
        assert torch.equal(fused.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)  # the default
        with pytest.raises(RuntimeError, match="activation must be"):
            fused.silu_and_mul(gate_up, "relu")
    else:
        if not (fused.amx_linear_supported() if kernel.startswith("amx") else fused.avx512_linear_supported()):
            pytest.skip(f"{kernel} needs its CPU feature")
        got, rtol = getattr(fused, kernel)(x, fused.amx_pack_gate_up(w), inter, "gelu_tanh"), 2**-6
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_add_is_olmo2s_post_norm_and_residual_add_bit_for_bit(dtype):
    """norm_add_w32_: residual + post_norm(x) in place, as OLMo 2's decoder
    layer adds after attention and after the MLP (x's rows spanning two
    decades of scale); x is left as it was."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    import native._fused as fused

    torch.manual_seed(0)
    norm = Olmo2RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    norm = norm.to(dtype)
    x = (torch.randn(23, 96) * torch.logspace(-1, 1, 23).unsqueeze(1)).to(dtype)
    residual = (torch.randn(23, 96) * 4).to(dtype)
    want, x0 = residual + norm(x), x.clone()
    fused.norm_add_w32_(x, residual, norm.weight.detach().float().contiguous(), 1e-6)
    same = torch.equal if dtype == torch.bfloat16 else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert same(residual, want) and torch.equal(x, x0)
    with pytest.raises(RuntimeError, match="fp32"):
        fused.norm_add_w32_(x, residual, norm.weight.detach().half(), 1e-6)
    with pytest.raises(RuntimeError, match="differ"):
        fused.norm_add_w32_(x[:3], residual, norm.weight.detach().float().contiguous(), 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemma_norm_add_norm_and_per_head_norms_are_its_modules_bit_for_bit(dtype):
    """norm_add_norm_w32: residual + post_norm(x), then the next pre-norm, as
    Gemma's decoder layer computes them; rms_norm_w32_ over [T, heads, D]
    views of a fused projection (Gemma 3's q/k norms) in place."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    import native._fused as fused

    torch.manual_seed(0)
    norms = [Gemma3RMSNorm(96, eps=1e-6) for _ in range(2)]
    with torch.no_grad():
        for n in norms:
            n.weight.copy_(torch.randn(96) * 0.3)
    post, pre = (n.to(dtype) for n in norms)
    x = (torch.randn(23, 96) * torch.logspace(-1, 1, 23).unsqueeze(1)).to(dtype)
    residual = (torch.randn(23, 96) * 4).to(dtype)
    want_res = residual + post(x)
    want = pre(want_res)
    w = [(1.0 + n.weight.detach().float()).contiguous() for n in (post, pre)]
    got = fused.norm_add_norm_w32(x, residual, w[0], 1e-6, w[1], 1e-6)
    same = torch.equal if dtype == torch.bfloat16 else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert same(residual, want_res) and same(got, want)
    head = Gemma3RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        head.weight.copy_(torch.randn(32) * 0.3)
    head = head.to(dtype)
    proj = torch.randn(11, 5 * 32 + 64).to(dtype)  # 5 heads of 32, then other columns
    heads = proj[:, : 5 * 32].view(11, 5, 32)
    want_heads, tail = head(heads.contiguous()), proj[:, 5 * 32 :].clone()
    fused.rms_norm_w32_(heads, (1.0 + head.weight.detach().float()).contiguous(), 1e-6, heads)
    assert same(heads, want_heads) and torch.equal(proj[:, 5 * 32 :], tail)
    with pytest.raises(RuntimeError, match="fp32"):
        fused.norm_add_norm_w32(x, residual, w[0].half(), 1e-6, w[1], 1e-6)


@needs_bf16
def test_an_mlp_with_biases_keeps_its_module():
    """The fused gate|up pass has no biases: a Llama with mlp_bias keeps the
    stock MLP (and the transformers forward), so its biases still count."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from executor.cpu.fused_modules import mlp_activation
    from tests.small_configs import small

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**small(mlp_bias=True))).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for p in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                p.weight.mul_(4.0)
                p.bias.normal_()
    model = model.to(torch.bfloat16)
    assert mlp_activation(model.model.layers[0].mlp) is None
    stock = ModelRunner(copy.deepcopy(model), 16, 64, prepack=False)
    runner = ModelRunner(model, 16, 64)
    assert not isinstance(runner.model.model.layers[0].mlp, FusedMLP) and runner.lean is None
    prompts = [[(7 * i + 5 * L) % 250 + 3 for i in range(L)] for L in (9, 40)]
    if native_bf16():  # oneDNN's F.linear and the packed kernels round alike here
        assert greedy(runner, prompts, 8) == greedy(stock, prompts, 8)
    else:
        # torch's bf16 F.linear on AVX2 sums in another order than
        # avx2_f32_linear, and this random model's near-ties flip greedy
        # tokens: the prompt logprobs agree instead (dropping the biases
        # moves them by 0.2 nats on average).
        for prompt in prompts:
            diff = _prompt_logprobs(runner, prompt) - _prompt_logprobs(stock, prompt)
            assert diff.abs().max() <= 0.02


@needs_bf16
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_fused_experts_compute_what_the_expert_bank_computes(kind):
    """FusedExperts against the transformers expert bank it replaces, on the
    same rows, routing and weights in bf16: each expert's packed gate|up pass
    and down projection, the routing weight and the expert-ordered sum; the
    two differ only in how their matmuls block the fp32 sums."""
    import copy

    from executor.cpu.fused_modules import moe_experts
    from tests.small_configs import ARCHS

    torch.manual_seed(0)
    block = ARCHS[kind]().model.layers[0].mlp.to(torch.bfloat16)
    experts = moe_experts(block)
    fused = FusedExperts(copy.deepcopy(experts), "silu")
    h = torch.randn(53, experts.gate_up_proj.shape[2]).to(torch.bfloat16)
    _, weights, index = block.gate(h)
    index[:5] = index[5]  # several rows on the same experts, some experts idle in a small batch
    got, want = fused(h, index, weights), experts(h, index, weights)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2e-3)
    assert torch.equal(fused(h[:0], index[:0], weights[:0]), h[:0])  # no rows, no work


_AVX2_BF16_PROBE = """
import json, torch
from executor import model_loader, model_source
from executor.cpu.packed_linear import PackedLinear, avx2_bf16
from executor.runner import ModelRunner, greedy_generate

def load():
    return model_loader.load_model(model_source.resolve("tiny"), torch.bfloat16)

fast, stock = ModelRunner(load(), 16, 64), ModelRunner(load(), 16, 64, prepack=False)
prompts = [[(5 * i + 3 * L) % 250 + 3 for i in range(L)] for L in (1, 7, 33, 90)]
print(json.dumps({
    "avx2_bf16": avx2_bf16(),
    "kernels": sorted({m.kernel for m in fast.model.modules() if isinstance(m, PackedLinear)}),
    "packed_dtypes": sorted({str(m.packed.dtype) for m in fast.model.modules() if isinstance(m, PackedLinear)}),
    "lean": fast.lean is not None,
    "fast": greedy_generate(fast, prompts, 10),
    "stock": greedy_generate(stock, prompts, 10),
}))
"""


def test_bf16_takes_the_avx2_path_on_any_avx2_cpu_capped_to_it():
    """What an AVX2-only CPU runs for bf16, on any AVX2 CPU under
    CBSERVE_NATIVE_ISA=avx2: every linear on avx2_f32_linear's bf16 panels,
    the lean forward, and greedy tokens that agree with the stock modules'."""
    if not native.cpu_features()["supported"][1]:  # (generic, avx2, avx512, amx)
        pytest.skip("this CPU does not run AVX2")
    env = dict(os.environ, CBSERVE_NATIVE_ISA="avx2")
    out = subprocess.run(
        [sys.executable, "-c", _AVX2_BF16_PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["avx2_bf16"] and got["lean"]
    assert got["kernels"] == ["avx2_f32"] and got["packed_dtypes"] == ["torch.bfloat16"]
    _assert_greedy_agrees(got["fast"], got["stock"])
