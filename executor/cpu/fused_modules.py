"""Drop-in fused replacements for the Llama block's RMSNorm and MLP on CPU.

Like weight prepacking, these are module swaps: the transformers decoder
layer code runs unchanged and calls `self.input_layernorm(x)` and
`self.mlp(x)` as always. RMSNorm becomes one native pass per row instead of
seven ATen ops; the MLP computes gate and up with one prepacked matmul and
SiLU-and-mul in one native pass (on AMX CPUs, in the matmul's epilogue).
Rounding points follow the Hugging Face modules. Used for bf16 on CPUs with
AVX-512 bf16 only; fp32 keeps the stock modules (the parity tests run there).
"""

from __future__ import annotations

import structlog
import torch

from executor.cpu import packed_linear
from executor.cpu.packed_linear import PackedLinear, supported

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
    """down(silu(gate(x)) * up(x)) with [gate | up] packed into one matmul.

    On AMX-BF16 CPUs the gate|up projection and SiLU-and-mul are one native
    pass (`amx_linear_silu_mul`, weights packed by `amx_pack_gate_up`) that
    never writes the [T, 2I] projection, for any number of rows; bit-exact
    with the two-step path, and it keeps no plain copy of the fused weight.
    On other AVX512-BF16 CPUs the same pass is `avx512_linear_silu_mul` over
    the same packing.
    Over GGUF Q4_1 blocks, up to `Q4_ROWS_MAX_ROWS` rows, the same pass is
    `amx_q4_rows_linear` with its SiLU-and-mul epilogue (over a second copy
    of the blocks in its feature-major layout).
    Elsewhere: a PackedLinear over [gate | up], then `silu_and_mul`.
    """

    def __init__(self, mlp: torch.nn.Module, batch_hint: int = 64) -> None:
        super().__init__()
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.inter = gate.out_features
        w = torch.cat([_weight(gate), _weight(up)], 0)
        ops = _gate_up_silu_ops(w)
        self.gate_up: PackedLinear | None = None
        self.packed_rows = None
        if ops is None:
            fused = torch.nn.Linear(gate.in_features, 2 * self.inter, bias=False, dtype=gate.weight.dtype)
            with torch.no_grad():
                fused.weight.copy_(w)
            self.gate_up = PackedLinear(fused, batch_hint)
        else:
            pack, self._gate_up_silu = ops
            if packed_linear.amx_ops() is None:  # avx512_linear_silu_mul: bf16 tiles only
                self.packed_gate_up = pack(w)
            else:
                from executor.cpu.gguf_weights import blocks_of, packed_rows, packed_tiles

                # amx_pack_gate_up's row order: gate block j, then up block j (16 rows each).
                order = torch.arange(2 * self.inter).view(2, -1, 16).transpose(0, 1).reshape(-1)
                blocks = blocks_of(gate, up)
                if blocks is not None:
                    blocks = blocks.rows(order)
                self.packed_gate_up = packed_tiles(blocks, pack(w), "gate_up")
                self.packed_rows = packed_rows(blocks, w[order], "gate_up")
        del w
        self.down = down if isinstance(down, PackedLinear) else PackedLinear(down, batch_hint)
        self._op = _fused().silu_and_mul

    @property
    def kernel(self) -> str:
        """What computes silu(gate) * up: "amx_linear_silu_mul" (+ "-q4_1" / "-q8_0" over GGUF blocks),
        "avx512_linear_silu_mul" or "<gate_up kernel> + silu_and_mul"."""
        if self.gate_up is not None:
            return f"{self.gate_up.kernel} + silu_and_mul"
        from executor.cpu.gguf_weights import packed_kind

        kind = packed_kind(self.packed_gate_up)
        name = self._gate_up_silu.__name__
        return name if kind is None else f"{name}-{kind}"

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x), [..., I]."""
        if self.gate_up is not None:
            return self._op(self.gate_up(x))
        if x.dim() == 2:  # the lean forward's [T, H]
            if x.shape[0] <= packed_linear.Q4_ROWS_MAX_ROWS and self.packed_rows is not None:
                return _fused().amx_q4_rows_linear(x.contiguous(), self.packed_rows, 2 * self.inter, self.inter)
            return self._gate_up_silu(x.contiguous(), self.packed_gate_up, self.inter)
        out = self._gate_up_silu(x.reshape(-1, x.shape[-1]).contiguous(), self.packed_gate_up, self.inter)
        return out.reshape(*x.shape[:-1], self.inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(x))


def _gate_up_silu_ops(w: torch.Tensor):
    """(amx_pack_gate_up, the native gate|up + SiLU-and-mul pass) for the fused
    [2I, K] weight `w` (bf16, I a multiple of 16): amx_linear_silu_mul on
    AMX-BF16 CPUs, avx512_linear_silu_mul on other AVX512-BF16 CPUs; else None."""
    if w.dtype != torch.bfloat16 or (w.shape[0] // 2) % 16 != 0:
        return None
    if packed_linear.amx_ops() is not None:
        return _fused().amx_pack_gate_up, _fused().amx_linear_silu_mul
    if packed_linear.avx512_ops() is not None:
        return _fused().amx_pack_gate_up, _fused().avx512_linear_silu_mul
    return None


def _weight(linear: torch.nn.Module) -> torch.Tensor:
    return linear.weight.detach()


def fuse_llama_blocks(model: torch.nn.Module) -> int:
    """Swaps every decoder layer's norms and MLP; returns the layers changed.
    A norm is swapped only where the native one computes exactly what it
    does (Llama's rounding; not Gemma's 1 + weight, nor OLMo 2's fp32
    weight product), an MLP only where it is down(silu(gate) * up)."""
    p = next(model.parameters())
    if not supported(p.dtype, p.device) or not _is_llama_like(model):
        return 0
    layers = model.model.layers
    for layer in layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            fused = _fused_norm(getattr(layer, name, None))
            if fused is not None:
                setattr(layer, name, fused)
        if getattr(layer.mlp.act_fn, "__class__", None).__name__ in ("SiLUActivation", "SiLU"):
            layer.mlp = FusedMLP(layer.mlp)
    model.model.norm = _fused_norm(model.model.norm) or model.model.norm
    mlp = layers[0].mlp if len(layers) else None
    _LOGGER.info(
        "fused RMSNorm and MLP",
        layers=len(layers),
        norms=isinstance(model.model.norm, FusedRMSNorm),
        mlp_kernel=mlp.kernel if isinstance(mlp, FusedMLP) else "transformers",
    )
    return len(layers)


def _fused_norm(norm: torch.nn.Module | None) -> FusedRMSNorm | None:
    """The native RMSNorm in place of `norm`, where it gives exactly
    `norm`'s output: tried on rows of several scales at swap time, so a norm
    of another formula or rounding keeps its own module (None)."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    try:
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(8, weight.shape[0], generator=g) * torch.logspace(-2, 2, 8).unsqueeze(1)).to(weight.dtype)
        fused = FusedRMSNorm(norm)
        with torch.no_grad():
            return fused if torch.equal(fused(x), norm(x)) else None
    except (RuntimeError, TypeError):
        return None


def _is_llama_like(model: torch.nn.Module) -> bool:
    try:
        layer = model.model.layers[0]
        return all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")) and hasattr(
            layer, "post_attention_layernorm"
        )
    except (AttributeError, IndexError, TypeError):
        return False
