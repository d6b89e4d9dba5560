"""Prometheus metrics of the router (names prefixed `cbserve_`), served as
text at http://HOST:METRICS_PORT/metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics import MetricWrapperBase

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_MODEL = ("model",)  # every series names the model it is about (router config `models:`)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.num_requests_running = Gauge(
            "cbserve_num_requests_running", "Requests in the running batch", labelnames=_MODEL, registry=r
        )
        self.num_requests_waiting = Gauge(
            "cbserve_num_requests_waiting", "Requests waiting to be scheduled", labelnames=_MODEL, registry=r
        )
        self.num_requests_swapped = Gauge(
            "cbserve_num_requests_swapped", "Requests swapped out to host memory", labelnames=_MODEL, registry=r
        )
        self.queue_requests = Gauge(
            "cbserve_queue_requests",
            "Requests per scheduler queue, labelled with the active policy",
            ["model", "policy", "queue"],
            registry=r,
        )
        self.swap_usage_ratio = Gauge(
            "cbserve_swap_usage_ratio",
            "Share of host swap blocks held by swapped-out requests (0-1)",
            labelnames=_MODEL,
            registry=r,
        )
        self.kv_cache_usage_ratio = Gauge(
            "cbserve_kv_cache_usage_ratio", "Share of KV blocks held by requests (0-1)", labelnames=_MODEL, registry=r
        )
        self.num_preemptions = Counter(
            "cbserve_num_preemptions", "Preemptions (recompute or swap)", labelnames=_MODEL, registry=r
        )
        self.num_swaps = Counter(
            "cbserve_num_swaps",
            "Preemptions that swapped a request's KV blocks out to host memory",
            labelnames=_MODEL,
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "cbserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labelnames=_MODEL, registry=r
        )
        self.prefix_cache_hits = Counter(
            "cbserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", labelnames=_MODEL, registry=r
        )
        self.prompt_tokens = Counter("cbserve_prompt_tokens", "Prompt tokens received", labelnames=_MODEL, registry=r)
        self.prompt_tokens_computed = Counter(
            "cbserve_prompt_tokens_computed", "Prompt tokens computed (not cached)", labelnames=_MODEL, registry=r
        )
        self.generation_tokens = Counter("cbserve_generation_tokens", "Tokens generated", labelnames=_MODEL, registry=r)
        self.requests = Counter(
            "cbserve_requests", "Finished requests by outcome", ["model", "finish_reason", "status"], registry=r
        )
        self.tenant_requests = Counter(
            "cbserve_tenant_requests",
            "Finished requests by tenant (server.auth_tokens_file; 'default' otherwise) and status",
            ["model", "tenant", "status"],
            registry=r,
        )
        self.tenant_service_tokens = Counter(
            "cbserve_tenant_service_tokens",
            "Service delivered by tenant: prompt tokens computed (recomputation included) and output tokens generated",
            ["model", "tenant", "kind"],
            registry=r,
        )
        self.tenant_counter = Gauge(
            "cbserve_tenant_counter",
            "scheduler.policy fair: the tenant's virtual token counter (weighted service; the least goes first)",
            ["model", "tenant"],
            registry=r,
        )
        self.slo_requests = Counter(
            "cbserve_slo_requests",
            "Requests of an SLO class by outcome: met (TTFT and TPOT within the class's targets), missed, "
            "rejected (scheduler.slo.on_miss: reject)",
            ["model", "class", "outcome"],
            registry=r,
        )
        self.slo_goodput = Gauge(
            "cbserve_slo_goodput_requests_per_second",
            "Requests that met their SLO class per second, over the last 60 s",
            labelnames=_MODEL,
            registry=r,
        )
        self.request_errors = Counter(
            "cbserve_request_errors",
            "Requests refused before admission, by gRPC status",
            ["model", "status"],
            registry=r,
        )
        self.iteration_tokens = Histogram(
            "cbserve_iteration_tokens",
            "Tokens computed per iteration",
            buckets=_TOKEN_BUCKETS,
            labelnames=_MODEL,
            registry=r,
        )
        self.batch_size = Histogram(
            "cbserve_batch_size", "Sequences per iteration", buckets=_TOKEN_BUCKETS, labelnames=_MODEL, registry=r
        )
        self.time_to_first_token = Histogram(
            "cbserve_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY_BUCKETS,
            labelnames=_MODEL,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "cbserve_inter_token_latency_seconds",
            "Gap between consecutive tokens of a request",
            buckets=_LATENCY_BUCKETS,
            labelnames=_MODEL,
            registry=r,
        )
        self.queue_time = Histogram(
            "cbserve_queue_time_seconds",
            "Arrival to first scheduled",
            buckets=_LATENCY_BUCKETS,
            labelnames=_MODEL,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "cbserve_e2e_request_latency_seconds",
            "Arrival to finish",
            buckets=_LATENCY_BUCKETS,
            labelnames=_MODEL,
            registry=r,
        )
        self.iteration_seconds = Histogram(
            "cbserve_iteration_seconds",
            "Wall time of one router iteration (schedule, step, outputs)",
            buckets=_LATENCY_BUCKETS,
            labelnames=_MODEL,
            registry=r,
        )
        self.executor_step_seconds = Histogram(
            "cbserve_executor_step_seconds",
            "Executor time per step",
            buckets=_LATENCY_BUCKETS,
            labelnames=_MODEL,
            registry=r,
        )
        self.executor_forward_seconds = Histogram(
            "cbserve_executor_forward_seconds",
            "Model forward + sampling time per step",
            buckets=_LATENCY_BUCKETS,
            labelnames=_MODEL,
            registry=r,
        )
        self.executor_up = Gauge(
            "cbserve_executor_up", "1 while the executor is connected", labelnames=_MODEL, registry=r
        )
        # Speculative decoding, with vLLM's meanings (vllm:spec_decode_*).
        self.spec_decode_num_drafts = Counter(
            "cbserve_spec_decode_num_drafts",
            "Drafts verified (one per sequence and step)",
            labelnames=_MODEL,
            registry=r,
        )
        self.spec_decode_num_draft_tokens = Counter(
            "cbserve_spec_decode_num_draft_tokens", "Draft tokens verified", labelnames=_MODEL, registry=r
        )
        self.spec_decode_num_accepted_tokens = Counter(
            "cbserve_spec_decode_num_accepted_tokens", "Draft tokens accepted", labelnames=_MODEL, registry=r
        )
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "cbserve_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft (0 = first)",
            labelnames=(*_MODEL, "position"),
            registry=r,
        )
        # LoRA: which adapters run and wait, as vLLM's vllm:lora_requests_info
        # (the inference gateway's LoRA-affinity scorer reads it): one series,
        # its value the time it was set, labels the adapter names joined by ",".
        lora_labels = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")
        self.lora_requests_info = Gauge(
            "cbserve_lora_requests_info",
            "LoRA adapters of running and waiting requests (labels); value: when set (Unix time)",
            labelnames=(*_MODEL, *lora_labels),
            registry=r,
        )
        self.vllm_lora_requests_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (vLLM's name, for the inference gateway)",
            labelnames=lora_labels,
            registry=r,
        )
        self.executor_restarts = Counter(
            "cbserve_executor_reconnects",
            "Times the router reconnected to a (new) executor",
            labelnames=_MODEL,
            registry=r,
        )

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        if port:
            start_http_server(port, addr=host, registry=self.registry)

    def for_model(self, name: str) -> "ModelMetrics":
        """The same metrics with the `model` label set to `name`."""
        return ModelMetrics(self, name)


class _Labelled:
    """A labelled metric with `model` fixed: `labels()` takes the others."""

    def __init__(self, metric, model: str) -> None:
        self._metric = metric
        self._model = model
        self._children: set[tuple[str, ...]] = set()

    def labels(self, **kw: str):
        values = tuple(str(kw[n]) for n in self._metric._labelnames[1:])
        self._children.add(values)
        return self._metric.labels(self._model, *values)

    def clear(self) -> None:
        """Removes this model's series only."""
        for values in self._children:
            self._metric.remove(self._model, *values)
        self._children.clear()

    def remove_where(self, **kw: str) -> None:
        """Removes this model's series whose labels have these values."""
        names = self._metric._labelnames[1:]
        want = {names.index(k): str(v) for k, v in kw.items()}
        for values in [v for v in self._children if all(v[i] == x for i, x in want.items())]:
            self._metric.remove(self._model, *values)
            self._children.discard(values)

    def label_values(self, name: str) -> set[str]:
        i = self._metric._labelnames[1:].index(name)
        return {v[i] for v in self._children}


class ModelMetrics:
    """One model's view of `Metrics`: the same attributes, each bound to the
    model's label, so an engine never names its model per sample."""

    def __init__(self, metrics: Metrics, name: str) -> None:
        self.root = metrics
        self.name = name
        self.registry = metrics.registry
        for attr, metric in vars(metrics).items():
            if isinstance(metric, MetricWrapperBase) and metric._labelnames[:1] != _MODEL:
                setattr(self, attr, metric)  # a series without the model label (vLLM's names)
            elif isinstance(metric, MetricWrapperBase):
                bound = metric.labels(name) if len(metric._labelnames) == 1 else _Labelled(metric, name)
                setattr(self, attr, bound)


def metric_names(metrics: Metrics) -> set[str]:
    """Exported sample-family names (counters without the _total suffix)."""
    names = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
    return names


METRIC_NAMES = metric_names(Metrics())
