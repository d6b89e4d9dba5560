"""`--model file.gguf`: a GGUF file by path, for two architectures, written in
the test; greedy tokens through the server equal the source model's."""

from __future__ import annotations

import pytest
import torch

from cbserve.v1 import generation_pb2 as gpb
from tests.conftest import start_server
from tests.integration.gguf_writer import write_gguf
from tests.integration.helpers import gen_request, stub, wait_idle
from tests.small_configs import small

NEW = 10


def _model(arch: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = small(num_hidden_layers=2, max_position_embeddings=512, head_dim=32)  # GGUF: hidden / heads
    torch.manual_seed(3)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common)).eval()  # q/k/v biases


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_file_by_path_serves_its_model(tmp_path, arch):
    model = _model(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(model, str(path))
    prompts = [[5, 6, 7, 8], list(range(10, 60))]
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                pad_token_id=0,
            )
        want.append(out[0, len(p) :].tolist())
    server = start_server(str(path), env={"CBSERVE_CACHE_DIR": str(tmp_path / "cache")})
    try:
        with server.channel() as ch:
            s = stub(ch)
            info = s.ModelInfo(gpb.ModelInfoRequest())
            assert info.model == f"tiny-{arch}" and info.max_context_length == 512
            got = [list(s.Complete(gen_request(p, max_new=NEW), timeout=60).token_ids) for p in prompts]
            assert s.Complete(gen_request(text="hello", max_new=2), timeout=60).usage.prompt_tokens == 5
        wait_idle(server)
    finally:
        server.stop()
    assert got == want
    assert any((tmp_path / "cache").iterdir())  # the dequantised checkpoint, kept per file
    _router_reads_the_converted_tokenizer(path, tmp_path / "cache")


def _router_reads_the_converted_tokenizer(path, cache):
    """Once the executor has converted the file, the router loads its
    tokenizer from the conversion, without torch, equal to transformers'
    own conversion of the GGUF file."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from tests.conftest import REPO

    text = "hello world, <s> 12 </s>"
    code = (
        "import json, sys; from router.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(path)!r}); "
        f"print(json.dumps([t.encode({text!r}), 'torch' in sys.modules]))"
    )
    env = {**os.environ, "CBSERVE_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    ids, torch_imported = json.loads(out.stdout.strip().splitlines()[-1])
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ids == ref(text, add_special_tokens=False)["input_ids"]
    assert not torch_imported


def test_a_gguf_type_without_a_kernel_is_refused_unless_a_dtype_expands_it(tmp_path, monkeypatch):
    """Q5_0 has no block kernel: under --dtype auto the executor refuses the
    file (exit 2, naming a tensor and its type) rather than expand it to bf16
    without a word; --dtype bfloat16 asks for the expansion and serves it."""
    import subprocess
    import sys

    from executor import model_loader, model_source
    from tests.conftest import REPO

    path = tmp_path / "tiny-q5.gguf"
    write_gguf(_model("llama"), str(path), quant="Q5_0")
    # The expansion below writes its converted checkpoint into the cache:
    # this test's own, not the developer's .cache.
    monkeypatch.setenv("CBSERVE_CACHE_DIR", str(tmp_path / "cache"))  # the executor below inherits it
    cmd = [sys.executable, "-m", "executor", "--model", str(path), "--device", "cpu"]
    out = subprocess.run(
        cmd + ["--listen", f"unix://{tmp_path}/e.sock"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-2000:]
    assert "tensor blk.0.attn_q.weight is Q5_0 (and 13 more tensors of types Q5_0)" in text
    assert "--dtype bfloat16" in text
    source = model_source.resolve(str(path))
    model_loader.check_gguf_types(model_source.resolve(str(_write(tmp_path, "Q4_K_M"))))  # the block types pass
    model = model_loader.load_model(source, torch.bfloat16)  # what --dtype bfloat16 loads
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert [p.name for p in (tmp_path / "cache").iterdir()], "the conversion went to another cache"


def _write(tmp_path, quant: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = small(num_hidden_layers=1, hidden_size=256, intermediate_size=512, max_position_embeddings=512)
    path = tmp_path / f"tiny-{quant}.gguf"
    write_gguf(LlamaForCausalLM(LlamaConfig(**cfg)), str(path), quant=quant)
    return path


def test_blocks_expanded_anyway_are_said_so(tmp_path, monkeypatch):
    """A served block type that ends up expanded (fp32 where fp32 is not
    prepacked, as on AVX512-BF16 CPUs; a GPU or CBSERVE_GGUF_BLOCKS=0 alike)
    is logged with the reason; a file with no blocks at all is not."""
    import structlog

    from executor import model_loader, model_source

    monkeypatch.setenv("CBSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CBSERVE_FP32_PREPACK", "0")  # as on AVX512-BF16 CPUs
    quantized, plain = _write(tmp_path, "Q4_1"), tmp_path / "fp32.gguf"
    write_gguf(_model("llama"), str(plain))
    for path, expect in ((quantized, ["float32 layers are not prepacked on this CPU"]), (plain, [])):
        with structlog.testing.capture_logs() as logs:
            model_loader.load_model(model_source.resolve(str(path)), torch.float32)
        said = [e["reason"] for e in logs if e["event"] == "GGUF weights expanded from their blocks"]
        assert said == expect, (path, logs)
