"""`cbserve executor`: loads the model, sizes the KV pool, serves plans."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import os
import signal
import sys

import structlog
import torch

from common.config import CacheConfig, ConfigError
from common.logging_setup import configure_logging
from executor import lifeline, model_loader, model_source
from executor.args import checked, refused
from executor.kv_cache import CacheShape, KVCacheTooLarge, available_bytes, cache_dtype
from executor.metrics import ExecutorMetrics
from executor.runner import ModelRunner
from executor.server import ExecutorService, build_server, wait_forever

_LOGGER = structlog.get_logger(__name__)


def main(argv: list[str] | None = None) -> int:
    """`python -m executor.main ARGS`: the arguments checked here, then served."""
    args_and_cache = checked(argv)
    return args_and_cache if isinstance(args_and_cache, int) else serve(*args_and_cache)


def serve(args: argparse.Namespace, cache: CacheConfig) -> int:
    """Loads the model and serves plans, for arguments check() passed (and
    `cache`, the cache section it read)."""
    configure_logging("info", "auto", process="executor")
    # Nothing to reload: a hang-up must not kill the model (its default action).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    lifeline.hold()  # started by `cbserve serve`: never outlive it (a no-op if __main__ did)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        source = model_source.resolve(args.model)
        device = model_loader.pick_device(args.device)
        dtype = model_loader.pick_dtype(args.dtype, device)
        kv_dtype = cache_dtype(cache.kv_cache_dtype, dtype, str(device))
        # Under --dtype auto only the GGUF types with kernels: an explicit --dtype expands any.
        model = model_loader.load_model(source, dtype, device, args.quantization, check_types=args.dtype == "auto")
    except (ValueError, FileNotFoundError) as exc:  # ModelNotServable is a ValueError
        return refused(exc)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, cache.block_size, kv_dtype)
    kv_bytes = cache.kv_cache_bytes
    if cache.memory_fraction and not cache.num_blocks:
        free = available_bytes(str(device))
        if free is None:
            return refused(ConfigError("cache.memory_fraction: the available memory cannot be read here"))
        kv_bytes = int(free * cache.memory_fraction)
        if device.type == "cpu":  # the swap pool comes out of the same host memory
            kv_bytes -= cache.swap_space_bytes
        _LOGGER.info("KV pool sized from available memory", available_mb=free >> 20, fraction=cache.memory_fraction)
    num_blocks = cache.num_blocks or shape.blocks_for(kv_bytes)
    if num_blocks < 1:
        return refused(ConfigError("cache: the KV pool would hold no block; give it more memory"))
    num_swap = shape.blocks_for(cache.swap_space_bytes)
    try:
        runner = ModelRunner(
            model,
            cache.block_size,
            num_blocks,
            num_swap,
            args.attention_backend,
            kv_cache_dtype=kv_dtype,
            cuda_graph_max_batch=max(0, args.cuda_graph_max_batch),
            max_model_len=max(0, args.max_model_len),
            max_loras=max(0, args.max_loras),
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=max(0, args.max_cpu_loras),
        )
    except (KVCacheTooLarge, ValueError) as exc:  # ValueError: a --max-model-len beyond the model's
        return refused(exc)
    except Exception as exc:  # noqa: BLE001  (a model whose first forward pieces fail cannot be served either)
        return refused(model_loader.ModelNotServable(f"{type(model).__name__}: cannot be served: {exc!r}"))
    for spec in args.lora_modules:
        name, _, path = spec.partition("=")
        try:
            runner.lora.load(name, path)
        except (ValueError, OSError) as exc:  # LoraError is a ValueError
            return refused(ConfigError(f"lora adapter {name!r}: {exc}"))
    eos_ids, sampling_defaults = model_loader.generation_facts(model)
    metrics = ExecutorMetrics()
    try:
        metrics.serve(args.metrics_port, args.metrics_host)
    except OSError as exc:
        return refused(OSError(f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {exc}"))
    service = ExecutorService(runner, source.name, eos_ids, metrics, sampling_defaults)
    try:
        server, health = build_server(
            service, args.listen, args.tls_cert, args.tls_key, args.tls_client_ca, args.allow_insecure_tcp
        )
    except ValueError as exc:
        return refused(exc)
    except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
        return refused(OSError(f"cannot listen on {args.listen}: {exc}"))
    # What exists now lives as long as the process (modules, parameters,
    # config tables, imported libraries): moved out of the cyclic GC's reach,
    # so a full collection never stalls a step walking them
    # (docs/operations.md, "Pauses").
    gc.collect()
    gc.freeze()
    _LOGGER.info(
        "executor ready",
        frozen_objects=gc.get_freeze_count(),
        rss_mb=_trim_heap(),
        weights_mb=round(runner.weight_bytes / 2**20),
        **_file_mb(source),
        listen=args.listen,
        model=source.name,
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        device=str(device),
        num_blocks=num_blocks,
        block_size=cache.block_size,
        backend=args.attention_backend,
        gpu_lean_forward=runner.gpu is not None,
        cuda_graphs=runner.graph_capture,
        threads=torch.get_num_threads(),
        omp_proc_bind=os.environ.get("OMP_PROC_BIND", ""),
    )
    _signal_ready()
    wait_forever(server, health, service.worker, max(0.0, args.hang_timeout))
    # Stopped: the gRPC server has ended every call. A handler thread of a
    # call its client abandoned (a killed router) can still be blocked, and
    # interpreter exit joins the server's threads: the process ends here so a
    # stopped executor never lingers holding its model and socket.
    _LOGGER.info("executor stopped")
    sys.stdout.flush()
    sys.stderr.flush()
    lifeline.orphaned_exit()
    os._exit(0)


def _signal_ready() -> None:
    """One byte to CBSERVE_READY_FD, where `cbserve serve` started this
    process: it restarts an executor that dies only after this."""
    fd = os.environ.get("CBSERVE_READY_FD")
    if not fd:
        return
    try:
        os.write(int(fd), b"1")
        os.close(int(fd))
    except (OSError, ValueError):
        pass


def _file_mb(source) -> dict:
    """{"gguf_file_mb": size} for a model served from a GGUF file, else {}:
    beside weights_mb, how far its blocks stay as compact as the file."""
    if not getattr(source, "gguf_file", None):
        return {}
    try:
        return {"gguf_file_mb": round(os.path.getsize(os.path.join(source.path, source.gguf_file)) / 2**20)}
    except OSError:
        return {}


def _trim_heap() -> int | None:
    """Hands the heap's free pages back to the OS (glibc malloc_trim) and
    returns the resident set in MB. Loading leaves the GGUF reader's and
    transformers' temporaries freed but resident (docs/operations.md, "Memory")."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            return int(fh.read().split("VmRSS:")[1].split()[0]) // 1024
    except (OSError, IndexError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
