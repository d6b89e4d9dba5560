"""`cbserve serve`: one machine, both processes. Starts the executor as a
child process, runs the router in this one, restarts the executor when it dies
or hangs after it once served, and stops both on SIGTERM / Ctrl-C. An
executor that exits before it is ready (arguments it refuses, a model it
cannot load, a crash while loading) is not restarted: it would fail the same
way again, so `cbserve serve` stops with status 2."""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import signal
import sys
import tempfile

import structlog

from common.logging_setup import configure_logging
from router.config import load_config
from router.main import apply_overrides, run_router

_LOGGER = structlog.get_logger(__name__)
EXECUTOR_USAGE_ERROR = 2  # executor/main.py's USAGE_ERROR (the router does not import the executor)


class ExecutorProcess:
    def __init__(self, argv: list[str], on_refused: asyncio.Event | None = None) -> None:
        self.argv = argv
        self.on_refused = on_refused  # set when the executor refuses its arguments
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.refused = False  # it could not start: exited before it was ready, or with EXECUTOR_USAGE_ERROR
        self.ready = False  # this process wrote its ready byte (executor/main.py)
        self._stopping = False

    async def start(self) -> None:
        # The executor writes one byte to CBSERVE_READY_FD once it serves.
        read_fd, write_fd = os.pipe()
        self.ready = False
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "executor",
                *self.argv,
                start_new_session=True,
                pass_fds=(write_fd,),
                env={**os.environ, "CBSERVE_READY_FD": str(write_fd)},
            )
        finally:
            os.close(write_fd)
        asyncio.get_running_loop().add_reader(read_fd, self._on_ready, read_fd)
        _LOGGER.info("executor started", pid=self.proc.pid)

    def _on_ready(self, fd: int) -> None:
        asyncio.get_running_loop().remove_reader(fd)
        try:
            self.ready = os.read(fd, 1) != b""  # b"": it exited without being ready
        finally:
            os.close(fd)

    def kill(self, why: str) -> None:
        """For a hung executor: SIGKILL; the watch loop restarts it."""
        if self.proc is not None and self.proc.returncode is None:
            _LOGGER.warning("killing executor", pid=self.proc.pid, reason=why)
            self.proc.kill()

    async def watch(self) -> None:
        backoff = 0.5
        while not self._stopping:
            rc = await self.proc.wait()
            if self._stopping:
                return
            await asyncio.sleep(0)  # a ready byte written just before the exit is read first
            if rc == EXECUTOR_USAGE_ERROR or not self.ready:  # a restart would fail the same way
                self.refused = True
                why = "refused its arguments or model" if rc == EXECUTOR_USAGE_ERROR else "exited before it was ready"
                _LOGGER.error(f"executor {why}; stopping (see its log above)", returncode=rc)
                if self.on_refused is not None:
                    self.on_refused.set()  # the router drains and returns
                return
            self.restarts += 1
            _LOGGER.error("executor exited; restarting", returncode=rc, restarts=self.restarts, in_s=backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
            await self.start()

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def _serve(args) -> int:
    cfg = load_config(args.config)
    apply_overrides(cfg, args)
    if not args.executor_address:
        # A fresh directory only this user can enter (mkdtemp: mode 0700, a
        # name nobody can create ahead of us), removed when serve exits.
        sock_dir = tempfile.mkdtemp(prefix="cbserve-")
        atexit.register(shutil.rmtree, sock_dir, True)
        cfg.executor.address = f"unix://{os.path.join(sock_dir, 'executor.sock')}"
    exe_argv = [
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--listen",
        cfg.executor.address,
        "--attention-backend",
        args.attention_backend,
        "--threads",
        str(args.executor_threads),
        "--metrics-port",
        str(args.executor_metrics_port),
        "--metrics-host",
        args.executor_metrics_host,
        "--max-model-len",
        str(args.max_model_len),
        # No graph for more sequences than the scheduler ever runs together.
        "--cuda-graph-max-batch",
        str(min(args.cuda_graph_max_batch, cfg.scheduler.max_num_seqs)),
    ]
    if args.config:
        exe_argv += ["--config", args.config]
    ex = cfg.executor
    if not ex.address.startswith("unix://"):
        if ex.tls_cert_file:
            exe_argv += ["--tls-cert", ex.tls_cert_file, "--tls-key", ex.tls_key_file]
        if ex.tls_client_ca_file:
            exe_argv += ["--tls-client-ca", ex.tls_client_ca_file]
        if ex.allow_insecure_tcp:
            exe_argv += ["--allow-insecure-tcp"]
    stop = asyncio.Event()
    executor = ExecutorProcess(exe_argv, on_refused=stop)
    await executor.start()
    watcher = asyncio.get_running_loop().create_task(executor.watch())

    def lost(why: str) -> None:
        if "DEADLINE_EXCEEDED" in why:  # a hung step: the executor cannot be trusted
            executor.kill(why)

    async def started(server) -> None:
        host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::") else cfg.server.host
        _LOGGER.info(
            "cbserve serving",
            grpc=f"{host}:{server.port}",
            openai=f"http://{host}:{cfg.server.http_port}/v1" if cfg.server.http_port else "off",
            metrics=f"http://{host}:{cfg.server.metrics_port}/metrics",
            try_it=f"cbserve generate --address {host}:{server.port} --chat 'What is the capital of France?'",
        )

    try:
        rc = await run_router(cfg, args.model, args.config, on_executor_lost=lost, on_started=started, stop=stop)
        return EXECUTOR_USAGE_ERROR if executor.refused else rc
    finally:
        await executor.stop()
        watcher.cancel()


def serve_main(args) -> int:
    cfg = load_config(args.config)
    configure_logging(cfg.logging.level, cfg.logging.format, process="router")
    return asyncio.run(_serve(args))
