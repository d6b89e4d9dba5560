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
from tests.small_configs import ARCHS

NEW = 12


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
