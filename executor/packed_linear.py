"""oneDNN weight prepacking for the model's linear layers on CPU.

torch's plain `F.linear` in bf16 re-lays-out the weight for the AMX/AVX-512
kernels on every call; for decode-sized batches that costs as much as the
matmul itself. Prepacking once at load time (the same primitive inductor uses
when freezing a model) removes it. Modules are swapped, not rewritten: the
transformers model code runs unchanged.

At one to four rows (decode at small batch) a step streams every weight from
memory once, and native `skinny_linear` (AVX512-BF16 dot products over the
plain weight rows, the next rows prefetched) streams them about 25 % faster
than oneDNN's prepacked kernel: 13.0 vs 16.2 ms for all of SmolLM2's
projections at one row (`make bench-kernels`). Both layouts are kept; each step
reads only one of them.
"""

from __future__ import annotations

import structlog
import torch

_LOGGER = structlog.get_logger(__name__)

# Rows up to which `skinny_linear` beats the prepacked kernel (measured: equal at 6).
SKINNY_MAX_ROWS = 4


def _skinny_op():
    try:
        import native._fused as fused
    except ImportError:
        return None
    return fused.skinny_linear if fused.skinny_linear_supported() else None


class PackedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, batch_hint: int = 64) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        # Kept for state_dict and for the skinny path; shares storage with the model's tensor.
        self.weight = linear.weight
        self._skinny = _skinny_op() if w.dtype == torch.bfloat16 and w.is_contiguous() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self._skinny is not None and x2.shape[0] <= SKINNY_MAX_ROWS and x2.is_contiguous():
            out = self._skinny(x2, self.weight, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return out.reshape(*shape[:-1], self.out_features)


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_linears(model: torch.nn.Module, batch_hint: int = 64) -> int:
    """Replaces every nn.Linear of a bf16 CPU model by a PackedLinear; returns
    how many were replaced (0 when unsupported)."""
    p = next(model.parameters())
    if not supported(p.dtype, p.device):
        return 0
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is torch.nn.Linear]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(mod, batch_hint))
    _LOGGER.info("prepacked linear weights", layers=len(targets))
    return len(targets)
