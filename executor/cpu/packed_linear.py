"""Weight prepacking for the model's linear layers on CPU.

torch's plain `F.linear` in bf16 re-lays-out the weight for the AMX/AVX-512
kernels on every call; for decode-sized batches that costs as much as the
matmul itself. Packing once at load time removes it. Modules are swapped, not
rewritten: the transformers model code runs unchanged.

Which kernel runs, by CPU and rows of x (`make bench-kernels` measures them;
the numbers behind each choice are in docs/native.md, "Linear layers"):
- AMX-BF16 CPUs (Sapphire Rapids and later): native `amx_linear` over weights
  packed into its tile layout, up to `AMX_MAX_ROWS` rows: a decode step
  streams every weight from memory once, and this kernel streams them faster
  than oneDNN's prepacked kernel. A GGUF Q4_1 layer also keeps its blocks in
  the feature-major layout of `amx_q4_rows_linear`, which expands them more
  cheaply and runs up to `Q4_ROWS_MAX_ROWS` rows, at the cost of a second copy
  of the 4-bit blocks. Above `AMX_MAX_ROWS` (long prefill chunks), plain
  `F.linear`, which beats both there; no oneDNN copy of the weights is kept.
  (FusedMLP packs its gate|up projection itself, for the SiLU-and-mul
  epilogue of `amx_linear_silu_mul`.)
- Other AVX512-BF16 CPUs (AMD Zen 4, Intel Cooper Lake): native
  `avx512_linear` (VDPBF16PS dot products) over the same tile layout, for
  any number of rows; no oneDNN copy of the weights is kept.
- Any other bf16 layer: `avx2_f32_linear` over bf16 panels where AVX2 + FMA
  run it (below), oneDNN's prepacked kernel otherwise.
- A GGUF layer on CPUs without AVX512-BF16 (fp32, or bf16 of a model of 1B
  and up): native `gguf_linear` over its blocks, for any number of rows
  (`gguf_weights.gguf_linear_weights`; docs/quantization.md).
- fp32 on CPUs without AVX512-BF16 (where `--dtype auto` serves fp32):
  native `avx2_f32_linear` over weights packed into panels of 16 features,
  for any number of rows; it streams the weights of a decode step faster than
  oneDNN's prepacked fp32 kernel, which in turn ran these projections about
  twice as fast as the MKL sgemm behind plain `F.linear` on an AVX2 AMD Zen 3
  (docs/native.md). bf16 on those CPUs (`--dtype bfloat16`) runs the same
  kernel over bf16 panels: fp32 sums, the output rounded once to bf16, the
  weights held and streamed at half the bytes. `CBSERVE_FP32_LINEAR=onednn`
  takes oneDNN's kernel instead for both. CPUs with AVX512-BF16 keep plain
  `F.linear` for fp32 (the parity runs), and `CBSERVE_FP32_PREPACK=0` / `1`
  turns fp32 packing off / on anywhere. Where fp32 or bf16 runs
  `avx2_f32_linear`, it also runs the fused modules and the lean forward
  (`fp32_lean`, `supported`).
"""

from __future__ import annotations

import os
from collections import Counter

import structlog
import torch

_LOGGER = structlog.get_logger(__name__)

# Rows up to which `amx_linear` beats plain F.linear (the crossover sits a
# little above; docs/native.md).
AMX_MAX_ROWS = 320
# Rows up to which GGUF Q4_1 layers run `amx_q4_rows_linear` over their
# second, feature-major copy of the blocks. It takes any number of rows and
# beats amx_linear kernel against kernel, but in a whole decode step only up
# to about here (docs/native.md).
Q4_ROWS_MAX_ROWS = 32
# Rows up to which, on AVX512-BF16 CPUs without AMX, a small model's GGUF
# layers (those that keep bf16 tiles beside their blocks) run `avx512_linear`
# over their blocks rather than the tiles: Q4_1 blocks are 5/16 of the bytes,
# and under int8 activations (gguf_weights.block_activations) Q8_0 blocks too
# beat the tiles up to about here, kernel against kernel (docs/native-cpu.md).
# Under bf16 activations Q8_0 blocks expand slower than the tiles stream at
# any row count, so Q8_0 layers keep the tiles alone.
AVX512_BLOCKS_MAX_ROWS = 4


def blocks_or_tiles(tiles: torch.Tensor, blocks: torch.Tensor | None, rows: int) -> torch.Tensor:
    """What avx512_linear (and its gate|up twin) reads for `rows` rows: a
    layer's small-batch blocks up to AVX512_BLOCKS_MAX_ROWS, else its bf16 tiles."""
    return blocks if blocks is not None and rows <= AVX512_BLOCKS_MAX_ROWS else tiles


def _fused():
    try:
        import native._fused as fused
    except ImportError:
        return None
    return fused


def avx512_ops():
    """(pack, linear) of native avx512_linear (over amx_pack_weight's layout), or
    None where the CPU has no AVX512-BF16 or has AMX (amx_ops() then)."""
    fused = _fused()
    if fused is None or not fused.avx512_linear_supported() or amx_ops() is not None:
        return None
    return fused.amx_pack_weight, fused.avx512_linear


def avx2_f32_ops():
    """(pack, linear) of native avx2_f32_linear for fp32 layers, or None where
    the CPU has no AVX2 + FMA or CBSERVE_FP32_LINEAR=onednn asks for oneDNN."""
    fused = _fused()
    if fused is None or not fused.avx2_f32_linear_supported():
        return None
    if os.environ.get("CBSERVE_FP32_LINEAR", "").strip() == "onednn":
        return None
    return fused.avx2_f32_pack_weight, fused.avx2_f32_linear


def amx_ops():
    """(pack, linear) of native amx_linear, or None where the CPU has no AMX-BF16."""
    fused = _fused()
    if fused is None or not fused.amx_linear_supported():
        return None
    return fused.amx_pack_weight, fused.amx_linear


class PackedLinear(torch.nn.Module):
    """`linear` over prepacked weights. An fp32 layer, or a bf16 one on
    `avx2_f32_linear` (one kernel at every row count), never reads the plain
    weight again and keeps only its shape and dtype (a meta tensor), so the
    weights are not held twice (a weight another module shares, a tied LM
    head's embedding, lives on there)."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int = 64, keep_plain: bool = True) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        # Kept for state_dict and for the plain paths; shares storage with the model's tensor.
        self.weight = linear.weight
        plain_bf16 = w.dtype == torch.bfloat16 and w.is_contiguous()
        amx = amx_ops() if plain_bf16 else None
        avx512 = avx512_ops() if plain_bf16 and amx is None else None
        self._amx = None
        self._avx512 = None
        self._avx2_f32 = None
        self._gguf = None  # gguf_linear over GGUF blocks (CPUs without AVX512-BF16)
        self._amx_argmax = None
        self._amx_alone = False  # amx_linear over GGUF blocks alone, at every row count (gguf_weights.amx_alone)
        self.packed_rows = None
        self.packed_blocks = None  # avx512_linear's GGUF blocks for <= AVX512_BLOCKS_MAX_ROWS rows
        if amx is not None:
            from executor.cpu.gguf_weights import amx_alone, blocks_of, packed_rows, packed_tiles

            pack, self._amx = amx
            # A GGUF layer's 4/8-bit blocks where they expand to exactly these
            # weights; kept for the lean forward's fused q|k|v (fast_forward.py).
            self.cbserve_blocks = blocks_of(linear)
            self.packed = packed_tiles(self.cbserve_blocks, pack(w), "linear")
            self._amx_alone = amx_alone(self.cbserve_blocks, self.packed)
            if self.bias is None and not self._amx_alone:
                self.packed_rows = packed_rows(self.cbserve_blocks, w, "linear")
            self._amx_argmax = _fused().amx_linear_argmax  # amx_ops() checked the CPU
            if self._amx_alone and not keep_plain:  # amx_linear takes every row count: the blocks are the weight
                del self.weight
                self.weight = torch.empty(w.shape, dtype=w.dtype, device="meta")
        elif avx512 is not None:
            from executor.cpu.gguf_weights import avx512_weights, blocks_of

            pack, self._avx512 = avx512
            self.cbserve_blocks = blocks_of(linear)  # as on AMX: kept for the fused q|k|v
            self.packed, self.packed_blocks = avx512_weights(self.cbserve_blocks, pack(w), "linear")
            if not keep_plain:  # avx512_linear takes any row count: the tiles (or blocks) are the weight
                del self.weight
                self.weight = torch.empty(w.shape, dtype=w.dtype, device="meta")
        else:
            from executor.cpu.gguf_weights import blocks_of, gguf_linear_weights

            avx2 = avx2_f32_ops() if w.dtype in (torch.float32, torch.bfloat16) else None
            self.cbserve_blocks = blocks_of(linear)  # as on AMX: kept for the fused q|k|v
            blocks = gguf_linear_weights(self.cbserve_blocks, w, "linear")
            if blocks is not None:
                self._gguf = _fused().gguf_linear
                self.packed = blocks
                if not keep_plain:  # gguf_linear takes any row count: the blocks are the weight
                    del self.weight
                    self.weight = torch.empty(w.shape, dtype=w.dtype, device="meta")
            elif avx2 is not None:
                pack, self._avx2_f32 = avx2
                self.packed = pack(w)
            else:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), batch_hint)
            if self._gguf is None and (w.dtype == torch.float32 or self._avx2_f32 is not None):
                del self.weight  # a plain attribute, not a parameter: out of state_dict and parameters()
                self.weight = torch.empty(w.shape, dtype=w.dtype, device="meta")

    @property
    def kernel(self) -> str:
        """Which kernel family runs: "amx" ("amx-q4_1" / "amx-q8_0" over GGUF
        blocks), "avx512" ("avx512+q4_1" / "+q8_0": also over GGUF blocks for small
        batches; "avx512-q4_1" etc.: over GGUF blocks alone), "gguf-q4_1" etc. (gguf_linear over
        GGUF blocks, CPUs without AVX512-BF16), "avx2_f32" or "onednn"."""
        if self._amx is not None:
            from executor.cpu.gguf_weights import packed_kind

            kind = packed_kind(self.packed)
            return "amx" if kind is None else f"amx-{kind}"
        if self._avx512 is not None:
            from executor.cpu.gguf_weights import packed_kind

            kind = packed_kind(self.packed)
            if kind is not None:
                return f"avx512-{kind}"
            if self.packed_blocks is None:
                return "avx512"
            return f"avx512+{packed_kind(self.packed_blocks)}"
        if self._gguf is not None:
            from executor.cpu.gguf_weights import packed_kind

            return f"gguf-{packed_kind(self.packed)}"
        if self._avx2_f32 is not None:
            return "avx2_f32"
        return "onednn"

    def kernel_for(self, rows: int) -> str:
        """The kernel forward() runs for `rows` rows of (contiguous) input."""
        if self._amx is not None:
            if rows <= Q4_ROWS_MAX_ROWS and self.packed_rows is not None:
                return "amx_q4_rows_linear"
            return "amx_linear" if rows <= AMX_MAX_ROWS or self._amx_alone else "F.linear"
        if self._avx512 is not None:
            from executor.cpu.gguf_weights import packed_kind

            kind = packed_kind(blocks_or_tiles(self.packed, self.packed_blocks, rows))
            return "avx512_linear" if kind is None else f"avx512_linear-{kind}"
        if self._gguf is not None:
            return "gguf_linear"
        if self._avx2_f32 is not None:
            return "avx2_f32_linear"
        return "oneDNN prepacked"

    def plain_weight(self) -> torch.Tensor:
        """The [out_features, in_features] weight: the model's tensor, or for
        a layer that dropped it, a copy unpacked from the avx2_f32 panels
        (exact: packing only moves values)."""
        if self.weight.device.type != "meta":
            return self.weight.detach()
        if self._avx512 is not None or self._amx is not None:
            # bf16 tiles [N/16, K/32, 16 k-pairs, 16 n, 2], or blocks expanding to them
            tiles = self.packed if self.packed.dtype == torch.bfloat16 else _fused().amx_dequant(self.packed)
            nb, kb = tiles.shape[:2]
            rows = tiles.permute(0, 3, 1, 2, 4).reshape(nb * 16, kb * 32)
            return rows[: self.out_features, : self.in_features].clone()
        if self._gguf is not None:
            w = _fused().gguf_dequant(self.packed, self.weight.dtype)
            return w[: self.out_features, : self.in_features].clone()
        if self._avx2_f32 is None:
            raise ValueError("the plain weight of a oneDNN-packed fp32 layer is gone")
        panels = self.packed.shape[0]
        return self.packed.permute(0, 2, 1).reshape(panels * self.packed.shape[2], -1)[: self.out_features].clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the lean forward's [T, H]: no reshapes on the per-step path
        x2 = x if flat else x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        if self._amx is not None:
            if rows <= Q4_ROWS_MAX_ROWS and self.packed_rows is not None:
                out = _fused().amx_q4_rows_linear(x2.contiguous(), self.packed_rows, self.out_features)
            elif rows <= AMX_MAX_ROWS or self._amx_alone:
                out = self._amx(x2.contiguous(), self.packed, self.out_features, self.bias)
            else:
                out = torch.nn.functional.linear(x2, self.weight, self.bias)
        elif self._avx512 is not None:
            packed = blocks_or_tiles(self.packed, self.packed_blocks, rows)
            out = self._avx512(x2.contiguous(), packed, self.out_features, self.bias)
        elif self._gguf is not None:
            out = self._gguf(x2.contiguous(), self.packed, self.out_features, self.bias)
        elif self._avx2_f32 is not None:
            out = self._avx2_f32(x2.contiguous(), self.packed, self.out_features, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return out if flat else out.reshape(*x.shape[:-1], self.out_features)

    def greedy_argmax(self, x: torch.Tensor) -> list[int] | None:
        """argmax(forward(x), -1) without writing the [rows, out_features]
        output (the greedy LM head: 64 x 49152 logits are 6.3 MB), where the
        amx kernel runs these rows; None elsewhere."""
        if self._amx_argmax is None or x.dim() != 2 or x.shape[0] > AMX_MAX_ROWS:
            return None
        return self._amx_argmax(x.contiguous(), self.packed, self.out_features, self.bias).tolist()


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bf16 runs the packed kernels, the fused modules and the lean
    forward here: natively (oneDNN computes bf16), or on AVX2 CPUs without it
    through `avx2_f32_linear` (bf16 weights and activations, fp32 sums; see
    `avx2_bf16`)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    return native_bf16() or avx2_bf16()


def native_bf16() -> bool:
    """Whether oneDNN computes bf16 on this CPU (AVX-512 and later)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def avx2_bf16() -> bool:
    """Whether bf16 layers run `avx2_f32_linear` on this CPU: one without
    AVX512-BF16 (or with the native ISA capped below it) where AVX2 + FMA run
    it, unless CBSERVE_FP32_LINEAR=onednn. Around it: act(gate) * up on 8
    AVX2 lanes, norms and rotary in the native passes' portable loops (all
    rounding as the model's code does), and the AVX2 attention kernels, which
    read bf16 K/V."""
    return avx512_ops() is None and amx_ops() is None and avx2_f32_ops() is not None


def fp32_lean(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an fp32 model runs the fused modules and the lean forward as
    bf16 does where bf16 is native: on CPUs where its linears run
    `avx2_f32_linear` (`CBSERVE_FP32_LEAN=0` keeps the transformers layer code
    around them). The native element-wise passes then differ from torch's in
    the order of their fp32 sums only (a few ulp), as the projections do."""
    if device.type != "cpu" or dtype != torch.float32 or os.environ.get("CBSERVE_FP32_LEAN", "").strip() == "0":
        return False
    return fp32_prepacked() and avx2_f32_ops() is not None


def same_output(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether a native pass reproduces a module on probe rows: bit for bit in
    bf16 / fp16, where the rounding points are the model's; in fp32 within a
    few ulp (the order of the sums differs), far tighter than any other
    formula would come."""
    if got.dtype != torch.float32:
        return torch.equal(got, want)
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=0.0)


def fp32_prepacked() -> bool:
    """Whether fp32 linears run oneDNN's prepacked kernel (see the module's
    docstring): on CPUs without native bf16, unless CBSERVE_FP32_PREPACK says."""
    switch = os.environ.get("CBSERVE_FP32_PREPACK", "").strip()
    if switch in ("0", "1"):
        return switch == "1" and torch.backends.mkldnn.is_available()
    from executor.cpu.isa import cpu_has_native_bf16

    return torch.backends.mkldnn.is_available() and not cpu_has_native_bf16()


def prepacked(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prepack_linears packs a model of this dtype on this device:
    bf16 where `supported`, fp32 where `fp32_prepacked`."""
    if supported(dtype, device):
        return True
    return device.type == "cpu" and dtype == torch.float32 and fp32_prepacked()


def prepack_linears(model: torch.nn.Module, batch_hint: int = 64) -> int:
    """Replaces every nn.Linear of a bf16 CPU model (or an fp32 one where
    `fp32_prepacked`) by a PackedLinear; returns how many were replaced (0
    when unsupported)."""
    p = next(model.parameters())
    if not prepacked(p.dtype, p.device):
        return 0
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is torch.nn.Linear]
    # A weight that only its Linear holds is not kept plain beside the tiles
    # where the packed kernel takes every row count (avx512_linear); a tied
    # LM head's weight is the embedding's and stays.
    holders = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    kernels = set()
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        packed = PackedLinear(mod, batch_hint, keep_plain=holders[mod.weight.data_ptr()] > 1)
        kernels.add(packed.kernel)
        setattr(parent, child, packed)
    _LOGGER.info("prepacked linear weights", layers=len(targets), kernels=sorted(kernels))
    return len(targets)


def embed_from_blocks(model: torch.nn.Module) -> bool:
    """Serves a GGUF model's embedding from its blocks (BlockEmbedding)
    where its linears are served from theirs alone (a model that keeps no
    bf16 tiles, gguf_weights.keep_tiles): the tied LM head's packed blocks
    where it has them (its plain weight, the table, is then dropped), else
    the embedding's own. Returns whether it did."""
    from executor.cpu.gguf_weights import BlockEmbedding, enabled, gguf_linear_weights, packed_kind, packed_tiles

    inner = getattr(model, "model", None)
    emb = getattr(inner, "embed_tokens", None)
    blocks = getattr(emb, "cbserve_blocks", None)
    if blocks is None or not enabled():
        return False
    head = getattr(model, "lm_head", None)
    tied = isinstance(head, PackedLinear) and head.weight is emb.weight
    tiles_cpu = avx512_ops() is not None or amx_ops() is not None  # kernels over amx_pack_weight's layout
    if tiles_cpu and blocks.keep_tiles:
        return False
    if tied and packed_kind(head.packed) is not None:
        packed = head.packed
    elif tiles_cpu:
        import native._fused as fused

        tiles = fused.amx_pack_weight(emb.weight.detach())
        packed = packed_tiles(blocks, tiles, "embedding")
        if packed is tiles:
            return False
    else:  # gguf_linear's CPUs: where its layers are served from blocks
        if not (isinstance(head, PackedLinear) and head.kernel.startswith("gguf-")):
            return False
        packed = gguf_linear_weights(blocks, emb.weight.detach(), "embedding")
        if packed is None:
            return False
    inner.embed_tokens = BlockEmbedding(packed, emb.num_embeddings, emb.embedding_dim, emb.weight.dtype)
    if tied:  # the table was the head's plain weight too; plain_weight() unpacks the blocks
        del head.weight
        head.weight = torch.empty(emb.weight.shape, dtype=emb.weight.dtype, device="meta")
    return True
