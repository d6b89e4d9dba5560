"""gguf_linear: GGUF blocks served as blocks on CPUs without AVX512-BF16
(AVX2 + FMA + F16C code, portable code elsewhere), in bf16 and in fp32 (what
`--dtype auto` serves on those CPUs).

- The kernel's products equal avx2_f32_linear's over the weights the blocks
  expand to, bit for bit (fp32: gguf-py's exact values; bf16: rounded once),
  for every type, row count and an odd last column block; the portable code
  equals the AVX2 code bit for bit.
- A model from a quantised file, run by the runner on the AVX2 path
  (CBSERVE_NATIVE_ISA=avx2 caps this CPU there, in a child process), gives
  the tokens and hidden states of the same file served expanded, with its
  weights at most 1.15x the file's tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import native._fused as fused
from executor.cpu.gguf_weights import BlockWeight
from tests.conftest import REPO
from tests.native.test_amx_blocks import _blocks

KINDS = ("q4_1", "q8_0", "q4_k", "q6_k")
AVX2 = fused.gguf_linear_avx2()


def _case(kind: str, n: int, seed: int) -> tuple[BlockWeight, torch.Tensor]:
    bw = _blocks(kind, n, 768 if kind.endswith("_k") else 576, seed=seed)
    return bw, bw.pack()


@pytest.mark.parametrize("kind", KINDS)
def test_expansion_is_the_files_values(kind):
    bw, packed = _case(kind, 1040, seed=3)
    w = bw.dequantize()  # gguf-py's fp32 values
    assert torch.equal(fused.gguf_dequant(packed, torch.float32), w)
    assert torch.equal(fused.gguf_dequant(packed, torch.bfloat16).view(torch.int16), w.bfloat16().view(torch.int16))
    ids = torch.tensor([0, 17, 1039, 5, 17])
    assert torch.equal(fused.gguf_embed(packed, ids, torch.float32), w[ids])
    assert torch.equal(
        fused.gguf_embed(packed, ids, torch.bfloat16).view(torch.int16), w[ids].bfloat16().view(torch.int16)
    )


@pytest.mark.skipif(not AVX2, reason="compares with avx2_f32_linear: needs an AVX2 CPU")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1024, 1040])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 8, 13, 16, 64])
def test_products_equal_avx2_f32_linear_over_the_expanded_weights(kind, n, m):
    bw, packed = _case(kind, n, seed=n + m)
    w = bw.dequantize()
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, w.shape[1], generator=g)
    bias = torch.randn(n, generator=g)
    for dtype in (torch.bfloat16, torch.float32):
        panels = fused.avx2_f32_pack_weight(w.to(dtype))
        for b in (None, bias.to(dtype)):
            got = fused.gguf_linear(x.to(dtype), packed, n, b)
            want = fused.avx2_f32_linear(x.to(dtype), panels, n, b)
            assert got.dtype == dtype and torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("kind", KINDS)
def test_products_match_fp32_matmul(kind):
    bw, packed = _case(kind, 48, seed=1)
    w = bw.dequantize()
    x = torch.randn(9, w.shape[1], generator=torch.Generator().manual_seed(2))
    want = x.double() @ w.double().T
    got = fused.gguf_linear(x, packed, 48, None)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_arguments_are_checked():
    packed = _blocks("q8_0", 32, 64, seed=0).pack()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        fused.gguf_linear(torch.randn(3, 40), packed, 32, None)
    with pytest.raises(RuntimeError, match=r"\[N/16, K/32"):
        fused.gguf_linear(torch.randn(3, 64), packed, 48, None)
    with pytest.raises(RuntimeError, match="uint8"):
        fused.gguf_linear(torch.randn(3, 64), packed[..., :300].contiguous(), 32, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fused.gguf_linear(torch.randn(3, 64).half(), packed, 32, None)
    with pytest.raises(RuntimeError, match="outside"):
        fused.gguf_embed(packed, torch.tensor([32]), torch.float32)


def _child(code: str, isa: str, args: tuple[str, ...] = (), **env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if k != "CBSERVE_NATIVE_ISA"}
    full.update(CBSERVE_NATIVE_ISA=isa, **env)
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, env=full, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_PRODUCTS = """
import json, torch, native._fused as f
from tests.executor.test_gguf_linear import KINDS, _case
out = {}
for kind in KINDS:
    bw, packed = _case(kind, 1040, seed=9)
    x = torch.randn(7, bw.shape[1], generator=torch.Generator().manual_seed(4))
    ys = [f.gguf_linear(x.to(t), packed, 1040, None).float() for t in (torch.float32, torch.bfloat16)]
    out[kind] = [y.view(torch.int32).sum().item() for y in ys] + [y.view(torch.int32)[:, ::97].tolist() for y in ys]
print(json.dumps({"avx2": f.gguf_linear_avx2(), "out": out}))
"""


@pytest.mark.skipif(not AVX2, reason="compares the portable code with the AVX2 code")
def test_portable_code_equals_the_avx2_code():
    generic, avx2 = _child(_PRODUCTS, "generic"), _child(_PRODUCTS, "avx2")
    assert not generic["avx2"] and avx2["avx2"]
    assert generic["out"] == avx2["out"]


# In the child: the same GGUF file served from its blocks and expanded
# (CBSERVE_GGUF_BLOCKS=0), tokens and hidden states compared bit for bit.
_SERVE = """
import json, sys, os, torch, gguf
from transformers import LlamaConfig, LlamaForCausalLM
from executor import model_loader, model_source
from executor.cpu.gguf_weights import BlockEmbedding
from executor.runner import ModelRunner
from tests.executor.helpers import greedy_with_hidden
from tests.integration.gguf_writer import write_gguf
from tests.small_configs import small

def serve(quant, embeddings, tied, dtype, tmp):
  os.environ.pop("CBSERVE_GGUF_BLOCKS", None)
  dtype = getattr(torch, dtype)
  torch.manual_seed(5)
  cfg = small(num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=272)
  cfg["tie_word_embeddings"] = tied == "1"
  os.makedirs(tmp, exist_ok=True)
  path = os.path.join(tmp, "tiny.gguf")
  write_gguf(LlamaForCausalLM(LlamaConfig(**cfg)).eval(), path, quant=quant, embeddings=embeddings)
  file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
  source = model_source.resolve(path)
  prompts = [list(range(5, 45)), [7, 8, 271]]
  runner = ModelRunner(model_loader.load_model(source, dtype), 16, 64)
  qkv = runner.lean.layers[0].qkv.__self__
  mlp = runner.model.model.layers[0].mlp
  facts = {
      "qkv": qkv.kernel, "gate_up": mlp.kernel, "down": mlp.down.kernel, "head": runner.model.lm_head.kernel,
      "embed_blocks": isinstance(runner.model.model.embed_tokens, BlockEmbedding),
      "shared_table": getattr(runner.model.model.embed_tokens, "packed", None) is runner.model.lm_head.packed,
      "ratio": runner.weight_bytes / file_bytes,
  }
  got = greedy_with_hidden(runner, prompts, 6)
  del runner
  os.environ["CBSERVE_GGUF_BLOCKS"] = "0"
  plain = ModelRunner(model_loader.load_model(source, dtype), 16, 64)
  facts["plain_qkv"] = plain.lean.layers[0].qkv.__self__.kernel
  facts["plain_ratio"] = plain.weight_bytes / file_bytes
  want = greedy_with_hidden(plain, prompts, 6)
  facts["tokens_equal"] = got[0] == want[0]
  facts["hidden_equal"] = len(got[1]) == len(want[1]) > 1 and all(  # bit for bit: as bytes
      torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got[1], want[1]))
  return facts

print(json.dumps({c[5]: serve(*c[:5]) for c in json.loads(sys.argv[1])}))
"""


AVX2_SERVED = [
    ("Q4_1", "Q8_0", True, "bfloat16"),
    ("Q4_K_M", "Q6_K", False, "bfloat16"),
    ("Q4_0", "Q8_0", True, "float32"),
    ("Q4_K_M", "Q6_K", False, "float32"),
]


@pytest.fixture(scope="module")
def avx2_served(tmp_path_factory):
    """Every case of AVX2_SERVED in one child process (one torch import
    instead of four), by case."""
    tmp = tmp_path_factory.mktemp("avx2-served")
    cases = [
        (q, e, "1" if t else "0", d, str(tmp / str(i)), "-".join(map(str, (q, e, t, d))))
        for i, (q, e, t, d) in enumerate(AVX2_SERVED)
    ]
    # TILES=0: as for a model of 1B and up (a small bf16 model keeps panels there);
    # FP32_PREPACK=1: fp32 as an AVX2-only CPU prepacks it under --dtype auto.
    return _child(
        _SERVE,
        "avx2",
        (json.dumps(cases),),
        CBSERVE_GGUF_TILES="0",
        CBSERVE_FP32_PREPACK="1",
        CBSERVE_CACHE_DIR=str(tmp / "cache"),
    )


@pytest.mark.skipif(not AVX2, reason="runs the AVX2 path: needs an AVX2 CPU")
@pytest.mark.parametrize("quant,embeddings,tied,dtype", AVX2_SERVED)
def test_a_quantised_file_is_served_from_its_blocks_on_the_avx2_path(avx2_served, quant, embeddings, tied, dtype):
    facts = avx2_served["-".join(map(str, (quant, embeddings, tied, dtype)))]
    if quant == "Q4_K_M":  # v (Q6_K) apart from q and k (Q4_K)
        assert facts["qkv"] == "gguf-q4_k | gguf-q4_k | gguf-q6_k"
        assert facts["gate_up"] == "gguf-q4_k + silu_and_mul" and facts["down"] == "gguf-q6_k"
    else:
        assert facts["qkv"] == "gguf-q4_1" and facts["gate_up"] == "gguf-q4_1 + silu_and_mul"
    assert facts["head"] == f"gguf-{embeddings.lower()}" and facts["embed_blocks"]
    assert facts["shared_table"] == tied
    assert facts["plain_qkv"] == "avx2_f32"
    assert facts["ratio"] <= 1.15, facts
    assert facts["plain_ratio"] > (2.5 if dtype == "bfloat16" else 5.0), facts
    assert facts["tokens_equal"] and facts["hidden_equal"], facts


_PORTABLE = """
import json, sys, os, torch
from transformers import LlamaConfig, LlamaForCausalLM
from executor import model_loader, model_source
from executor.runner import ModelRunner, greedy_generate
from tests.integration.gguf_writer import write_gguf
from tests.small_configs import small

torch.manual_seed(5)
path = os.path.join(sys.argv[1], "tiny.gguf")
cfg = small(num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=272)
write_gguf(LlamaForCausalLM(LlamaConfig(**cfg)).eval(), path, quant="Q4_K_M", embeddings="Q6_K")
source = model_source.resolve(path)
prompts = [list(range(5, 45)), [7, 8, 271]]
facts = {}
for blocks in ("", "1", "0"):
    os.environ["CBSERVE_GGUF_BLOCKS"] = blocks
    runner = ModelRunner(model_loader.load_model(source, torch.float32), 16, 64)
    facts[blocks] = {
        "q": runner.model.model.layers[0].self_attn.q_proj.kernel,
        "tokens": greedy_generate(runner, prompts, 6),
    }
    del runner
print(json.dumps(facts))
"""


@pytest.mark.skipif(not AVX2, reason="caps an x86 CPU to the portable code")
def test_portable_code_serves_blocks_only_when_asked(tmp_path):
    """Without AVX2 only the portable code reads blocks, several times slower
    than the expanded weights' kernels: the blocks are served there only
    with CBSERVE_GGUF_BLOCKS=1, and give the expanded model's tokens."""
    facts = _child(
        _PORTABLE, "generic", (str(tmp_path),), CBSERVE_FP32_PREPACK="1", CBSERVE_CACHE_DIR=str(tmp_path / "cache")
    )
    assert facts[""]["q"] == facts["0"]["q"] == "onednn"
    assert facts["1"]["q"] == "gguf-q4_k"
    assert facts["1"]["tokens"] == facts["0"]["tokens"] == facts[""]["tokens"]


_INT8 = """
import json, os, torch
from executor import model_loader, model_source
from executor.runner import ModelRunner
from tests.executor.helpers import greedy_with_hidden

source = model_source.resolve('tiny:{"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}')
prompts = [list(range(5, 45)), [7, 8, 9]]
facts, runs = {}, {}
for blocks in ("", "0"):
    os.environ["CBSERVE_GGUF_BLOCKS"] = blocks
    runner = ModelRunner(model_loader.load_model(source, torch.bfloat16, quantization="int8"), 16, 64)
    facts[blocks or "blocks"] = [runner.lean.layers[0].qkv.__self__.kernel, runner.weight_bytes]
    runs[blocks] = greedy_with_hidden(runner, prompts, 6)
    del runner
facts["tokens_equal"] = runs[""][0] == runs["0"][0]
pairs = zip(runs[""][1], runs["0"][1])
facts["hidden_equal"] = all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in pairs)
print(json.dumps(facts))
"""


@pytest.mark.skipif(not AVX2, reason="runs the AVX2 path: needs an AVX2 CPU")
def test_int8_weights_are_served_from_their_bytes_on_the_avx2_path():
    """`--quantization int8` in bf16 on an AVX2 CPU: its Q8_0 blocks through
    gguf_linear give the tokens and hidden states of the same int8 model's
    bf16 weights through avx2_f32_linear, in fewer bytes."""
    facts = _child(_INT8, "avx2")
    assert facts["blocks"][0] == "gguf-q8_0" and facts["0"][0] == "avx2_f32"
    assert facts["blocks"][1] < facts["0"][1]
    assert facts["tokens_equal"] and facts["hidden_equal"], facts
