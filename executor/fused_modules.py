"""Drop-in fused replacements for the Llama block's RMSNorm and MLP on CPU.

Like weight prepacking, these are module swaps: the transformers decoder
layer code runs unchanged and calls `self.input_layernorm(x)` and
`self.mlp(x)` as always. RMSNorm becomes one native pass per row instead of
seven ATen ops; the MLP computes gate and up with one prepacked matmul and
SiLU-and-mul in one native pass. Rounding points follow the Hugging Face
modules. Used for bf16 on CPUs with AVX-512 bf16 only; fp32 keeps the stock
modules (the parity tests run there).
"""

from __future__ import annotations

import structlog
import torch

from executor.packed_linear import PackedLinear, supported

_LOGGER = structlog.get_logger(__name__)


def _fused():
    import native._fused as fused

    return fused


class FusedRMSNorm(torch.nn.Module):
    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        self._op = _fused().rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x.contiguous(), self.weight, self.eps)


class FusedMLP(torch.nn.Module):
    """down(silu(gate(x)) * up(x)) with [gate | up] packed into one matmul."""

    def __init__(self, mlp: torch.nn.Module, batch_hint: int = 64) -> None:
        super().__init__()
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        fused = torch.nn.Linear(gate.in_features, gate.out_features + up.out_features, bias=False,
                                dtype=gate.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([_weight(gate), _weight(up)], 0))
        self.gate_up = PackedLinear(fused, batch_hint)
        self.down = down if isinstance(down, PackedLinear) else PackedLinear(down, batch_hint)
        self._op = _fused().silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self._op(self.gate_up(x)))


def _weight(linear: torch.nn.Module) -> torch.Tensor:
    return linear.weight.detach()


def fuse_llama_blocks(model: torch.nn.Module) -> int:
    """Swaps every decoder layer's norms and MLP; returns the layers changed."""
    p = next(model.parameters())
    if not supported(p.dtype, p.device) or not _is_llama_like(model):
        return 0
    layers = model.model.layers
    for layer in layers:
        layer.input_layernorm = FusedRMSNorm(layer.input_layernorm)
        layer.post_attention_layernorm = FusedRMSNorm(layer.post_attention_layernorm)
        if getattr(layer.mlp.act_fn, "__class__", None).__name__ in ("SiLUActivation", "SiLU"):
            layer.mlp = FusedMLP(layer.mlp)
    model.model.norm = FusedRMSNorm(model.model.norm)
    _LOGGER.info("fused RMSNorm and MLP", layers=len(layers))
    return len(layers)


def _is_llama_like(model: torch.nn.Module) -> bool:
    try:
        layer = model.model.layers[0]
        return all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")) and \
            hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm")
    except (AttributeError, IndexError, TypeError):
        return False
