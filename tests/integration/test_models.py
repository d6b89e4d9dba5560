"""Several models behind one router (`models:`): requests routed by name
through both APIs, each model with its own executor, scheduler and KV pool,
metrics labelled by model, and one executor's death touching only its own
model's requests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import psutil
import pytest
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cbserve.v1 import generation_pb2 as gpb
from router.config import ConfigError, config_from_dict
from router.tokenizer import build_tiny_tokenizer
from tests.conftest import REPO, start_server
from tests.integration.helpers import gen_request, stub, wait_idle
from tests.small_configs import SMALL

NEW = 10
PROMPTS = [[(7 * i + 3 * n) % 250 + 3 for i in range(n)] for n in (40, 9)]


def _checkpoint(path, arch: str):
    """A small random checkpoint of `arch` and its fp32 reference model."""
    import transformers

    cfg_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    }[arch]
    torch.manual_seed(1)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**SMALL))
    with torch.no_grad():  # sharper than the near-uniform init, so greedy tokens are stable
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return model.eval()


def _hf(model, prompt, new=NEW):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, min_new_tokens=new
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    refs = {"llama": _checkpoint(root / "llama", "llama"), "qwen": _checkpoint(root / "qwen", "qwen2")}
    config = {
        "scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 8},
        "models": [
            {"name": "llama", "model": str(root / "llama"), "dtype": "float32"},
            {
                "name": "qwen",
                "model": str(root / "qwen"),
                "dtype": "float32",
                "scheduler": {"policy": "sjf"},
                "cache": {"num_blocks": 200},
            },
        ],
    }
    # --model names neither: with `models:` the list decides.
    server = start_server("tiny", config=config, extra_args=["--executor-threads", "1"])
    yield server, root, refs
    server.stop()


def _executor_of(server, path) -> psutil.Process:
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        if str(path) in " ".join(child.cmdline()):
            return child
    raise AssertionError(f"no executor serving {path}")


def _health(channel, service: str) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_requests_go_to_the_model_they_name(two_models):
    server, _, refs = two_models
    want = {name: [_hf(ref, p) for p in PROMPTS] for name, ref in refs.items()}
    assert want["llama"] != want["qwen"]  # the models tell themselves apart
    with server.channel() as ch:
        s = stub(ch)
        info = s.ModelInfo(gpb.ModelInfoRequest(), timeout=10)
        assert info.model == "llama" and list(info.models) == ["llama", "qwen"]
        q = s.ModelInfo(gpb.ModelInfoRequest(model="qwen"), timeout=10)
        assert (q.model, q.policy, q.num_kv_blocks) == ("qwen", "sjf", 200)
        assert (info.policy, info.num_kv_blocks) == ("fcfs", 512)
        futures = [
            (name, s.Complete.future(gen_request(p, max_new=NEW, model=model), timeout=120))
            for name, model in (("llama", "llama"), ("qwen", "qwen"), ("llama", ""))
            for p in PROMPTS
        ]
        got: dict[str, list] = {"llama": [], "qwen": []}
        for name, f in futures:
            got[name].append(list(f.result().token_ids))
        assert got == {"llama": want["llama"] * 2, "qwen": want["qwen"]}
        with pytest.raises(grpc.RpcError) as err:
            s.Complete(gen_request(PROMPTS[1], model="gpt-4"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'llama', 'qwen'" in err.value.details()
        tok = s.Tokenize(gpb.TokenizeRequest(text="hi", model="qwen"), timeout=10)
        assert list(tok.token_ids)
        for service in ("", "llama", "qwen"):
            assert _health(ch, service) == health_pb2.HealthCheckResponse.SERVING
    wait_idle(server)
    ok = "cbserve_requests_total{finish_reason=LENGTH,status=OK}"
    assert server.metrics(model="qwen")[ok] == len(PROMPTS)
    assert server.metrics(model="llama")[ok] == 2 * len(PROMPTS)
    # A name served nowhere is counted on the default model.
    not_found = "cbserve_request_errors_total{status=NOT_FOUND}"
    assert server.metrics(model="llama")[not_found] == 1 and server.metrics(model="qwen").get(not_found, 0) == 0


def test_the_openai_api_lists_and_routes_by_model(two_models):
    openai = pytest.importorskip("openai")
    server, _, refs = two_models
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["llama", "qwen"]
    tok = build_tiny_tokenizer()
    for name in ("llama", "qwen"):
        out = client.completions.create(
            model=name, prompt=PROMPTS[0], max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.model == name
        assert out.choices[0].text == tok.decode(_hf(refs[name], PROMPTS[0]), skip_special_tokens=True)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)


def test_one_executor_dying_fails_only_its_own_models_requests(two_models):
    server, root, refs = two_models
    long_new = 300
    with server.channel() as ch:
        s = stub(ch)
        llama = s.Generate(gen_request(PROMPTS[0], max_new=long_new, model="llama"), timeout=300)
        qwen = s.Generate(gen_request(PROMPTS[0], max_new=long_new, model="qwen"), timeout=300)
        llama_tokens = list(next(llama).token_ids)
        next(qwen)  # both running
        victim = _executor_of(server, root / "qwen")
        victim.send_signal(signal.SIGSTOP)  # the qwen stream is surely in flight when it dies
        victim.kill()
        errors = []

        def drain_llama():
            try:
                for msg in llama:
                    llama_tokens.extend(msg.token_ids)
            except grpc.RpcError as exc:  # pragma: no cover - the failure the test looks for
                errors.append(exc)

        t = threading.Thread(target=drain_llama)
        t.start()
        with pytest.raises(grpc.RpcError) as err:
            for _ in qwen:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _health(ch, "") == health_pb2.HealthCheckResponse.SERVING  # the router serves on
        t.join(120)
        assert not errors and len(llama_tokens) == long_new
        # The same request again gives the same tokens: the stream never noticed.
        again = s.Complete(gen_request(PROMPTS[0], max_new=long_new, model="llama"), timeout=120)
        assert list(again.token_ids) == llama_tokens
        # `cbserve serve` restarts the dead executor; its model serves again.
        end = time.monotonic() + 120
        while _health(ch, "qwen") != health_pb2.HealthCheckResponse.SERVING and time.monotonic() < end:
            time.sleep(0.2)
        r = s.Complete(gen_request(PROMPTS[1], max_new=NEW, model="qwen"), timeout=120)
        assert list(r.token_ids) == _hf(refs["qwen"], PROMPTS[1])
    wait_idle(server)
    assert server.metrics(model="qwen")["cbserve_executor_reconnects_total"] == 1
    assert server.metrics(model="llama")["cbserve_executor_reconnects_total"] == 0


def test_model_list_errors_are_refused():
    with pytest.raises(ConfigError, match=r"models\[1\].name: 'a' is used twice"):
        config_from_dict({"models": [{"name": "a", "model": "tiny"}, {"name": "a", "model": "tiny"}]})
    with pytest.raises(ConfigError, match=r"models\[0\].model: required"):
        config_from_dict({"models": [{"name": "a"}]})
    with pytest.raises(ConfigError, match=r"models\[0\]: scheduler.policy"):
        config_from_dict({"models": [{"model": "tiny", "scheduler": {"policy": "lifo"}}]})
    cfg = config_from_dict(
        {"scheduler": {"max_num_seqs": 8}, "models": [{"model": "tiny", "scheduler": {"policy": "sjf"}}]}
    )
    assert cfg.models[0].name == "tiny-random-llama"


def test_router_alone_refuses_two_models_on_one_executor(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "a", "model": "tiny"}, {"name": "b", "model": "tiny"}]}))
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "router", "--config", str(path), "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert out.returncode == 2 and "both use executor.address" in out.stderr


def test_a_sharded_checkpoint_serves_as_one(tmp_path):
    """Sharded safetensors (an index and several files) load as one model:
    greedy tokens equal the in-memory model's."""
    model = _checkpoint(tmp_path, "llama")
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(tmp_path, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    server = start_server(str(tmp_path))
    try:
        with server.channel() as ch:
            for prompt in PROMPTS:
                out = stub(ch).Complete(gen_request(prompt, max_new=NEW), timeout=60)
                assert list(out.token_ids) == _hf(model, prompt)
        wait_idle(server)
    finally:
        server.stop()
