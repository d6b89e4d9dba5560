"""`cbserve executor`'s arguments, and what can be refused from them alone.

Imports nothing heavy: executor/__main__.py checks the arguments before
torch loads, so a typo in --listen or --device, a config file that does
not parse, or a model file or address they name that cannot serve
(executor/preflight.py) is refused (exit 2) at once instead of after the
seconds that importing torch and transformers take (and, on a GPU, CUDA's
start-up), and before any weight is read."""

from __future__ import annotations

import argparse
import re

import structlog

from common.config import CacheConfig, ConfigError, load_cache_config
from executor import model_source, preflight

USAGE_ERROR = 2  # exit status for arguments or config it cannot serve with (argparse's too): no restart
_DEVICE = re.compile(r"auto|cpu(:\d+)?|cuda(:\d+)?")

_LOGGER = structlog.get_logger(__name__)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="cbserve executor", description="`cbserve executor`: loads the model, sizes the KV pool, serves plans."
    )
    p.add_argument(
        "--model",
        default=model_source.DEFAULT_MODEL,
        help="'smollm2' (embedded default), 'tiny[:{json overrides}]', or a local HF checkpoint dir",
    )
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32 | float16")
    p.add_argument(
        "--quantization",
        default="none",
        help="none | int8: the projections as int8 weights, one scale per output channel (CPU, bf16)",
    )
    p.add_argument(
        "--device", default="auto", help="auto (the first CUDA GPU if torch sees one, else cpu) | cpu | cuda | cuda:N"
    )
    p.add_argument("--listen", default="unix:///tmp/cbserve-executor.sock", help="unix:///path or host:port")
    p.add_argument("--config", default=None, help="the router's YAML file: its cache section sizes the KV pool")
    p.add_argument("--attention-backend", default="native", choices=["native", "torch"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument(
        "--max-model-len", type=int, default=0, help="longest sequence served, prompt + output (0 = the model's)"
    )
    p.add_argument(
        "--cuda-graph-max-batch",
        type=int,
        default=256,
        help="on a CUDA GPU: capture decode steps of up to this many sequences as CUDA graphs (0 = eager)",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port of this process (0 = off)")
    p.add_argument("--max-loras", type=int, default=0, help="LoRA adapter slots a step can use (0 = LoRA off)")
    p.add_argument("--max-lora-rank", type=int, default=64, help="the largest LoRA rank accepted")
    p.add_argument("--max-cpu-loras", type=int, default=0, help="adapters kept read in memory (0 = max-loras)")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="adapters read and checked at start (a bad one: exit 2); the router registers them",
    )
    p.add_argument(
        "--metrics-host", default="127.0.0.1", help="address the metrics port binds (0.0.0.0 to let a scraper reach it)"
    )
    p.add_argument("--tls-cert", default="", help="TLS certificate for a TCP listener")
    p.add_argument("--tls-key", default="")
    p.add_argument("--tls-client-ca", default="", help="accept only clients with a certificate this CA signed (mTLS)")
    p.add_argument("--allow-insecure-tcp", action="store_true", help="listen on TCP without TLS (not recommended)")
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=120.0,
        help="health NOT_SERVING while a step runs longer than this (s), so a liveness probe restarts it; 0 = off",
    )
    return p.parse_args(argv)


def check_device(name: str) -> None:
    """ValueError for a --device that is not one of the forms served, whatever
    devices exist (which only torch can tell: model_loader.pick_device)."""
    if not _DEVICE.fullmatch(name):
        raise ValueError(f"device {name!r} is not auto|cpu|cuda|cuda:N")


def check_listen(address: str, tls_cert: str, allow_insecure_tcp: bool) -> None:
    """ValueError for a TCP listener without TLS that is not explicitly
    allowed: anyone who reaches it could drive the executor."""
    if address.startswith("unix://") or tls_cert or allow_insecure_tcp:
        return
    raise ValueError(
        f"--listen {address}: TCP without TLS lets anyone who reaches it drive the executor; "
        "give --tls-cert/--tls-key, or --allow-insecure-tcp"
    )


def check(args: argparse.Namespace) -> CacheConfig:
    """The cache section of --config, once the arguments pass every check
    that needs no model built (executor/preflight.py: the files and the
    address they name included): ConfigError, ValueError (ModelNotServable
    among them) or OSError naming the first that fails."""
    cache = load_cache_config(args.config)
    if args.max_loras < 0 or args.max_lora_rank < 1 or args.max_cpu_loras < 0:
        raise ConfigError("--max-loras and --max-cpu-loras must be >= 0, --max-lora-rank >= 1")
    check_device(args.device)
    check_listen(args.listen, args.tls_cert, args.allow_insecure_tcp)
    preflight.check_lora_modules(args.lora_modules, args.max_loras, args.max_lora_rank)
    preflight.check_model(args.model, args.dtype, args.device, args.max_model_len)
    preflight.check_listen_free(args.listen)
    return cache


def refused(exc: Exception) -> int:
    """Logs why the arguments or config cannot be served; the exit status."""
    _LOGGER.error("executor cannot start", error=str(exc))
    return USAGE_ERROR


def checked(argv: list[str] | None) -> tuple[argparse.Namespace, CacheConfig] | int:
    """The parsed arguments and their cache section once check() passes,
    else refused()'s exit status. executor/__main__.py runs it before torch
    loads and hands what passed to executor.main.serve."""
    args = parse_args(argv)
    try:
        return args, check(args)
    except (ConfigError, ValueError, OSError) as exc:
        from common.logging_setup import configure_logging

        configure_logging("info", "auto", process="executor")
        return refused(exc)
