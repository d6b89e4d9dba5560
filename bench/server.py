"""Starts and stops a cbserve server (router + executor) for one benchmark run.

`cbserve serve --model M --dtype D --config router.yaml --port P --metrics-port Q`
on free loopback ports, ready when grpc.health.v1 Health/Check says SERVING,
stopped with SIGTERM (then SIGKILL after a grace period) of the process we
started. Server output goes to a log file next to the results.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import yaml

from common.ports import free_port


def cbserve_command() -> list[str]:
    exe = Path(sys.executable).with_name("cbserve")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("cbserve")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from router.cli import main; sys.exit(main(sys.argv[1:]))"]


# The benchmark servers' token budget unless a run overrides it (the router's default).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512


def write_router_config(
    path: Path,
    policy: str,
    *,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    static_batch_size: int = 16,
    dynamic_max_wait_ms: float = 50.0,
    extra: dict[str, Any] | None = None,
) -> Path:
    cfg: dict[str, Any] = {
        "scheduler": {
            "policy": policy,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "static_batch_size": static_batch_size,
            "dynamic_max_wait_ms": dynamic_max_wait_ms,
        }
    }
    for k, v in (extra or {}).items():
        cfg.setdefault(k, {}).update(v)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def health_serving(target: str, timeout: float = 2.0) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


class CbserveServer:
    """Context manager: a cbserve server on free ports for one policy."""

    def __init__(
        self,
        workdir: Path,
        policy: str,
        *,
        model: str | None = None,
        dtype: str = "bfloat16",
        ready_timeout_s: float = 600.0,
        config_overrides: dict[str, Any] | None = None,
        extra_args: list[str] | None = None,
        device: str = "cpu",
        tree: Path | None = None,
        env: dict[str, str] | None = None,
    ):
        # tree: another checkout of cbserve (native extensions built in place)
        # whose router and executor run instead of this one's.
        self.tree = Path(tree).resolve() if tree is not None else None
        self.workdir = Path(workdir).resolve()
        self.device = device
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.policy = policy
        self.model = model
        self.dtype = dtype
        self.ready_timeout_s = ready_timeout_s
        self.config_overrides = dict(config_overrides or {})
        self.extra_args = list(extra_args or [])
        self.env = dict(env or {})  # set for the server (its executor inherits them)
        self.port = free_port()
        self.metrics_port = free_port()
        self.http_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / f"server-{policy}-{dtype}.log"
        self.startup_s = float("nan")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> "CbserveServer":
        sched = {k: v for k, v in self.config_overrides.items() if k != "extra"}
        # (cbserve serve gives its executor a unique socket of its own.)
        cfg = write_router_config(
            self.workdir / f"router-{self.policy}.yaml", self.policy, **sched, extra=self.config_overrides.get("extra")
        )
        # On the CPU also where a GPU exists unless asked otherwise: the
        # suite's peers are CPU builds (`bench run --device cuda` for a GPU).
        cmd = cbserve_command() + [
            "serve",
            "--dtype",
            self.dtype,
            "--device",
            self.device,
            "--config",
            str(cfg),
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            "--http-port",
            str(self.http_port),
        ]
        if self.model:
            cmd += ["--model", self.model]
        cmd += self.extra_args
        env = {**os.environ, **self.env}
        cwd = Path(__file__).resolve().parents[1]
        if self.tree is not None:
            cmd = [sys.executable, "-m", "router.cli", *cmd[len(cbserve_command()) :]]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.tree), env.get("PYTHONPATH")]))
            cwd = self.tree
        self.cmd = cmd
        log = open(self.log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(cwd))
        log.close()
        deadline = t0 + self.ready_timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"cbserve exited with {self.proc.returncode} during start-up; log {self.log_path}:\n{self.tail()}"
                )
            if health_serving(self.target, timeout=1.0):
                self.startup_s = time.perf_counter() - t0
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"cbserve not SERVING after {self.ready_timeout_s}s; log {self.log_path}:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> "CbserveServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
