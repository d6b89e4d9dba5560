"""The OpenAI-compatible HTTP API: Starlette on uvicorn, in the router's own
event loop, on the same engine, scheduler and admission as the gRPC API.

A request is translated into the gRPC `GenerateRequest` and admitted by
`router.admission.admit`, so the validation, limits, messages and statuses
are the gRPC API's; `HTTP_STATUS` maps each gRPC status to its HTTP one. The
OpenAI fields cbserve does not implement are refused with a 400 that names
the field, never ignored (`UNSUPPORTED`). docs/api.md lists every field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

import grpc
import structlog
import uvicorn
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from cbserve.v1 import generation_pb2 as gpb
from router import __version__, tool_calls
from router.admission import admit_all, refuse, siblings
from router.config import RouterConfig
from router.engine import Delta, Engine, RequestHandle, merged
from router.models import Models
from router.request import Finish
from router.tenants import SLO_CLASS_HEADER, request_tenant
from router.validation import ROLES, RequestError, prompt_ids

_LOGGER = structlog.get_logger(__name__)

# The OpenAI API's value for each sampling field a request leaves out, where
# the model's generation config sets none (server.use_generation_config).
OPENAI_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
_FINISH = {Finish.EOS: "stop", Finish.STOP_SEQUENCE: "stop", Finish.LENGTH: "length", Finish.CANCELLED: "abort"}
# The leading field of a validation message (the gRPC API's names) -> the
# OpenAI parameter it came from, for the error object's `param`.
_PARAM = {
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.min_p": "min_p",
    "sampling.logit_bias": "logit_bias",
    "stopping.stop_token_ids": "stop_token_ids",
    "stopping.min_tokens": "min_tokens",
    "stopping.max_new_tokens": "max_tokens",
    "stopping.stop": "stop",
    "text": "prompt",
    "token_ids": "prompt",
    "input": "prompt",
    "messages": "messages",
    "request_id": "X-Request-Id",
    "priority": "priority",
    "structured": "response_format",
    "prompt_logprobs": "prompt_logprobs",
    "tools": "tools",
}
# OpenAI fields cbserve does not implement yet, with the values that ask for
# nothing beyond the default (besides absent or null). Compared with their
# type, so neither 0 nor 1 passes for False or True (completions'
# `logprobs: 0` asks for logprobs; chat's `logprobs: false` does not).
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": (),
    "functions": (),
    "function_call": (),
}
TIMEOUT_HEADERS = ("x-request-timeout", "x-envoy-expected-rq-timeout-ms")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPE.get(status, "server_error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def _from_request_error(exc: RequestError) -> ApiError:
    status = HTTP_STATUS.get(exc.code, 500)
    head = re.match(r"([\w.]+)(\[\d+\])?[\w.\[\]]*:", exc.message)
    param = None
    if head:
        field = head.group(1)
        param = _PARAM.get(field) or _PARAM.get(field.split(".")[0])
    return ApiError(status, exc.message, param)


# -- request bodies (OpenAI's names; `extra="allow"`: unknown fields are ignored) --
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's extension: usage (tokens so far) on every chunk.
    continuous_usage_stats: bool = False


class _Common(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    slo_class: str | None = None  # scheduler.slo_classes (else the x-slo-class header)
    speculative: bool | None = None  # false: no speculative decoding for this request
    n: int = 1  # completions per prompt: siblings that share the prompt's KV blocks
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    # vLLM's extensions
    min_p: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's guided_* fields
    # and structured_outputs object.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs, k alternatives each


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    # The legacy API's logprobs: how many alternatives per token (0: only the sampled one's).
    logprobs: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionBody(_Body):
    name: str
    arguments: str = "{}"


class ToolCallBody(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionBody


class MessageBody(_Body):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None


class ChatBody(_Common):
    messages: list[MessageBody]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True


class LoraAdapterBody(_Body):
    lora_name: str
    lora_path: str | None = None
    # The base model (none: the first); cbserve's extension.
    model: str | None = None


def _lora_status(exc: RequestError) -> int:
    """A run-time adapter change's refusal: FAILED_PRECONDITION (in use) is a
    409 conflict, the rest as every other endpoint maps them."""
    return 409 if exc.code == grpc.StatusCode.FAILED_PRECONDITION else HTTP_STATUS.get(exc.code, 500)


class TokenizeBody(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[MessageBody] | None = None
    tools: list[dict] | None = None


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[int]


@dataclass
class ToolUse:
    """How a chat request's tools shape its output: `mode` is none, auto,
    required or named (`name` the function); `fmt` the auto format."""

    mode: str
    functions: dict[str, dict]
    name: str = ""
    fmt: str = "none"

    def calls(self, text: str) -> tuple[str | None, list[tool_calls.ToolCall]]:
        """(content, calls) of a whole output."""
        if self.mode == "required":
            calls = tool_calls.calls_from_required(text)
        elif self.mode == "named":
            calls = tool_calls.call_from_named(self.name, text)
        elif self.mode == "auto":
            content, calls = tool_calls.parse(self.fmt, text, self.functions)
            return (content or None) if calls else text, calls
        else:
            calls = []
        return (None, calls) if calls else (text, [])

    def finish(self, finish: str | None, calls: list) -> str | None:
        # OpenAI ends a forced (named) function with "stop", other calls with "tool_calls".
        return "tool_calls" if calls and self.mode != "named" else finish


def _validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith(("function-", "list[", "str", "int")))
    loc = loc or None
    return ApiError(400, f"{loc or 'body'}: {first.get('msg', 'invalid value')}", loc)


class OpenAIApi:
    """The HTTP endpoints: the body names the model, whose `ModelApi` serves it."""

    def __init__(self, models: Models, cfg: RouterConfig) -> None:
        self.models = models
        self.cfg = cfg
        self.apis = {e.name: ModelApi(e, cfg) for e in models.engines}
        self.default = self.apis[models.default.name]
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
        ]
        handlers = {ApiError: self._api_error, 404: self._http_error, 405: self._http_error}
        self.app = Starlette(routes=routes, exception_handlers=handlers)

    async def _api_error(self, request: HttpRequest, exc: ApiError) -> JSONResponse:
        return JSONResponse(_error_body(exc.status, exc.message, exc.param, exc.code), status_code=exc.status)

    async def _http_error(self, request: HttpRequest, exc: Exception) -> JSONResponse:
        """Unknown paths and methods, in OpenAI's error format too."""
        status = getattr(exc, "status_code", 404)
        message = f"{request.method} {request.url.path}: " + (
            "no such endpoint" if status == 404 else "method not allowed"
        )
        return JSONResponse(_error_body(status, message), status_code=status)

    def _api(self, name: str | None) -> "ModelApi":
        """The API of the model a body names (none: the first); 404 for a
        name not served here, as OpenAI answers."""
        api = self.apis.get(name) if name else self.default
        if api is None and name:  # a LoRA adapter: its base model's API
            engine = self.models.adapter_engine(name)
            api = self.apis[engine.name] if engine is not None else None
        if api is None:
            served = ", ".join(repr(n) for n in self.apis)
            raise self.default._refused(
                404, f"the model {name[:128]!r} does not exist; this server serves {served}", "model", "model_not_found"
            )
        return api

    async def _parsed(self, request: HttpRequest, body_type: type[BaseModel]) -> tuple[Any, "ModelApi"]:
        body = await self.default._json(request, body_type)
        api = self._api(body.model)
        api.check_available()
        return body, api

    async def completions(self, request: HttpRequest) -> Response:
        body, api = await self._parsed(request, CompletionBody)
        return await api.completions(request, body)

    async def chat_completions(self, request: HttpRequest) -> Response:
        body, api = await self._parsed(request, ChatBody)
        return await api.chat_completions(request, body)

    async def tokenize(self, request: HttpRequest) -> Response:
        body, api = await self._parsed(request, TokenizeBody)
        return await api.tokenize(body)

    async def detokenize(self, request: HttpRequest) -> Response:
        body, api = await self._parsed(request, DetokenizeBody)
        return await api.detokenize(body)

    async def list_models(self, request: HttpRequest) -> Response:
        """Every model served here, the default first (max_model_len once its
        executor has said it)."""
        self.default._authorize(request)
        if not any(api.engine.facts is not None for api in self.apis.values()):
            raise self.default._refused(503, "the executor is not available")
        cards = [card for api in self.apis.values() for card in (api.card(), *api.adapter_cards())]
        return JSONResponse({"object": "list", "data": cards})

    async def load_lora_adapter(self, request: HttpRequest) -> Response:
        """vLLM's run-time load: {lora_name, lora_path}; 200 with a text line."""
        body, api = await self._lora_body(request)
        try:
            await api.engine.load_adapter(body.lora_name, body.lora_path or "", self.models.taken_names())
        except RequestError as exc:
            raise api._refused(_lora_status(exc), exc.message) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: HttpRequest) -> Response:
        body, api = await self._lora_body(request)
        try:
            api.engine.unload_adapter(body.lora_name)
        except RequestError as exc:
            raise api._refused(_lora_status(exc), exc.message) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def _lora_body(self, request: HttpRequest) -> tuple["LoraAdapterBody", "ModelApi"]:
        body = await self.default._json(request, LoraAdapterBody)
        api = self._api(body.model) if body.model else self.default
        if not api.engine.cfg.lora.allow_runtime_updates:  # as vLLM without its switch: no such endpoint
            raise api._refused(404, f"{request.url.path}: off (lora.allow_runtime_updates is false)")
        return body, api

    async def health(self, request: HttpRequest) -> Response:
        """200 while any model serves; `?model=NAME` asks about one."""
        name = request.query_params.get("model")
        if name and name not in self.apis:
            return Response(status_code=404)
        engine = self.apis[name].engine if name else None
        return Response(status_code=200 if self.models.serving(engine) else 503)

    async def version(self, request: HttpRequest) -> Response:
        return JSONResponse({"version": __version__})


class ModelApi:
    """The HTTP endpoints' work over one model's engine."""

    def __init__(self, engine: Engine, cfg: RouterConfig) -> None:
        self.engine = engine
        self.cfg = cfg

    # -- plumbing ---------------------------------------------------------------
    def model_name(self) -> str:
        return self.engine.name

    def adapter_cards(self) -> list[dict]:
        """The model's LoRA adapters, as vLLM lists them (parent: the base)."""
        cards = []
        for a in self.engine.loras.values():
            card = {"id": a.name, "object": "model", "created": 0, "owned_by": "cbserve", "root": a.path}
            card["parent"] = self.model_name()
            if self.engine.facts is not None:
                card["max_model_len"] = self.engine.facts.max_context
            cards.append(card)
        return cards

    def served_name(self, handles: list[RequestHandle]) -> str:
        """The `model` a response names: the adapter a request chose, else the model."""
        lora = handles[0].req.lora if handles else None
        return lora.name if lora is not None else self.model_name()

    def card(self) -> dict:
        card = {"id": self.model_name(), "object": "model", "created": 0, "owned_by": "cbserve"}
        if self.engine.facts is not None:
            card["max_model_len"] = self.engine.facts.max_context
        return card

    def check_available(self) -> None:
        if self.engine.facts is None:
            raise self._refused(503, f"the executor of model {self.engine.name!r} is not available")

    def _authorize(self, request: HttpRequest) -> str:
        """The caller's tenant; 401 for a missing or unknown token."""
        tenant = self.engine.auth.tenant(request.headers.get("authorization"))
        if tenant is None:
            raise self._refused(401, "missing or wrong bearer token", code="invalid_api_key")
        request.state.tenant = tenant
        return tenant

    async def _json(self, request: HttpRequest, model: type[BaseModel]) -> Any:
        """The body parsed into `model`, read no further than the size limit."""
        self._authorize(request)
        limit = self.cfg.http_body_limit()
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise self._refused(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise self._refused(413, f"the request body is larger than {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        # Parsing megabytes of JSON takes milliseconds: on a tokenizer thread.
        return await self.engine.off_loop(self._parse, b"".join(chunks), model)

    def _parse(self, raw: bytes, model: type[BaseModel]) -> Any:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise self._refused(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise self._refused(400, "the request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            err = _validation_error(exc)
            raise self._refused(400, err.message, err.param) from None

    def _refused(self, status: int, message: str, param: str | None = None, code: str | None = None) -> ApiError:
        grpc_code = next((c for c, s in HTTP_STATUS.items() if s == status), grpc.StatusCode.INVALID_ARGUMENT)
        refuse(self.engine, grpc_code, message)
        return ApiError(status, message, param, code)

    def _check_supported(self, body: _Common) -> None:
        extra = body.model_extra or {}
        for field in ("tools", "tool_choice"):  # chat fields a completion cannot honour
            if extra.get(field) is not None:
                raise self._refused(400, f"{field}: only /v1/chat/completions takes tools", field)
        for field, unused in UNSUPPORTED.items():
            value = extra.get(field)
            if value is None or any(type(value) is type(u) and value == u for u in unused):
                continue
            raise self._refused(400, f"{field}: not supported by cbserve yet", field)

    def _timeout(self, request: HttpRequest) -> float | None:
        for name in TIMEOUT_HEADERS:
            raw = request.headers.get(name)
            if raw is None:
                continue
            try:
                value = float(raw) / (1000.0 if name.endswith("-ms") else 1.0)
            except ValueError:
                raise self._refused(400, f"{name}: not a number", name) from None
            if not value > 0:
                raise self._refused(400, f"{name}: must be > 0", name)
            return value
        return None

    # -- translation ------------------------------------------------------------
    @contextlib.contextmanager
    def _in_range(self, param: str | None):
        """A JSON number beyond the protobuf field's range (int32 token ids,
        uint32 max_tokens, ...) is the client's 400, not a server error."""
        try:
            yield
        except (ValueError, TypeError) as exc:
            raise self._refused(400, f"{param or 'body'}: a value is out of range ({exc})", param) from None

    def _base_msg(self, body: _Common, max_tokens: int | None, request_id: str) -> gpb.GenerateRequest:
        if max_tokens is not None and max_tokens < 1:
            raise self._refused(400, f"max_tokens: must be >= 1, got {max_tokens}", "max_tokens")
        with self._in_range(None):
            return self._translate(body, max_tokens, request_id)

    def _translate(self, body: _Common, max_tokens: int | None, request_id: str) -> gpb.GenerateRequest:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        facts = self.engine.facts
        use = self.cfg.server.use_generation_config and facts is not None
        defaults = OPENAI_SAMPLING_DEFAULTS | facts.sampling_defaults if use else OPENAI_SAMPLING_DEFAULTS

        def pick(name: str):
            value = getattr(body, name)
            return defaults[name] if value is None else value

        sampling = gpb.SamplingParams(
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=max(0, int(pick("top_k"))),  # vLLM's -1 means off, as 0 here
            repetition_penalty=pick("repetition_penalty"),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            min_p=pick("min_p"),
        )
        for key, bias in (body.logit_bias or {}).items():
            if not key.isdigit():
                raise self._refused(400, f"logit_bias: {key[:32]!r} is not a token id", "logit_bias")
            sampling.logit_bias[int(key)] = bias
        if body.min_tokens < 0:
            raise self._refused(400, f"min_tokens: must be >= 0, got {body.min_tokens}", "min_tokens")
        if any(t < 0 for t in body.stop_token_ids or []):
            raise self._refused(400, "stop_token_ids: token ids are >= 0", "stop_token_ids")
        if body.seed is not None:
            if not 0 <= body.seed < 2**64:
                raise self._refused(400, f"seed: must be in [0, 2**64), got {body.seed}", "seed")
            sampling.seed = body.seed
        structured = self._structured(body)
        logprobs, top_logprobs = self._logprobs(body)
        return gpb.GenerateRequest(
            model=body.model or "",
            request_id=request_id,
            structured=structured,
            sampling=sampling,
            stopping=gpb.StoppingCriteria(
                max_new_tokens=max_tokens or 0,
                stop=stop,
                ignore_eos=body.ignore_eos,
                stop_token_ids=body.stop_token_ids or [],
                min_tokens=body.min_tokens,
            ),
            # vLLM's priority: lower is handled earlier; cbserve's: larger is more urgent.
            priority=-body.priority,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            cache_salt=body.cache_salt or "",
            prompt_logprobs=body.prompt_logprobs,
            speculative=body.speculative,
        )

    def _logprobs(self, body: _Common) -> tuple[bool, int]:
        """(logprobs asked, alternatives per token) from the completions API's
        `logprobs: k` or the chat API's `logprobs: true` + `top_logprobs: k`."""
        if isinstance(body, ChatBody):
            k = body.top_logprobs or 0
            if k and not body.logprobs:
                raise self._refused(400, "top_logprobs: needs logprobs: true", "top_logprobs")
            name, asked = "top_logprobs", body.logprobs
        else:
            k = body.logprobs or 0
            name, asked = "logprobs", body.logprobs is not None
        if not 0 <= k <= 20:
            raise self._refused(400, f"{name}: must be in [0, 20], got {k}", name)
        return asked, k

    def _structured(self, body: _Common) -> gpb.StructuredOutput | None:
        """The one structured-output constraint of a body, from whichever of
        OpenAI's and vLLM's fields carries it; None when there is none."""
        found: list[tuple[str, gpb.StructuredOutput]] = []
        rf = body.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(("response_format", gpb.StructuredOutput(json_object=True)))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
                if not isinstance(schema, (dict, bool)):
                    msg = "response_format: json_schema.schema must be a JSON Schema object"
                    raise self._refused(400, msg, "response_format")
                found.append(("response_format", gpb.StructuredOutput(json_schema=json.dumps(schema))))
            elif kind != "text":
                msg = f"response_format: type {str(kind)[:32]!r} is not text, json_object or json_schema"
                raise self._refused(400, msg, "response_format")
        so = dict(body.structured_outputs or {})
        pairs = [
            ("guided_json", body.guided_json),
            ("guided_regex", body.guided_regex),
            ("guided_choice", body.guided_choice),
            ("guided_grammar", body.guided_grammar),
            ("structured_outputs.json", so.pop("json", None)),
            ("structured_outputs.regex", so.pop("regex", None)),
            ("structured_outputs.choice", so.pop("choice", None)),
            ("structured_outputs.grammar", so.pop("grammar", None)),
        ]
        if so.pop("json_object", None):
            found.append(("structured_outputs.json_object", gpb.StructuredOutput(json_object=True)))
        if so:
            raise self._refused(400, f"structured_outputs: {sorted(so)[0]!r} is not supported", "structured_outputs")
        for name, value in pairs:
            if value is None:
                continue
            kind = name.rsplit(".", 1)[-1].removeprefix("guided_")
            if kind == "json":
                text = value if isinstance(value, str) else json.dumps(value)
                found.append((name, gpb.StructuredOutput(json_schema=text)))
            elif kind == "choice":
                if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                    raise self._refused(400, f"{name}: a list of strings", name)
                found.append((name, gpb.StructuredOutput(choice=gpb.Choices(choices=value))))
            elif isinstance(value, str):
                found.append((name, gpb.StructuredOutput(**{kind: value})))
            else:
                raise self._refused(400, f"{name}: a string", name)
        if len(found) > 1:
            names = ", ".join(n for n, _ in found)
            msg = f"{found[1][0]}: one structured-output constraint per request, got {names}"
            raise self._refused(400, msg, found[1][0])
        return found[0][1] if found else None

    async def _admit_all(self, body: _Common, msgs: list[gpb.GenerateRequest], request: HttpRequest) -> list:
        """Every prompt's `n` completions admitted, or none (OpenAI's choice
        order: prompt by prompt)."""
        slo_class = body.slo_class or request.headers.get(SLO_CLASS_HEADER) or ""
        for msg in msgs:
            msg.slo_class = slo_class
        try:
            pairs = [p for msg in msgs for p in siblings(msg, body.n, self.cfg.limits.max_n)]
        except RequestError as exc:
            raise self._refused(400, exc.message, "n") from None
        try:
            return await admit_all(self.engine, self.cfg, pairs, self._timeout(request), request.state.tenant)
        except RequestError as exc:
            raise _from_request_error(exc) from None

    @staticmethod
    def _request_id(request: HttpRequest) -> str:
        return request.headers.get("x-request-id") or uuid.uuid4().hex

    # -- endpoints -----------------------------------------------------------------
    def _generation_checks(self, request: HttpRequest, body: _Common) -> str:
        """A generation body checked for unsupported fields; its request id
        (bound to the logs)."""
        self._check_supported(body)
        rid = self._request_id(request)
        request.state.tenant = request_tenant(
            self.engine.auth,
            request.state.tenant,
            request.headers.get(self.engine.cfg.scheduler.tenant_header),
            body.user,
        )
        structlog.contextvars.bind_contextvars(request_id=rid, tenant=request.state.tenant, model=self.engine.name)
        return rid

    async def completions(self, request: HttpRequest, body: CompletionBody) -> Response:
        rid = self._generation_checks(request, body)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise self._refused(400, "prompt: the list is empty", "prompt")
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        msgs = []
        for i, p in enumerate(prompts):
            msg = self._base_msg(body, max_tokens, rid if len(prompts) == 1 else f"{rid}-{i}")
            with self._in_range("prompt"):
                if isinstance(p, str):
                    msg.text = p
                else:
                    msg.token_ids.ids.extend(p)
            msgs.append(msg)
        handles = await self._admit_all(body, msgs, request)
        return await self._respond(request, body, handles, rid, chat=False)

    async def chat_completions(self, request: HttpRequest, body: ChatBody) -> Response:
        rid = self._generation_checks(request, body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        msg = self._base_msg(body, max_tokens, rid)
        msg.messages.CopyFrom(_chat_messages(body.messages, body.tools))
        tools = self._tool_use(body, msg)
        handles = await self._admit_all(body, [msg], request)
        return await self._respond(request, body, handles, rid, chat=True, tools=tools)

    def _tool_use(self, body: ChatBody, msg: gpb.GenerateRequest) -> ToolUse:
        """The request's tool mode; a forced call becomes the request's
        structured-output constraint."""
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none"):
                raise self._refused(400, "tool_choice: needs tools", "tool_choice")
            return ToolUse("none", {})
        try:
            functions = tool_calls.declared(body.tools)
        except tool_calls.ToolError as exc:
            raise self._refused(400, str(exc), "tools") from None
        if choice is None or choice == "auto":
            fmt = self.cfg.server.tool_call_parser
            if fmt == "auto":
                fmt = tool_calls.detect(getattr(self.engine.tokenizer.hf, "chat_template", None))
            return ToolUse("auto", functions, fmt=fmt)
        if choice == "none":
            return ToolUse("none", functions)
        if choice == "required":
            use = ToolUse("required", functions)
            schema = tool_calls.required_schema(functions, body.parallel_tool_calls)
        else:
            fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str):
                msg_ = "tool_choice: none, auto, required or {'type': 'function', 'function': {'name': ...}}"
                raise self._refused(400, msg_, "tool_choice")
            if name not in functions:
                raise self._refused(400, f"tool_choice: {name[:64]!r} is not one of the tools", "tool_choice")
            use, schema = ToolUse("named", functions, name=name), functions[name]
        if msg.HasField("structured"):
            msg_ = "tool_choice: a forced call cannot be combined with another structured-output constraint"
            raise self._refused(400, msg_, "tool_choice")
        msg.structured.CopyFrom(gpb.StructuredOutput(json_schema=json.dumps(schema)))
        return use

    async def models(self, request: HttpRequest) -> Response:
        self._authorize(request)
        f = self.engine.facts
        if f is None:
            raise self._refused(503, "the executor is not available")
        card = {
            "id": self.model_name(),
            "object": "model",
            "created": 0,
            "owned_by": "cbserve",
            "max_model_len": f.max_context,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def tokenize(self, body: TokenizeBody) -> Response:
        if (body.prompt is None) == (body.messages is None):
            raise self._refused(400, "input: set one of prompt, messages", "prompt")
        msg = gpb.TokenizeRequest()
        if body.prompt is not None:
            msg.text = body.prompt
        else:
            msg.messages.CopyFrom(_chat_messages(body.messages, body.tools))
        eng = self.engine
        try:
            ids = await eng.off_loop(prompt_ids, msg, eng.tokenizer, self.cfg.limits, eng.facts.vocab_size)
        except RequestError as exc:
            refuse(eng, exc.code, exc.message)
            raise _from_request_error(exc) from None
        return JSONResponse({"count": len(ids), "max_model_len": eng.facts.max_context, "tokens": ids})

    async def detokenize(self, body: DetokenizeBody) -> Response:
        vocab = self.engine.facts.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise self._refused(400, f"tokens: {bad} is outside [0, {vocab})", "tokens")
        text = await self.engine.off_loop(self.engine.tokenizer.decode, body.tokens, False)
        return JSONResponse({"prompt": text})

    # -- responses -------------------------------------------------------------------
    async def _respond(
        self,
        request: HttpRequest,
        body: _Common,
        handles: list[RequestHandle],
        rid: str,
        chat: bool,
        tools: ToolUse | None = None,
    ) -> Response:
        headers = {"x-request-id": rid}
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
        tools = tools or ToolUse("none", {})
        if body.stream:
            opts = body.stream_options or StreamOptions()
            stream = self._stream(handles, cid, chat, opts.include_usage, opts.continuous_usage_stats, tools)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        collect = asyncio.ensure_future(self._collect(handles))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client went away: its requests end at the next iteration
                collect.cancel()
                for h in handles:
                    if not h.done:
                        self.engine.abort(h.req)
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)
        results = collect.result()
        error = next((d.error for d in results if d.error is not None), None)
        if error is not None:
            raise _from_request_error(RequestError(*error))
        created = int(time.time())
        choices = []
        for i, (h, d) in enumerate(zip(handles, results)):
            finish = _FINISH.get(d.finish)
            logprobs, _ = self._logprobs_object(d, chat, 0)
            if chat:
                content, calls = tools.calls(d.text)
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = [c.to_openai() for c in calls]
                choices.append(
                    {"index": i, "message": message, "logprobs": logprobs, "finish_reason": tools.finish(finish, calls)}
                )
            else:
                choices.append({"index": i, "text": d.text, "logprobs": logprobs, "finish_reason": finish})
            if d.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = self._prompt_logprobs_object(d, h.req.prompt_token_ids)
        obj = {
            "id": cid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.served_name(handles),
            "choices": choices,
            "usage": _usage(handles),
        }
        return JSONResponse(obj, headers=headers)

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs_object(self, d: Delta, chat: bool, offset: int) -> tuple[dict | None, int]:
        """OpenAI's logprobs object for the tokens of `d` (None when the
        request asked for none), and the completions API's text offset after
        them. Token texts are each token decoded alone."""
        if not d.logprobs:
            return None, offset
        texts = [self._token_text(t) for t in d.token_ids]
        if chat:
            content = []
            for i, (text, lp) in enumerate(zip(texts, d.logprobs)):
                ids, lps = d.top[i] if i < len(d.top) else ([], [])
                alts = [self._token_text(a) for a in ids]
                content.append(
                    {
                        "token": text,
                        "logprob": lp,
                        "bytes": list(text.encode()),
                        "top_logprobs": [
                            {"token": a, "logprob": b, "bytes": list(a.encode())} for a, b in zip(alts, lps)
                        ],
                    }
                )
            return {"content": content}, offset
        text_offset = []
        for text in texts:
            text_offset.append(offset)
            offset += len(text)
        # The completions API's rule (OpenAI's and vLLM's): each position's
        # entry holds the k best alternatives and always the sampled token,
        # so up to k + 1 items. The chat API keeps exactly k (above). Keys
        # are texts: where two tokens decode alike, the sampled one's value
        # is kept, so entry[token] is always its token_logprobs value.
        top = []
        for i, (text, lp) in enumerate(zip(texts, d.logprobs)):
            ids, lps = d.top[i] if i < len(d.top) else ([], [])
            entry = {self._token_text(a): b for a, b in zip(ids, lps)}
            entry[text] = lp
            top.append(entry)
        return {"tokens": texts, "token_logprobs": d.logprobs, "top_logprobs": top, "text_offset": text_offset}, offset

    def _prompt_logprobs_object(self, d: Delta, prompt: list[int]) -> list:
        """vLLM's prompt_logprobs: None for the first prompt token, then per
        token a dict keyed by token id (the prompt token and its k best
        alternatives) of {logprob, rank, decoded_token}."""
        out: list = [None]
        for tok, entry in zip(prompt[1:], d.prompt_logprobs):
            if entry is None:
                out.append(None)
                continue
            lp, rank, ids, lps = entry
            item = {str(tok): {"logprob": lp, "rank": rank, "decoded_token": self._token_text(tok)}}
            for r, (a, b) in enumerate(zip(ids, lps), start=1):
                item.setdefault(str(a), {"logprob": b, "rank": r, "decoded_token": self._token_text(a)})
            out.append(item)
        return out

    async def _collect(self, handles: list[RequestHandle]) -> list[Delta]:
        acc = [Delta() for _ in handles]
        async for i, d in merged(handles):
            acc[i] = acc[i].merge(d)
        return acc

    async def _stream(
        self,
        handles: list[RequestHandle],
        cid: str,
        chat: bool,
        include_usage: bool,
        continuous_usage: bool = False,
        tools: ToolUse | None = None,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        model = self.served_name(handles)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict], usage: dict | None = None) -> bytes:
            chunk: dict[str, Any] = {"id": cid, "object": obj, "created": created, "model": model, "choices": choices}
            if include_usage:
                chunk["usage"] = usage if usage is not None or not continuous_usage else _usage(handles)
            return b"data: " + json.dumps(chunk, separators=(",", ":")).encode("utf-8") + b"\n\n"

        offsets = [0] * len(handles)  # completions' text_offset, per choice

        def choice(
            i: int,
            text: str | None,
            finish: str | None,
            role: bool = False,
            d: Delta | None = None,
            calls: list[dict] | None = None,
        ) -> dict:
            logprobs = None
            if d is not None:
                logprobs, offsets[i] = self._logprobs_object(d, chat, offsets[i])
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
                if calls:
                    delta["tool_calls"] = calls
                return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

        calls_out = [_StreamedCalls(tools or ToolUse("none", {})) for _ in handles]
        try:
            if chat:
                yield event([choice(0, None, None, role=True)])
            async for i, d in merged(handles):
                if d.error is not None:
                    err = _from_request_error(RequestError(*d.error))
                    body = _error_body(err.status, err.message, err.param)
                    yield b"data: " + json.dumps(body).encode("utf-8") + b"\n\n"
                    break
                if d.text or d.token_ids:  # tokens whose text is still incomplete UTF-8 too
                    text, calls = calls_out[i].feed(d.text)
                    yield event([choice(i, text, None, d=d, calls=calls)])
                if d.finish is not None:
                    text, calls = calls_out[i].finish()
                    if text or calls:
                        yield event([choice(i, text, None, calls=calls)])
                    finish = calls_out[i].use.finish(_FINISH.get(d.finish), calls_out[i].made)
                    last = choice(i, None, finish)
                    if d.prompt_logprobs is not None:
                        last["prompt_logprobs"] = self._prompt_logprobs_object(d, handles[i].req.prompt_token_ids)
                    yield event([last])
            else:
                if include_usage:
                    yield event([], _usage(handles))
            yield b"data: [DONE]\n\n"
        finally:
            for h in handles:  # the client went away mid-stream, or an error ended it
                if not h.done:
                    self.engine.abort(h.req)


class _StreamedCalls:
    """One streamed choice's tool calls: what each delta's text becomes
    (content that can go out, and tool_calls deltas), per tool mode. A named
    function's arguments stream as they come; `required` calls go out whole
    at the end (the array is only known to parse then); `auto` holds back
    only what may be the start of a call."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.buffer = ""
        self.made: list[tool_calls.ToolCall] = []
        self.call_id = ""
        self.auto = tool_calls.AutoStream(use.fmt, use.functions) if use.mode == "auto" else None

    def feed(self, text: str) -> tuple[str, list[dict] | None]:
        mode = self.use.mode
        if mode == "named" and text:
            if not self.call_id:
                self.made = [tool_calls.ToolCall(self.use.name, "")]
                self.call_id = self.made[0].id
                return "", [self.made[0].to_openai(0) | {"function": {"name": self.use.name, "arguments": text}}]
            return "", [{"index": 0, "function": {"arguments": text}}]
        if mode == "required":
            self.buffer += text
            return "", None
        if self.auto is not None:
            return self.auto.feed(text), None
        return text, None

    def finish(self) -> tuple[str, list[dict] | None]:
        """What is still to send when the output ends: content, and the
        calls (None when none)."""
        if self.use.mode == "required":  # the whole buffered output, as a non-streamed response reads it
            text, self.made = self.use.calls(self.buffer)
        elif self.auto is not None:
            text, self.made = self.auto.finish()
        else:  # none and named send everything as it comes
            return "", None
        return text or "", [c.to_openai(k) for k, c in enumerate(self.made)] or None


def _chat_messages(messages: list[MessageBody], tools: list[dict] | None = None) -> gpb.ChatMessages:
    out = gpb.ChatMessages(tools_json=json.dumps(tools) if tools else "")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ApiError(400, f"messages[{i}].role: {m.role[:32]!r} is not one of {', '.join(ROLES)}", "messages")
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        calls = [
            gpb.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in m.tool_calls or []
        ]
        out.messages.add(
            role=m.role, content=content, tool_call_id=m.tool_call_id or "", name=m.name or "", tool_calls=calls
        )
    return out


def _usage(handles: list[RequestHandle]) -> dict:
    # A prompt with n > 1 completions counts once, as OpenAI counts it.
    firsts = {h.req.group or h.req.request_id: h for h in reversed(handles)}.values()
    prompt = sum(len(h.req.prompt_token_ids) for h in firsts)
    completion = sum(len(h.req.output_token_ids) for h in handles)
    cached = sum(h.req.num_cached_prompt_tokens for h in firsts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _disconnected(request: HttpRequest) -> None:
    """Returns when the client closes its connection (the body is read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Uvicorn(uvicorn.Server):
    """uvicorn inside the router's event loop: the router owns SIGTERM / SIGINT
    (it drains both APIs), so the server installs no signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """Binds the HTTP port at construction (so a port in use fails start-up with
    OSError, as the gRPC port does) and serves until `stop`."""

    def __init__(self, models: Models, cfg: RouterConfig) -> None:
        s = cfg.server
        self.api = OpenAIApi(models, cfg)
        self.sock = socket.create_server((s.host, s.http_port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        kw: dict[str, Any] = {}
        if s.tls_cert_file:
            kw = {"ssl_certfile": s.tls_cert_file, "ssl_keyfile": s.tls_key_file}
            if s.tls_client_ca_file:
                kw |= {"ssl_ca_certs": s.tls_client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(
            self.api.app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1, **kw
        )
        self.server = _Uvicorn(config)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]), name="cbserve-http")

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            await self._task
        self.sock.close()
