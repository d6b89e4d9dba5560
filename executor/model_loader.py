"""Loads the model (transformers definition, weights in the chosen dtype)."""

from __future__ import annotations

import json
import os
import time

import structlog
import torch

from common.model_cache import EXPORT_STAMP, converted_complete, default_converted_dir, gguf_converted_dir
from executor.args import check_device
from executor.cpu.isa import cpu_has_native_bf16
from executor.model_source import GGUF_FILE as GGUF_FILE_DEFAULT
from executor.model_source import ModelSource, tiny_config_dict
from executor.preflight import ModelNotServable, architecture, check_weights_fit

_LOGGER = structlog.get_logger(__name__)


def pick_device(name: str) -> torch.device:
    """'auto' is the first CUDA GPU when torch sees one, else the CPU; 'cpu',
    'cuda' or 'cuda:N' ask for that device and fail clearly without it."""
    check_device(name)
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cpu":
        return device
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = 0 if device.index is None else device.index
    if index >= count:
        raise ValueError(
            f"device {name!r}: torch sees {count} CUDA device(s)"
            + ("" if torch.version.cuda else " (this torch is a CPU build)")
        )
    return torch.device("cuda", index)


def pick_dtype(name: str, device: torch.device = torch.device("cpu")) -> torch.dtype:
    """'auto' is bf16 on a GPU and where the CPU computes it natively, fp32 otherwise."""
    if name in ("bfloat16", "bf16"):
        return torch.bfloat16
    if name in ("float32", "fp32"):
        return torch.float32
    if name in ("float16", "fp16"):
        return torch.float16
    if name != "auto":
        raise ValueError(f"dtype {name!r} is not auto|bfloat16|float32|float16")
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def build_tiny(source: ModelSource, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(source.seed)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config_dict(source)))
    return model.to(dtype)


def _converted_dir(source: ModelSource) -> str:
    """Where a GGUF file's dequantised checkpoint is kept (common.model_cache:
    the router reads its tokenizer there)."""
    if source.gguf_file == GGUF_FILE_DEFAULT:
        return default_converted_dir()
    return gguf_converted_dir(os.path.join(source.path, source.gguf_file))


def export_gguf_checkpoint(source: ModelSource, dest: str, force: bool = False) -> str:
    """Writes a plain HF checkpoint (config.json, model.safetensors in fp32,
    tokenizer, generation_config) of a GGUF model to dest; idempotent.

    transformers refuses save_pretrained on a GGUF-loaded model, so the
    dequantised state dict, config and tokenizer are written directly. Other
    engines (the vLLM peer of the benchmarks) load the same directory.
    """
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if converted_complete(dest) and not force:
        _LOGGER.info("reusing converted GGUF checkpoint", dest=dest)
        return dest
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    tmp = f"{dest}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("torch_dtype", None)
    config["dtype"] = "float32"
    config["architectures"] = [type(model).__name__]
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {
        k: v.detach().to(torch.float32).contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }  # tied weights are stored once
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    model.generation_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    seconds = round(time.perf_counter() - t0, 1)
    with open(os.path.join(tmp, EXPORT_STAMP), "w", encoding="utf-8") as fh:
        json.dump({"source": f"{source.path}/{source.gguf_file}", "seconds": seconds}, fh)
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    if os.path.isdir(dest):
        shutil.rmtree(dest, ignore_errors=True)
    try:
        os.rename(tmp, dest)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    _LOGGER.info("converted GGUF checkpoint", dest=dest, seconds=seconds)
    return dest


# GGUF tensor types served under --dtype auto: plain floats, and the block
# types the CPU kernels read (executor/cpu/gguf_weights.py). Any other would
# be expanded to bf16 or fp32 (about 3.5x a 4-bit file's bytes) without a
# word: it is refused instead, and an explicit --dtype expands it.
GGUF_SERVED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


def _gguf_reader(source: ModelSource):
    """gguf-py's reader of a GGUF source's file, or None (another source, or
    a file it cannot read: the loader then says what is wrong with it).
    Parsing the header takes seconds (2 s for SmolLM2, 4-5 s for a 1B file:
    the vocabulary's strings), so one reader serves a whole load."""
    if source.kind != "gguf":
        return None
    from gguf import GGUFReader

    try:
        return GGUFReader(os.path.join(source.path, source.gguf_file))
    except Exception:  # noqa: BLE001  (gguf-py raises several kinds on a damaged file)
        return None


def check_gguf_types(source: ModelSource, reader=None) -> None:
    """ModelNotServable naming the first tensor of a GGUF file whose type
    is not one of GGUF_SERVED_TYPES (a no-op for other sources, and for a
    file that does not read). `reader`: the file's, where one is open."""
    reader = reader if reader is not None else _gguf_reader(source)
    if reader is None:
        return
    bad = [(t.name, t.tensor_type.name) for t in reader.tensors if t.tensor_type.name not in GGUF_SERVED_TYPES]
    if bad:
        name, kind = bad[0]
        more = (
            f" (and {len(bad) - 1} more tensors of types {', '.join(sorted({k for _, k in bad}))})"
            if len(bad) > 1
            else ""
        )
        raise ModelNotServable(
            f"{source.gguf_file}: tensor {name} is {kind}{more}, a GGUF type cbserve has no kernel for "
            f"(it serves {', '.join(GGUF_SERVED_TYPES)}); --dtype bfloat16 or float32 serves it expanded to that type"
        )


def checkpoint_dir(source: ModelSource) -> str | None:
    """A HF directory holding the model's weights and tokenizer (None for tiny)."""
    if source.kind == "gguf":
        return export_gguf_checkpoint(source, _converted_dir(source))
    if source.kind == "hf_dir":
        return source.path
    return None


# The sampling fields of a generation config that become the OpenAI API's
# defaults (vLLM's --generation-config auto takes the same ones). Their
# ranges are the router's to judge (router/validation.py).
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _token_ids(value) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value or []]


def generation_facts(model: torch.nn.Module) -> tuple[list[int], dict[str, float]]:
    """The end-of-sequence ids (config.json's, then those the generation
    config adds: Llama 3 Instruct's <|eot_id|> is only there) and the
    sampling values the generation config sets away from transformers'
    defaults (a config derived from config.json sets none)."""
    eos = _token_ids(model.config.eos_token_id)
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return eos, {}
    eos += [i for i in _token_ids(gen.eos_token_id) if i not in eos]
    diff = gen.to_diff_dict()
    defaults: dict[str, float] = {}
    for name in SAMPLING_DEFAULT_FIELDS:
        value = diff.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (name == "top_k" and value != int(value)):
            _LOGGER.warning("generation config value left out", field=name, value=repr(value)[:64])
            continue
        defaults[name] = int(value) if name == "top_k" else float(value)
    return eos, defaults


def check_causal_lm(path: str) -> None:
    """Refuses a checkpoint that transformers has no causal-LM class for
    (an encoder-decoder like T5, an encoder like BERT, an unknown type)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
        model_type = json.load(fh).get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelNotServable(
            f"{architecture(path)}: not a decoder-only causal LM that transformers can build "
            "(cbserve serves the AutoModelForCausalLM architectures)"
        )


def _check_fits(path: str, dtype: torch.dtype, device: torch.device) -> None:
    """Refuses a checkpoint whose weights alone exceed the memory `device`
    has available, before loading starts (executor/preflight.py refused it
    already where the device is the CPU)."""
    from executor.kv_cache import available_bytes

    name = str(dtype).removeprefix("torch.")
    check_weights_fit(path, dtype.itemsize, name, device.type, available_bytes(str(device)))


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device = torch.device("cpu"),
    quantization: str = "none",
    check_types: bool = False,
) -> torch.nn.Module:
    """The causal LM in eval mode, on `device`, in `dtype`; with
    quantization "int8", its projections as int8 weights
    (executor/cpu/int8_weights.py). ModelNotServable where the checkpoint is
    not one or does not load, or the quantization cannot be served, or
    (`check_types`: --dtype auto) a GGUF tensor's type is not served
    (check_gguf_types)."""
    t0 = time.perf_counter()
    _check_quantization(source, dtype, device, quantization)
    reader = _gguf_reader(source)
    if check_types:
        check_gguf_types(source, reader)
    if source.kind == "tiny":
        model = build_tiny(source, dtype)
    else:
        from transformers import AutoModelForCausalLM

        try:
            path = checkpoint_dir(source)
        except Exception as exc:  # noqa: BLE001  (transformers' GGUF loader refuses an architecture it lacks)
            raise ModelNotServable(f"{source.gguf_file}: the GGUF file does not load: {exc}") from exc
        if source.kind == "hf_dir":
            check_causal_lm(path)
        _check_fits(path, dtype, device)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
        except Exception as exc:  # noqa: BLE001  (truncated files raise the safetensors library's own error)
            raise ModelNotServable(f"{architecture(path)} at {path} does not load: {exc}") from exc
        # transformers fills weights a checkpoint lacks with random values and
        # only warns: such a model would answer, wrongly.
        missing = sorted(info.get("missing_keys") or [])
        if missing:
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            raise ModelNotServable(
                f"{architecture(path)} at {path} is incomplete: no weights for {', '.join(missing[:4])}{more}"
            )
    model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    blocks = _attach_gguf_blocks(model, reader, dtype, device)
    int8_layers = 0
    if quantization == "int8":
        from executor.cpu import gguf_weights, int8_weights

        int8_layers = int8_weights.quantize(model, attach=gguf_weights.enabled())
    activations = "bf16"
    if blocks or int8_layers:
        from executor.cpu import gguf_weights

        activations = gguf_weights.apply_block_activations()
    _LOGGER.info(
        "model loaded",
        model=source.name,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        seconds=round(time.perf_counter() - t0, 2),
        gguf_block_layers=blocks,
        int8_layers=int8_layers,
        block_activations=activations,
    )
    return model


def _check_quantization(source: ModelSource, dtype: torch.dtype, device: torch.device, quantization: str) -> None:
    """ModelNotServable for a --quantization the model or this machine cannot serve."""
    from executor.cpu import gguf_weights, int8_weights, packed_linear

    if quantization not in int8_weights.METHODS:
        raise ModelNotServable(f"--quantization {quantization!r} is not one of {', '.join(int8_weights.METHODS)}")
    if quantization == "none":
        return
    if source.kind == "gguf":
        raise ModelNotServable(f"--quantization {quantization}: {source.gguf_file} is GGUF, quantized already")
    if device.type != "cpu" or dtype != torch.bfloat16:
        raise ModelNotServable(
            f"--quantization {quantization} runs on the CPU in bfloat16 (not {device.type}, {dtype})"
        )
    if not (gguf_weights.supported() and packed_linear.supported(dtype, device)):
        raise ModelNotServable(f"--quantization {quantization} needs the native block kernels; none run here")


def _attach_gguf_blocks(model: torch.nn.Module, reader, dtype: torch.dtype, device: torch.device) -> int:
    """A GGUF model (`reader`: its file's, None for other sources) on the
    CPU, in bf16 or in fp32 where its linears are prepacked (CPUs without
    AVX512-BF16): its blocks go with the linear layers for the kernels to
    stream (executor/cpu/gguf_weights.py); 0 elsewhere, with a warning saying
    why the weights are expanded."""
    if reader is None:
        return 0
    from executor.cpu import gguf_weights, packed_linear

    why = None
    if device.type != "cpu":
        why = "no GPU kernel reads GGUF blocks"
    elif not packed_linear.prepacked(dtype, device):
        why = f"{str(dtype).removeprefix('torch.')} layers are not prepacked on this CPU"
    elif not gguf_weights.enabled():
        why = f"{gguf_weights.ENV_SWITCH}=0"
    elif not gguf_weights.supported():
        why = f"no vector kernel reads blocks on this CPU ({gguf_weights.ENV_SWITCH}=1: portable code, slower)"
    if why is None:
        return gguf_weights.attach(model, reader)
    if all(t.tensor_type.name in ("F32", "F16", "BF16") for t in reader.tensors):
        return 0  # no blocks to keep
    _LOGGER.warning("GGUF weights expanded from their blocks", reason=why, dtype=str(dtype).removeprefix("torch."))
    return 0
