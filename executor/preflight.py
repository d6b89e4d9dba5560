"""What the executor refuses from the files and address its arguments name,
before torch loads (executor/args.py runs it from executor/__main__.py).

Importing torch and transformers takes seconds, and loading a real model's
weights takes longer still: a checkpoint whose files are cut short, weights
larger than the host's memory, a --max-model-len beyond the model's
context, a TCP address another process listens on, or a LoRA adapter that
is not one are all known from the files and the address alone, so they are
refused first, naming the problem. Only what needs the model built (a
config that does not match its weights, a tensor missing, a KV pool that
does not fit beside it) is left to executor/main.py. Every rule here is
also the one the later code applies, so nothing servable is refused early.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import socket
import struct

from executor import lora_files, model_source

# The serving dtypes by --dtype name (main.py's pick_dtype), and their bytes per element.
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
DTYPE_NAMES |= {"float16": "float16", "fp16": "float16"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Safetensors dtypes: the floating ones are cast to the serving dtype on
# load; the others keep their bytes per element.
ST_FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
ST_BYTES_FIXED = {"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class ModelNotServable(ValueError):
    """A model the executor cannot serve: not a decoder-only causal LM, or a
    checkpoint that does not load. The message names the architecture."""


def architecture(path: str) -> str:
    """'<architectures[0]> (model_type <t>)' of a checkpoint directory's config.json."""
    cfg = read_config(path)
    archs = cfg.get("architectures") or ["?"]
    return f"{archs[0]} (model_type {cfg.get('model_type', '?')})"


def read_config(path: str) -> dict:
    """A checkpoint directory's config.json; ModelNotServable where it does not read."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ModelNotServable(f"{path}: config.json cannot be read: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ModelNotServable(f"{path}: config.json is not a JSON object")
    return cfg


def safetensors_header(name: str) -> dict:
    """A safetensors file's header, checked against the file's length:
    ValueError naming what is wrong where the file is cut short or its
    header does not parse (the loader would fail on it the same way)."""
    size = os.path.getsize(name)
    with open(name, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{os.path.basename(name)} holds {size} bytes: no safetensors header")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise ValueError(
                f"{os.path.basename(name)} is cut short: its header takes {length} bytes, the file holds {size}"
            )
        try:
            header = json.loads(fh.read(length))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"{os.path.basename(name)}: the safetensors header does not parse: {exc}") from exc
    if 8 + length + end > size:
        raise ValueError(
            f"{os.path.basename(name)} is cut short: its tensors end at byte {8 + length + end}, the file holds {size}"
        )
    return header


def checkpoint_bytes(path: str, itemsize: int) -> int | None:
    """What the weights of a safetensors checkpoint take once loaded with
    `itemsize` bytes per floating element, read from the files' headers
    alone (ValueError where one is cut short); None without safetensors
    files."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return None
    total = 0
    for name in files:
        for key, t in safetensors_header(name).items():
            if key == "__metadata__":
                continue
            numel = 1
            for d in t["shape"]:
                numel *= int(d)
            total += numel * (itemsize if t["dtype"] in ST_FLOATING else ST_BYTES_FIXED.get(t["dtype"], 8))
    return total


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
        return int(text) if text != "max" else None
    except (OSError, ValueError):
        return None


def host_available_bytes(root: str = "/") -> int | None:
    """Host memory available now: MemAvailable of /proc/meminfo, or less under
    a cgroup memory limit (a Kubernetes pod's: its limit minus its usage, v2 or
    v1); None where neither can be read."""
    avail = None
    try:
        with open(os.path.join(root, "proc/meminfo"), encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    cg = os.path.join(root, "sys/fs/cgroup")
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        limit = _read_int(os.path.join(cg, limit_file))
        usage = _read_int(os.path.join(cg, usage_file))
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes ~2^63 for "no limit"
            left = max(0, limit - usage)
            avail = left if avail is None else min(avail, left)
            break
    return avail


def check_weights_fit(path: str, itemsize: int, dtype_name: str, device_type: str, free: int | None) -> None:
    """Refuses a checkpoint whose weights alone exceed `free` bytes of
    `device_type` memory (else the kernel's OOM killer ends the executor
    mid-load with no word of why)."""
    try:
        need = checkpoint_bytes(path, itemsize)
    except (OSError, ValueError, KeyError, TypeError):
        return  # the loader says what is wrong with the files
    if need is not None and free is not None and need > free:
        raise ModelNotServable(
            f"{architecture(path)} at {path}: its weights take {need / 2**30:.1f} GiB in "
            f"{dtype_name}, more than the {free / 2**30:.1f} GiB of {device_type} memory available"
        )


def check_max_model_len(requested: int, model_len: int) -> None:
    """ValueError for a --max-model-len beyond the model's positions."""
    if requested > model_len:
        raise ValueError(f"--max-model-len {requested} is beyond the model's context ({model_len} positions)")


def check_listen_free(address: str) -> None:
    """OSError where another socket already listens on the TCP `address`
    (host:port) the executor is to serve: the bind gRPC makes after the
    load would fail. Probed with SO_REUSEADDR, as gRPC binds, so a port
    left in TIME_WAIT by an earlier executor passes; a unix socket path is
    always taken over (build_server). A host that does not resolve here is
    left to gRPC."""
    if address.startswith("unix:"):
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM)
    except OSError:
        return
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                raise OSError(f"cannot listen on {address}: {exc.strerror}") from None
            raise


def _cpu_dtype(dtype: str, device: str) -> str | None:
    """The dtype main.py will serve in (model_loader.pick_dtype) on the CPU;
    None where it does not serve on the CPU for certain (`auto`: a GPU, if
    torch sees one) or refuses the name."""
    if device.split(":")[0] != "cpu":
        return None
    if dtype != "auto":
        return DTYPE_NAMES.get(dtype)
    from executor.cpu.isa import cpu_has_native_bf16

    return "bfloat16" if cpu_has_native_bf16() else "float32"


def check_model(model: str, dtype: str, device: str, max_model_len: int) -> None:
    """What the model's files refuse (ModelNotServable, ValueError,
    FileNotFoundError): a spec that names no model, a checkpoint whose
    config.json or safetensors files do not read or are cut short, weights
    larger than the host's available memory (on the CPU), a
    --max-model-len beyond the config's max_position_embeddings."""
    source = model_source.resolve(model)
    if source.kind == "tiny":
        cfg = model_source.tiny_config_dict(source)
    elif source.kind == "hf_dir":
        path = source.path
        cfg = read_config(path)
        for name in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            try:
                safetensors_header(name)
            except (OSError, ValueError) as exc:
                raise ModelNotServable(f"{architecture(path)} at {path} does not load: {exc}") from exc
        serving = _cpu_dtype(dtype, device)
        if serving is not None:
            check_weights_fit(path, DTYPE_BYTES[serving], serving, "cpu", host_available_bytes())
    else:
        return  # a GGUF file's context and weights are read by the loader
    # The runner reads model.config.max_position_embeddings; a config.json
    # without it takes its class's default, which only transformers knows.
    model_len = cfg.get("max_position_embeddings")
    if max_model_len > 0 and isinstance(model_len, int):
        check_max_model_len(max_model_len, model_len)


def check_lora_modules(specs: list[str], max_loras: int, max_rank: int) -> None:
    """ValueError for --lora-modules without LoRA slots, or a NAME=PATH
    whose directory is not a PEFT LoRA adapter the limits allow (its
    weights' shapes are checked against the model once it is loaded)."""
    if specs and max_loras <= 0:
        raise ValueError("--lora-modules needs --max-loras > 0")
    for spec in specs:
        name, _, path = spec.partition("=")
        try:
            lora_files.check_dir(path, max_rank)
        except (ValueError, OSError) as exc:
            raise ValueError(f"lora adapter {name!r}: {exc}") from exc
