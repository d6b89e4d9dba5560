"""The router process: public gRPC server + engine loop + metrics, with
SIGTERM drain and SIGHUP reload of the scheduler section."""

from __future__ import annotations

import asyncio
import functools
import gc
import signal
from typing import Awaitable, Callable

import structlog

from common.logging_setup import configure_logging
from router.config import ConfigError, RouterConfig, apply_overrides, load_config, model_entries
from router.engine import Engine
from router.http_api import HttpServer
from router.metrics import Metrics
from router.models import Models
from router.server import PublicServer
from router.tokenizer import load_tokenizer
from router.tracing import setup_tracing

_LOGGER = structlog.get_logger(__name__)


async def run_router(
    cfg: RouterConfig,
    model: str,
    config_path: str | None = None,
    on_executor_lost: Callable[[str, str], None] | None = None,
    on_started: Callable[[PublicServer], Awaitable[None] | None] | None = None,
    stop: asyncio.Event | None = None,
    entries: list | None = None,
) -> int:
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    entries = entries or model_entries(cfg, model)
    tokenizers: dict[str, object] = {}
    for e in entries:  # models loaded from the same spec share one tokenizer
        if e.spec not in tokenizers:
            tokenizers[e.spec] = await loop.run_in_executor(None, load_tokenizer, e.spec)
            tokenizers[e.spec].parse_special_in_text = cfg.server.parse_special_tokens_in_text
    metrics = Metrics()
    metrics.serve(cfg.server.metrics_port, cfg.server.host)
    tracer = setup_tracing(cfg.tracing)
    models = Models(
        [
            Engine(
                e.cfg,
                tokenizers[e.spec],
                metrics,
                on_executor_lost=functools.partial(on_executor_lost, e.name) if on_executor_lost else None,
                tracer=tracer,
                name=e.name,
            )
            for e in entries
        ]
    )
    server = PublicServer(models, cfg)
    http = HttpServer(models, cfg) if cfg.server.http_port else None
    await server.start()
    if http is not None:
        http.start()
    models.start()

    def _reload() -> None:
        try:
            new = {e.name: e.cfg for e in model_entries(load_config(config_path), model)}
            # Only scheduler sections reload; a model added or removed needs a restart.
            missing = [name for name in models.names if name not in new]
            if missing:
                raise ConfigError(f"models {missing} are gone from the new file; restart to change the model list")
            # make_policy may still refuse (a 'module:Class' that does not load):
            # set_scheduler_config builds the policy before changing anything.
            for engine in models.engines:
                engine.set_scheduler_config(new[engine.name])
        except ConfigError as exc:
            _LOGGER.error("config reload refused; keeping the old one", error=str(exc))

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    if config_path:
        loop.add_signal_handler(signal.SIGHUP, _reload)
    else:  # nothing to reload: SIGHUP's default action would kill the router
        loop.add_signal_handler(
            signal.SIGHUP, lambda: _LOGGER.warning("SIGHUP ignored: started without --config, nothing to reload")
        )
    # The tokenizer, config, server and imported libraries live as long as
    # the process: out of the cyclic GC's reach, as in the executor, so a full
    # collection never stalls the event loop walking them
    # (docs/operations.md, "Pauses").
    gc.collect()
    gc.freeze()
    _LOGGER.info(
        "router listening",
        address=f"{cfg.server.host}:{server.port}",
        http=f"http://{cfg.server.host}:{http.port}/v1" if http is not None else "off",
        frozen_objects=gc.get_freeze_count(),
        metrics=f"http://{cfg.server.host}:{cfg.server.metrics_port}/metrics",
        models={e.name: e.cfg.executor.address for e in entries},
        policy=cfg.scheduler.policy,
    )
    if on_started is not None:
        res = on_started(server)
        if asyncio.iscoroutine(res):
            await res
    await stop.wait()
    _LOGGER.info("draining", timeout_s=cfg.server.drain_timeout_s, in_flight=models.in_flight)
    await server.drain_and_stop(cfg.server.drain_timeout_s)
    if http is not None:
        await http.stop()
    await models.stop()
    if tracer is not None:
        tracer.shutdown()
    _LOGGER.info("router stopped")
    return 0


def router_main(args) -> int:
    cfg = load_config(args.config)
    apply_overrides(cfg, args)
    configure_logging(cfg.logging.level, cfg.logging.format, process="router")
    seen: dict[str, str] = {}
    for e in model_entries(cfg, args.model):  # the router alone starts no executor
        other = seen.setdefault(e.cfg.executor.address, e.name)
        if other != e.name:
            raise ConfigError(
                f"models {other!r} and {e.name!r} both use executor.address {e.cfg.executor.address!r}: "
                "give each model its own executor"
            )
    return asyncio.run(run_router(cfg, args.model, args.config))
