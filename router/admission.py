"""Admission, shared by every public protocol: a validated request enters the
engine, or a RequestError says why not (with the gRPC status that the HTTP
API maps to its own). One place, so a request is admitted or refused the same
way whichever protocol it came in by."""

from __future__ import annotations

import time

import grpc

from cbserve.v1 import generation_pb2 as gpb
from router.config import RouterConfig
from router.engine import Engine, RequestHandle
from router.validation import RequestError, build_request


def admit(engine: Engine, cfg: RouterConfig, msg: gpb.GenerateRequest, timeout_s: float | None) -> RequestHandle:
    """Validates `msg` and submits it; raises RequestError before queueing
    anything when it cannot be served. Counts every refusal by status."""
    try:
        return _admit(engine, cfg, msg, timeout_s)
    except RequestError as exc:
        engine.metrics.request_errors.labels(status=exc.code.name).inc()
        raise


def refuse(engine: Engine, code: grpc.StatusCode, message: str) -> RequestError:
    """A refusal outside `admit` (auth, a malformed body), counted the same way."""
    engine.metrics.request_errors.labels(status=code.name).inc()
    return RequestError(code, message)


def _admit(engine: Engine, cfg: RouterConfig, msg: gpb.GenerateRequest, timeout_s: float | None) -> RequestHandle:
    if not engine.accepting:
        raise RequestError(grpc.StatusCode.UNAVAILABLE, "the server is draining")
    if not engine.ready.is_set() or engine.facts is None:
        raise RequestError(grpc.StatusCode.UNAVAILABLE, "the executor is not available")
    facts = engine.facts
    sched = engine.scheduler
    lim = cfg.limits
    deadline = time.monotonic() + timeout_s if timeout_s is not None else None
    usable_blocks = facts.num_blocks - sched.blocks.watermark_blocks
    req = build_request(
        msg,
        engine.tokenizer,
        lim,
        facts.vocab_size,
        facts.max_context,
        usable_blocks * facts.block_size,
        deadline,
    )
    if req.request_id in engine.handles:
        raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {req.request_id!r} is already in flight")
    if len(sched.waiting) >= lim.max_queued_requests:
        raise RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"the queue is full ({lim.max_queued_requests} requests waiting)"
        )
    if sched.num_queued_tokens() + len(req.prompt_token_ids) > lim.max_queued_tokens:
        raise RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"the queue is full ({lim.max_queued_tokens} prompt tokens waiting)"
        )
    return engine.submit(req)
