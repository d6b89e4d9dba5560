"""KV block tables: who holds which block, prefix sharing, and the one place
that frees a request's blocks.

Blocks are refcounted. A full block whose tokens are computed gets a hash
chained from its parent's hash and its token ids (plus the request's cache
salt), so later requests with the same prefix reuse it. A block whose refcount
drops to zero keeps its hash and sits in the free queue; it is evicted (hash
dropped) least-recently-used only when a fresh block is needed.

Allocation is check-then-act: `allocate` returns None before mutating
anything when the pool cannot satisfy it.


    request.block_ids:  [ b7 | b2 | b9 | b4 ]     block_size = 4
    tokens:              0..3 4..7 8..11 12..13   (b4 half full: not hashable)
    hashes:              h0   h1   h2   -         h1 = H(h0, tokens 4..7)
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field

from router.request import Request


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


@dataclass
class _Table:
    block_ids: list[int] = field(default_factory=list)
    # Hashes of this request's leading full blocks (len <= len(block_ids)).
    hashes: list[bytes] = field(default_factory=list)


def hash_block(parent: bytes | None, token_ids: list[int], salt: str = "") -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else salt.encode("utf-8") + b"\x00root")
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return h.digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_swap_blocks: int = 0,
        enable_prefix_caching: bool = True,
        watermark: float = 0.0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Refcount-0 blocks, oldest first: evicted from the front.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._tables: dict[str, _Table] = {}
        self.num_swap_blocks = num_swap_blocks
        self._swap_free: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self._swapped: dict[str, list[int]] = {}
        # Prefix-cache counters, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- queries ------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def swap_usage(self) -> float:
        if not self.num_swap_blocks:
            return 0.0
        return 1.0 - len(self._swap_free) / self.num_swap_blocks

    def block_ids(self, req: Request) -> list[int]:
        t = self._tables.get(req.request_id)
        return list(t.block_ids) if t else []

    def holds(self, req: Request) -> bool:
        return req.request_id in self._tables

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    # -- prefix cache -------------------------------------------------------
    def _prompt_hashes(self, req: Request) -> list[bytes]:
        tokens = req.all_token_ids
        bs = self.block_size
        out: list[bytes] = []
        parent = None
        for i in range(len(tokens) // bs):
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs], req.cache_salt)
            out.append(parent)
        return out

    def lookup_prefix(self, req: Request) -> list[int]:
        """Leading cached blocks for a request not yet holding blocks. The last
        token is always left to compute (something must be sampled), and a
        shared block is never written, so a fully cached prompt gives back its
        last block."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in self._prompt_hashes(req):
            bid = self._cached.get(h)
            if bid is None:
                break
            hits.append(bid)
        if hits and len(hits) * self.block_size >= req.num_tokens:
            hits.pop()
        return hits

    # -- allocation ---------------------------------------------------------
    def _take_free(self) -> int:
        bid, _ = self._free.popitem(last=False)
        blk = self._blocks[bid]
        if blk.block_hash is not None:
            if self._cached.get(blk.block_hash) == bid:
                del self._cached[blk.block_hash]
            blk.block_hash = None
        blk.ref_count = 1
        return bid

    def _ref(self, bid: int) -> None:
        blk = self._blocks[bid]
        if blk.ref_count == 0:
            del self._free[bid]
        blk.ref_count += 1

    def can_allocate(self, req: Request, num_tokens: int, cached: list[int] | None = None, reserve: int = 0) -> bool:
        table = self._tables.get(req.request_id)
        have = len(table.block_ids) if table else len(cached or [])
        need = max(0, self.blocks_needed(num_tokens) - have)
        # Cached blocks with refcount 0 sit in the free queue: taking them
        # shrinks what is left for fresh ones.
        revived = sum(1 for b in (cached or []) if self._blocks[b].ref_count == 0) if table is None else 0
        return need + revived + reserve <= len(self._free)

    def allocate(
        self, req: Request, num_tokens: int, cached: list[int] | None = None, reserve: int = 0
    ) -> list[int] | None:
        """Grows req's table to hold num_tokens. Returns the new block ids
        (cached hits first), or None and changes nothing when it cannot."""
        if not self.can_allocate(req, num_tokens, cached, reserve):
            return None
        table = self._tables.get(req.request_id)
        new: list[int] = []
        if table is None:
            table = self._tables[req.request_id] = _Table()
            for bid in cached or []:
                self._ref(bid)
                table.block_ids.append(bid)
                table.hashes.append(self._blocks[bid].block_hash)  # type: ignore[arg-type]
                new.append(bid)
            if self.enable_prefix_caching:
                self.prefix_queries += len(req.prompt_token_ids)
                self.prefix_hits += len(cached or []) * self.block_size
        need = self.blocks_needed(num_tokens) - len(table.block_ids)
        for _ in range(max(0, need)):
            bid = self._take_free()
            table.block_ids.append(bid)
            new.append(bid)
        return new

    def commit_computed(self, req: Request) -> None:
        """Registers the hashes of req's blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(req.request_id)
        if table is None:
            return
        full = min(req.num_computed_tokens // self.block_size, len(table.block_ids))
        if full <= len(table.hashes):
            return
        tokens = req.all_token_ids
        bs = self.block_size
        parent = table.hashes[-1] if table.hashes else None
        for i in range(len(table.hashes), full):
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs], req.cache_salt)
            table.hashes.append(parent)
            blk = self._blocks[table.block_ids[i]]
            if blk.block_hash is None and parent not in self._cached:
                blk.block_hash = parent
                self._cached[parent] = blk.block_id

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Drops req's blocks past the first num_tokens tokens (rejected
        draft tokens' blocks: never hashed, never shared)."""
        table = self._tables.get(req.request_id)
        if table is None:
            return
        keep = self.blocks_needed(num_tokens)
        if len(table.block_ids) <= keep:
            return
        dropped = _Table(table.block_ids[keep:])
        del table.block_ids[keep:]
        del table.hashes[keep:]
        self._release(dropped)

    def free(self, req: Request) -> None:
        """The one release path: drops req's device and host blocks. Safe to
        call twice."""
        table = self._tables.pop(req.request_id, None)
        if table is not None:
            self._release(table)
        host = self._swapped.pop(req.request_id, None)
        if host:
            self._swap_free.extend(host)

    def _release(self, table: _Table) -> None:
        """Drops one reference to each block of a table that left _tables."""
        # Tail blocks first into the queue, so they are evicted first.
        for bid in reversed(table.block_ids):
            blk = self._blocks[bid]
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self._free[bid] = None
                if blk.block_hash is None:
                    self._free.move_to_end(bid, last=False)  # nothing cached: reuse first

    # -- swap ---------------------------------------------------------------
    def can_swap_out(self, req: Request) -> bool:
        table = self._tables.get(req.request_id)
        return table is not None and len(table.block_ids) <= len(self._swap_free)

    def swap_out(self, req: Request) -> list[tuple[int, int]]:
        """Moves req's blocks to host blocks; returns (device, host) copies."""
        table = self._tables[req.request_id]
        pairs = [(bid, self._swap_free.pop()) for bid in table.block_ids]
        self._swapped[req.request_id] = [h for _, h in pairs]
        self._release(self._tables.pop(req.request_id))
        return pairs

    def num_swapped_blocks(self, req: Request) -> int:
        return len(self._swapped.get(req.request_id, []))

    def can_swap_in(self, req: Request, reserve: int = 0) -> bool:
        host = self._swapped.get(req.request_id, [])
        return len(host) + reserve <= len(self._free)

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        """Brings req's host blocks back into fresh device blocks; returns
        (host, device) copies. Call can_swap_in first."""
        host = self._swapped.pop(req.request_id)
        table = self._tables[req.request_id] = _Table()
        pairs = []
        for h in host:
            bid = self._take_free()
            table.block_ids.append(bid)
            pairs.append((h, bid))
        self._swap_free.extend(host)
        return pairs

    # -- invariants (tests) -------------------------------------------------
    def check_invariants(self) -> None:
        refs = [0] * self.num_blocks
        for t in self._tables.values():
            for b in t.block_ids:
                refs[b] += 1
        for blk in self._blocks:
            if blk.ref_count != refs[blk.block_id]:
                raise AssertionError(f"block {blk.block_id}: ref_count {blk.ref_count} != {refs[blk.block_id]} holders")
            if (blk.ref_count == 0) != (blk.block_id in self._free):
                raise AssertionError(f"block {blk.block_id}: free-queue membership wrong")
        for h, bid in self._cached.items():
            if self._blocks[bid].block_hash != h:
                raise AssertionError(f"cache map points at block {bid} with another hash")
        host_used = sum(len(v) for v in self._swapped.values())
        if host_used + len(self._swap_free) != self.num_swap_blocks:
            raise AssertionError("host blocks leaked")
