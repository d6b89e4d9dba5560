"""Architectures beyond Llama through the whole server, against Hugging Face.

Each test writes a tiny random checkpoint (no download) whose config makes
its feature matter: sliding windows of 16 tokens with prompts several windows
long (Mistral, Qwen2, Gemma 2's alternating layers, Gemma 3), attention and
final-logit soft caps small enough to bend the scores (Gemma 2), Granite's
logits scaling and multipliers, Phi-3's longrope over chunked prompts, the
q/k norms of Qwen3 and OLMo 2, and the experts of Mixtral and Qwen2-MoE (on
the transformers forward). Greedy tokens in fp32 through `cbserve
serve` (several concurrent prompts, a token budget that chunks the prefills)
equal `generate(do_sample=False)`; logprobs equal the model's own
log-softmax where the architecture post-processes its logits.
"""

from __future__ import annotations

import pytest
import torch

from router.tokenizer import build_tiny_tokenizer
from tests.conftest import start_server
from tests.integration.helpers import gen_request, stub, wait_idle
from tests.small_configs import SMALL, longrope

NEW = 12
COMMON = SMALL
WINDOW = 16


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=WINDOW))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)
    return Qwen2ForCausalLM(cfg)


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        **{**COMMON, "hidden_activation": "gelu_pytorch_tanh"},
        sliding_window=WINDOW,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0,
        query_pre_attn_scalar=64,
    )
    return Gemma2ForCausalLM(cfg)


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=64))


def _granite():
    from transformers import GraniteConfig, GraniteForCausalLM

    cfg = GraniteConfig(
        **COMMON, logits_scaling=4.0, embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.05
    )
    return GraniteForCausalLM(cfg)


def _phi3():
    # longrope: short factors up to 64 positions, long ones beyond. The 97-
    # and 150-token prompts are prefilled in 64-token chunks beside others;
    # every chunk must take the long factors, as a one-shot prefill does.
    # (No prompt here crosses 64 while decoding: generate() then recomputes
    # the whole cache, which cbserve does not; see docs/api.md.)
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(
        **{**COMMON, "head_dim": 32}, original_max_position_embeddings=64, rope_parameters=longrope(16, 64)
    )
    return Phi3ForCausalLM(cfg)


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**COMMON))  # per-head q/k RMSNorm


def _olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2ForCausalLM(Olmo2Config(**COMMON))  # q/k norms over all heads, norms after attention and MLP


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    return MixtralForCausalLM(cfg)


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128
    )
    return Qwen2MoeForCausalLM(cfg)


ARCHS = {
    "mistral": _mistral,
    "qwen2": _qwen2,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "granite": _granite,
    "phi3": _phi3,
    "qwen3": _qwen3,
    "olmo2": _olmo2,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
}


def _checkpoint(tmp_path, name):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = ARCHS[name]()
    with torch.no_grad():  # random init is near-uniform: sharpen it so windows and caps change tokens
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    path = tmp_path / name
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return path, ref


def _prompts():
    lengths = [150, 97, 33, 5]  # several windows, a chunk edge, shorter than a window
    return [[(11 * i + 7 * n) % 250 + 3 for i in range(n)] for n in lengths]


def _hf(model, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW
        )
    return out[0, len(prompt) :].tolist()


def _hf_logprobs(model, prompt, tokens):
    """The model's own log-softmax of its logits for each generated token."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()


@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_tokens_through_the_server_equal_hugging_face(tmp_path, name):
    path, ref = _checkpoint(tmp_path, name)
    prompts = _prompts()
    want = [_hf(ref, p) for p in prompts]
    want_lp = _hf_logprobs(ref, prompts[0], want[0])
    if name in ("mistral", "gemma2"):
        # The window must matter: the same model without it gives other tokens.
        ref.config.sliding_window = 10**6
        for layer in ref.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = 10**6
        assert [_hf(ref, p) for p in prompts] != want
    server = start_server(
        str(path), config={"scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 8}}, dtype="float32"
    )
    try:
        with server.channel() as ch:
            s = stub(ch)
            futures = [s.Complete.future(gen_request(p, max_new=NEW, logprobs=True)) for p in prompts]
            results = [f.result(timeout=300) for f in futures]
        wait_idle(server)
    finally:
        server.stop()
    assert [list(r.token_ids) for r in results] == want
    if name in ("granite", "gemma2"):  # logits scaled / soft-capped by the model: logprobs follow
        assert list(results[0].logprobs) == pytest.approx(want_lp, abs=2e-3)
