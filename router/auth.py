"""Optional bearer-token auth on the public API. Health checks and reflection
stay open; the token is compared in constant time."""

from __future__ import annotations

import hmac
import os
from typing import Callable

import grpc

PROTECTED_PREFIX = "/cbserve.v1.Generation/"


def load_token(token_file: str, token_env: str) -> str | None:
    if token_file:
        with open(token_file, encoding="utf-8") as fh:
            token = fh.read().strip()
        if not token:
            raise ValueError(f"auth token file {token_file!r} is empty")
        return token
    if token_env:
        token = os.environ.get(token_env, "").strip()
        if not token:
            raise ValueError(f"auth token environment variable {token_env!r} is unset or empty")
        return token
    return None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, on_denied: Callable[[], None] | None = None) -> None:
        self._expected = f"Bearer {token}".encode("utf-8")
        self._on_denied = on_denied

    def _authorized(self, metadata) -> bool:
        given = b""
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode("utf-8") if isinstance(value, str) else value
                break
        return hmac.compare_digest(given, self._expected)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if not handler_call_details.method.startswith(PROTECTED_PREFIX) or handler is None:
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        if self._on_denied is not None:
            self._on_denied()
        return _denying(handler)


_DENIED = "missing or wrong bearer token"


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
        yield  # pragma: no cover (makes this an async generator)

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)
