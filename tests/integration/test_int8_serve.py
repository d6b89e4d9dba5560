"""`cbserve serve --quantization int8`: the router hands the flag to its
executor, which serves the projections as int8 weights; a request through
the server gets the tokens the int8 model gives in-process."""

from __future__ import annotations

import pytest
import torch

from executor import model_loader, model_source
from executor.runner import ModelRunner, greedy_generate
from tests.conftest import start_server
from tests.executor.helpers import avx512_bf16
from tests.integration.helpers import gen_request, stub, wait_idle

pytestmark = pytest.mark.skipif(not avx512_bf16(), reason="needs an AVX512-BF16 CPU")

SPEC = 'tiny:{"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}'


def test_serve_with_int8_weights():
    prompt = list(range(10, 40))
    runner = ModelRunner(
        model_loader.load_model(model_source.resolve(SPEC), torch.bfloat16, quantization="int8"), 16, 64
    )
    want = greedy_generate(runner, [prompt], 8)[0]
    server = start_server(SPEC, dtype="bfloat16", extra_args=["--quantization", "int8"])
    try:
        with server.channel() as ch:
            got = list(stub(ch).Complete(gen_request(prompt, max_new=8), timeout=60).token_ids)
        wait_idle(server)
        assert '"int8_layers": 14' in server.log()  # the executor quantized all 2 x 7 projections
    finally:
        server.stop()
    assert got == want
