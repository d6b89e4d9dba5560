"""Admission, shared by every public protocol: a validated request enters the
engine, or a RequestError says why not (with the gRPC status that the HTTP
API maps to its own). One place, so a request is admitted or refused the same
way whichever protocol it came in by."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from cbserve.v1 import generation_pb2 as gpb
from router.config import RouterConfig, SchedulerConfig
from router.engine import Engine, RequestHandle
from router.policies.slo import miss_message, rejects_misses
from router.validation import RequestError, build_request


async def admit(
    engine: Engine,
    cfg: RouterConfig,
    msg: gpb.GenerateRequest,
    timeout_s: float | None,
    tenant: str = "default",
    group: str | None = None,
) -> RequestHandle:
    """Validates `msg` and submits it; raises RequestError before queueing
    anything when it cannot be served. Counts every refusal by status.
    Validation and tokenization (the chat template included) run on the
    engine's tokenizer threads, never on the event loop."""
    try:
        _check_serving(engine)
        msg.DiscardUnknownFields()  # nothing a client adds outlives this call
        slo_class = slo_targets(engine.cfg.scheduler, msg.slo_class)
        nbytes = msg.ByteSize()
        facts = engine.facts
        usable_blocks = facts.num_blocks - engine.scheduler.blocks.watermark_blocks
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        build = engine.off_loop(
            build_request,
            msg,
            engine.tokenizer,
            cfg.limits,
            facts.vocab_size,
            facts.max_context,
            usable_blocks * facts.block_size,
            deadline,
            engine.structured,
        )
        if msg.HasField("structured"):
            limit = cfg.limits.grammar_compile_timeout_s
            try:
                req = await asyncio.wait_for(build, limit)
            except asyncio.TimeoutError:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"structured: the constraint did not compile within {limit} s"
                ) from None
        else:
            req = await build
        req.nbytes = nbytes
        req.slo_class, ttft_s, req.tpot_s = slo_class
        if ttft_s is not None:
            req.ttft_deadline = req.arrival_time + ttft_s
        # Bounded here, on the event loop, right before the submit below.
        tenant = req.tenant = engine.bounded_tenant(tenant)
        req.group = group
        # The tenant goes into every block hash under the request's own salt:
        # tenants never share prefix-cache blocks.
        req.cache_salt = f"{tenant}\0{req.cache_salt}"
        if msg.model and msg.model != engine.name:
            req.lora = engine.loras.get(msg.model)
            if req.lora is None:  # unloaded since the model was looked up
                raise RequestError(grpc.StatusCode.NOT_FOUND, f"model {msg.model[:128]!r} is not served here")
            # Blocks computed with an adapter are that adapter's alone.
            req.cache_salt += f"\0lora:{req.lora.name}"
        if req.sampling.prompt_logprobs is not None:
            # Every prompt token's logprob needs its row computed: a salt of
            # its own keeps the request off cached blocks.
            req.cache_salt += f"\0prompt-logprobs-{uuid.uuid4().hex}"
            req.prompt_lps = [None] * (len(req.prompt_token_ids) - 1)
        return _enqueue(engine, cfg, req)
    except RequestError as exc:
        engine.metrics.request_errors.labels(status=exc.code.name).inc()
        raise


def slo_targets(sched: SchedulerConfig, name: str) -> tuple[str, float | None, float | None]:
    """(class, TTFT seconds, TPOT seconds) of a request naming SLO class
    `name` (empty: scheduler.default_slo_class); INVALID_ARGUMENT for a
    class the configuration does not define."""
    name = name or sched.default_slo_class
    if not name:
        return "", None, None
    targets = sched.slo_classes.get(name)
    if targets is None:
        known = ", ".join(sorted(sched.slo_classes)) or "none are configured (scheduler.slo_classes)"
        shown = name if len(name) <= 64 else name[:64] + "..."
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"slo_class: {shown!r} is not a known class ({known})")
    return name, targets["ttft_ms"] / 1000.0, targets["tpot_ms"] / 1000.0


def siblings(msg: gpb.GenerateRequest, n: int, max_n: int) -> list[tuple[gpb.GenerateRequest, str | None]]:
    """`n` completions of one prompt as (request, group) pairs: ids
    `<id>-<j>`, seeds `seed + j` when seeded, and the group (the prompt's
    request id) by which the scheduler lets one sibling compute the prompt
    before the others take its blocks from the prefix cache."""
    if not 1 <= n <= max_n:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"n: must be in [1, {max_n}], got {n}")
    if n == 1:
        return [(msg, None)]
    if not msg.request_id:
        msg.request_id = uuid.uuid4().hex
    out = []
    for j in range(n):
        sib = gpb.GenerateRequest()
        sib.CopyFrom(msg)
        sib.request_id = f"{msg.request_id}-{j}"
        sib.n = 1
        if msg.sampling.HasField("seed"):
            sib.sampling.seed = (msg.sampling.seed + j) % 2**64
        out.append((sib, msg.request_id))
    return out


async def admit_all(
    engine: Engine,
    cfg: RouterConfig,
    pairs: list[tuple[gpb.GenerateRequest, str | None]],
    timeout_s: float | None,
    tenant: str = "default",
) -> list[RequestHandle]:
    """Admits every (request, group) pair or none: a refusal aborts the ones
    already queued and raises."""
    handles: list[RequestHandle] = []
    try:
        for msg, group in pairs:
            handles.append(await admit(engine, cfg, msg, timeout_s, tenant, group))
    except RequestError:
        for h in handles:
            engine.abort(h.req)
        raise
    return handles


def refuse(engine: Engine, code: grpc.StatusCode, message: str) -> RequestError:
    """A refusal outside `admit` (auth, a malformed body), counted the same way."""
    engine.metrics.request_errors.labels(status=code.name).inc()
    return RequestError(code, message)


def _check_serving(engine: Engine) -> None:
    if not engine.accepting:
        raise RequestError(grpc.StatusCode.UNAVAILABLE, "the server is draining")
    if not engine.ready.is_set() or engine.facts is None:
        raise RequestError(grpc.StatusCode.UNAVAILABLE, "the executor is not available")


def _enqueue(engine: Engine, cfg: RouterConfig, req) -> RequestHandle:
    """On the event loop, after validation: the checks against the queue as
    it is now, then the submit (nothing between them can interleave)."""
    _check_serving(engine)  # the state may have changed while it was tokenized
    sched = engine.scheduler
    lim = cfg.limits
    budget = sched.cfg.max_num_batched_tokens
    if not sched.cfg.enable_chunked_prefill and len(req.prompt_token_ids) > budget:
        # Unchunked, such a prompt never fits a step: refused now, not left
        # at the head of the queue.
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"input: the prompt has {len(req.prompt_token_ids)} tokens, more than scheduler.max_num_batched_tokens "
            f"({budget}) with chunked prefill off",
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
    if sum(r.nbytes for r in sched.waiting) + req.nbytes > lim.max_queued_bytes:
        raise RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"the queue is full ({lim.max_queued_bytes} bytes of requests waiting)"
        )
    if rejects_misses(sched) and sched.policy.cannot_meet(req, time.monotonic()):
        engine.count_slo(req, "rejected")
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, miss_message(req))
    return engine.submit(req)
