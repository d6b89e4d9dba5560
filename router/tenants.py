"""Who a request is for: its tenant, the unit of fair share
(`scheduler.policy: fair`), prefix-cache isolation, metrics and logs.

- Auth on (`server.auth_tokens_file`, or one token): the tenant its bearer
  token names. The header and the OpenAI `user` field are ignored for
  identity, so no client can speak for another.
- Auth off: the `scheduler.tenant_header` header (HTTP) or metadata key
  (gRPC), by default the Gateway API Inference Extension's
  `x-gateway-inference-fairness-id`; else the OpenAI `user` field; else
  `default`.

A client-chosen id is kept as given when it is short and plain (letters,
digits and `._:@/+=-`, at most MAX_TENANT_CHARS); any other value becomes
`#` and a digest of it, so ids stay bounded in size and never collide with
the reserved names (`~overflow`, and auth tenants, which are plain).
How many distinct tenants may have requests in flight is bounded by
`limits.max_tenants` in the engine (the rest share `~overflow`).
"""

from __future__ import annotations

import hashlib
import re

from router.auth import DEFAULT_TENANT, Authenticator

MAX_TENANT_CHARS = 64
# The header (HTTP) / metadata key (gRPC) that names a request's SLO class
# when its body / message leaves `slo_class` empty.
SLO_CLASS_HEADER = "x-slo-class"
OVERFLOW_TENANT = "~overflow"
_PLAIN = re.compile(rf"[A-Za-z0-9._:@/+=-]{{1,{MAX_TENANT_CHARS}}}")


def tenant_id(value: str) -> str:
    """A client-chosen tenant id as the router keeps it."""
    if _PLAIN.fullmatch(value):
        return value
    return "#" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def request_tenant(auth: Authenticator, authenticated: str, header: str | None, user: str | None = None) -> str:
    """The tenant of a request that passed authentication as `authenticated`."""
    if auth.enabled:
        return authenticated
    for value in (header, user):
        if value:
            return tenant_id(value)
    return DEFAULT_TENANT


def metadata_value(metadata, key: str) -> str | None:
    """A gRPC metadata value by (lower-case) key; None when absent."""
    key = key.lower()
    for k, v in metadata or ():
        if k == key:
            return v if isinstance(v, str) else None
    return None
