"""prompt_logprobs through both APIs against the fp32 model's own
log-softmax, with the prompt prefilled in several chunks; such requests never
take prompt blocks from the prefix cache; bad values are refused by name."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
import torch

from tests.conftest import start_server
from tests.integration.helpers import gen_request, stub, wait_idle

PROMPT = [(7 * i) % 250 + 3 for i in range(90)]  # 90 tokens: three chunks of the 32-token budget


@pytest.fixture(scope="module")
def server():
    s = start_server("tiny", config={"scheduler": {"max_num_batched_tokens": 32, "max_num_seqs": 8}})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    from executor import model_loader, model_source

    model = model_loader.load_model(model_source.resolve("tiny"), torch.float32)
    with torch.no_grad():
        lps = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    return lps[:-1]  # row j predicts prompt token j + 1


def test_prompt_logprobs_equal_the_models_over_chunked_prefill(server, reference):
    req = gen_request(PROMPT, max_new=2, prompt_logprobs=3)
    with server.channel() as ch:
        r = stub(ch).Complete(req, timeout=60)
        again = stub(ch).Complete(req, timeout=60)
    assert len(r.prompt_logprobs) == len(PROMPT) - 1
    for j, e in enumerate(r.prompt_logprobs):
        row, tok = reference[j], PROMPT[j + 1]
        assert e.token_id == tok
        assert e.logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert e.rank == int((row > row[tok]).sum()) + 1
        want = row.topk(3)
        assert list(e.top_token_ids) == want.indices.tolist()
        assert list(e.top_logprobs) == pytest.approx(want.values.tolist(), abs=1e-4)
    # The same prompt again is computed again, not taken from the cache.
    assert again.usage.cached_prompt_tokens == 0
    assert [e.logprob for e in again.prompt_logprobs] == pytest.approx([e.logprob for e in r.prompt_logprobs], abs=1e-5)
    # Streamed: on the last message only.
    with server.channel() as ch:
        msgs = list(stub(ch).Generate(gen_request(PROMPT, max_new=3, prompt_logprobs=0)))
    assert [len(m.prompt_logprobs) for m in msgs] == [0] * (len(msgs) - 1) + [len(PROMPT) - 1]
    assert all(not e.top_token_ids for e in msgs[-1].prompt_logprobs)
    with server.channel() as ch, pytest.raises(grpc.RpcError) as err:
        stub(ch).Complete(gen_request(PROMPT, max_new=2, prompt_logprobs=21), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in err.value.details()
    wait_idle(server)


def test_prompt_logprobs_through_the_openai_api(server, reference):
    client = openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    c = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    plp = c.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT)
    for j, entry in enumerate(plp[1:]):
        tok = PROMPT[j + 1]
        assert entry[str(tok)]["logprob"] == pytest.approx(reference[j][tok].item(), abs=1e-4)
        assert entry[str(tok)]["rank"] >= 1 and len(entry) in (2, 3)  # the token, and its 2 best unless among them
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=2, temperature=0, stream=True, extra_body={"prompt_logprobs": 0}
    )
    last = [ch for ch in stream if ch.choices and ch.choices[0].finish_reason][-1]
    assert len(last.choices[0].model_extra["prompt_logprobs"]) == len(PROMPT)
    bad = httpx.post(f"{server.http_url}/completions", json={"model": model, "prompt": "x", "prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
    wait_idle(server)


def test_a_recomputed_prompt_keeps_its_prompt_logprobs(reference):
    # 12 blocks of 16 tokens: four 40-token prompts fit, their 60-token
    # outputs do not, so sequences are preempted and recomputed (their prompt
    # logprobs computed again, in place).
    small = start_server("tiny", config={"cache": {"num_blocks": 12, "block_size": 16}})
    prompt = PROMPT[:40]
    try:
        with small.channel() as ch:
            calls = [
                stub(ch).Complete.future(gen_request(prompt, max_new=60, prompt_logprobs=1), timeout=120)
                for _ in range(4)
            ]
            results = [c.result() for c in calls]
        want = [reference[j][prompt[j + 1]].item() for j in range(len(prompt) - 1)]
        for r in results:
            assert [e.logprob for e in r.prompt_logprobs] == pytest.approx(want, abs=1e-4)
        assert small.metrics()["cbserve_num_preemptions_total"] >= 1
        wait_idle(small)
    finally:
        small.stop()
