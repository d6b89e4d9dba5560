"""Scheduling policies, chosen by `scheduler.policy` in the router config."""

from __future__ import annotations

import importlib

from router.config import ConfigError, SchedulerConfig
from router.policies.base import Policy
from router.policies.fair import FairPolicy
from router.policies.fcfs import FCFSPolicy
from router.policies.priority import PriorityPolicy
from router.policies.sjf import SJFPolicy
from router.policies.slo import SloPolicy
from router.policies.static import DynamicPolicy, StaticPolicy

BUILTIN = {
    p.name: p for p in (FCFSPolicy, SJFPolicy, PriorityPolicy, StaticPolicy, DynamicPolicy, FairPolicy, SloPolicy)
}


def make_policy(cfg: SchedulerConfig) -> Policy:
    """A policy instance by name, or from 'module:Class' (an operator's own)."""
    if cfg.policy in BUILTIN:
        return BUILTIN[cfg.policy](cfg)
    module_name, _, class_name = cfg.policy.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"scheduler.policy: cannot load {cfg.policy!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ConfigError(f"scheduler.policy: {cfg.policy!r} is not a router.policies.Policy subclass")
    return cls(cfg)


__all__ = ["Policy", "make_policy", "BUILTIN"]
