"""LoRA adapters on the executor (docs/lora.md).

An adapter is a PEFT directory (adapter_config.json and
adapter_model.safetensors) whose targets are any of the decoder layers'
q/k/v/o and gate/up/down projections. `read_adapter` checks it against the
model and refuses, naming the problem, anything it cannot serve exactly.

The router registers adapters (`LoadLora`: read, checked, kept in a host
cache of `max_cpu_loras`) and puts them in `max_loras` slots with a plan's
`lora_slots`; each new sequence names its slot. A step groups its rows by
slot. Every projection runs once over the whole packed batch, as without
LoRA; then each targeted projection adds, for each slot's rows, PEFT's delta

    y += (x A^T) B^T * scaling      (scaling = alpha / r, or alpha / sqrt(r) with rslora)

computed in fp32 (PEFT keeps adapter weights in fp32 over a bf16 model) and
rounded once into y. Rows of the base model cost nothing, and a step with
none but them runs exactly as without LoRA.

The hooks: the lean forward calls `add` after its fused q|k|v (per slice),
o_proj and down projection, and runs a LoRA step's gate|up through
FusedMLP.projection, the delta, then the activation (`mlp`). The
transformers forward runs through `LoraLinear` wrappers of the targeted
modules (and `LoraMLP` around a FusedMLP).
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import structlog
import torch

from executor.errors import PlanError
from executor.lora_files import (  # noqa: F401  (LoraError and TARGETS are this module's API too)
    ATTN_TARGETS,
    CONFIG_FILE,
    MLP_TARGETS,
    TARGETS,
    WEIGHTS_FILE,
    LoraError,
    check_dir,
)

_LOGGER = structlog.get_logger(__name__)

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.([A-Za-z_]+)\.lora_([AB])\.weight$")


@dataclass
class Adapter:
    name: str
    rank: int
    scaling: float
    # (layer, target) -> (A [r, in], B [out, r]), fp32.
    mats: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def targets(self) -> list[str]:
        return sorted({t for _, t in self.mats}, key=TARGETS.index)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.mats.values())


def base_shapes(model: torch.nn.Module) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, target) -> (in_features, out_features) of each projection the
    model has under PEFT's names (taken before any fusing replaces them)."""
    shapes = {}
    for i, layer in enumerate(getattr(model.model, "layers", [])):
        for part, names in (("self_attn", ATTN_TARGETS), ("mlp", MLP_TARGETS)):
            parent = getattr(layer, part, None)
            for name in names:
                mod = getattr(parent, name, None)
                if isinstance(getattr(mod, "in_features", None), int):
                    shapes[(i, name)] = (mod.in_features, mod.out_features)
    return shapes


def read_adapter(name: str, path: str, shapes: dict[tuple[int, str], tuple[int, int]], max_rank: int) -> Adapter:
    """The adapter at `path`, checked against the model's projections."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    rank, scaling = check_dir(path, max_rank)
    weights = os.path.join(path, WEIGHTS_FILE)
    try:
        tensors = load_file(weights)
    except (OSError, SafetensorError, ValueError) as exc:
        raise LoraError(f"{weights}: not a readable safetensors file ({exc})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    layers = 1 + max((i for i, _ in shapes), default=-1)
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoraError(f"{weights}: tensor {key!r} is not a LoRA weight of a decoder projection")
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        if target not in TARGETS:
            raise LoraError(f"{weights}: target module {target!r} is not one of {', '.join(TARGETS)}")
        if layer >= layers:
            raise LoraError(f"{weights}: {key!r} is for layer {layer}; the model has {layers}")
        if (layer, target) not in shapes:
            raise LoraError(f"{weights}: the model's layer {layer} has no {target} projection for {key!r}")
        pairs.setdefault((layer, target), {})[ab] = t
    if not pairs:
        raise LoraError(f"{weights}: no LoRA weights")
    adapter = Adapter(name, rank, scaling)
    for (layer, target), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{target}"
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{weights}: {where} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[(layer, target)]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraError(
                f"{weights}: {where} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; rank {rank} "
                "needs [r, in] and [out, r]"
            )
        if a.shape[1] != fan_in or b.shape[0] != fan_out:
            raise LoraError(
                f"{weights}: {where} maps {a.shape[1]} -> {b.shape[0]} features; the model's {target} "
                f"maps {fan_in} -> {fan_out}"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoraError(f"{weights}: {where} is not floating point")
        adapter.mats[(layer, target)] = (a.float().contiguous(), b.float().contiguous())
    return adapter


class LoraManager:
    """The host cache, the slots, and the current step's rows by slot.

    Each projection has a stack per slot (`_Stack`): A and B transposed,
    [S, K, R] and [S, R, N] in fp32, with the slot's rank (0: its adapter
    leaves the projection alone) and scaling; R is the largest rank of the
    adapters put in slots so far, rounded up to 16 (lora_add's lanes), an
    adapter's rows past its own rank zero. Putting an adapter in a slot copies it
    there; a step then computes every slot's rows of a projection in one
    native call (`lora_add`), or by torch ops per slot off the CPU."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int) -> None:
        self.shapes = base_shapes(model)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.device = next(model.parameters()).device
        self.cache: OrderedDict[str, Adapter] = OrderedDict()  # least recently used first
        self.slots: list[Adapter | None] = [None] * (max_loras + 1)  # slot 0: the base model
        self.broken: dict[int, str] = {}  # slot -> why its adapter could not be read
        self.stacks: dict[tuple[int, str], _Stack] = {}
        self.stack_rank = 0
        from executor.cpu.packed_linear import _fused

        self._native = getattr(_fused(), "lora_add", None) if self.device.type == "cpu" else None
        self._rows_sampled: torch.Tensor | None = None
        self._slots_sampled: list[int] = []
        self.rows: torch.Tensor | None = None  # int32 [T]: the rows' slots while a step with adapter rows runs
        self.row_list: list[int] = []
        self.active: list[int] = []  # the slots of this step's rows

    # -- adapters and slots ---------------------------------------------------
    def load(self, name: str, path: str) -> Adapter:
        """Reads and checks the adapter; keeps it in the host cache."""
        adapter = read_adapter(name, path, self.shapes, self.max_rank)
        self._cache_put(adapter)
        _LOGGER.info(
            "lora adapter read",
            name=name,
            rank=adapter.rank,
            targets=adapter.targets,
            mb=round(adapter.nbytes / 2**20, 1),
        )
        return adapter

    def _cache_put(self, adapter: Adapter) -> None:
        self.cache[adapter.name] = adapter
        self.cache.move_to_end(adapter.name)
        keep = {id(a) for a in self.slots if a is not None} | {id(adapter)}
        for name in list(self.cache):
            if len(self.cache) <= self.max_cpu_loras:
                break
            if id(self.cache[name]) not in keep:
                del self.cache[name]

    def assign(self, slot: int, name: str, path: str, in_use: set[int]) -> None:
        """Puts adapter `name` in `slot` (empty name: clears it). A slot a
        held sequence uses is refused (PlanError: the router's state is
        wrong); an adapter that cannot be read marks the slot broken, and the
        sequences that name it fail alone."""
        if not 1 <= slot <= self.max_loras:
            raise PlanError(f"lora slot {slot} outside [1, {self.max_loras}]")
        if slot in in_use:
            raise PlanError(f"lora slot {slot} is reassigned while a sequence uses it")
        self.broken.pop(slot, None)
        adapter = None
        if name:
            adapter = self.cache.get(name)
            if adapter is None:
                try:
                    adapter = self.load(name, path)
                except (LoraError, OSError) as exc:
                    self.broken[slot] = f"lora adapter {name!r}: {exc}"
            else:
                self.cache.move_to_end(name)
        self.slots[slot] = adapter
        self._install(slot, adapter)

    def _install(self, slot: int, adapter: Adapter | None) -> None:
        """Copies the adapter into every projection's stack at `slot` (None:
        the slot's ranks become 0)."""
        if adapter is not None and adapter.rank > self.stack_rank:
            self._grow(-(-adapter.rank // 16) * 16)
        i = slot - 1
        with torch.no_grad():
            for key, st in self.stacks.items():
                mats = adapter.mats.get(key) if adapter is not None else None
                if mats is None:
                    st.ranks[i] = 0
                    st.rank_list[i] = 0
                    continue
                a, b = mats
                r = a.shape[0]
                st.at[i].zero_()
                st.bt[i].zero_()
                st.at[i, :, :r].copy_(a.t())
                st.bt[i, :r].copy_(b.t())
                st.ranks[i] = r
                st.rank_list[i] = r
                st.scales[i] = adapter.scaling

    def _grow(self, rank: int) -> None:
        """Stacks of rank `rank` (the slots' contents kept)."""
        old, self.stacks = self.stacks, {}
        for key, (fan_in, fan_out) in self.shapes.items():
            st = _Stack(self.max_loras, rank, fan_in, fan_out, self.device)
            prev = old.get(key)
            if prev is not None:
                st.at[:, :, : self.stack_rank].copy_(prev.at)
                st.bt[:, : self.stack_rank].copy_(prev.bt)
                st.ranks.copy_(prev.ranks)
                st.scales.copy_(prev.scales)
                st.rank_list = list(prev.rank_list)
            self.stacks[key] = st
        self.stack_rank = rank

    def slot_error(self, slot: int) -> str | None:
        """Why a sequence cannot use `slot`, or None."""
        if slot == 0:
            return None
        if not 1 <= slot <= self.max_loras:
            return f"lora slot {slot} outside [1, {self.max_loras}]"
        if slot in self.broken:
            return self.broken[slot]
        if self.slots[slot] is None:
            return f"lora slot {slot} holds no adapter"
        return None

    # -- one step -----------------------------------------------------------------
    def begin(self, row_slots: list[int] | None, sampled_rows: list[int] | None = None) -> None:
        """The step's rows by slot (None: no adapter rows), and the rows that
        sample (the lean forward's last layer runs only those)."""
        if not row_slots:
            self.end()
            return
        self._slots_sampled = [row_slots[r] for r in sampled_rows] if sampled_rows is not None else []
        self._rows_sampled = torch.tensor(self._slots_sampled, dtype=torch.int32, device=self.device)
        self._use(torch.tensor(row_slots, dtype=torch.int32, device=self.device), row_slots)

    def use_sampled(self) -> None:
        self._use(self._rows_sampled, self._slots_sampled)

    def _use(self, rows: torch.Tensor | None, slots: list[int]) -> None:
        self.row_list = slots
        self.active = sorted({s for s in slots if s})
        self.rows = rows if self.active else None

    def end(self) -> None:
        self.rows = self._rows_sampled = None
        self._slots_sampled = self.row_list = []
        self.active = []

    def _stack(self, layer: int, target: str) -> "_Stack | None":
        """The projection's stack where an adapter of this step's rows changes it, else None."""
        st = self.stacks.get((layer, target))
        if st is None or not any(st.rank_list[s - 1] for s in self.active):
            return None
        return st

    def targets(self, layer: int, *names: str) -> bool:
        """Whether an adapter of this step's rows changes one of these projections."""
        return any(self._stack(layer, n) is not None for n in names)

    def add(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor, col: int = 0) -> None:
        """out[rows, col : col + width] += each row's adapter's delta of
        `target` over x[rows]; x [T, in], out [T, >= col + width] (2-D)."""
        st = self._stack(layer, target)
        if st is None or self.rows is None:
            return
        if self._native is not None:
            self._native(x.contiguous(), out, col, self.rows, st.at, st.bt, st.ranks, st.scales)
            return
        for s in self.active:  # off the CPU: torch ops per slot
            r = st.rank_list[s - 1]
            if not r:
                continue
            idx = torch.tensor([i for i, v in enumerate(self.row_list) if v == s], device=x.device)
            xs = x.index_select(0, idx).float()
            delta = (xs @ st.at[s - 1, :, :r]) @ st.bt[s - 1, :r] * float(st.scales[s - 1])
            width = st.bt.shape[2]
            part = out[idx, col : col + width]
            out[idx, col : col + width] = (part.float() + delta).to(out.dtype)

    def mlp(self, layer: int, mlp: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        """A FusedMLP on [T, H] rows with this step's deltas."""
        if self.targets(layer, "gate_proj", "up_proj"):
            gu = mlp.projection(h)
            self.add(layer, "gate_proj", h, gu, 0)
            self.add(layer, "up_proj", h, gu, mlp.inter)
            a = mlp.activate(gu)
        else:
            a = mlp.act(h)
        out = mlp.down(a)
        self.add(layer, "down_proj", a, out)
        return out


class _Stack:
    """One projection's adapters by slot (index slot - 1)."""

    def __init__(self, slots: int, rank: int, fan_in: int, fan_out: int, device: torch.device) -> None:
        self.at = torch.zeros(slots, fan_in, rank, device=device)
        self.bt = torch.zeros(slots, rank, fan_out, device=device)
        self.ranks = torch.zeros(slots, dtype=torch.int32)
        self.scales = torch.zeros(slots)
        self.rank_list = [0] * slots  # the same ranks, read per call without a tensor access


class LoraLinear(torch.nn.Module):
    """A targeted projection of the transformers forward: the base module,
    then the step's deltas."""

    def __init__(self, base: torch.nn.Module, lora: LoraManager, layer: int, target: str) -> None:
        super().__init__()
        self.base = base
        self._lora = (lora,)  # not a submodule
        self.layer = layer
        self.target = target
        self.in_features = base.in_features
        self.out_features = base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        lora = self._lora[0]
        if lora.rows is not None:
            lora.add(self.layer, self.target, x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1]))
        return out


class LoraMLP(torch.nn.Module):
    """A FusedMLP in the transformers forward, with the step's deltas."""

    def __init__(self, mlp: torch.nn.Module, lora: LoraManager, layer: int) -> None:
        super().__init__()
        self.fused = mlp
        self._lora = (lora,)
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self._lora[0]
        if lora.rows is None:
            return self.fused(x)
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return lora.mlp(self.layer, self.fused, flat).reshape(*x.shape[:-1], -1)


def wrap_transformers_modules(model: torch.nn.Module, lora: LoraManager) -> None:
    """Wraps the targetable projections of every decoder layer (the
    transformers forward)."""
    from executor.cpu.fused_modules import FusedMLP

    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for name in ATTN_TARGETS:
            if (i, name) in lora.shapes:
                setattr(attn, name, LoraLinear(getattr(attn, name), lora, i, name))
        if isinstance(layer.mlp, FusedMLP):
            layer.mlp = LoraMLP(layer.mlp, lora, i)
            continue
        for name in MLP_TARGETS:
            if (i, name) in lora.shapes:
                setattr(layer.mlp, name, LoraLinear(getattr(layer.mlp, name), lora, i, name))
