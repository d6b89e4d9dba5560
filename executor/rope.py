"""Rotary embeddings whose frequencies depend on the sequence, chosen per
token for a packed batch.

Phi-3 style `longrope` has two sets of frequencies: short up to
`original_max_position_embeddings`, long beyond. transformers picks one set
for a whole forward from its largest position, which in a packed batch (and
in a prompt prefilled in chunks) depends on what else is in the step. A
one-sequence forward, as `generate()` runs it, uses the long set for a whole
prompt longer than the original length, and for each later token once its
position reaches past it. `PerTokenLongRope` reproduces that token by token:
long where max(prompt length, position + 1) exceeds the original length; the
runner sets that length per token before each forward (`set_lengths`).
"""

from __future__ import annotations

import torch


class PerTokenLongRope(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        super().__init__()
        cfg = inner.config
        params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        self.original_max = int(
            params.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings")
        )
        device = inner.original_inv_freq.device
        long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, device, seq_len=self.original_max + 1)
        self.register_buffer("short_inv", inner.original_inv_freq.float().clone(), persistent=False)
        self.register_buffer("long_inv", long_inv.float(), persistent=False)
        self.scaling = float(inner.attention_scaling)
        self.lengths: torch.Tensor | None = None  # [T]: the length that picks each token's set

    def set_lengths(self, lengths: torch.Tensor | None) -> None:
        self.lengths = lengths

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = position_ids.float()  # [B, T]
        lengths = self.lengths if self.lengths is not None else position_ids.max() + 1
        long = (torch.as_tensor(lengths, device=pos.device) > self.original_max).expand_as(pos)
        inv = torch.where(long[..., None], self.long_inv, self.short_inv)  # [B, T, D/2]
        freqs = pos[..., None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(x.dtype), (emb.sin() * self.scaling).to(x.dtype)


def install(model: torch.nn.Module) -> PerTokenLongRope | None:
    """Replaces a longrope rotary embedding of `model` by the per-token one;
    None when the model has none."""
    inner = getattr(getattr(model, "model", None), "rotary_emb", None)
    if inner is None or getattr(inner, "rope_type", None) != "longrope":
        return None
    rope = PerTokenLongRope(inner)
    model.model.rotary_emb = rope
    return rope
