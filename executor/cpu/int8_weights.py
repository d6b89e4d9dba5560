"""`--quantization int8`: a bf16 checkpoint's projections as int8 weights
with one symmetric scale per output channel (W8A16), served by the same
block kernels as a GGUF file's Q8_0 layers.

Each row w of a projection becomes q = round(w / s), s = max|w| / 127 in
fp16, |q| <= 127; the model served is the one whose weights are bf16(s * q)
(the bf16 weight is replaced by it, so every path, the transformers layer
code included, computes the same model). Packed as Q8_0 blocks whose 32-wide
scales are all the row's s, the kernels expand them to exactly those bf16
values (executor/cpu/gguf_weights.py): 8.5 bits a weight against 16. The
embedding and the LM head stay bf16, as in vLLM's W8A16 schemes.
"""

from __future__ import annotations

import structlog
import torch

from executor.cpu.gguf_weights import BLOCK, BlockWeight

_LOGGER = structlog.get_logger(__name__)

METHODS = ("none", "int8")
# The projections quantized, by module name suffix (Llama-like decoder layers).
_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_rows(weight: torch.Tensor) -> BlockWeight:
    """The int8 form of a [N, K] weight (K a multiple of 32): per-row
    symmetric scales, as Q8_0 blocks that all carry their row's scale."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).half()
    # A scale that fp16 rounded down could put a weight at 128: clamp it.
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(scale.float()))
    q = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    d = scale[:, None].expand(-1, w.shape[1] // BLOCK).contiguous()
    return BlockWeight("q8_0", q, d, None)


def quantize(model: torch.nn.Module, attach: bool) -> int:
    """Replaces every decoder projection's bf16 weight by its int8
    expansion bf16(s * q) and, with `attach`, gives the module the blocks as
    `cbserve_blocks` (gguf_weights.attach's attribute) for the kernels to
    stream; returns how many projections were quantized."""
    n = 0
    for name, mod in model.named_modules():
        if not (isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in _TARGETS):
            continue
        if mod.weight.dtype != torch.bfloat16 or mod.in_features % BLOCK or mod.out_features % 16:
            continue
        bw = quantize_rows(mod.weight)
        with torch.no_grad():
            mod.weight.copy_(bw.dequantize().to(torch.bfloat16))
        if attach:
            mod.cbserve_blocks = bw
        n += 1
    return n
