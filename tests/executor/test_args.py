"""What `cbserve executor`'s arguments, and the files and address they name,
refuse is refused before torch loads: exit 2 with the reason, at once
(executor/args.py, executor/preflight.py)."""

from __future__ import annotations

import json
import math
import socket
import struct
import subprocess
import sys

import pytest

from executor.args import check_device, check_listen
from executor.preflight import check_listen_free, check_model, safetensors_header
from tests.conftest import REPO


def _executor(*args: str) -> subprocess.CompletedProcess:
    """`python -X importtime -m executor ARGS`: its exit status, and in
    stderr every module it imported."""
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "executor", "--model", "tiny", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _imported(stderr: str) -> set[str]:
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--device", "tpu"], "device 'tpu' is not auto|cpu|cuda|cuda:N"),
        (["--listen", "127.0.0.1:1"], "TCP without TLS lets anyone who reaches it drive the executor"),
        (["--config", "/nonexistent/cbserve.yaml"], "cannot read config file '/nonexistent/cbserve.yaml'"),
        (["--max-lora-rank", "0"], "--max-lora-rank >= 1"),
    ],
)
def test_arguments_it_cannot_serve_are_refused_before_torch_loads(args, why):
    out = _executor(*args)
    assert out.returncode == 2, out.stdout + out.stderr[-3000:]
    assert why in out.stdout + out.stderr and "executor cannot start" in out.stdout + out.stderr
    imported = _imported(out.stderr)
    assert "executor.args" in imported and "torch" not in imported and "executor.main" not in imported


def test_arguments_it_can_serve_go_on_to_load_the_model(tmp_path):
    # Whether CUDA device 99 exists only torch can tell: past the early checks.
    out = _executor("--device", "cuda:99", "--listen", f"unix://{tmp_path}/e.sock")
    assert out.returncode == 2 and "torch sees" in out.stdout + out.stderr
    imported = _imported(out.stderr)
    assert "torch" in imported and "executor.main" in imported


def _checkpoint(path, tensors: dict, cut: int = 0, max_positions: int = 2048):
    """A Llama checkpoint's config.json and a model.safetensors of `tensors`
    (name -> (dtype, shape)) whose data is zeros, less its last `cut` bytes."""
    path.mkdir(exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": max_positions}
    (path / "config.json").write_text(json.dumps(cfg))
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * {"F32": 4, "BF16": 2}[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    data = struct.pack("<Q", len(blob)) + blob + bytes(offset)
    (path / "model.safetensors").write_bytes(data[: len(data) - cut])
    return path


def _huge(path):
    """`path` with a second file whose header declares a 2 TiB tensor of no bytes."""
    header = json.dumps({"huge": {"dtype": "BF16", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 0]}})
    (path / "model-extra.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())
    return path


def _adapter(path, **cfg):
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, **cfg}))
    return path


def _refusals(tmp_path, listener) -> list[tuple[list[str], str]]:
    """(arguments, the reason they are refused for) of each kind the files or address they name refuse."""
    ok = {"model.embed_tokens.weight": ("F32", (64, 16))}
    port = listener.getsockname()[1]
    return [
        (["--model", str(tmp_path / "nothing")], "is neither 'smollm2', 'tiny', a local checkpoint directory"),
        (["--model", str(_checkpoint(tmp_path / "cut", ok, cut=100))], "does not load: model.safetensors is cut short"),
        (
            ["--model", str(_huge(_checkpoint(tmp_path / "big", ok))), "--device", "cpu", "--dtype", "float32"],
            "its weights take 4096.0 GiB in float32, more than the",
        ),
        (
            ["--model", str(_checkpoint(tmp_path / "short", ok, max_positions=512)), "--max-model-len", "600"],
            "--max-model-len 600 is beyond the model's context (512 positions)",
        ),
        (["--max-model-len", "5000"], "--max-model-len 5000 is beyond the model's context (2048 positions)"),
        (["--listen", f"127.0.0.1:{port}", "--allow-insecure-tcp"], f"cannot listen on 127.0.0.1:{port}"),
        (["--lora-modules", f"a={_adapter(tmp_path / 'a')}"], "--lora-modules needs --max-loras > 0"),
        (["--max-loras", "1", "--lora-modules", f"b={tmp_path / 'none'}"], "lora adapter 'b'"),
        (
            ["--max-loras", "1", "--max-lora-rank", "4", "--lora-modules", f"c={_adapter(tmp_path / 'c')}"],
            "rank 8 is over lora.max_lora_rank (4)",
        ),
        (
            ["--max-loras", "1", "--lora-modules", f"d={_adapter(tmp_path / 'd', target_modules=['lm_head'])}"],
            "target module 'lm_head' is not one of",
        ),
        (["--max-loras", "1", "--lora-modules", f"e={_adapter(tmp_path / 'e')}"], "no adapter_model.safetensors"),
    ]


def test_what_the_named_files_and_address_refuse_is_refused_before_torch_loads(tmp_path):
    """A checkpoint cut short, weights beyond the host's memory, a context
    beyond the model's, a port another process listens on, an adapter
    that is not one: each refused with its reason before torch loads (and
    so before a weight is read)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        for args, why in _refusals(tmp_path, listener):
            out = _executor("--listen", f"unix://{tmp_path}/e.sock", *args)
            log = out.stdout + out.stderr
            assert out.returncode == 2 and why in log and "executor cannot start" in log, (args, log[-3000:])
            assert "torch" not in _imported(out.stderr), args


def test_a_port_left_by_a_closed_listener_passes_the_probe():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_listen_free(f"127.0.0.1:{port}")
    check_listen_free(f"127.0.0.1:{port}")
    check_listen_free("unix:///tmp/anything.sock")


def test_an_intact_checkpoint_passes_and_its_header_is_read(tmp_path):
    path = _checkpoint(tmp_path / "ok", {"a": ("F32", (4, 8)), "b": ("BF16", (3,))})
    header = safetensors_header(str(path / "model.safetensors"))
    assert header["a"]["shape"] == [4, 8] and header["b"]["data_offsets"] == [128, 134]
    check_model(str(path), "float32", "cpu", 2048)
    check_model(str(path), "auto", "cuda", 0)  # the GPU's memory is torch's to tell


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", "cpu:0"])
def test_the_device_forms_served_pass(name):
    check_device(name)


@pytest.mark.parametrize("name", ["tpu", "mps", "cuda:", "cuda:x", "CUDA", " cpu", "cuda:0 "])
def test_other_device_strings_are_refused_by_their_form(name):
    with pytest.raises(ValueError, match=r"is not auto\|cpu\|cuda\|cuda:N"):
        check_device(name)


def test_tcp_needs_tls_or_an_explicit_allowance():
    check_listen("unix:///tmp/e.sock", "", False)
    check_listen("127.0.0.1:5000", "cert.pem", False)
    check_listen("127.0.0.1:5000", "", True)
    with pytest.raises(ValueError, match="--allow-insecure-tcp"):
        check_listen("127.0.0.1:5000", "", False)
