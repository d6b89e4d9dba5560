"""Router configuration: typed sections loaded from YAML and validated once.

Every field says why it exists. `load_config(path)` raises `ConfigError` with a
message an operator can act on; nothing here asserts on user input.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from common.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    ConfigError,
    build_section,
    read_yaml,
    validate_cache,
)
from common.config import (
    positive as _positive,
)

__all__ = [
    "KV_CACHE_DTYPES",
    "CacheConfig",
    "ConfigError",
    "ModelConfig",
    "RouterConfig",
    "model_config",
    "default_model_name",
    "load_config",
    "config_from_dict",
]

BUILTIN_POLICIES = ("fcfs", "sjf", "priority", "static", "dynamic", "fair", "slo")
# The --model values that mean the embedded SmolLM2 (executor/model_source.py takes the same).
DEFAULT_MODEL_SPECS = ("smollm2", "default", "SmolLM2-135M-Instruct")
# server.tool_call_parser's values: router/tool_calls.py reads the formats.
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "none")


# What a request carries beside its prompt text (stop strings, a prompt as
# token ids, tools, sampling fields) within the derived transport limits.
REQUEST_HEADROOM_BYTES = 1024 * 1024


@dataclass
class ServerConfig:
    # Public gRPC address. 0.0.0.0 so a pod is reachable; the CLI may override.
    host: str = "0.0.0.0"
    port: int = 50051
    # Prometheus text endpoint (HTTP); 0 disables it.
    metrics_port: int = 9090
    # OpenAI-compatible HTTP API (router/http_api.py); 0 disables it.
    http_port: int = 8000
    # Largest HTTP request body; beyond it the request gets 413 unread.
    # 0 = derived from limits.max_input_chars (RouterConfig.http_body_limit).
    max_http_body_bytes: int = 0
    # The model name the HTTP API serves and checks `model` against; empty =
    # the executor's model name (gateways route by this name).
    served_model_name: str = ""
    # Largest gRPC request a client may send; beyond it gRPC refuses the call
    # from the message's length prefix, before the request is assembled or
    # parsed. 0 = derived from limits.max_input_chars
    # (RouterConfig.receive_limit).
    max_receive_message_bytes: int = 0
    # gRPC's bandwidth-delay probing grows every stream's receive window to
    # what the link carries, so a client pushes a whole oversized message
    # before it is refused. Off, a stream's window starts at 64 KiB and grows
    # to a message's size once its length prefix passed the receive limit
    # (one round trip more for a message larger than 64 KiB).
    grpc_bdp_probe: bool = False
    # Largest gRPC metadata a client may send (headers, auth token).
    max_metadata_bytes: int = 16 * 1024
    # On SIGTERM: in-flight requests get this long to finish, then are cancelled.
    drain_timeout_s: float = 30.0
    # Generate streams send a message once this many tokens are pending (the
    # first token and the final message go out at once). 1 = every token; a
    # larger value trades smoothness for less per-message CPU in the router
    # and the clients (vLLM's --stream-interval).
    stream_interval: int = 1
    # Prompt `text` (gRPC text, OpenAI completions' prompt) parses special-token
    # text such as `</s>` into those tokens, as vLLM and TGI do; false keeps it
    # characters. Chat message content is always data.
    parse_special_tokens_in_text: bool = True
    # The OpenAI API takes the sampling values of the model's generation
    # config (temperature, top_p, top_k, min_p, repetition_penalty) for the
    # fields a request leaves out, as vLLM does; false: OpenAI's defaults.
    use_generation_config: bool = True
    # Threads that tokenize, render chat templates and validate requests off
    # the event loop (one slow request never stalls the others).
    tokenizer_threads: int = 2
    # Niceness added to those threads (0-19): tokenizing large inputs gives
    # way to the event loop and a co-located executor when cores are short.
    tokenizer_nice: int = 10
    # TLS on the public port: server certificate and key (PEM). Empty = plaintext.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # When set, clients must present a certificate signed by this CA (mTLS).
    tls_client_ca_file: str = ""
    # Bearer-token auth: the token is read from this file, or from this env var.
    auth_token_file: str = ""
    auth_token_env: str = ""
    # Several clients apart: one "TENANT TOKEN" pair per line. A tenant's
    # requests only share prefix-cache blocks with its own; metrics and logs
    # name it. Exclusive with auth_token_file / auth_token_env.
    auth_tokens_file: str = ""
    # gRPC server reflection (grpcurl list) on the public port.
    enable_reflection: bool = True
    # How `tool_choice: auto` finds tool calls in the model's output
    # (router/tool_calls.py): auto = the format the chat template teaches,
    # hermes, llama3_json, or none (output is always content).
    tool_call_parser: str = "auto"


@dataclass
class ExecutorConfig:
    # Where the executor listens: unix:///path (co-located) or host:port.
    address: str = "unix:///tmp/cbserve-executor.sock"
    # A step that takes longer than this means the executor hung: treated as down.
    step_timeout_s: float = 60.0
    # Send plans on one long-lived bidirectional stream (StepStream) instead of
    # a unary Step call per iteration (less CPU and latency on both sides).
    step_stream: bool = True
    # Back-off between reconnection attempts after the executor went away.
    reconnect_backoff_s: float = 0.5
    reconnect_backoff_max_s: float = 5.0
    # TLS for router<->executor over TCP: the executor's certificate and key
    # (used by `cbserve serve` to start it) and the CA the router trusts.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    # mTLS: the router's client certificate and key, and the CA the executor
    # checks them against (it then accepts no other client).
    tls_client_cert_file: str = ""
    tls_client_key_file: str = ""
    tls_client_ca_file: str = ""
    # A TCP address without TLS is refused unless this is true: the executor
    # runs any plan it is sent.
    allow_insecure_tcp: bool = False


def check_executor_transport(ex: "ExecutorConfig") -> None:
    """The executor link's rules, checked after command-line overrides."""
    if ex.address.startswith("unix://"):
        return
    if not ex.tls_ca_file and not ex.allow_insecure_tcp:
        raise ConfigError(
            f"executor.address {ex.address!r} is TCP without TLS: anyone who reaches it can drive the executor; "
            "set executor.tls_cert_file / tls_key_file / tls_ca_file, or executor.allow_insecure_tcp: true"
        )
    if bool(ex.tls_client_cert_file) != bool(ex.tls_client_key_file):
        raise ConfigError("executor.tls_client_cert_file and executor.tls_client_key_file must be set together")
    if ex.tls_client_ca_file and not ex.tls_client_cert_file:
        raise ConfigError("executor.tls_client_ca_file (mTLS) needs executor.tls_client_cert_file and key")


@dataclass
class FairConfig:
    """`scheduler.policy: fair`, per-tenant fair share (router/policies/fair.py):
    each tenant's counter grows by the service it gets, divided by its weight;
    the least-served backlogged tenant goes first."""

    # Counter units per prompt token computed and per output token generated.
    prompt_weight: float = 1.0
    output_weight: float = 2.0
    # Shares by tenant name ({tenant: weight}); a tenant not named has 1.
    weights: dict = field(default_factory=dict)
    # An under-served tenant's waiting request may take the seat (or the KV
    # blocks) of the newest running request of the most over-served tenant.
    preempt: bool = True
    # While requests decode and compete for the seats, a step's tokens are
    # capped so that its predicted time is at most this many times a
    # decode-only step of the same batch (prefill goes in smaller chunks): a
    # tenant that becomes backlogged waits for at most one step, and this
    # keeps that step short. 0 = no cap.
    max_step_ratio: float = 1.5


@dataclass
class SloConfig:
    """`scheduler.policy: slo` (router/policies/slo.py)."""

    # A waiting request that can no longer meet its TTFT: `deprioritize`
    # serves it after those that still can; `reject` ends it at once with
    # RESOURCE_EXHAUSTED (HTTP 429), as it does a new request that cannot.
    on_miss: str = "deprioritize"


@dataclass
class SchedulerConfig:
    # fcfs | sjf | priority | static | dynamic | fair, or module:Class for your own.
    policy: str = "fcfs"
    # Most sequences in one iteration (bounds batch size and executor state).
    max_num_seqs: int = 64
    # Token budget of one iteration: decodes first, then prefill chunks.
    max_num_batched_tokens: int = 512
    # Split prompts longer than the remaining budget across iterations.
    enable_chunked_prefill: bool = True
    # Cap on one request's prefill chunk so long prompts cannot starve others
    # (0 = no cap beyond the budget).
    long_prefill_token_threshold: int = 0
    # What to do with a victim when KV memory runs out: recompute | swap.
    preemption_mode: str = "recompute"
    # SJF aging: a request waiting this long goes before any shorter job.
    sjf_max_wait_s: float = 10.0
    # Batch size of the request-level baselines (static, dynamic).
    static_batch_size: int = 16
    # Dynamic batching: the longest a batch waits to fill up.
    dynamic_max_wait_ms: float = 50.0
    # Steady-state decode: send the next plan while the current one runs, so
    # the executor never waits for the router (see Scheduler.schedule_ahead).
    pipeline_decode: bool = True
    # Late binding of that plan: it is held until this long before the step in
    # flight is predicted to end (from the executor's last decode step time),
    # so a prompt arriving meanwhile joins the next step instead of queueing
    # behind a decode already sent. 0 = send it as soon as it is planned.
    pipeline_lead_ms: float = 4.0
    # With auth off, a request's tenant is this header (HTTP) or metadata key
    # (gRPC), else the OpenAI `user` field, else `default`. It is the header
    # the Gateway API Inference Extension sends. Ignored with auth on: the
    # token names the tenant.
    tenant_header: str = "x-gateway-inference-fairness-id"
    fair: FairConfig = field(default_factory=FairConfig)
    # SLO classes a request may name (gRPC / body field `slo_class`, header
    # `x-slo-class`): {name: {ttft_ms: T, tpot_ms: P}}. Every policy counts
    # cbserve_slo_requests_total by class; `slo` (and `fair`, within a
    # tenant) orders by them.
    slo_classes: dict = field(default_factory=dict)
    # The class of a request that names none; empty = no class.
    default_slo_class: str = ""
    slo: SloConfig = field(default_factory=SloConfig)


SPECULATIVE_METHODS = ("ngram", "suffix")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys): the router
    drafts tokens from each sequence's own tokens, the executor verifies them
    in one forward pass; outputs are those of decoding without it."""

    # ngram (prompt lookup over the sequence's prompt and output) | suffix
    # (SuffixDecoding: the sequence and recent outputs of other requests,
    # draft length by how often a continuation was seen) | "" = off.
    method: str = "ngram"
    # Most draft tokens proposed for a sequence in one step.
    num_speculative_tokens: int = 3
    # ngram: the last n tokens, n from prompt_lookup_max down to
    # prompt_lookup_min, are looked for earlier in the sequence; what
    # followed the latest match is the draft.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # No drafts in a step whose batch has at least this many sequences:
    # there the forward is compute-bound and draft rows cost what they save.
    disable_by_batch_size: int = 32
    # suffix: the longest suffix matched (tokens), the requests whose outputs
    # are kept for other requests to draw from (0 = the request's own tokens
    # only), the draft's length cap per matched token, and the probability
    # (how often the path was seen after the match) below which it ends.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1


@dataclass
class LoraConfig:
    """LoRA adapters over the model (vLLM's --enable-lora options; docs/lora.md)."""

    # Served from the start: [{name, path}], a PEFT directory each. Requests
    # choose one by its name in `model`.
    adapters: list = field(default_factory=list)
    # Adapters a step can run with at once (the executor's slots).
    max_loras: int = 4
    # The largest rank an adapter may have.
    max_lora_rank: int = 64
    # Adapters the executor keeps read in host memory (0 = max_loras).
    max_cpu_loras: int = 0
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (and gRPC's
    # LoadLoraAdapter / UnloadLoraAdapter); refused while false.
    allow_runtime_updates: bool = False
    # LoRA on with no adapter at start (implied by adapters or
    # allow_runtime_updates).
    enable_lora: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.enable_lora or self.adapters or self.allow_runtime_updates)


@dataclass
class LimitsConfig:
    # Backpressure: beyond these, new requests get RESOURCE_EXHAUSTED at once.
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1_000_000
    # Largest max_new_tokens a request may ask for; also the default cap is
    # what remains of the context.
    max_new_tokens: int = 4096
    # Default when a request leaves max_new_tokens unset.
    default_max_new_tokens: int = 256
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_request_id_chars: int = 128
    max_messages: int = 256
    max_priority_abs: int = 1000
    # Characters of prompt text, or of all chat message contents together
    # (generation and Tokenize alike), and of a cache_salt. The transport
    # limits derive from max_input_chars, so a larger input is refused
    # before the router spends CPU on its bytes.
    max_input_chars: int = 256 * 1024
    max_cache_salt_chars: int = 256
    # Serialized size of the requests waiting in the queue, together.
    max_queued_bytes: int = 256 * 1024 * 1024
    # Messages one stream may have waiting for a client that does not read;
    # beyond it the request is cancelled with RESOURCE_EXHAUSTED.
    max_stream_buffer: int = 4096
    # A structured-output constraint that takes longer to compile is refused.
    grammar_compile_timeout_s: float = 10.0
    # Largest OpenAI `n` (completions per prompt).
    max_n: int = 8
    # Distinct tenants with requests in flight (one model); the requests of
    # any further tenant share the one tenant `~overflow`.
    max_tenants: int = 1024


@dataclass
class LoggingConfig:
    # debug | info | warning | error
    level: str = "info"
    # json | console | auto (console on a terminal, json otherwise)
    format: str = "auto"


@dataclass
class TracingConfig:
    # OpenTelemetry tracing of each request's life: none | otlp. Off costs nothing.
    exporter: str = "none"
    # OTLP/gRPC collector address, e.g. http://otel-collector:4317.
    otlp_endpoint: str = "http://127.0.0.1:4317"
    # Plaintext to the collector (a sidecar or node-local agent).
    otlp_insecure: bool = True
    # service.name of the exported spans.
    service_name: str = "cbserve-router"


@dataclass
class ModelConfig:
    """One entry of `models:`: a model with its own executor, scheduler and
    KV pool behind the same router. Sections given here are merged over the
    top-level ones."""

    # The name requests choose it by (gRPC `model`, OpenAI `model`); empty =
    # the name of what `model` loads.
    name: str = ""
    # What its executor loads: smollm2 | tiny | a checkpoint directory | a .gguf file.
    model: str = ""
    # `cbserve serve` starts its executor with these (empty / 0 = the command line's).
    dtype: str = ""
    device: str = ""
    max_model_len: int = 0
    # Overrides of the top-level sections for this model. An `executor.address`
    # here means its executor runs elsewhere: `cbserve serve` starts none.
    executor: dict = field(default_factory=dict)
    scheduler: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)
    speculative: dict = field(default_factory=dict)
    lora: dict = field(default_factory=dict)


@dataclass
class RouterConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Several models behind one router (empty = the one of `--model`).
    models: list = field(default_factory=list)

    def receive_limit(self) -> int:
        """Largest gRPC request: as set, or what the largest valid prompt
        takes (4 bytes of UTF-8 a character) plus REQUEST_HEADROOM_BYTES."""
        return self.server.max_receive_message_bytes or (4 * self.limits.max_input_chars + REQUEST_HEADROOM_BYTES)

    def http_body_limit(self) -> int:
        """Largest HTTP body: as set, or the largest valid prompt as JSON
        (6 bytes a character escaped as \\uXXXX) plus REQUEST_HEADROOM_BYTES."""
        return self.server.max_http_body_bytes or (6 * self.limits.max_input_chars + REQUEST_HEADROOM_BYTES)


def model_config(cfg: RouterConfig, m: ModelConfig, where: str) -> RouterConfig:
    """The whole configuration one model's engine runs with: the top level
    with the entry's sections merged over it."""
    sections = {}
    for name, cls in (
        ("executor", ExecutorConfig),
        ("scheduler", SchedulerConfig),
        ("cache", CacheConfig),
        ("speculative", SpeculativeConfig),
        ("lora", LoraConfig),
    ):
        override = getattr(m, name)
        if not isinstance(override, dict):
            raise ConfigError(f"{where}.{name}: expected a mapping, got {type(override).__name__}")
        merged = {**dataclasses.asdict(getattr(cfg, name)), **override}
        sections[name] = build_section(cls, merged, f"{where}.{name}")
    return dataclasses.replace(cfg, models=[], **sections)


def _validate_models(cfg: RouterConfig) -> None:
    names = set()
    for i, m in enumerate(cfg.models):
        where = f"models[{i}]"
        if not m.model:
            raise ConfigError(f"{where}.model: required (smollm2, tiny, a checkpoint directory or a .gguf file)")
        if m.name in names:
            raise ConfigError(f"{where}.name: {m.name!r} is used twice")
        names.add(m.name)
        _positive(m.max_model_len, f"{where}.max_model_len", True)
        try:
            validate(model_config(cfg, m, where))
        except ConfigError as exc:
            msg = str(exc)
            raise ConfigError(msg if msg.startswith(where) else f"{where}: {msg}") from None


def validate_speculative(sp: SpeculativeConfig, where: str = "speculative") -> None:
    if sp.method and sp.method not in SPECULATIVE_METHODS:
        raise ConfigError(
            f"{where}.method: {sp.method!r} is not one of {', '.join(SPECULATIVE_METHODS)} (or empty: off)"
        )
    for name in (
        "num_speculative_tokens",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "disable_by_batch_size",
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_spec_factor",
    ):
        _positive(getattr(sp, name), f"{where}.{name}")
    _positive(sp.suffix_decoding_max_cached_requests, f"{where}.suffix_decoding_max_cached_requests", True)
    if not 0 <= sp.suffix_decoding_min_token_prob <= 1:
        raise ConfigError(
            f"{where}.suffix_decoding_min_token_prob: must be in [0, 1], got {sp.suffix_decoding_min_token_prob}"
        )
    if sp.prompt_lookup_min > sp.prompt_lookup_max:
        raise ConfigError(
            f"{where}.prompt_lookup_min: {sp.prompt_lookup_min} is more than prompt_lookup_max ({sp.prompt_lookup_max})"
        )


def validate_lora(lc: LoraConfig, model_names: tuple[str, ...] = (), where: str = "lora") -> None:
    for name in ("max_loras", "max_lora_rank"):
        _positive(getattr(lc, name), f"{where}.{name}")
    _positive(lc.max_cpu_loras, f"{where}.max_cpu_loras", True)
    if lc.max_cpu_loras and lc.max_cpu_loras < lc.max_loras:
        raise ConfigError(f"{where}.max_cpu_loras: {lc.max_cpu_loras} is less than max_loras ({lc.max_loras})")
    if not isinstance(lc.adapters, list):
        raise ConfigError(f"{where}.adapters: expected a list of {{name, path}}, got {type(lc.adapters).__name__}")
    seen: set[str] = set()
    for i, a in enumerate(lc.adapters):
        at = f"{where}.adapters[{i}]"
        if not isinstance(a, dict) or set(a) != {"name", "path"}:
            raise ConfigError(f"{at}: expected {{name, path}}, got {a!r}")
        if not adapter_name_ok(a["name"]) or not isinstance(a["path"], str) or not a["path"]:
            raise ConfigError(f"{at}: name must be letters, digits, - _ . / : and path a directory, got {a!r}")
        if a["name"] in seen or a["name"] in model_names:
            raise ConfigError(f"{at}.name: {a['name']!r} is already a model or adapter name")
        seen.add(a["name"])


def adapter_name_ok(name: Any) -> bool:
    """A LoRA adapter's name: 1-128 letters, digits, - _ . / and :."""
    return isinstance(name, str) and 0 < len(name) <= 128 and all(c.isalnum() or c in "-_./:" for c in name)


def lora_modules(values: list[str]) -> list[dict]:
    """--lora-modules NAME=PATH ... (or vLLM's JSON form {"name", "path"})."""
    out = []
    for v in values:
        v = v.strip()
        if v.startswith("{"):
            try:
                data = json.loads(v)
            except ValueError as exc:
                raise ConfigError(f"--lora-modules: {v[:80]!r} is not JSON ({exc})") from None
            if not isinstance(data, dict) or not {"name", "path"} <= set(data):
                raise ConfigError(f"--lora-modules: {v[:80]!r} needs name and path")
            out.append({"name": data["name"], "path": data["path"]})
            continue
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules: {v[:80]!r} is not NAME=PATH")
        out.append({"name": name, "path": path})
    return out


def validate(cfg: RouterConfig) -> RouterConfig:
    """Checks cross-field rules; returns cfg or raises ConfigError."""
    validate_lora(cfg.lora, (cfg.server.served_model_name,) if cfg.server.served_model_name else ())
    s = cfg.scheduler
    if s.policy not in BUILTIN_POLICIES and ":" not in s.policy:
        raise ConfigError(
            f"scheduler.policy: {s.policy!r} is not one of {', '.join(BUILTIN_POLICIES)} and not a 'module:Class' path"
        )
    _positive(s.max_num_seqs, "scheduler.max_num_seqs")
    _positive(s.max_num_batched_tokens, "scheduler.max_num_batched_tokens")
    if s.max_num_batched_tokens < s.max_num_seqs:
        raise ConfigError(
            "scheduler.max_num_batched_tokens must be >= scheduler.max_num_seqs so every "
            "running sequence can decode each iteration: increase max_num_batched_tokens "
            "or decrease max_num_seqs"
        )
    _positive(s.long_prefill_token_threshold, "scheduler.long_prefill_token_threshold", True)
    if s.preemption_mode not in ("recompute", "swap"):
        raise ConfigError(f"scheduler.preemption_mode: {s.preemption_mode!r} must be 'recompute' or 'swap'")
    _positive(s.sjf_max_wait_s, "scheduler.sjf_max_wait_s")
    _positive(s.static_batch_size, "scheduler.static_batch_size")
    _positive(s.dynamic_max_wait_ms, "scheduler.dynamic_max_wait_ms", True)
    _positive(s.pipeline_lead_ms, "scheduler.pipeline_lead_ms", True)
    _validate_fair(s.fair)
    _validate_slo(s)
    if not _plain_name(s.tenant_header):
        raise ConfigError(f"scheduler.tenant_header: {s.tenant_header!r} is not a header name (letters, digits, - _ .)")
    validate_cache(cfg.cache)
    validate_speculative(cfg.speculative)
    lim = cfg.limits
    for name in (
        "max_queued_requests",
        "max_queued_tokens",
        "max_new_tokens",
        "default_max_new_tokens",
        "max_stop_strings",
        "max_stop_string_chars",
        "max_request_id_chars",
        "max_messages",
        "max_priority_abs",
        "max_input_chars",
        "max_cache_salt_chars",
        "max_queued_bytes",
        "max_stream_buffer",
        "grammar_compile_timeout_s",
        "max_n",
        "max_tenants",
    ):
        _positive(getattr(lim, name), f"limits.{name}")
    if lim.default_max_new_tokens > lim.max_new_tokens:
        raise ConfigError("limits.default_max_new_tokens must be <= limits.max_new_tokens")
    srv = cfg.server
    _positive(srv.stream_interval, "server.stream_interval")
    _positive(srv.tokenizer_threads, "server.tokenizer_threads")
    if not 0 <= srv.tokenizer_nice <= 19:
        raise ConfigError(f"server.tokenizer_nice: must be in [0, 19], got {srv.tokenizer_nice}")
    _positive(srv.max_http_body_bytes, "server.max_http_body_bytes", True)
    _positive(srv.max_receive_message_bytes, "server.max_receive_message_bytes", True)
    for name in ("port", "metrics_port", "http_port"):
        port = getattr(srv, name)
        if not 0 <= port <= 65535:
            raise ConfigError(f"server.{name}: must be in [0, 65535], got {port}")
    _positive(srv.drain_timeout_s, "server.drain_timeout_s", True)
    if bool(srv.tls_cert_file) != bool(srv.tls_key_file):
        raise ConfigError("server.tls_cert_file and server.tls_key_file must be set together")
    if srv.tls_client_ca_file and not srv.tls_cert_file:
        raise ConfigError("server.tls_client_ca_file (mTLS) needs server.tls_cert_file and tls_key_file")
    if srv.auth_tokens_file and (srv.auth_token_file or srv.auth_token_env):
        raise ConfigError("server.auth_tokens_file excludes server.auth_token_file and server.auth_token_env")
    if cfg.server.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ConfigError(
            f"server.tool_call_parser: {cfg.server.tool_call_parser!r} is not {'|'.join(TOOL_CALL_PARSERS)}"
        )
    for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_token_file", "auth_tokens_file"):
        path = getattr(srv, name)
        if path and not os.path.isfile(path):
            raise ConfigError(f"server.{name}: file {path!r} does not exist")
    _positive(cfg.executor.step_timeout_s, "executor.step_timeout_s")
    ex = cfg.executor
    if not (ex.address.startswith("unix://") or ":" in ex.address):
        raise ConfigError(f"executor.address: {ex.address!r} is neither unix:///path nor host:port")
    if bool(ex.tls_cert_file) != bool(ex.tls_key_file):
        raise ConfigError("executor.tls_cert_file and executor.tls_key_file must be set together")
    check_executor_transport(ex)
    for name in (
        "tls_cert_file",
        "tls_key_file",
        "tls_ca_file",
        "tls_client_cert_file",
        "tls_client_key_file",
        "tls_client_ca_file",
    ):
        path = getattr(ex, name)
        if path and not os.path.isfile(path):
            raise ConfigError(f"executor.{name}: file {path!r} does not exist")
    if cfg.logging.level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"logging.level: {cfg.logging.level!r} is not debug|info|warning|error")
    if cfg.tracing.exporter not in ("none", "otlp"):
        raise ConfigError(f"tracing.exporter: {cfg.tracing.exporter!r} is not none|otlp")
    if cfg.logging.format not in ("json", "console", "auto"):
        raise ConfigError(f"logging.format: {cfg.logging.format!r} is not json|console|auto")
    return cfg


def _positive_number(value: Any) -> bool:
    """A finite number > 0 (not a bool) from YAML."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < float("inf")


def _plain_name(name: Any) -> bool:
    """A non-empty name of letters, digits, - _ and . (header, class)."""
    return isinstance(name, str) and bool(name) and all(c.isalnum() or c in "-_." for c in name)


def _validate_fair(f: FairConfig) -> None:
    _positive(f.prompt_weight, "scheduler.fair.prompt_weight", True)
    _positive(f.output_weight, "scheduler.fair.output_weight", True)
    r = f.max_step_ratio
    if not (r == 0 or (_positive_number(r) and r >= 1)) or isinstance(r, bool):
        raise ConfigError(f"scheduler.fair.max_step_ratio: expected 0 (off) or a number >= 1, got {f.max_step_ratio!r}")
    if f.prompt_weight == 0 and f.output_weight == 0:
        raise ConfigError("scheduler.fair: prompt_weight and output_weight cannot both be 0 (nothing would be charged)")
    if not isinstance(f.weights, dict):
        raise ConfigError(f"scheduler.fair.weights: expected a mapping of tenant to weight, got {f.weights!r}")
    for tenant, w in f.weights.items():
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"scheduler.fair.weights: {tenant!r} is not a tenant name")
        if not _positive_number(w):
            raise ConfigError(f"scheduler.fair.weights.{tenant}: expected a positive number, got {w!r}")


SLO_CLASS_KEYS = ("ttft_ms", "tpot_ms")


def _validate_slo(s: SchedulerConfig) -> None:
    if not isinstance(s.slo_classes, dict):
        raise ConfigError(f"scheduler.slo_classes: expected a mapping of class to targets, got {s.slo_classes!r}")
    for name, targets in s.slo_classes.items():
        where = f"scheduler.slo_classes.{name}"
        if not _plain_name(name):
            raise ConfigError(f"scheduler.slo_classes: {name!r} is not a class name (letters, digits, - _ .)")
        if not isinstance(targets, dict):
            raise ConfigError(f"{where}: expected a mapping with ttft_ms and tpot_ms, got {targets!r}")
        for key, value in targets.items():
            if key not in SLO_CLASS_KEYS:
                raise ConfigError(f"{where}.{key}: unknown key (known: {', '.join(SLO_CLASS_KEYS)})")
            if not _positive_number(value):
                raise ConfigError(f"{where}.{key}: expected a positive number of milliseconds, got {value!r}")
        missing = [k for k in SLO_CLASS_KEYS if k not in targets]
        if missing:
            raise ConfigError(f"{where}: {' and '.join(missing)} required")
    if s.default_slo_class and s.default_slo_class not in s.slo_classes:
        raise ConfigError(f"scheduler.default_slo_class: {s.default_slo_class!r} is not in scheduler.slo_classes")
    if s.slo.on_miss not in ("deprioritize", "reject"):
        raise ConfigError(f"scheduler.slo.on_miss: {s.slo.on_miss!r} must be 'deprioritize' or 'reject'")
    if s.policy == "slo" and not s.slo_classes:
        raise ConfigError("scheduler.policy slo needs scheduler.slo_classes (at least one class)")


def config_from_dict(data: dict[str, Any] | None) -> RouterConfig:
    data = dict(data or {})
    entries = data.pop("models", None) or []
    if not isinstance(entries, list):
        raise ConfigError(f"config.models: expected a list, got {type(entries).__name__}")
    cfg = build_section(RouterConfig, data, "config")
    cfg.models = [build_section(ModelConfig, e, f"config.models[{i}]") for i, e in enumerate(entries)]
    for m in cfg.models:
        m.name = m.name or default_model_name(m.model)
    _validate_models(cfg)
    return validate(cfg)


def default_model_name(spec: str) -> str:
    """The name a model spec is served under when none is given: what the
    executor reports for it (executor/model_source.py names it the same way)."""
    spec = spec.strip()
    if spec in ("", *DEFAULT_MODEL_SPECS):
        return "SmolLM2-135M-Instruct"
    if spec == "tiny" or spec.startswith("tiny:"):
        return "tiny-random-llama"
    base = os.path.basename(os.path.normpath(spec))
    return base.removesuffix(".gguf")


def load_config(path: str | None) -> RouterConfig:
    """Loads and validates a router YAML file; None gives the defaults."""
    return config_from_dict(read_yaml(path)) if path else validate(RouterConfig())


def apply_overrides(cfg: RouterConfig, args) -> None:
    """Command-line flags win over the config file."""
    if getattr(args, "port", None) is not None:
        cfg.server.port = args.port
    if getattr(args, "metrics_port", None) is not None:
        cfg.server.metrics_port = args.metrics_port
    if getattr(args, "http_port", None) is not None:
        cfg.server.http_port = args.http_port
    if getattr(args, "host", None):
        cfg.server.host = args.host
    if getattr(args, "speculative_config", None):
        try:
            data = json.loads(args.speculative_config)
        except ValueError as exc:
            raise ConfigError(f"--speculative-config: not JSON ({exc})") from None
        cfg.speculative = build_section(SpeculativeConfig, data, "--speculative-config")
        validate_speculative(cfg.speculative, "--speculative-config")
    adapters = lora_modules(getattr(args, "lora_modules", None) or [])
    for key in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        if getattr(args, key, None) is not None:
            setattr(cfg.lora, key, getattr(args, key))
    if adapters or getattr(args, "enable_lora", False):
        if cfg.models:
            raise ConfigError("--lora-modules / --enable-lora: with `models:` in the config, give each model's lora:")
        cfg.lora.adapters = [*cfg.lora.adapters, *adapters]
        cfg.lora.enable_lora = True
    validate_lora(cfg.lora)
    if getattr(args, "executor_address", None):
        if cfg.models:
            raise ConfigError("--executor-address: with `models:` in the config, give each model's executor.address")
        cfg.executor.address = args.executor_address
        check_executor_transport(cfg.executor)


@dataclass
class ModelEntry:
    """What one model runs with. `spec` is what its executor loads and where
    the router's tokenizer comes from."""

    name: str
    spec: str
    cfg: RouterConfig
    # `cbserve serve` starts its executor (no executor.address of its own).
    own_executor: bool = True
    dtype: str = ""
    device: str = ""
    max_model_len: int = 0


def model_entries(cfg: RouterConfig, spec: str) -> list[ModelEntry]:
    """The models of a configuration: its `models:` list, or else the one
    model of the command line (`--model`) under server.served_model_name."""
    if not cfg.models:
        return [ModelEntry(cfg.server.served_model_name or default_model_name(spec), spec, cfg)]
    return [
        ModelEntry(
            m.name,
            m.model,
            model_config(cfg, m, f"models[{i}]"),
            own_executor="address" not in m.executor,
            dtype=m.dtype,
            device=m.device,
            max_model_len=m.max_model_len,
        )
        for i, m in enumerate(cfg.models)
    ]
