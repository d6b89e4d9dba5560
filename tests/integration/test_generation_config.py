"""A checkpoint's generation_config.json is served as its authors meant:
the end-of-sequence ids it adds to config.json's end generation (Llama 3's
<|eot_id|> lives only there), and its sampling values are the OpenAI API's
defaults for the fields a request leaves out, as vLLM does."""

from __future__ import annotations

import httpx
import pytest
import torch

from cbserve.v1 import generation_pb2 as gpb
from router.tokenizer import build_tiny_tokenizer
from tests.conftest import start_server
from tests.integration.helpers import gen_request, stub, wait_idle
from tests.small_configs import SMALL

PROMPT = [5, 6, 7, 8]
NEW = 12


def _greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small random Llama whose generation config ends on the fourth greedy
    token (config.json's own eos id is 2) and samples with top_k 1."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("generation-config")
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    with torch.no_grad():  # sharper than the near-uniform init, so greedy tokens are stable
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.eval()
    greedy = _greedy(model, PROMPT, NEW)
    stop_at = next(i for i in range(3, NEW) if greedy[i] not in greedy[:i] and greedy[i] != 2)
    model.generation_config = GenerationConfig(
        bos_token_id=1, eos_token_id=[2, greedy[stop_at]], do_sample=True, temperature=0.9, top_k=1
    )
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path, greedy, stop_at


@pytest.fixture(scope="module")
def server(checkpoint):
    s = start_server(str(checkpoint[0]))
    s.model = httpx.get(f"{s.http_url}/models", timeout=10).json()["data"][0]["id"]
    yield s
    s.stop()


def test_an_eos_id_of_the_generation_config_ends_generation(server, checkpoint):
    _, greedy, stop_at = checkpoint
    with server.channel() as ch:
        out = stub(ch).Complete(gen_request(PROMPT, max_new=NEW, ignore_eos=False), timeout=30)
        assert list(out.token_ids) == greedy[: stop_at + 1] and out.finish_reason == gpb.EOS
        # ignore_eos runs past it, on the same greedy tokens.
        out = stub(ch).Complete(gen_request(PROMPT, max_new=NEW, ignore_eos=True), timeout=30)
        assert list(out.token_ids) == greedy
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0}
    choice = httpx.post(f"{server.http_url}/completions", json=body, timeout=30).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    wait_idle(server)


def test_the_openai_api_samples_with_the_generation_configs_defaults(server):
    """top_k 1 from the generation config makes a request that names no
    top_k greedy whatever its seed; one that turns top_k off samples from
    the whole (nearly flat) distribution at the config's temperature. gRPC
    requests state their own sampling: its temperature 0 is greedy."""
    with server.channel() as ch:
        greedy = stub(ch).Complete(gen_request(PROMPT, max_new=NEW, ignore_eos=True), timeout=30).text

    def complete(**fields) -> str:
        body = {"model": server.model, "prompt": PROMPT, "max_tokens": NEW, "ignore_eos": True, **fields}
        r = httpx.post(f"{server.http_url}/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert [complete(seed=seed) for seed in (1, 2, 3)] == [greedy] * 3
    free = [complete(seed=seed, top_k=-1) for seed in (1, 2)]
    assert greedy not in free and free[0] != free[1]
    wait_idle(server)
