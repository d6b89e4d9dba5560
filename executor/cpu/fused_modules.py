"""Drop-in fused replacements for the Llama block's RMSNorm and MLP on CPU.

Like weight prepacking, these are module swaps: the transformers decoder
layer code runs unchanged and calls `self.input_layernorm(x)` and
`self.mlp(x)` as always. RMSNorm becomes one native pass per row instead of
seven ATen ops; the gated MLP (SiLU, or Gemma's GELU-tanh; gate and up as two
projections or Phi-3's one) computes gate and up with one prepacked matmul
and act-and-mul in one native pass (on AMX CPUs, in the matmul's epilogue).
Rounding points follow the Hugging Face modules. Used for bf16 where
`packed_linear.supported` (native bf16, or AVX2 over bf16 panels), and for
fp32 where its projections run `avx2_f32_linear` (`packed_linear.fp32_lean`);
elsewhere fp32 keeps the stock modules.
"""

from __future__ import annotations

import structlog
import torch

from executor.cpu import packed_linear
from executor.cpu.packed_linear import PackedLinear, fp32_lean, same_output, supported

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
    """down(act(gate(x)) * up(x)) with [gate | up] packed into one matmul,
    act SiLU or GELU-tanh (`activation`, see `mlp_activation`).

    On AMX-BF16 CPUs the gate|up projection and SiLU-and-mul are one native
    pass (`amx_linear_silu_mul`, weights packed by `amx_pack_gate_up`) that
    never writes the [T, 2I] projection, for any number of rows; bit-exact
    with the two-step path, and it keeps no plain copy of the fused weight.
    On other AVX512-BF16 CPUs the same pass is `avx512_linear_silu_mul` over
    the same packing.
    Over GGUF Q4_1 blocks, up to `Q4_ROWS_MAX_ROWS` rows, a SiLU MLP's pass
    is `amx_q4_rows_linear` with its SiLU-and-mul epilogue (over a second
    copy of the blocks in its feature-major layout), unless the blocks are
    held alone (gguf_weights.amx_alone).
    Elsewhere: a PackedLinear over [gate | up], then `silu_and_mul`.
    """

    def __init__(self, mlp: torch.nn.Module, batch_hint: int = 64, activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation
        projs = (mlp.gate_up_proj,) if hasattr(mlp, "gate_up_proj") else (mlp.gate_proj, mlp.up_proj)
        down = mlp.down_proj
        w = torch.cat([_weight(p) for p in projs], 0)  # [gate | up] rows (Phi-3's gate_up_proj already is)
        self.inter = w.shape[0] // 2
        ops = _gate_up_silu_ops(w)
        self.gate_up: PackedLinear | None = None
        self.packed_rows = None
        self.packed_blocks = None  # avx512_linear_silu_mul's GGUF blocks for few rows (no AMX)
        if ops is None:
            fused = torch.nn.Linear(w.shape[1], 2 * self.inter, bias=False, dtype=w.dtype)
            with torch.no_grad():
                fused.weight.copy_(w)
            from executor.cpu.gguf_weights import blocks_of

            blocks = blocks_of(*projs)  # [gate | up] rows, as w: gguf_linear's (CPUs without AVX512-BF16)
            if blocks is not None:
                fused.cbserve_blocks = blocks
            self.gate_up = PackedLinear(fused, batch_hint, keep_plain=False)
        else:
            from executor.cpu.gguf_weights import amx_alone, avx512_weights, blocks_of, packed_rows, packed_tiles

            pack, self._gate_up_silu = ops
            # amx_pack_gate_up's row order: gate block j, then up block j (16
            # rows each); both kernels read GGUF blocks in that order too.
            order = torch.arange(2 * self.inter).view(2, -1, 16).transpose(0, 1).reshape(-1)
            blocks = blocks_of(*projs)
            if blocks is not None:
                blocks = blocks.rows(order)
            if packed_linear.amx_ops() is None:  # avx512_linear_silu_mul: gguf_weights.avx512_weights
                self.packed_gate_up, self.packed_blocks = avx512_weights(blocks, pack(w), "gate_up")
            else:
                self.packed_gate_up = packed_tiles(blocks, pack(w), "gate_up")
                if activation == "silu" and not amx_alone(blocks, self.packed_gate_up):  # rows: SiLU's epilogue
                    self.packed_rows = packed_rows(blocks, w[order], "gate_up")
        del w
        self.down = down if isinstance(down, PackedLinear) else PackedLinear(down, batch_hint, keep_plain=False)
        self._op = _fused().silu_and_mul

    @property
    def kernel(self) -> str:
        """What computes act(gate) * up: "amx_linear_silu_mul" (+ "-q4_1" / "-q8_0" over GGUF blocks),
        "avx512_linear_silu_mul" ("+q4_1" / "+q8_0": over GGUF blocks for few rows; "-q4_k" etc.: over
        GGUF blocks alone)
        or "<gate_up kernel> + silu_and_mul"; "(gelu_tanh)" after it for GELU."""
        suffix = "" if self.activation == "silu" else f" ({self.activation})"
        if self.gate_up is not None:
            return f"{self.gate_up.kernel} + silu_and_mul{suffix}"
        from executor.cpu.gguf_weights import packed_kind

        kind = packed_kind(self.packed_gate_up)
        name = self._gate_up_silu.__name__
        if self.packed_blocks is not None:
            name += f"+{packed_kind(self.packed_blocks)}"
        return (name if kind is None else f"{name}-{kind}") + suffix

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x), [..., I]."""
        if self.gate_up is not None:
            return self._op(self.gate_up(x), self.activation)
        if x.dim() == 2:  # the lean forward's [T, H]
            if x.shape[0] <= packed_linear.Q4_ROWS_MAX_ROWS and self.packed_rows is not None:
                return _fused().amx_q4_rows_linear(x.contiguous(), self.packed_rows, 2 * self.inter, self.inter)
            packed = packed_linear.blocks_or_tiles(self.packed_gate_up, self.packed_blocks, x.shape[0])
            return self._gate_up_silu(x.contiguous(), packed, self.inter, self.activation)
        out = self._gate_up_silu(
            x.reshape(-1, x.shape[-1]).contiguous(), self.packed_gate_up, self.inter, self.activation
        )
        return out.reshape(*x.shape[:-1], self.inter)

    def projection(self, x: torch.Tensor) -> torch.Tensor:
        """The [T, 2I] gate|up projection of [T, H] rows, before the
        activation (a LoRA step adds its deltas there, executor/lora.py).
        Over amx_pack_gate_up's packing the linear kernel of the same tiles
        gives gate block j, up block j; the rows are put back in [gate | up]
        order. `activate` of it equals `act(x)` bit for bit."""
        if self.gate_up is not None:
            return self.gate_up(x)
        x = x.contiguous()
        n = 2 * self.inter
        amx = packed_linear.amx_ops()
        if amx is not None:
            gu = amx[1](x, self.packed_gate_up, n, None)
        else:
            packed = packed_linear.blocks_or_tiles(self.packed_gate_up, self.packed_blocks, x.shape[0])
            gu = packed_linear.avx512_ops()[1](x, packed, n, None)
        t = x.shape[0]
        return gu.view(t, self.inter // 16, 2, 16).transpose(1, 2).reshape(t, n)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of a [T, 2I] projection."""
        return self._op(gate_up, self.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(x))


class _Expert(torch.nn.Module):
    """One expert of a 3-D expert bank as the projections FusedMLP takes."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn: torch.nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(gate_up.shape[1], gate_up.shape[0], bias=False, dtype=gate_up.dtype)
        self.down_proj = torch.nn.Linear(down.shape[1], down.shape[0], bias=False, dtype=down.dtype)
        with torch.no_grad():
            self.gate_up_proj.weight.copy_(gate_up)
            self.down_proj.weight.copy_(down)
        self.act_fn = act_fn


class FusedExperts(torch.nn.Module):
    """A mixture-of-experts bank (Mixtral's, Qwen2-MoE's, Qwen3-MoE's
    `*Experts`: gate_up_proj [E, 2I, H] and down_proj [E, H, I] parameters)
    with each expert a FusedMLP: its gate|up and act-and-mul in one native
    pass, its down projection packed, instead of F.linear over an unpacked
    slice of the bank per call. Same interface and rounding points as the
    module it replaces: each expert's output times its routing weight, cast
    to the activations' dtype, added into the result expert by expert in
    increasing expert order."""

    def __init__(self, experts: torch.nn.Module, activation: str) -> None:
        super().__init__()
        self.num_experts = int(experts.num_experts)
        bank = zip(experts.gate_up_proj.detach(), experts.down_proj.detach())
        self.experts = torch.nn.ModuleList(
            FusedMLP(_Expert(gu, d, experts.act_fn), activation=activation) for gu, d in bank
        )
        self._calls = [(e.act, e.down.forward) for e in self.experts]

    @property
    def kernel(self) -> str:
        return self.experts[0].kernel

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, experts in order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = 0
        for e, n in enumerate(counts[: self.num_experts]):
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            token_idx, slot = pairs // k, pairs % k
            act, down = self._calls[e]
            h = down(act(hidden_states.index_select(0, token_idx)))
            h = h * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out


# Expert banks whose forward is Mixtral's loop (gate rows then up rows in
# gate_up_proj, no biases, each expert's output times its routing weight,
# added expert by expert): what FusedExperts reproduces. Others keep theirs.
_EXPERT_BANKS = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts")


def moe_experts(mlp: torch.nn.Module) -> torch.nn.Module | None:
    """The expert bank of a mixture-of-experts block in the layout
    FusedExperts takes, or None."""
    experts = getattr(mlp, "experts", None)
    if type(experts).__name__ not in _EXPERT_BANKS:
        return None
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3):
        return None
    if not hasattr(experts, "num_experts") or gu.shape[0] != experts.num_experts or down.shape[0] != gu.shape[0]:
        return None
    if gu.shape[1] != 2 * down.shape[2] or gu.shape[2] != down.shape[1]:
        return None
    return experts


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
    A norm is swapped only where the native one computes what it does
    (`same_output`: Llama's rounding; not Gemma's 1 + weight, nor in bf16
    OLMo 2's fp32 weight product), an MLP only where it is down(act(gate) * up) with an
    activation the native pass has (`mlp_activation`)."""
    p = next(model.parameters())
    if not (supported(p.dtype, p.device) or fp32_lean(p.dtype, p.device)) or not _is_llama_like(model):
        return 0
    layers = model.model.layers
    for layer in layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            fused = _fused_norm(getattr(layer, name, None))
            if fused is not None:
                setattr(layer, name, fused)
        activation = mlp_activation(layer.mlp)
        if activation is not None:
            layer.mlp = FusedMLP(layer.mlp, activation=activation)
        else:
            _fuse_moe(layer.mlp)
    model.model.norm = _fused_norm(model.model.norm) or model.model.norm
    mlp = layers[0].mlp if len(layers) else None
    experts = getattr(mlp, "experts", None)
    kernel = mlp if isinstance(mlp, FusedMLP) else experts if isinstance(experts, FusedExperts) else None
    _LOGGER.info(
        "fused RMSNorm and MLP",
        layers=len(layers),
        norms=isinstance(model.model.norm, FusedRMSNorm),
        mlp_kernel=kernel.kernel if kernel is not None else "transformers",
        experts=isinstance(experts, FusedExperts),
    )
    return len(layers)


def _fuse_moe(block: torch.nn.Module) -> None:
    """A mixture-of-experts block's expert bank as FusedExperts, and its
    shared expert (Qwen2-MoE's) as a FusedMLP, where their activation has
    the native pass."""
    experts = moe_experts(block)
    activation = _ACTIVATIONS.get(type(getattr(experts, "act_fn", None)).__name__)
    if experts is None or activation is None:
        return
    block.experts = FusedExperts(experts, activation)
    shared = getattr(block, "shared_expert", None)
    shared_act = mlp_activation(shared) if shared is not None else None
    if shared_act is not None:
        block.shared_expert = FusedMLP(shared, activation=shared_act)


def _fused_norm(norm: torch.nn.Module | None) -> FusedRMSNorm | None:
    """The native RMSNorm in place of `norm`, where it gives (`same_output`)
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
            return fused if same_output(fused(x), norm(x)) else None
    except (RuntimeError, TypeError):
        return None


# The activation modules whose act(gate) * up the native pass computes:
# transformers' SiLU (hidden_act "silu" / "swish") and GELU with the tanh
# approximation as torch computes it ("gelu_pytorch_tanh", Gemma's).
_ACTIVATIONS = {"SiLUActivation": "silu", "SiLU": "silu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh"}


def mlp_activation(mlp: torch.nn.Module) -> str | None:
    """ "silu" / "gelu_tanh" for a gated MLP the native pass computes (gate
    and up projections, or one gate_up projection, then down; no biases: the
    pass has none, and Llama's `mlp_bias` keeps the stock module), else None."""
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    names = ("gate_up_proj", "down_proj") if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj", "down_proj")
    projs = [getattr(mlp, n, None) for n in names]
    if act is None or any(getattr(p, "weight", None) is None or getattr(p, "bias", None) is not None for p in projs):
        return None
    return _ACTIVATIONS.get(type(act).__name__)


def _is_llama_like(model: torch.nn.Module) -> bool:
    try:
        layer = model.model.layers[0]
        mlp = layer.mlp
        return (mlp_activation(mlp) is not None or moe_experts(mlp) is not None) and hasattr(
            layer, "post_attention_layernorm"
        )
    except (AttributeError, IndexError, TypeError):
        return False
