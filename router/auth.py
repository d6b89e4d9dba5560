"""Optional bearer-token auth on the public API, for one client or for
several tenants. Health checks and reflection stay open; a token is compared
with every known one in constant time."""

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


DEFAULT_TENANT = "default"


def load_tenants(path: str) -> dict[str, str]:
    """tenant -> token from a file of "TENANT TOKEN" lines (# comments)."""
    tenants: dict[str, str] = {}
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or not parts[0].replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"{path}:{n}: expected 'TENANT TOKEN' (tenant: letters, digits, - and _)")
            if parts[0] in tenants or parts[1] in tenants.values():
                raise ValueError(f"{path}:{n}: tenant or token given twice")
            tenants[parts[0]] = parts[1]
    if not tenants:
        raise ValueError(f"auth tokens file {path!r} names no tenant")
    return tenants


class Authenticator:
    """Who a bearer token belongs to: the tenant, DEFAULT_TENANT for the
    single-token setting, None when unknown. Without any token configured
    everyone is DEFAULT_TENANT."""

    def __init__(self, token_file: str = "", token_env: str = "", tokens_file: str = "") -> None:
        if tokens_file:
            tenants = load_tenants(tokens_file)
        else:
            token = load_token(token_file, token_env)
            tenants = {DEFAULT_TENANT: token} if token else {}
        self.enabled = bool(tenants)
        self._expected = [(f"Bearer {tok}".encode("utf-8"), name) for name, tok in tenants.items()]

    def tenant(self, authorization: bytes | str | None) -> str | None:
        if not self.enabled:
            return DEFAULT_TENANT
        given = authorization.encode("utf-8") if isinstance(authorization, str) else (authorization or b"")
        found = None
        for expected, name in self._expected:  # every comparison, whatever matches
            if hmac.compare_digest(given, expected):
                found = name
        return found

    def tenant_of_metadata(self, metadata) -> str | None:
        for key, value in metadata or ():
            if key == "authorization":
                return self.tenant(value)
        return self.tenant(None)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth: Authenticator, on_denied: Callable[[], None] | None = None) -> None:
        self._auth = auth
        self._on_denied = on_denied

    def _authorized(self, metadata) -> bool:
        return self._auth.tenant_of_metadata(metadata) is not None

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
