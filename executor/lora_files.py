"""A LoRA adapter's directory and config, read without torch
(executor/lora.py reads its weights; executor/preflight.py refuses a bad
adapter named at start before torch loads)."""

from __future__ import annotations

import json
import math
import os

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTN_TARGETS + MLP_TARGETS
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoraError(ValueError):
    """An adapter that cannot be served; the message says why."""


def read_config(path: str) -> dict:
    """The adapter directory's adapter_config.json."""
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoraError(f"{path}: not a directory (a PEFT adapter is a directory with {CONFIG_FILE})")
    if not os.path.isfile(cfg_path):
        raise LoraError(f"{path}: no {CONFIG_FILE}; not a PEFT adapter directory")
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as exc:
        raise LoraError(f"{cfg_path}: not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{cfg_path}: expected a JSON object")
    return cfg


def check_config(cfg: dict, where: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from a PEFT LoRA config; refuses what is not plain LoRA."""
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoraError(f"{where}: peft_type {kind!r} is not LORA")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError(f"{where}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoraError(f"{where}: rank {r} is over lora.max_lora_rank ({max_rank})")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    unsupported = {
        "use_dora": cfg.get("use_dora"),
        "fan_in_fan_out": cfg.get("fan_in_fan_out"),
        "modules_to_save": cfg.get("modules_to_save"),
        "rank_pattern": cfg.get("rank_pattern"),
        "alpha_pattern": cfg.get("alpha_pattern"),
    }
    for key, value in unsupported.items():
        if value:
            raise LoraError(f"{where}: {key} is not supported (got {value!r})")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias {cfg['bias']!r} is not supported (only 'none')")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = [t for t in targets if t not in TARGETS]
        if bad:
            raise LoraError(f"{where}: target module {bad[0]!r} is not one of {', '.join(TARGETS)}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scaling)


def check_dir(path: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of the adapter directory at `path`: its config
    checked, its weights file present (not yet read)."""
    rank, scaling = check_config(read_config(path), os.path.join(path, CONFIG_FILE), max_rank)
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        extra = (
            " (adapter_model.bin is not read: save it with safe_serialization)"
            if os.path.isfile(os.path.join(path, "adapter_model.bin"))
            else ""
        )
        raise LoraError(f"{path}: no {WEIGHTS_FILE}{extra}")
    return rank, scaling
