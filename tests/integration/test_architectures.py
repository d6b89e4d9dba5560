"""Architectures beyond Llama through the whole server, against Hugging Face.

Each architecture gets a tiny random checkpoint (no download) whose config
makes its feature matter: sliding windows of 16 tokens with prompts several windows
long (Mistral, Qwen2, Gemma 2's alternating layers, Gemma 3), attention and
final-logit soft caps small enough to bend the scores (Gemma 2), Granite's
logits scaling and multipliers, Phi-3's longrope over chunked prompts, the
q/k norms of Qwen3 and OLMo 2, and the experts of Mixtral and Qwen2-MoE (on
the transformers forward). One `cbserve serve` serves them all (a `models:`
entry and an executor each; requests name their model). Greedy tokens in
fp32 through it (several concurrent prompts, a token budget that chunks the
prefills) equal `generate(do_sample=False)`; logprobs equal the model's own
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


def _checkpoint(root, name):
    """Writes `name`'s sharpened random checkpoint under `root`."""
    torch.manual_seed(0)
    model = ARCHS[name]()
    with torch.no_grad():  # random init is near-uniform: sharpen it so windows and caps change tokens
        for name_, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif name_.endswith("_proj.bias"):  # zeros at init: make Qwen2's q/k/v biases matter
                p.normal_(0.0, 0.5)
    path = root / name
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def _reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every architecture behind one router (`models:`, an executor each,
    started side by side): one start-up instead of one per architecture.
    Each model keeps its own scheduler and pool, so a test sees only its own."""
    root = tmp_path_factory.mktemp("archs")
    entries = [
        {
            "name": name,
            "model": str(_checkpoint(root, name)),
            "dtype": "float32",
            "cache": {"num_blocks": 512, "block_size": 16},
        }
        for name in ARCHS
    ]
    config = {"scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 8}, "models": entries}
    server = start_server("tiny", config=config, extra_args=["--executor-threads", "1"], timeout=300)
    yield server, root
    server.stop()


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
def test_greedy_tokens_through_the_server_equal_hugging_face(served, name):
    server, root = served
    ref = _reference(root / name)
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
    with server.channel() as ch:
        s = stub(ch)
        futures = [s.Complete.future(gen_request(p, max_new=NEW, logprobs=True, model=name)) for p in prompts]
        results = [f.result(timeout=300) for f in futures]
    wait_idle(server)
    assert [list(r.token_ids) for r in results] == want
    if name in ("granite", "gemma2"):  # logits scaled / soft-capped by the model: logprobs follow
        assert list(results[0].logprobs) == pytest.approx(want_lp, abs=2e-3)


def test_the_router_tokenizes_every_checkpoint_without_torch(served):
    """The router process (`cbserve serve` itself) loaded each checkpoint's
    tokenizer without torch: it does no tensor work (docs/architecture.md)."""
    server, _ = served
    with open(f"/proc/{server.proc.pid}/maps", encoding="utf-8") as fh:
        maps = fh.read()
    assert "libtorch" not in maps
    with open(f"/proc/{server.executor_pid()}/maps", encoding="utf-8") as fh:
        assert "libtorch" in fh.read()  # the check can see torch where it is
