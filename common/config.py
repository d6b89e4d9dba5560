"""The configuration both processes read: the YAML loader, its typed-section
builder, and the `cache:` section (the executor sizes its KV pool from it, the
router its block tables). The router's own sections live in router/config.py.

`ConfigError` carries a message an operator can act on; nothing here asserts
on user input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import yaml

KV_CACHE_DTYPES = ("auto", "fp8_e5m2")


class ConfigError(ValueError):
    """The configuration is invalid; the message says which key and why."""


@dataclass
class CacheConfig:
    # Tokens per KV block; the executor allocates its pool with this size.
    block_size: int = 16
    # Device KV blocks; 0 = derive from kv_cache_bytes.
    num_blocks: int = 0
    # KV pool size in bytes when num_blocks and memory_fraction are 0.
    kv_cache_bytes: int = 1 << 30
    # When > 0 (and num_blocks is 0): the KV pool takes this share of the
    # memory available to it once the model is loaded (free GPU memory, or
    # the host's / the container's available memory on the CPU).
    memory_fraction: float = 0.0
    # Host memory for swap preemption (executor side).
    swap_space_bytes: int = 256 << 20
    # Share of blocks kept free when admitting new prompts, so running
    # sequences can grow without immediate preemption.
    watermark: float = 0.01
    # Requests sharing a prompt prefix share its KV blocks.
    enable_prefix_caching: bool = True
    # Storage of the executor's KV blocks: 'auto' (the model's dtype) or
    # 'fp8_e5m2' (one byte per value, CPU only: twice the blocks for the same
    # bytes and half the bytes each decode step reads, at 2 mantissa bits).
    kv_cache_dtype: str = "auto"


def read_yaml(path: str) -> Any:
    """The parsed YAML document at `path`; ConfigError when unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            return yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path!r}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from exc


def build_section(cls: type, data: Any, where: str) -> Any:
    """An instance of the dataclass `cls` from a mapping: unknown keys and
    values of the wrong type are refused, nested dataclasses built in turn."""
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{where}.{key}: unknown key (known: {known})")
        f = fields[key]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            kwargs[key] = build_section(type(default), value, f"{where}.{key}")
            continue
        kwargs[key] = _coerce(value, type(default), f"{where}.{key}")
    return cls(**kwargs)


def _coerce(value: Any, typ: type, where: str) -> Any:
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def positive(value: float, where: str, allow_zero: bool = False) -> None:
    """Refuses a negative value (and zero unless `allow_zero`)."""
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{where}: must be {bound}, got {value}")


def validate_cache(c: CacheConfig) -> CacheConfig:
    """Checks the cache section's rules; returns it or raises ConfigError."""
    if c.block_size < 1 or c.block_size & (c.block_size - 1) or c.block_size > 128:
        raise ConfigError(f"cache.block_size: must be a power of two in [1, 128], got {c.block_size}")
    positive(c.num_blocks, "cache.num_blocks", True)
    positive(c.kv_cache_bytes, "cache.kv_cache_bytes")
    positive(c.swap_space_bytes, "cache.swap_space_bytes", True)
    if not 0 <= c.memory_fraction <= 0.95:
        raise ConfigError(
            f"cache.memory_fraction: must be in [0, 0.95] (0 = use kv_cache_bytes), got {c.memory_fraction}"
        )
    if c.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"cache.kv_cache_dtype: {c.kv_cache_dtype!r} must be one of {', '.join(KV_CACHE_DTYPES)}")
    if not 0 <= c.watermark < 0.5:
        raise ConfigError(f"cache.watermark: must be in [0, 0.5), got {c.watermark}")
    return c


def load_cache_config(path: str | None) -> CacheConfig:
    """The validated `cache:` section of a config file (defaults when `path`
    is None or the section is absent). The other sections are the router's:
    it validates them when it loads the same file."""
    if not path:
        return CacheConfig()
    data = read_yaml(path)
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping, got {type(data).__name__}")
    return validate_cache(build_section(CacheConfig, (data or {}).get("cache"), "config.cache"))
