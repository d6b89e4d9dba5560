"""Multi-LoRA through a real server (tiny random Llama, random PEFT
adapters): requests choose adapters by `model` over gRPC and the `openai`
client and get PEFT's greedy tokens, six adapters share two slots under
concurrent load with nothing leaked, adapters load and unload at run time,
no prefix-cache block crosses adapters, and a bad adapter at start is exit 2."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import grpc
import httpx
import pytest
import torch

from cbserve.v1 import generation_pb2 as gpb
from executor import model_loader, model_source
from tests.conftest import start_server, wait_serving
from tests.integration.helpers import executor_held, gen_request, stub, wait_idle
from tests.integration.test_faults import _serve_refused
from tests.lora_adapters import make_adapter, peft_reference

PROMPT = [5, 9, 3, 17, 40, 9, 3, 17, 5, 9, 22, 41, 7, 60, 61, 62, 63, 64, 65, 66]  # more than one 16-token block
N_NEW = 6
NAMES = [f"a{i}" for i in range(6)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Six adapters of the tiny model (each its own seed, some only on some
    projections) and PEFT's greedy tokens for PROMPT under each and the base."""
    root = tmp_path_factory.mktemp("lora")
    base = model_loader.load_model(model_source.resolve("tiny"), torch.float32)
    targets = [None, ("q_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj"), None, ("o_proj",), None]
    paths, want = {}, {}
    for i, name in enumerate(NAMES):
        kw = {"targets": targets[i]} if targets[i] else {}
        paths[name] = make_adapter(base, str(root / name), seed=100 + i, **kw)
        want[name] = peft_reference(base, paths[name], PROMPT, N_NEW)[0]
    want[""] = peft_reference(base, None, PROMPT, N_NEW)[0]
    extra = make_adapter(base, str(root / "extra"), seed=200)
    want["extra"] = peft_reference(base, extra, PROMPT, N_NEW)[0]
    assert len({tuple(w) for w in want.values()}) >= 5, "the adapters should change the outputs"
    return paths, want, extra, root


@pytest.fixture(scope="module")
def server(adapters):
    paths, *_ = adapters
    cfg = {
        "lora": {
            "adapters": [{"name": n, "path": p} for n, p in paths.items()],
            "max_loras": 2,
            "allow_runtime_updates": True,
        },
        "scheduler": {"max_num_seqs": 8},
        "speculative": {"method": ""},
    }
    s = start_server("tiny", config=cfg)
    yield s
    s.stop()


def _generate(server, model: str, prompt=PROMPT, max_new: int = N_NEW) -> list[int]:
    with server.channel() as ch:
        r = stub(ch).Complete(gen_request(prompt, max_new=max_new, model=model), timeout=60)
    return list(r.token_ids)


def test_requests_choose_adapters_by_model_and_get_pefts_tokens(server, adapters):
    _, want, _, _ = adapters
    for name in ["", *NAMES]:
        assert _generate(server, name) == want[name], name
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0)
    listed = {m.id: m for m in client.models.list().data}
    assert set(NAMES) <= set(listed) and listed["a0"].parent == "tiny-random-llama"
    out = client.completions.create(model="a2", prompt=PROMPT, max_tokens=N_NEW, temperature=0, logprobs=0)
    assert out.model == "a2"
    with server.channel() as ch:
        info = stub(ch).ModelInfo(gpb.ModelInfoRequest())
    assert list(info.lora_adapters) == sorted(NAMES)
    grpc_text = None
    with server.channel() as ch:
        grpc_text = stub(ch).Complete(gen_request(PROMPT, max_new=N_NEW, model="a2")).text
    assert out.choices[0].text == grpc_text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)


def test_six_adapters_on_two_slots_under_concurrent_load(server, adapters):
    _, want, _, _ = adapters
    names = [*NAMES, "", *reversed(NAMES), "", *NAMES]
    results: dict[int, list[int] | str] = {}

    def one(i: int, name: str) -> None:
        try:
            results[i] = _generate(server, name)
        except grpc.RpcError as exc:
            results[i] = f"{exc.code()}: {exc.details()}"

    threads = [threading.Thread(target=one, args=(i, n)) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {i: results.get(i) for i in range(len(names))} == {i: want[n] for i, n in enumerate(names)}
    wait_idle(server)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    gauge = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(gauge) == 1 and 'max_lora="2"' in gauge[0] and 'running_lora_adapters=""' in gauge[0], gauge


def test_no_prefix_cache_block_is_shared_across_adapters(server):
    prompt = [p + 1 for p in PROMPT]  # not computed by earlier tests
    hits = "cbserve_prefix_cache_hits_total"
    before = server.metrics()[hits]
    first = {name: _generate(server, name, prompt) for name in ("a3", "a5", "")}
    assert server.metrics()[hits] == before, "a prompt block computed under one adapter served another"
    assert len(set(map(tuple, first.values()))) == 3
    assert _generate(server, "a3", prompt) == first["a3"]  # the same adapter again: its own blocks
    assert server.metrics()[hits] > before


def test_adapters_load_and_unload_at_run_time(server, adapters, tmp_path):
    _, want, extra, root = adapters
    base_url = f"http://127.0.0.1:{server.http_port}/v1"
    r = httpx.post(f"{base_url}/load_lora_adapter", json={"lora_name": "extra", "lora_path": extra})
    assert r.status_code == 200 and "added" in r.text
    assert _generate(server, "extra") == want["extra"]
    r = httpx.post(f"{base_url}/load_lora_adapter", json={"lora_name": "extra", "lora_path": extra})
    assert r.status_code == 400 and "already" in r.json()["error"]["message"]
    r = httpx.post(f"{base_url}/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "none")})
    assert r.status_code == 400 and "not a directory" in r.json()["error"]["message"]
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 999, "lora_alpha": 8}')
    with server.channel() as ch, pytest.raises(grpc.RpcError) as err:
        stub(ch).LoadLoraAdapter(gpb.LoraAdapterRequest(lora_name="big", lora_path=str(tmp_path / "cfg")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_lora_rank" in err.value.details()
    r = httpx.post(f"{base_url}/unload_lora_adapter", json={"lora_name": "extra"})
    assert r.status_code == 200 and "removed" in r.text
    with server.channel() as ch, pytest.raises(grpc.RpcError) as err:
        stub(ch).Complete(gen_request(PROMPT, max_new=2, model="extra"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    r = httpx.post(f"{base_url}/unload_lora_adapter", json={"lora_name": "extra"})
    assert r.status_code == 404
    # In use: refused while a request of it runs.
    done = threading.Event()

    def long_one() -> None:
        try:
            _generate(server, "a1", max_new=400)
        finally:
            done.set()

    t = threading.Thread(target=long_one)
    t.start()
    for _ in range(200):
        if server.metrics().get("cbserve_num_requests_running"):
            break
        done.wait(0.05)
    with executor_held(server):  # it cannot end while the unload is asked for
        assert not done.is_set()
        r = httpx.post(f"{base_url}/unload_lora_adapter", json={"lora_name": "a1"})
    t.join(120)
    assert r.status_code == 409 and "in use" in r.json()["error"]["message"]
    assert _generate(server, "a1") == want["a1"]
    wait_idle(server)


def test_a_restarted_executor_gets_every_adapter_again(server, adapters):
    """SIGKILL the executor: the supervisor starts a new one, the router
    registers the adapters with it and starts its slots afresh."""
    _, want, _, _ = adapters
    before = server.metrics()["cbserve_executor_reconnects_total"]
    os.kill(server.executor_pid(), signal.SIGKILL)
    end = time.monotonic() + 60
    while server.metrics()["cbserve_executor_reconnects_total"] <= before and time.monotonic() < end:
        time.sleep(0.1)
    wait_serving(server.address, 60)
    for name in ("a4", "a0", ""):
        assert _generate(server, name) == want[name], name
    wait_idle(server)


def test_runtime_updates_are_off_by_default(tiny_server, adapters):
    paths, *_ = adapters
    url = f"http://127.0.0.1:{tiny_server.http_port}/v1/load_lora_adapter"
    r = httpx.post(url, json={"lora_name": "x", "lora_path": paths["a0"]})
    assert r.status_code == 404 and "allow_runtime_updates" in r.json()["error"]["message"]
    with tiny_server.channel() as ch, pytest.raises(grpc.RpcError) as err:
        stub(ch).LoadLoraAdapter(gpb.LoraAdapterRequest(lora_name="x", lora_path=paths["a0"]))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    text = urllib.request.urlopen(f"http://127.0.0.1:{tiny_server.metrics_port}/metrics").read().decode()
    assert 'vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""}' in text


def test_a_bad_adapter_at_start_is_exit_2(adapters, tmp_path):
    paths, *_ = adapters
    log = _serve_refused("--lora-modules", f"ok={paths['a0']}", f"bad={tmp_path / 'nothing'}")
    assert "lora adapter 'bad'" in log and "not a directory" in log
