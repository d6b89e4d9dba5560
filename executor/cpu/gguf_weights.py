"""The GGUF file's 4- and 8-bit weight blocks, kept for the AMX kernels.

SmolLM2's GGUF stores every projection as Q4_1 blocks (32 weights of one
row: w = d * q + m, fp16 d and m, 4-bit q) and the tied embedding / LM head
as Q8_0 (w = d * q, 8-bit q). transformers dequantises them in fp32 and the
bf16 model rounds each weight once: so bf16(d * q + m) *is* the model cbserve
serves. A bf16 decode step streams 2 bytes per weight from memory; these
blocks take 5/8 (Q4_1) and 8.5/8 (Q8_0) bits, and the AMX kernels expand them
on the fly to exactly the same bf16 tiles (native/csrc/linear/amx_linear.cpp).
Same weights, same outputs, a third of the bytes a step reads.

Every tensor is checked at load: its expansion must equal the loaded bf16
weight bit for bit, else that layer keeps the bf16 tiles (a GGUF whose
mapping or rounding differs is served as before, with a warning).
`CBSERVE_GGUF_BLOCKS=0` turns the whole path off; `CBSERVE_Q4_ROWS=0` keeps
the Q4_1 layers on amx_linear's layout and kernel (amx_q4_rows_linear's
feature-major layout otherwise).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import structlog
import torch

_LOGGER = structlog.get_logger(__name__)

BLOCK = 32  # weights per GGUF block (Q4_1, Q8_0)
TILE_N = 16  # output features per AMX weight tile
ENV_SWITCH = "CBSERVE_GGUF_BLOCKS"
# "0": Q4_1 layers keep amx_linear's layout and kernel instead of amx_q4_rows_linear's.
ROWS_SWITCH = "CBSERVE_Q4_ROWS"

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

    kind: str  # "q4_1" | "q8_0"
    q: torch.Tensor  # [N, K]: uint8 0..15 (q4_1) or int8 (q8_0)
    d: torch.Tensor  # [N, K/32] fp16
    m: torch.Tensor | None  # [N, K/32] fp16 (q4_1)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def rows(self, index: torch.Tensor) -> "BlockWeight":
        return BlockWeight(self.kind, self.q[index], self.d[index], None if self.m is None else self.m[index])

    @staticmethod
    def cat(parts: list["BlockWeight"]) -> "BlockWeight":
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot concatenate {sorted(kinds)} blocks")
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return BlockWeight(parts[0].kind, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: d * q (+ m), each operation rounded (as gguf-py computes it)."""
        n, k = self.shape
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
        nb, kb = n // TILE_N, k // BLOCK
        half = TILE_N // 2
        # [nb, 2 halves, 8 features, kb, 16 k-pairs, 2 parities] -> lanes (feature, parity) per half
        q = self.q.view(torch.uint8).view(nb, 2, half, kb, BLOCK // 2, 2).permute(0, 3, 4, 1, 2, 5)
        q = q.reshape(nb, kb, BLOCK // 2, 2, TILE_N)  # [nb, kb, k-pair, half, lane]
        if self.kind == "q4_1":
            rows = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [nb, kb, 16 k-pairs, 16 lanes]
            # k-pair 4g + r in byte r of lane j of group g.
            qt = rows.view(nb, kb, 4, 4, TILE_N).transpose(3, 4).reshape(nb, kb, -1)
        else:
            qt = q.reshape(nb, kb, -1)
        return _pair_major(self._with_scales(qt))

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


def _pair_major(tiles: torch.Tensor) -> torch.Tensor:
    """Tiles [nb, kb, bytes] stored pair-major: column blocks 2p and 2p + 1
    alternate k-block by k-block, an odd last block follows alone."""
    nb, kb, tb = tiles.shape
    full = nb - nb % 2
    pairs = tiles[:full].view(full // 2, 2, kb, tb).transpose(1, 2).reshape(full, kb, tb)
    return torch.cat([pairs, tiles[full:]]).contiguous()


# Bytes of one packed tile (BlockWeight.pack) -> the block kind it holds.
_TILE_KIND = {320: "q4_1", 544: "q8_0"}


def packed_kind(packed: torch.Tensor) -> str | None:
    """ "q4_1" / "q8_0" for packed GGUF blocks, None for bf16 tiles."""
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
    return None


def _unpermute(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order transformers gives a GGUF Llama q/k weight (it undoes the
    rotary interleave llama.cpp's converter applied)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


def read_blocks(gguf_path: str, config) -> dict[str, BlockWeight]:
    """Block weights of a Llama GGUF by Hugging Face module name
    ('model.layers.0.self_attn.q_proj', ..., 'model.embed_tokens')."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    out: dict[str, BlockWeight] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens"
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
    """Whether the kernels that read blocks run here: amx_linear on AMX-BF16
    CPUs, avx512_linear on other AVX512-BF16 CPUs (every AMX CPU has
    AVX512-BF16, so the one check covers both)."""
    try:
        import native._fused as fused
    except ImportError:
        return False
    return bool(fused.avx512_linear_supported())


def attach(model: torch.nn.Module, gguf_path: str) -> int:
    """Gives every bf16 Linear of `model` its GGUF blocks as a
    `cbserve_blocks` attribute (the tied LM head gets the embedding's);
    returns how many. PackedLinear and FusedMLP pack them instead of the
    bf16 weight once `packed_tiles` has checked them."""
    blocks = read_blocks(gguf_path, model.config)
    modules = dict(model.named_modules())
    if getattr(model.config, "tie_word_embeddings", False) and "model.embed_tokens" in blocks:
        blocks["lm_head"] = blocks["model.embed_tokens"]
    n = 0
    for name, bw in blocks.items():
        mod = modules.get(name)
        if (
            isinstance(mod, torch.nn.Linear)
            and mod.weight.dtype == torch.bfloat16
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


def small_batch_blocks(blocks: BlockWeight | None, bf16_tiles: torch.Tensor, what: str) -> torch.Tensor | None:
    """The packed Q4_1 blocks for avx512_linear's small batches (CPUs without
    AMX) where they expand to exactly `bf16_tiles`, else None (Q8_0 blocks:
    slower there than the tiles; packed_linear.AVX512_BLOCKS_MAX_ROWS)."""
    if blocks is None or blocks.kind != "q4_1":
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
