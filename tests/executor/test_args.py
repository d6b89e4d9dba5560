"""What `cbserve executor`'s arguments alone refuse is refused before torch
loads: exit 2 with the reason, at once (executor/args.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from executor.args import check_device, check_listen
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


def test_arguments_it_can_serve_go_on_to_load_the_model():
    # A bad model is only found by loading it: past the early checks.
    out = _executor("--device", "cpu", "--listen", "unix:///nonexistent/dir/e.sock", "--model", "/nonexistent-model")
    assert out.returncode == 2
    imported = _imported(out.stderr)
    assert "torch" in imported and "executor.main" in imported


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
