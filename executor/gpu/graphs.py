"""Decode steps replayed from CUDA graphs.

A decode step launches ~280 kernels (graphs.py's lean forward, the LM head,
the argmax); launched one by one from Python the host is the bottleneck, not
the GPU. At start-up the step is captured once per batch-size bucket
(1, 2, 4, 8, then multiples of 16 up to `max_batch`) over static device
buffers; a pure-decode step of B sequences copies its metadata into those
buffers (one pinned host staging area, one copy), pads to the next bucket and
replays that bucket's graph. Padding rows read block 0 and write no cache
slot (slot -1); their outputs are never read. Anything else (a prompt chunk
in the step, more sequences than the largest bucket) runs the same forward
eagerly.

The graphs share one memory pool, captured largest bucket first, so the
activations of all buckets cost about what the largest needs alone.
"""

from __future__ import annotations

import time

import numpy as np
import structlog
import torch

from executor.gpu.lean_forward import GpuLeanForward, StepInputs

_LOGGER = structlog.get_logger(__name__)


def buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, 16, 32, 48, ... up to
    max_batch (which is always one)."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch]
    out += list(range(16, max_batch, 16))
    return sorted(set(out + [max_batch]))


class DecodeGraphs:
    def __init__(
        self,
        lean: GpuLeanForward,
        lm_head: torch.nn.Module,
        kv,
        block_size: int,
        max_context: int,
        max_batch: int,
    ) -> None:
        self.lean = lean
        self.lm_head = lm_head
        self.kv = kv
        self.block_size = block_size
        self.width = -(-max_context // block_size)  # block-table columns: the longest context
        self.buckets = buckets(max_batch)
        self.max_batch = max_batch
        dev = lean.device
        n, w = max_batch, self.width
        # Staging layout (int32): ids | positions | slots | seq_lens, n each;
        # then the block tables [n, w]; then cu_seqlens_q [n + 1] (0..n: one
        # token per sequence, the same for every step, written once).
        self._tables_at = 4 * n
        self._cu_at = 4 * n + n * w
        total = self._cu_at + n + 1
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=True)
        self.h = self.host.numpy()
        self.h[self._cu_at :] = np.arange(n + 1, dtype=np.int32)
        self.h[2 * n : 3 * n] = -1  # slots of padding rows: nothing written
        self.h[3 * n : 4 * n] = 1  # seq_lens of padding rows: one token of block 0
        self.dev = self.host.to(dev)
        self.tokens_host = torch.empty(n, dtype=torch.int64, pin_memory=True)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _inputs(self, b: int) -> StepInputs:
        n, w, d = self.max_batch, self.width, self.dev
        return StepInputs(
            input_ids=d[0:b],
            positions=d[n : n + b],
            slots=d[2 * n : 2 * n + b],
            block_tables=d[self._tables_at : self._tables_at + b * w].view(b, w),
            cu_seqlens_q=d[self._cu_at : self._cu_at + b + 1],
            seq_lens=d[3 * n : 3 * n + b],
            max_q_len=1,
        )

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.lean(self._inputs(b), self.kv)
        logits = self.lm_head(hidden)
        return logits, logits.argmax(-1)

    @torch.inference_mode()
    def capture(self) -> dict:
        """Captures every bucket; returns what it took (seconds, bytes)."""
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: cuBLAS handles and workspaces exist before capture
            for _ in range(2):
                self._forward(self.buckets[-1])
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.logits[b], self.tokens[b] = self._forward(b)
            self.graphs[b] = g
        torch.cuda.synchronize()
        took = {
            "buckets": len(self.buckets),
            "max_batch": self.max_batch,
            "seconds": round(time.perf_counter() - t0, 3),
            "bytes": torch.cuda.memory_reserved() - before,
        }
        _LOGGER.info("cuda graphs captured", **took)
        return took

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def run(self, last_ids: list[int], positions: list[int], tables: list[list[int]]) -> tuple[int, torch.Tensor]:
        """Replays the decode step of len(last_ids) sequences (token ids,
        their positions, their block tables); returns (bucket, its graph's
        argmax tokens [bucket] on the device). Its logits stay in
        `self.logits[bucket]` until the next replay."""
        B = len(last_ids)
        b = self.bucket_for(B)
        n, w, bs, h = self.max_batch, self.width, self.block_size, self.h
        h[0:B] = last_ids
        h[n : n + B] = positions
        h[3 * n : 3 * n + B] = positions
        h[3 * n : 3 * n + B] += 1
        slots = h[2 * n : 2 * n + B]
        for r, (pos, table) in enumerate(zip(positions, tables)):
            need = pos // bs + 1
            at = self._tables_at + r * w
            h[at : at + need] = table[:need]
            slots[r] = table[pos // bs] * bs + pos % bs
        # Rows B..b keep the padding values (their metadata is never
        # overwritten: ids, positions and tables of real rows may linger,
        # slots and seq_lens are reset below).
        h[2 * n + B : 2 * n + b] = -1
        h[3 * n + B : 3 * n + b] = 1
        used = self._tables_at + b * w
        self.dev[:used].copy_(self.host[:used], non_blocking=True)
        self.graphs[b].replay()
        self.replays += 1
        return b, self.tokens[b]

    def tokens_to_host(self, tokens: torch.Tensor, count: int) -> list[int]:
        out = self.tokens_host[: tokens.shape[0]]
        out.copy_(tokens, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return out[:count].tolist()
