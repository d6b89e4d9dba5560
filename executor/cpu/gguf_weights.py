"""A GGUF file's quantised weight blocks, kept for the block kernels
(amx_linear on AMX CPUs; avx512_linear on other AVX512-BF16 CPUs).

SmolLM2's GGUF stores every projection as Q4_1 blocks (32 weights of one
row: w = d * q + m, fp16 d and m, 4-bit q) and the tied embedding / LM head
as Q8_0 (w = d * q, 8-bit q); Q4_0 is read as Q4_1, and the K-quants of
Q4_K_M files (Q4_K, Q6_K: 256-weight super-blocks with 6- or 8-bit scales
per 32 / 16 weights) are packed one super-block a tile. transformers
dequantises them in fp32 and the bf16 model rounds each weight once: so
bf16(d * q + m) *is* the model cbserve serves, and the kernels expand the
blocks on the fly to exactly the same bf16 tiles (native/csrc/linear/
gguf_tiles.h). Same weights, same outputs, a third of the bytes or less.

Every tensor is checked at load: its expansion must equal the loaded bf16
weight bit for bit, else that layer keeps the bf16 tiles (a GGUF whose
mapping or rounding differs is served as before, with a warning).
`CBSERVE_GGUF_BLOCKS=0` turns the whole path off; `CBSERVE_GGUF_TILES`
chooses, on CPUs without AMX, between blocks alone and bf16 tiles beside
them (avx512_weights); `CBSERVE_Q4_ROWS=0` keeps the Q4_1 layers on
amx_linear's layout and kernel (amx_q4_rows_linear's feature-major layout
otherwise). docs/quantization.md.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import structlog
import torch

_LOGGER = structlog.get_logger(__name__)

BLOCK = 32  # weights per GGUF block (Q4_1, Q8_0; a Q4_K sub-block)
Q4K_SUB = 8  # 32-weight blocks per K-quant super-block
Q6K_SCALES = 16  # scales per Q6_K super-block (one per 16 weights)
# Kinds packed one 256-weight super-block a tile (gguf_tiles.h): read by
# avx512_linear only, and never with bf16 tiles beside them.
K_QUANTS = ("q4_k", "q6_k")
TILE_N = 16  # output features per AMX weight tile
ENV_SWITCH = "CBSERVE_GGUF_BLOCKS"
# Whether Q4_0 / Q4_1 / Q8_0 layers keep bf16 copies beside their blocks
# (CPUs without AMX: tiles, faster above a few rows, avx512_weights; AMX
# CPUs: the plain weight and Q4_1's feature-major copy, amx_alone) and the
# embedding its bf16 table: "1" yes, "0" no, "auto" (unset) where the
# model's bf16 tiles would take less than AUTO_TILES_MAX_BYTES, on CPUs
# without AMX (keep_tiles).
TILES_SWITCH = "CBSERVE_GGUF_TILES"
# A model this small is bound by its step's overheads, not its weights'
# memory (SmolLM2-135M: 270 MB of bf16 tiles, 94 MB of blocks); above it
# (1B and up) the blocks alone keep the weights at about the file's size.
AUTO_TILES_MAX_BYTES = 1 << 30
# "0": Q4_1 layers keep amx_linear's layout and kernel instead of amx_q4_rows_linear's.
ROWS_SWITCH = "CBSERVE_Q4_ROWS"
# What avx512_linear (up to 16 rows) and gguf_linear (every call) multiply
# blocks by (block_activations): "int8" (x rounded per 32-wide k-block to
# int8, or int16 against Q8_0, and integer dot products: faster kernels,
# docs/benchmarks-quant.md) or "bf16" (the blocks expand to the model's weights: outputs equal
# the bf16 or fp32 model's bit for bit). "auto": int8 on AVX512-BF16 CPUs
# with VNNI and without AMX only.
ACTIVATIONS_SWITCH = "CBSERVE_GGUF_ACTIVATIONS"

# GGUF tensor (per layer) -> the Hugging Face Llama module it becomes.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass
class BlockWeight:
    """A [N, K] weight as GGUF blocks, one q value per weight (unpacked so
    rows can be permuted and concatenated like the bf16 weight's)."""

    kind: str  # "q4_1" | "q8_0" | "q4_k" | "q6_k"
    q: torch.Tensor  # [N, K]: uint8 0..15 (q4_1, q4_k) or int8 (q8_0; q6_k: -32..31)
    d: torch.Tensor  # [N, K/32] fp16; q4_k, q6_k: [N, K/256], the super-block's d
    m: torch.Tensor | None  # [N, K/32] fp16 (q4_1); q4_k: [N, K/256], dmin
    # q4_k: [N, K/32] uint8, each block's 6-bit scale; q6_k: [N, K/16] int8, each 16 weights' scale
    sc: torch.Tensor | None = None
    mn: torch.Tensor | None = None  # q4_k: [N, K/32] uint8, each block's 6-bit min
    keep_tiles: bool = False  # bf16 copies beside these blocks (keep_tiles(), TILES_SWITCH)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def _fields(self) -> list[torch.Tensor | None]:
        return [self.q, self.d, self.m, self.sc, self.mn]

    def rows(self, index: torch.Tensor) -> "BlockWeight":
        return BlockWeight(self.kind, *[None if f is None else f[index] for f in self._fields()], self.keep_tiles)

    @staticmethod
    def cat(parts: list["BlockWeight"]) -> "BlockWeight":
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot concatenate {sorted(kinds)} blocks")
        fields = zip(*[p._fields() for p in parts])
        keep = all(p.keep_tiles for p in parts)
        return BlockWeight(parts[0].kind, *[None if f[0] is None else torch.cat(f) for f in fields], keep)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: d * q (+ m), each operation rounded (as gguf-py
        computes it; Q4_K: (d * sc) * q - dmin * mn)."""
        n, k = self.shape
        if self.kind == "q6_k":
            scale = self.d.float().repeat_interleave(Q6K_SCALES, 1) * self.sc.float()
            return scale.repeat_interleave(16, 1) * self.q.float()
        if self.kind == "q4_k":
            scale = self.d.float().repeat_interleave(Q4K_SUB, 1) * self.sc.float()
            low = self.m.float().repeat_interleave(Q4K_SUB, 1) * self.mn.float()
            return scale.repeat_interleave(BLOCK, 1) * self.q.float() - low.repeat_interleave(BLOCK, 1)
        w = self.d.float().repeat_interleave(BLOCK, 1) * self.q.float()
        if self.m is not None:
            w = w + self.m.float().repeat_interleave(BLOCK, 1)
        return w.reshape(n, k)

    def pack(self) -> torch.Tensor:
        """uint8 [N/16, K/32, tile bytes], the layout amx_linear reads. A bf16
        tile row (one k-pair) is 32 words, word w = parity w % 2 of feature
        w / 2; here its q values sit in two 16-lane halves, words 0..15
        (features 0..7) and 16..31 (features 8..15), so the kernel converts
        the two to bf16 in tile order with one instruction. Per tile: the q
        values (Q4_1: 256 bytes, four groups of [16 lanes][4 k-pairs], words
        0..15 in the low nibble, 16..31 in the high; Q8_0: 512 bytes,
        [16 k-pairs][2 halves][16 lanes]), then the 16 fp16 scales (and the
        16 minimums), one per feature. The tiles are stored pair-major:
        column blocks 2p and 2p + 1 alternate k-block by k-block (an odd
        last block follows alone), so the kernel's sweep over a pair is one
        forward stream; the tensor's [N/16, K/32] shape counts the tiles but
        does not index them (amx_dequant gives them back in [N/16, K/32] order)."""
        n, k = self.shape
        if n % TILE_N or k % BLOCK:
            raise ValueError(f"[{n}, {k}] is not whole tiles of {TILE_N} x {BLOCK}")
        if self.kind in K_QUANTS:
            return self._pack_k_quant()
        return _pair_major(self._with_scales(self._q_tiles()))

    def _q_tiles(self) -> torch.Tensor:
        """uint8 [N/16, K/32, q bytes]: each tile's q values as `pack` lays them out."""
        n, k = self.shape
        nb, kb = n // TILE_N, k // BLOCK
        half = TILE_N // 2
        # [nb, 2 halves, 8 features, kb, 16 k-pairs, 2 parities] -> lanes (feature, parity) per half
        q = self.q.view(torch.uint8).view(nb, 2, half, kb, BLOCK // 2, 2).permute(0, 3, 4, 1, 2, 5)
        q = q.reshape(nb, kb, BLOCK // 2, 2, TILE_N)  # [nb, kb, k-pair, half, lane]
        if self.kind == "q6_k":  # q + 32: its low 4 bits as Q4_1's, then the high 2
            u = q.view(torch.int8).to(torch.int16) + 32
            low, high = (u & 0xF).to(torch.uint8), (u >> 4).to(torch.int32)
            # [nb, kb, 4 g, 4 R, 2 h, 16 lanes] -> lanes of 16 bits, bits 4R + 2h
            shifts = 4 * torch.arange(4).view(4, 1, 1) + 2 * torch.arange(2).view(2, 1)
            high = high.view(nb, kb, 4, 4, 2, TILE_N) << shifts
            words = high.sum(dim=(3, 4)).to(torch.int16)  # [nb, kb, 4 g, 16 lanes]
            return torch.cat([_nibble_rows(low), words.view(torch.uint8).reshape(nb, kb, -1)], dim=2)
        if self.kind in ("q4_1", "q4_k"):
            return _nibble_rows(q)
        return q.reshape(nb, kb, -1)

    def _pack_k_quant(self) -> torch.Tensor:
        """uint8 [N/16, K/256, tile bytes], one tile per super-block of 16
        features (gguf_tiles.h), pair-major as `pack`. Q4_K (2368 bytes):
        its 8 k-blocks' q bytes in Q4_1's tile layout, then d [16] and
        dmin [16] fp16, then sc [8][16] and mn [8][16] uint8. Q6_K (3360):
        per k-block the low 4 bits of q + 32 in Q4_1's layout and their high
        2 bits (_q_tiles), then d [16] fp16, then sc [16][16] int8."""
        n, k = self.shape
        nb, sb = n // TILE_N, k // (BLOCK * Q4K_SUB)
        qt = self._q_tiles().reshape(nb, sb, -1)

        def per_feature(t: torch.Tensor, per_tile: int) -> torch.Tensor:  # [N, sb * per_tile] -> [nb, sb, bytes]
            t = t.view(nb, TILE_N, sb, per_tile).permute(0, 2, 3, 1).contiguous()
            return t.view(torch.uint8).reshape(nb, sb, -1)

        if self.kind == "q6_k":
            return _pair_major(torch.cat([qt, per_feature(self.d, 1), per_feature(self.sc, Q6K_SCALES)], dim=2))
        parts = [qt, per_feature(self.d, 1), per_feature(self.m, 1), per_feature(self.sc, Q4K_SUB)]
        return _pair_major(torch.cat(parts + [per_feature(self.mn, Q4K_SUB)], dim=2))

    def pack_rows(self) -> torch.Tensor | None:
        """uint8 [N/32, K/32, 2, 320], the feature-major layout
        amx_q4_rows_linear reads (the weights as AMX's A operand: a tile row
        is one feature's 32 weights of one block), or None where it does not
        apply (Q8_0, or N not a multiple of 32). Per pair of column blocks,
        per k-block, the two tiles; a tile is 8 row pairs of 32 bytes (byte j
        holds weight j of the even row in its low nibble, of the odd row in
        its high nibble), then d[16] and m[16] in fp16."""
        n, k = self.shape
        if self.kind != "q4_1" or n % (2 * TILE_N) or k % BLOCK:
            return None
        nb, kb = n // TILE_N, k // BLOCK
        q = self.q.view(nb, TILE_N // 2, 2, kb, BLOCK)
        qt = (q[:, :, 0] | (q[:, :, 1] << 4)).permute(0, 2, 1, 3).reshape(nb, kb, -1)  # [nb, kb, 8 x 32]
        return _pair_major(self._with_scales(qt)).view(nb // 2, kb, 2, -1)

    def _with_scales(self, qt: torch.Tensor) -> torch.Tensor:
        """[nb, kb, tile bytes]: each tile's q bytes `qt` [nb, kb, *], then
        its 16 fp16 d (and 16 m), one per feature of the column block."""
        nb, kb = qt.shape[:2]
        scales = [self.d] + ([] if self.m is None else [self.m])
        st = [s.view(nb, TILE_N, kb).permute(0, 2, 1).contiguous().view(torch.uint8) for s in scales]
        return torch.cat([qt] + st, dim=2)


def _nibble_rows(q: torch.Tensor) -> torch.Tensor:
    """[nb, kb, 16 k-pairs, 2 halves, 16 lanes] 4-bit values -> [nb, kb, 256]
    bytes: k-pair 4g + r in byte r of lane j of group g, the first half in the
    low nibble."""
    nb, kb = q.shape[:2]
    rows = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [nb, kb, 16 k-pairs, 16 lanes]
    return rows.view(nb, kb, 4, 4, TILE_N).transpose(3, 4).reshape(nb, kb, -1)


def _pair_major(tiles: torch.Tensor) -> torch.Tensor:
    """Tiles [nb, kb, bytes] stored pair-major: column blocks 2p and 2p + 1
    alternate k-block by k-block, an odd last block follows alone."""
    nb, kb, tb = tiles.shape
    full = nb - nb % 2
    pairs = tiles[:full].view(full // 2, 2, kb, tb).transpose(1, 2).reshape(full, kb, tb)
    return torch.cat([pairs, tiles[full:]]).contiguous()


# Bytes of one packed tile (BlockWeight.pack) -> the block kind it holds.
_TILE_KIND = {320: "q4_1", 544: "q8_0", 2368: "q4_k", 3360: "q6_k"}


def packed_kind(packed: torch.Tensor) -> str | None:
    """ "q4_1" / "q8_0" / "q4_k" / "q6_k" for packed GGUF blocks, None for bf16 tiles."""
    return _TILE_KIND.get(packed.shape[-1]) if packed.dtype == torch.uint8 else None


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, K] 4-bit values from a Q4 tensor's [N, blocks, 16] bytes: a
    block's low nibbles are its weights 0..15, the high ones 16..31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(qs.shape[0], -1)


def _blocks(tensor) -> BlockWeight | None:
    """A gguf ReaderTensor of type Q4_0, Q4_1 or Q8_0 as a BlockWeight, else
    None. Q4_0 (w = d * (q - 8)) becomes Q4_1 with m = -8d: d * q and 8d are
    exact in fp32 and so is their difference, so the kernels' d * q + m
    rounds to the bf16 of gguf-py's d * (q - 8), up to the sign of a zero
    (each layer is still checked against the loaded weight); a block whose
    -8d overflows fp16 keeps the tensor out."""
    kind = tensor.tensor_type.name.lower()
    raw = torch.from_numpy(tensor.data.copy())  # uint8 [N, blocks * block bytes]
    n = raw.shape[0]
    if kind == "q4_0":
        b = raw.view(n, -1, 18)
        q = _nibbles(b[..., 2:])
        d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
        m = (-8 * d.float()).half()
        if not torch.equal(m.float(), -8 * d.float()):
            return None
        return BlockWeight("q4_1", q, d, m)
    if kind == "q4_1":
        b = raw.view(n, -1, 20)
        q = _nibbles(b[..., 4:])
        return BlockWeight(
            kind,
            q,
            b[..., 0:2].contiguous().view(torch.float16)[..., 0],
            b[..., 2:4].contiguous().view(torch.float16)[..., 0],
        )
    if kind == "q8_0":
        b = raw.view(n, -1, 34)
        q = b[..., 2:].contiguous().view(torch.int8).reshape(n, -1)
        return BlockWeight(kind, q, b[..., 0:2].contiguous().view(torch.float16)[..., 0], None)
    if kind == "q4_k":
        return _q4_k(raw.view(n, -1, 144))
    if kind == "q6_k":
        return _q6_k(raw.view(n, -1, 210))
    return None


def _q4_k(b: torch.Tensor) -> BlockWeight:
    """Q4_K super-blocks [N, K/256, 144 bytes] (fp16 d, fp16 dmin, 12 bytes
    of 6-bit scales and mins, 128 bytes of 4-bit q) as a BlockWeight: q
    chunk c's low nibbles are block 2c's 32 weights, its high ones block 2c + 1's;
    scale bytes 0-3 / 4-7 hold blocks 0-3's sc / mn in their low 6 bits and
    the top 2 bits of blocks 4-7's, bytes 8-11 their low 4 bits (gguf-py's get_scale_min)."""
    n, sb = b.shape[:2]
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
    dmin = b[..., 2:4].contiguous().view(torch.float16)[..., 0]
    lo_sc, lo_mn, high = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    sc = torch.cat([lo_sc & 0x3F, (high & 0x0F) | ((lo_sc >> 2) & 0x30)], dim=2).reshape(n, -1)
    mn = torch.cat([lo_mn & 0x3F, (high >> 4) | ((lo_mn >> 2) & 0x30)], dim=2).reshape(n, -1)
    qs = b[..., 16:].reshape(n, sb, 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=3).reshape(n, -1)
    return BlockWeight("q4_k", q, d, dmin, sc.contiguous(), mn.contiguous())


def _q6_k(b: torch.Tensor) -> BlockWeight:
    """Q6_K super-blocks [N, K/256, 210 bytes] (128 bytes of low 4 bits,
    64 of high 2 bits, 16 int8 scales, fp16 d) as a BlockWeight with
    q = (low | high << 4) - 32: weight e of a super-block (h = e / 128,
    r = e % 128) has its low bits in nibble r / 64 of byte 64 h + r % 64 and
    its high bits in bit pair r / 32 of byte 32 h + r % 32 (gguf-py's Q6_K)."""
    n, sb = b.shape[:2]
    ql = b[..., :128].reshape(n, sb, 2, 1, 64)
    qh = b[..., 128:192].reshape(n, sb, 2, 1, 32)
    low = torch.cat([ql & 0xF, ql >> 4], dim=3).reshape(n, sb, 256)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(n, sb, 256)
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(n, -1)
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    d = b[..., 208:210].contiguous().view(torch.float16)[..., 0]
    return BlockWeight("q6_k", q, d, None, sc)


def _unpermute(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order transformers gives a GGUF Llama q/k weight (it undoes the
    rotary interleave llama.cpp's converter applied)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


def read_blocks(reader, config) -> dict[str, BlockWeight]:
    """Block weights of a Llama GGUF (`reader`: gguf-py's GGUFReader of the
    file) by Hugging Face module name ('model.layers.0.self_attn.q_proj',
    ..., 'model.embed_tokens', 'lm_head')."""
    out: dict[str, BlockWeight] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens"
        elif t.name == "output.weight":  # an untied LM head
            name = "lm_head"
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
            name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
        else:
            continue
        bw = _blocks(t)
        if bw is None:
            continue
        if parts[-2] == "attn_q":
            bw = bw.rows(_unpermute(bw.shape[0], config.num_attention_heads))
        elif parts[-2] == "attn_k":
            bw = bw.rows(_unpermute(bw.shape[0], config.num_key_value_heads or config.num_attention_heads))
        out[name] = bw
    return out


def _switched_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def enabled() -> bool:
    return _switched_on(ENV_SWITCH)


def supported() -> bool:
    """Whether vector kernels that read blocks run here: amx_linear on
    AMX-BF16 CPUs, avx512_linear on other AVX512-BF16 CPUs, gguf_linear's
    AVX2 code on other AVX2 + FMA + F16C CPUs. Elsewhere (no AVX2, or not
    x86) gguf_linear's portable code reads them too, several times slower
    than the expanded weights' kernels (docs/quantization.md): only when
    CBSERVE_GGUF_BLOCKS=1 asks (`portable_asked`)."""
    try:
        import native._fused as fused
    except ImportError:
        return False
    return bool(fused.avx512_linear_supported() or fused.gguf_linear_avx2()) or portable_asked()


def _activations_switch() -> str:
    return os.environ.get(ACTIVATIONS_SWITCH, "auto").strip().lower()


def block_activations() -> str:
    """ "int8" where this CPU has AVX512-VNNI and no AMX and ACTIVATIONS_SWITCH
    asks for it: "int8", or "auto" (unset) on an AVX512-BF16 CPU (Zen 4),
    where only avx512_linear's calls of up to 16 rows take it; else "bf16".
    On CPUs without AVX512-BF16 (Ice Lake, Cascade Lake) every gguf_linear
    call would take it, prefill chunks included, so there it is opt-in:
    faster, but it can flip a near tie of the fp32 model (docs/quantization.md).
    amx_linear always multiplies in bf16, gguf_linear on AVX2-only CPUs in fp32."""
    switch = _activations_switch()
    try:
        import native._fused as fused
    except ImportError:
        return "bf16"
    if switch == "bf16" or not fused.avx512_int8_supported() or fused.amx_linear_supported():
        return "bf16"
    if switch != "int8" and not fused.avx512_linear_supported():
        return "bf16"
    return "int8"


def apply_block_activations() -> str:
    """Sets the block kernels' activations (process-wide) to block_activations(); returns it.
    Called once a load, so an unknown ACTIVATIONS_SWITCH is warned of here, not per layer."""
    switch = _activations_switch()
    if switch not in ("auto", "int8", "bf16"):
        _LOGGER.warning("unknown value, using auto", variable=ACTIVATIONS_SWITCH, value=switch)
    kind = block_activations()
    try:
        import native._fused as fused
    except ImportError:
        return kind
    fused.set_block_activations(kind)
    return kind


def portable_asked() -> bool:
    """CBSERVE_GGUF_BLOCKS=1: blocks also where only portable code reads them."""
    return os.environ.get(ENV_SWITCH, "").strip() == "1"


def gguf_linear_weights(blocks: BlockWeight | None, weight: torch.Tensor, what: str) -> torch.Tensor | None:
    """The packed blocks gguf_linear reads for a layer (CPUs without
    AVX512-BF16) where they expand to exactly `weight` ([N, K], fp32: the
    exact values; bf16: rounded once), else None: the layer keeps its
    plain weight. A bf16 layer whose blocks say `keep_tiles` (a small model)
    keeps its bf16 panels too, since on those CPUs the expansion costs more
    than streaming bf16 (docs/quantization.md); fp32 layers read the
    blocks at every size, faster than streaming fp32 and 4-7x fewer bytes."""
    if blocks is None or not enabled() or weight.dim() != 2:
        return None
    if weight.dtype == torch.bfloat16 and blocks.keep_tiles:
        return None
    import native._fused as fused

    packed = blocks.pack()
    # As values (packed_tiles): a Q4_0 zero's sign may differ from gguf-py's.
    if tuple(weight.shape) == blocks.shape and torch.equal(
        fused.gguf_dequant(packed, weight.dtype).float(), weight.float()
    ):
        return packed
    _LOGGER.warning("GGUF blocks do not expand to the loaded weights; serving them expanded", layer=what)
    return None


def attach(model: torch.nn.Module, reader) -> int:
    """Gives every bf16 or fp32 Linear of `model` its GGUF blocks as a
    `cbserve_blocks` attribute (the tied LM head gets the embedding's);
    returns how many. PackedLinear and FusedMLP pack them instead of the
    bf16 weight once `packed_tiles` has checked them."""
    blocks = read_blocks(reader, model.config)
    keep = keep_tiles(2 * sum(bw.q.numel() for bw in blocks.values()))
    for bw in blocks.values():
        bw.keep_tiles = keep
    modules = dict(model.named_modules())
    if getattr(model.config, "tie_word_embeddings", False) and "model.embed_tokens" in blocks:
        blocks.setdefault("lm_head", blocks["model.embed_tokens"])
    n = 0
    for name, bw in blocks.items():
        mod = modules.get(name)
        if (
            isinstance(mod, (torch.nn.Linear, torch.nn.Embedding))
            and mod.weight.dtype in (torch.bfloat16, torch.float32)
            and tuple(mod.weight.shape) == bw.shape
            and bw.shape[0] % TILE_N == 0
        ):
            mod.cbserve_blocks = bw
            n += 1
    return n


def release(model: torch.nn.Module) -> int:
    """Drops every module's `cbserve_blocks` once the kernels' packed copies
    exist (their q values take a byte a weight: ~135 MB for SmolLM2);
    returns how many were dropped."""
    n = 0
    for mod in model.modules():
        if "cbserve_blocks" in vars(mod):
            del mod.cbserve_blocks
            n += 1
    return n


def blocks_of(*linears: torch.nn.Module) -> BlockWeight | None:
    """The blocks of these modules' weights stacked by rows (as torch.cat of
    their weights), or None unless every one has blocks of one kind."""
    parts = [getattr(m, "cbserve_blocks", None) for m in linears]
    if any(p is None for p in parts) or len({p.kind for p in parts}) != 1:
        return None
    return parts[0] if len(parts) == 1 else BlockWeight.cat(parts)


def packed_tiles(blocks: BlockWeight | None, bf16_tiles: torch.Tensor, what: str) -> torch.Tensor:
    """The packed blocks where the kernels expand them to exactly
    `bf16_tiles` (amx_pack_weight / amx_pack_gate_up of the loaded weight),
    else `bf16_tiles`: a GGUF whose layout or rounding differs from what
    transformers loaded is served from the bf16 weights, with a warning."""
    if blocks is None or not enabled():
        return bf16_tiles
    import native._fused as fused

    packed = blocks.pack()
    # Equal as values: a Q4_0 weight of 0 expands to +0 where gguf-py's
    # d * (q - 8) gives -0 for a negative d, the same products either way.
    if torch.equal(fused.amx_dequant(packed).float(), bf16_tiles.float()):
        return packed
    _LOGGER.warning("GGUF blocks do not expand to the loaded weights; serving bf16 tiles", layer=what)
    return bf16_tiles


def amx_alone(blocks: BlockWeight | None, packed: torch.Tensor) -> bool:
    """Whether an AMX CPU's layer that packed these blocks (`packed`, what
    packed_tiles gave) holds them alone, with no plain bf16 weight beside
    them (for F.linear over long prefill chunks) nor the feature-major Q4_1
    copy (amx_q4_rows_linear for few rows): amx_linear then runs at every
    row count. K-quant layers always; Q4_0 / Q4_1 / Q8_0 ones where the
    model is too large to keep tiles (`keep_tiles`), so that the weights
    take about the file's size."""
    if blocks is None or packed.dtype != torch.uint8:  # no blocks, or bf16 tiles instead of them
        return False
    return blocks.kind in K_QUANTS or not blocks.keep_tiles


def avx512_weights(
    blocks: BlockWeight | None, bf16_tiles: torch.Tensor, what: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What avx512_linear (CPUs without AMX) reads for a layer: (the weights
    for any row count, blocks for few rows or None). A layer is served
    from its blocks alone, no bf16 tiles beside them, so that a quantised
    file's model takes about the file's size (bits a weight: Q4_1 5,
    Q8_0 8.5, Q4_K 4.625, Q6_K 6.5625); but where its blocks say
    `keep_tiles` (a small model, TILES_SWITCH) a Q4_1 layer keeps the tiles,
    faster above AVX512_BLOCKS_MAX_ROWS rows, and its blocks for fewer
    (packed_linear.py); a Q8_0 layer keeps the tiles alone under bf16
    activations (its expansion is slower than their stream at any row count)
    and its blocks beside them under int8 (small_batch_blocks). K-quants have
    no tiles beside them."""
    if blocks is not None and (blocks.kind in K_QUANTS or not blocks.keep_tiles):
        return packed_tiles(blocks, bf16_tiles, what), None
    return bf16_tiles, small_batch_blocks(blocks, bf16_tiles, what)


def keep_tiles(bf16_bytes: int) -> bool:
    """Whether a model whose blocks expand to `bf16_bytes` of bf16 tiles
    keeps bf16 copies beside the blocks (TILES_SWITCH). Unset: on AMX CPUs
    never (amx_linear over the blocks decodes as fast as over bf16 tiles,
    docs/quantization.md), elsewhere below AUTO_TILES_MAX_BYTES."""
    switch = os.environ.get(TILES_SWITCH, "auto").strip().lower()
    if switch in ("0", "1"):
        return switch == "1"
    try:
        import native._fused as fused
    except ImportError:
        return bf16_bytes < AUTO_TILES_MAX_BYTES
    return bf16_bytes < AUTO_TILES_MAX_BYTES and not fused.amx_linear_supported()


class BlockEmbedding(torch.nn.Module):
    """An embedding table kept as its GGUF blocks (packed tiles: a tied LM
    head's own): a lookup expands the rows it needs (native gguf_embed, on
    any CPU), to the values nn.Embedding would hold in `dtype`. `weight` is
    a meta tensor of the table's shape and dtype."""

    def __init__(
        self, packed: torch.Tensor, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        super().__init__()
        import native._fused as fused

        self.packed = packed
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = torch.empty(num_embeddings, embedding_dim, dtype=dtype, device="meta")
        self._rows = functools.partial(fused.gguf_embed, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self._rows(self.packed, flat).view(*ids.shape, self.embedding_dim)


def small_batch_blocks(blocks: BlockWeight | None, bf16_tiles: torch.Tensor, what: str) -> torch.Tensor | None:
    """The packed blocks for avx512_linear's small batches (CPUs without AMX)
    where they expand to exactly `bf16_tiles`, else None: Q4_1 blocks, and
    Q8_0 blocks too under int8 activations; expanded to bf16 they are slower there than
    the tiles (packed_linear.AVX512_BLOCKS_MAX_ROWS)."""
    kinds = ("q4_1", "q8_0") if block_activations() == "int8" else ("q4_1",)
    if blocks is None or blocks.kind not in kinds:
        return None
    packed = packed_tiles(blocks, bf16_tiles, what)
    return packed if packed is not bf16_tiles else None


def packed_rows(blocks: BlockWeight | None, weight: torch.Tensor, what: str) -> torch.Tensor | None:
    """The feature-major Q4_1 layout (BlockWeight.pack_rows) for the
    small-batch kernel where it expands to exactly `weight` (the bf16 [N, K]
    weight in the row order the kernel's caller uses), else None."""
    if blocks is None or not enabled() or not _switched_on(ROWS_SWITCH):
        return None
    packed = blocks.pack_rows()
    if packed is None:
        return None
    import native._fused as fused

    if torch.equal(fused.amx_q4_rows_dequant(packed).view(torch.int16), weight.view(torch.int16)):
        return packed
    _LOGGER.warning("GGUF blocks do not expand to the loaded weights; no small-batch Q4_1 kernel", layer=what)
    return None
