"""Several models behind one router: each a name, an engine (its own
executor link, scheduler and KV pool) and a tokenizer. A request picks one by
name; an empty name means the first. One executor's failure only touches the
requests of its own model."""

from __future__ import annotations

import asyncio
from typing import Callable

import grpc

from router.engine import Engine
from router.validation import RequestError


class Models:
    """The router's engines by model name; the first is the default."""

    def __init__(self, engines: list[Engine]) -> None:
        if not engines:
            raise ValueError("a router serves at least one model")
        self.engines = engines
        self._by_name = {e.name: e for e in engines}

    @property
    def default(self) -> Engine:
        return self.engines[0]

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.engines]

    def get(self, name: str | None) -> Engine:
        """The engine serving `name` (None or empty: the default); a name not
        served here is NOT_FOUND, naming the ones that are."""
        if not name:
            return self.default
        engine = self._by_name.get(name) or self.adapter_engine(name)
        if engine is None:
            served = ", ".join(repr(n) for n in self.names)
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"model {name[:128]!r} is not served here (served: {served})")
        return engine

    def taken_names(self) -> set[str]:
        """Every name a request can choose: models and their adapters."""
        return {*self._by_name, *(a for e in self.engines for a in e.loras)}

    def adapter_engine(self, name: str) -> Engine | None:
        """The engine whose model serves LoRA adapter `name`, or None."""
        return next((e for e in self.engines if name in e.loras), None)

    def serving(self, engine: Engine | None = None) -> bool:
        """Whether `engine` (default: any model) takes requests now."""
        engines = [engine] if engine is not None else self.engines
        return any(e.ready.is_set() and e.accepting for e in engines)

    def on_ready_change(self, fn: Callable[[Engine, bool], None]) -> None:
        for e in self.engines:
            e.on_ready_change(lambda ready, e=e: fn(e, ready))

    @property
    def in_flight(self) -> int:
        return sum(len(e.handles) for e in self.engines)

    def start(self) -> None:
        for e in self.engines:
            e.start()

    async def drain(self, timeout: float) -> None:
        await asyncio.gather(*(e.drain(timeout) for e in self.engines))

    async def stop(self) -> None:
        await asyncio.gather(*(e.stop() for e in self.engines))
