"""The public gRPC service `cbserve.v1.Generation`, with grpc.health.v1 and
server reflection on the same port."""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cbserve.v1 import generation_pb2 as gpb
from cbserve.v1 import generation_pb2_grpc as gpb_grpc
from router import __version__
from router.admission import admit_all, refuse, siblings
from router.auth import BearerTokenInterceptor
from router.config import RouterConfig
from router.engine import Delta, Engine, RequestHandle, merged
from router.models import Models
from router.tenants import SLO_CLASS_HEADER, metadata_value, request_tenant
from router.validation import RequestError, prompt_ids

_LOGGER = structlog.get_logger(__name__)
SERVICE_NAME = "cbserve.v1.Generation"


class GenerationService(gpb_grpc.GenerationServicer):
    def __init__(self, models: Models, cfg: RouterConfig) -> None:
        self.models = models
        self.cfg = cfg

    # -- admission ----------------------------------------------------------------
    async def _refuse(self, context, code: grpc.StatusCode, message: str, engine: Engine | None = None):
        """Ends the RPC before admission; counted by status code."""
        refuse(engine or self.models.default, code, message)
        await _abort(context, (code, message))

    async def _engine(self, name: str, context) -> Engine:
        """The engine of the requested model; NOT_FOUND for a name not served."""
        try:
            return self.models.get(name)
        except RequestError as exc:
            await self._refuse(context, exc.code, exc.message)

    async def _admit(self, request: gpb.GenerateRequest, context, event: str) -> tuple[str, list[RequestHandle]]:
        """The request's id and its `n` completions (one unless it asks for
        more), all admitted or none."""
        engine = await self._engine(request.model, context)
        if not request.slo_class:
            request.slo_class = metadata_value(context.invocation_metadata(), SLO_CLASS_HEADER) or ""
        try:
            pairs = siblings(request, request.n or 1, self.cfg.limits.max_n)
        except RequestError as exc:
            await self._refuse(context, exc.code, exc.message, engine)
        try:
            metadata = context.invocation_metadata()
            tenant = request_tenant(
                engine.auth,
                engine.auth.tenant_of_metadata(metadata),
                metadata_value(metadata, engine.cfg.scheduler.tenant_header),
            )
            handles = await admit_all(engine, engine.cfg, pairs, context.time_remaining(), tenant)
        except RequestError as exc:
            await _abort(context, (exc.code, exc.message))
        req = handles[0].req
        # `siblings` named a group's id; a single request may have had one assigned.
        rid = request.request_id or req.request_id
        # Every log line of this RPC's task carries the request id.
        structlog.contextvars.bind_contextvars(request_id=rid, tenant=req.tenant, model=engine.name)
        _LOGGER.debug(event, prompt_tokens=len(req.prompt_token_ids), n=len(handles))
        return rid, handles

    @staticmethod
    def _abort_unfinished(handles: list[RequestHandle]) -> None:
        for h in handles:
            if not h.done:  # client cancelled, disconnected or hit its deadline
                h.engine.abort(h.req, _client_gone(h.req))

    @staticmethod
    def _response(
        rid: str, d: Delta, usage: gpb.Usage | None = None, prompt: list[int] | None = None
    ) -> gpb.GenerateResponse:
        resp = gpb.GenerateResponse(request_id=rid, token_ids=d.token_ids, text=d.text, logprobs=d.logprobs)
        for ids, lps in d.top:
            resp.top_logprobs.add(token_ids=ids, logprobs=lps)
        if d.finish is not None:
            resp.finish_reason = d.finish.value
        if usage is not None:
            resp.usage.CopyFrom(usage)
        if d.prompt_logprobs is not None and prompt is not None:
            for tok, entry in zip(prompt[1:], d.prompt_logprobs):
                lp, rank, ids, lps = entry if entry is not None else (float("nan"), 0, [], [])
                resp.prompt_logprobs.add(token_id=tok, logprob=lp, rank=rank, top_token_ids=ids, top_logprobs=lps)
        return resp

    @staticmethod
    def _usage(req) -> gpb.Usage:
        return gpb.Usage(
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=len(req.output_token_ids),
            cached_prompt_tokens=req.num_cached_prompt_tokens,
        )

    # -- RPCs -----------------------------------------------------------------------
    async def Generate(self, request, context):
        # A coroutine writing with context.write (not an async generator) so
        # that a write failing because the client already left is caught here.
        rid, handles = await self._admit(request, context, "generate started")
        try:
            async for i, d in merged(handles):
                if d.error is not None:
                    await _abort(context, d.error)
                last = d.finish is not None
                if d.token_ids or d.text or last:
                    req = handles[i].req
                    resp = self._response(rid, d, self._usage(req) if last else None, req.prompt_token_ids)
                    resp.index = i
                    await _send(context, resp)
        finally:
            self._abort_unfinished(handles)
        _stop_if_client_left(context)

    async def Complete(self, request, context):
        rid, handles = await self._admit(request, context, "complete started")
        acc = [Delta() for _ in handles]
        try:
            async for i, d in merged(handles):
                if d.error is not None:
                    await _abort(context, d.error)
                acc[i] = acc[i].merge(d)
        finally:
            self._abort_unfinished(handles)
        choices = []
        for i, (h, d) in enumerate(zip(handles, acc)):
            choices.append(self._response(rid, d, self._usage(h.req), h.req.prompt_token_ids))
            choices[-1].index = i
        _stop_if_client_left(context)
        if len(choices) == 1:
            return choices[0]
        out = gpb.GenerateResponse()
        out.CopyFrom(choices[0])
        out.choices.extend(choices)
        out.usage.completion_tokens = sum(c.usage.completion_tokens for c in choices)
        return out

    async def Tokenize(self, request, context):
        eng = await self._engine(request.model, context)
        vocab = eng.facts.vocab_size if eng.facts else eng.tokenizer.vocab_size
        request.DiscardUnknownFields()
        try:
            ids = await eng.off_loop(prompt_ids, request, eng.tokenizer, self.cfg.limits, vocab)
        except RequestError as exc:
            await self._refuse(context, exc.code, exc.message, eng)
        tokens = await eng.off_loop(lambda: [eng.tokenizer.id_to_token(i) for i in ids])
        return gpb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def ModelInfo(self, request, context):
        eng = await self._engine(request.model, context)
        f = eng.facts
        if f is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the executor of model {eng.name!r} is not available")
        return gpb.ModelInfoResponse(
            model=eng.name,
            models=self.models.names,
            lora_adapters=sorted(eng.loras),
            dtype=f.dtype,
            max_context_length=f.max_context,
            vocab_size=f.vocab_size,
            block_size=f.block_size,
            num_kv_blocks=f.num_blocks,
            policy=eng.cfg.scheduler.policy,
            version=__version__,
            max_new_tokens_limit=self.cfg.limits.max_new_tokens,
            attention_backend=f.attention_backend,
        )

    async def LoadLoraAdapter(self, request, context):
        eng = await self._engine(request.model, context)
        try:
            await eng.load_adapter(request.lora_name, request.lora_path, self.models.taken_names())
        except RequestError as exc:
            await self._refuse(context, exc.code, exc.message, eng)
        return gpb.LoraAdapterResponse(message=f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    async def UnloadLoraAdapter(self, request, context):
        eng = await self._engine(request.model, context)
        try:
            eng.unload_adapter(request.lora_name)
        except RequestError as exc:
            await self._refuse(context, exc.code, exc.message, eng)
        return gpb.LoraAdapterResponse(message=f"Success: LoRA adapter '{request.lora_name}' removed successfully.")


# When the client's deadline passes or it cancels, gRPC's core ends the call
# before the server's Python side hears of it; anything sent in that window
# fails inside gRPC (ExecuteBatchError), which gRPC logs with a traceback when
# the error escapes a handler. The helpers below stop the handler instead
# (CancelledError, which gRPC takes quietly): the client is gone, nothing is lost.


def _stop_if_client_left(context) -> None:
    remaining = context.time_remaining()
    if context.done() or (remaining is not None and remaining <= 0):
        raise asyncio.CancelledError()


async def _quietly(context, send, *args) -> None:
    _stop_if_client_left(context)
    try:
        await send(*args)
    except grpc.aio.AbortError:
        raise  # the normal way abort() ends a handler
    except Exception as exc:  # noqa: BLE001 - gRPC's internal error type is not public
        if type(exc).__name__ == "ExecuteBatchError":
            raise asyncio.CancelledError() from exc
        raise


async def _send(context, message) -> None:
    """Streams one message of the RPC (see above for a client that left)."""
    await _quietly(context, context.write, message)


async def _abort(context, error: tuple[grpc.StatusCode, str]) -> None:
    """Ends the RPC with `error` (see above for a client that left)."""
    await _quietly(context, context.abort, *error)


def _client_gone(req):
    """Why a handler stopped before its request finished: the client's deadline
    (recorded as DEADLINE_EXCEEDED), else a cancel or disconnect (None)."""
    if req.deadline is not None and time.monotonic() >= req.deadline - 0.005:
        return (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
    return None


def _credentials(cfg: RouterConfig):
    s = cfg.server
    if not s.tls_cert_file:
        return None
    with open(s.tls_key_file, "rb") as k, open(s.tls_cert_file, "rb") as c:
        pair = (k.read(), c.read())
    ca = None
    if s.tls_client_ca_file:
        with open(s.tls_client_ca_file, "rb") as fh:
            ca = fh.read()
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


class PublicServer:
    """Runs the public port: Generation + Health + reflection."""

    def __init__(self, models: Models, cfg: RouterConfig) -> None:
        self.models = models
        self.cfg = cfg
        s = cfg.server
        auth = models.default.auth
        denied = models.default.metrics.request_errors.labels(status=grpc.StatusCode.UNAUTHENTICATED.name)
        interceptors = [BearerTokenInterceptor(auth, on_denied=denied.inc)] if auth.enabled else []
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", cfg.receive_limit()),
                ("grpc.max_metadata_size", s.max_metadata_bytes),
                ("grpc.so_reuseport", 0),
                ("grpc.http2.bdp_probe", int(s.grpc_bdp_probe)),
                ("grpc.max_connection_age_ms", 10 * 60 * 1000),  # clients re-resolve DNS (k8s scale-out)
                ("grpc.max_connection_age_grace_ms", 60 * 1000),
            ],
        )
        gpb_grpc.add_GenerationServicer_to_server(GenerationService(models, cfg), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if s.enable_reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
                self.server,
            )
        addr = f"{s.host}:{s.port}"
        creds = _credentials(cfg)
        self.port = self.server.add_secure_port(addr, creds) if creds else self.server.add_insecure_port(addr)
        if self.port == 0:
            raise OSError(f"cannot listen on {addr}")
        models.on_ready_change(self._on_ready)

    def _on_ready(self, engine: Engine, ready: bool) -> None:
        """The server (and the Generation service) serve while any model
        does: one model's executor down must not take the others out of a
        load balancer. Each model has its own entry under its name."""
        loop = asyncio.get_running_loop()
        for name, up in self._health_states():
            loop.create_task(self.health.set(name, up))

    def _health_states(self) -> list[tuple[str, int]]:
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        states = [(name, serving if self.models.serving() else not_serving) for name in ("", SERVICE_NAME)]
        for e in self.models.engines:
            states.append((e.name, serving if self.models.serving(e) else not_serving))
        return states

    async def start(self) -> None:
        for name, _ in self._health_states():
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def drain_and_stop(self, timeout: float) -> None:
        for name, _ in self._health_states():
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.models.drain(timeout)
        await self.server.stop(grace=1.0)
