"""`cbserve serve`: one machine, both processes. Starts the executor as a
child process, runs the router in this one, restarts the executor when it dies
or hangs after it once served, and stops both on SIGTERM / Ctrl-C. An
executor that exits before it is ready (arguments it refuses, a model it
cannot load, a crash while loading) is not restarted: it would fail the same
way again, so `cbserve serve` stops with status 2."""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import os
import shutil
import signal
import sys
import tempfile

import structlog
import yaml

from common.logging_setup import configure_logging
from router.config import ModelEntry, apply_overrides, load_config, model_entries

_LOGGER = structlog.get_logger(__name__)
EXECUTOR_USAGE_ERROR = 2  # executor/main.py's USAGE_ERROR (the router does not import the executor)


class ExecutorProcess:
    # Restart back-off: doubles per death from the first up to the most, and
    # starts from the first again once an executor has served this long
    # (a death after a long healthy run is not a crash loop, as Kubernetes'
    # CrashLoopBackOff resets).
    first_backoff_s = 0.5
    max_backoff_s = 10.0
    healthy_reset_s = 60.0
    module = "executor"  # what `python -m` runs

    def __init__(
        self, argv: list[str], on_refused: asyncio.Event | None = None, name: str = "", run_dir: str = ""
    ) -> None:
        self.argv = argv
        self.run_dir = run_dir  # serve's private directory of its socket, removed by an orphan (lifeline)
        self.name = name  # the model it serves (logs)
        self.on_refused = on_refused  # set when the executor refuses its arguments
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.refused = False  # it could not start: exited before it was ready, or with EXECUTOR_USAGE_ERROR
        self.ready = False  # this process wrote its ready byte (executor/main.py)
        self.started_at = 0.0  # loop time of the last start
        self._stopping = False

    async def start(self) -> None:
        # The executor writes one byte to CBSERVE_READY_FD once it serves.
        read_fd, write_fd = os.pipe()
        self.ready = False
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                self.module,
                *self.argv,
                start_new_session=True,
                pass_fds=(write_fd,),
                env=self._env(write_fd),
            )
        finally:
            os.close(write_fd)
        asyncio.get_running_loop().add_reader(read_fd, self._on_ready, read_fd)
        self.started_at = asyncio.get_running_loop().time()
        _LOGGER.info("executor started", pid=self.proc.pid, model=self.name)

    def _env(self, ready_fd: int) -> dict[str, str]:
        # executor/lifeline.py: it exits when this process dies, and then
        # removes the directory this process could not.
        env = {**os.environ, "CBSERVE_READY_FD": str(ready_fd), "CBSERVE_PARENT_PID": str(os.getpid())}
        env.pop("CBSERVE_RUN_DIR", None)
        if self.run_dir:
            env["CBSERVE_RUN_DIR"] = self.run_dir
        return env

    def _on_ready(self, fd: int) -> None:
        asyncio.get_running_loop().remove_reader(fd)
        try:
            self.ready = os.read(fd, 1) != b""  # b"": it exited without being ready
        finally:
            os.close(fd)

    def kill(self, why: str) -> None:
        """For a hung executor: SIGKILL; the watch loop restarts it."""
        if self.proc is not None and self.proc.returncode is None:
            _LOGGER.warning("killing executor", pid=self.proc.pid, model=self.name, reason=why)
            self.proc.kill()

    async def watch(self) -> None:
        backoff = self.first_backoff_s
        while not self._stopping:
            rc = await self.proc.wait()
            if self._stopping:
                return
            if asyncio.get_running_loop().time() - self.started_at >= self.healthy_reset_s:
                backoff = self.first_backoff_s
            await asyncio.sleep(0)  # a ready byte written just before the exit is read first
            if rc == EXECUTOR_USAGE_ERROR or not self.ready:  # a restart would fail the same way
                self.refused = True
                why = "refused its arguments or model" if rc == EXECUTOR_USAGE_ERROR else "exited before it was ready"
                _LOGGER.error(f"executor {why}; stopping (see its log above)", returncode=rc, model=self.name)
                if self.on_refused is not None:
                    self.on_refused.set()  # the router drains and returns
                return
            self.restarts += 1
            _LOGGER.error(
                "executor exited; restarting", returncode=rc, model=self.name, restarts=self.restarts, in_s=backoff
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)
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


def _executor_argv(args, e: ModelEntry, index: int, config_path: str | None) -> list[str]:
    """The command line of model `e`'s executor (the entry's settings, else
    the command line's)."""
    metrics_port = args.executor_metrics_port + index if args.executor_metrics_port else 0
    argv = [
        "--model",
        e.spec,
        "--dtype",
        e.dtype or args.dtype,
        "--quantization",
        getattr(args, "quantization", "none"),
        "--device",
        e.device or args.device,
        "--listen",
        e.cfg.executor.address,
        "--attention-backend",
        args.attention_backend,
        "--threads",
        str(args.executor_threads),
        "--metrics-port",
        str(metrics_port),
        "--metrics-host",
        args.executor_metrics_host,
        "--max-model-len",
        str(e.max_model_len or args.max_model_len),
        # No graph for more sequences than the scheduler ever runs together.
        "--cuda-graph-max-batch",
        str(min(args.cuda_graph_max_batch, e.cfg.scheduler.max_num_seqs)),
    ]
    if config_path:
        argv += ["--config", config_path]
    lora = e.cfg.lora
    if lora.enabled:  # the adapters given at start are read (and checked) before the executor is ready
        argv += ["--max-loras", str(lora.max_loras), "--max-lora-rank", str(lora.max_lora_rank)]
        argv += ["--max-cpu-loras", str(lora.max_cpu_loras)]
        for a in lora.adapters:
            argv += ["--lora-modules", f"{a['name']}={a['path']}"]
    ex = e.cfg.executor
    if not ex.address.startswith("unix://"):
        if ex.tls_cert_file:
            argv += ["--tls-cert", ex.tls_cert_file, "--tls-key", ex.tls_key_file]
        if ex.tls_client_ca_file:
            argv += ["--tls-client-ca", ex.tls_client_ca_file]
        if ex.allow_insecure_tcp:
            argv += ["--allow-insecure-tcp"]
    return argv


def _private_dir() -> str:
    """A fresh directory only this user can enter (mkdtemp: mode 0700, a
    name nobody can create ahead of us), removed when serve exits."""
    path = tempfile.mkdtemp(prefix="cbserve-")
    atexit.register(shutil.rmtree, path, True)
    return path


async def _serve(args) -> int:
    cfg = load_config(args.config)
    apply_overrides(cfg, args)
    entries = model_entries(cfg, args.model)
    configs: list[str | None] = []
    run_dir = ""  # the private directory of the executors' sockets, if serve made one
    if not cfg.models:  # the classic single model: --executor-address or a private socket
        if not args.executor_address:
            run_dir = _private_dir()
            cfg.executor.address = f"unix://{os.path.join(run_dir, 'executor.sock')}"
        configs.append(args.config)
    else:
        run_dir = _private_dir() if any(e.own_executor for e in entries) else ""
        for i, e in enumerate(entries):
            if not e.own_executor:
                configs.append(None)
                continue
            e.cfg.executor.address = f"unix://{os.path.join(run_dir, f'executor-{i}.sock')}"
            # The executor reads only `cache:`: this model's, merged.
            path = os.path.join(run_dir, f"executor-{i}.yaml")
            with open(path, "w", encoding="utf-8") as fh:
                yaml.safe_dump({"cache": dataclasses.asdict(e.cfg.cache)}, fh)
            configs.append(path)
    stop = asyncio.Event()
    executors: dict[str, ExecutorProcess] = {}
    for i, (e, path) in enumerate(zip(entries, configs)):
        if e.own_executor:
            executors[e.name] = ExecutorProcess(
                _executor_argv(args, e, i, path), on_refused=stop, name=e.name, run_dir=run_dir
            )
    for ex in executors.values():
        await ex.start()
    # Imported once the executors are on their way (gRPC, HTTP, the engine:
    # most of the router's import time), so their start-up, the longer one,
    # begins first.
    from router.main import run_router

    loop = asyncio.get_running_loop()
    watchers = [loop.create_task(ex.watch()) for ex in executors.values()]

    def lost(name: str, why: str) -> None:
        if "DEADLINE_EXCEEDED" in why and name in executors:  # a hung step: the executor cannot be trusted
            executors[name].kill(why)

    async def started(server) -> None:
        host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::") else cfg.server.host
        _LOGGER.info(
            "cbserve serving",
            grpc=f"{host}:{server.port}",
            openai=f"http://{host}:{cfg.server.http_port}/v1" if cfg.server.http_port else "off",
            metrics=f"http://{host}:{cfg.server.metrics_port}/metrics",
            models=[e.name for e in entries],
            try_it=f"cbserve generate --address {host}:{server.port} --chat 'What is the capital of France?'",
        )

    try:
        rc = await run_router(
            cfg, args.model, args.config, on_executor_lost=lost, on_started=started, stop=stop, entries=entries
        )
        return EXECUTOR_USAGE_ERROR if any(ex.refused for ex in executors.values()) else rc
    finally:
        await asyncio.gather(*(ex.stop() for ex in executors.values()))
        for w in watchers:
            w.cancel()


def serve_main(args) -> int:
    cfg = load_config(args.config)
    configure_logging(cfg.logging.level, cfg.logging.format, process="router")
    return asyncio.run(_serve(args))
