"""LoRA adapters on the router's side (docs/lora.md): which adapters a model
serves, and which of them sit in the executor's `max_loras` slots.

A request names an adapter by `model`. It runs only while its adapter holds
a slot; the slot is held (pinned) from admission until the executor drops
the sequence (finished, or preempted by recompute; a swapped-out sequence
keeps it). A waiting request whose adapter holds no slot takes a free slot,
else the least recently used slot that no sequence pins; the executor loads
the adapter into it with the step's plan. Where none is free, the request
waits and one resident adapter is set draining (the one with the fewest
sequences): it takes no new request, so its slot frees up as its sequences
end, and the first request refused a slot gets it. Requests behind that one
go on where their adapter is resident and not draining (and requests of the
base model always): the batch stays full, and no request starves. At most
`max_loras` adapters therefore run in any step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int = 0
    targets: tuple[str, ...] = ()


class LoraSlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slot_of: dict[str, int] = {}  # resident adapter -> slot (1..max_loras)
        self.users: dict[str, int] = {}  # adapter -> sequences pinning its slot
        self._lru: OrderedDict[str, None] = OrderedDict()  # resident adapters, least recently used first
        self._pending: list[tuple[int, str, str]] = []  # (slot, name, path) for the next plan
        # The adapter whose slot frees up for a request refused one: it takes
        # no new request until its sequences end and it is evicted.
        self.draining: str | None = None

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """The slot `adapter` computes in, pinned once more; None when every
        slot is pinned by other adapters."""
        name = adapter.name
        slot = self.slot_of.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self.slot_of[name] = slot
            self._pending.append((slot, name, adapter.path))
        self._lru[name] = None
        self._lru.move_to_end(name)
        self.users[name] = self.users.get(name, 0) + 1
        return slot

    def can_acquire(self, name: str) -> bool:
        return name in self.slot_of or len(self.slot_of) < self.max_loras or self._evictable() is not None

    def _evictable(self) -> str | None:
        return next((n for n in self._lru if not self.users.get(n)), None)

    def pick_draining(self) -> None:
        """Keeps the draining adapter while it holds its slot, else picks the
        resident one with the fewest sequences (the least recently used of
        those)."""
        if self.draining in self.slot_of:
            return
        order = list(self._lru)
        self.draining = min(order, key=lambda n: (self.users.get(n, 0), order.index(n)), default=None)

    def _free_slot(self) -> int | None:
        used = set(self.slot_of.values())
        free = next((s for s in range(1, self.max_loras + 1) if s not in used), None)
        if free is not None:
            return free
        victim = self._evictable()
        if victim is None:
            return None
        del self._lru[victim]
        self.users.pop(victim, None)
        if victim == self.draining:
            self.draining = None
        return self.slot_of.pop(victim)

    def release(self, name: str) -> None:
        left = self.users.get(name, 0) - 1
        if left > 0:
            self.users[name] = left
        else:
            self.users.pop(name, None)

    def evict(self, name: str) -> None:
        """Drops an adapter nobody pins from its slot (it was unloaded)."""
        slot = self.slot_of.pop(name, None)
        self._lru.pop(name, None)
        if slot is not None:
            self._pending.append((slot, "", ""))

    def take_pending(self) -> list[tuple[int, str, str]]:
        out, self._pending = self._pending, []
        return out

    @property
    def resident(self) -> list[str]:
        return list(self.slot_of)
