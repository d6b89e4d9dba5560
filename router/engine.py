"""The iteration loop: schedule, send one plan, apply the result, stream
detokenized deltas, and keep going while the executor comes and goes."""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import grpc
import structlog

from router.auth import Authenticator
from router.block_manager import BlockManager
from router.config import ConfigError, RouterConfig, adapter_name_ok
from router.detokenizer import IncrementalDetokenizer
from router.executor_client import ExecutorClient, ExecutorUnavailable, LoraRefused, PlanRejected
from router.lora import LoraAdapter, LoraSlots
from router.metrics import Metrics
from router.plan import encode_plan
from router.policies import make_policy
from router.policies.slo import miss_message, rejects_misses
from router.request import Finish, Request, Status
from router.scheduler import Scheduler, SchedulerOutput
from router.speculative import Speculator
from router.tenants import OVERFLOW_TENANT
from router.tokenizer import Tokenizer
from router.tracing import RequestTracer
from router.validation import RequestError, sampling_defaults

_LOGGER = structlog.get_logger(__name__)


@dataclass
class Delta:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top: list = field(default_factory=list)  # per token (ids, logprobs) of its top_logprobs alternatives
    finish: Finish | None = None
    # A gRPC status that ends the stream with an error instead of a finish.
    error: tuple[grpc.StatusCode, str] | None = None
    # On the final delta of a request that asked: Request.prompt_lps.
    prompt_logprobs: list | None = None

    def merge(self, later: "Delta") -> "Delta":
        """self followed by later (later's finish and error win)."""
        return Delta(
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            logprobs=self.logprobs + later.logprobs,
            top=self.top + later.top,
            finish=later.finish,
            error=later.error,
            prompt_logprobs=later.prompt_logprobs or self.prompt_logprobs,
        )


def _store_prompt_logprobs(req: Request | None, plp) -> None:
    """A step's prompt logprobs into the request's per-position list."""
    if req is None or req.prompt_lps is None:
        return
    k = len(plp.top_token_ids) // max(1, len(plp.logprobs))
    for j, (lp, rank) in enumerate(zip(plp.logprobs, plp.ranks)):
        at = plp.first - 1 + j
        if 0 <= at < len(req.prompt_lps):
            top = slice(j * k, (j + 1) * k)
            req.prompt_lps[at] = (lp, rank, list(plp.top_token_ids[top]), list(plp.top_logprobs[top]))


# An idle engine checks that its executor still answers, as the same
# instance, this often (and whenever the connection to it closes).
IDLE_CHECK_S = 5.0
IDLE_CHECK_TIMEOUT_S = 10.0
# The window of the SLO goodput gauge.
SLO_GOODPUT_WINDOW_S = 60.0


def _spec_fields(req: Request) -> dict:
    """Speculative decoding's share of a request, for its final log line:
    drafts verified, draft tokens accepted / proposed, and accepted tokens
    per draft (the mean accepted length is that + 1 tokens a step)."""
    if not req.spec_drafts:
        return {}
    return {
        "spec_drafts": req.spec_drafts,
        "spec_acceptance_rate": round(req.spec_accepted / req.spec_draft_tokens, 3),
        "spec_mean_accepted_length": round(1 + req.spec_accepted / req.spec_drafts, 3),
    }


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def _tops(result) -> list:
    """A step result's flat top_logprobs, per sampled sequence: (ids, logprobs) or None."""
    out, at = [], 0
    ids, lps = list(result.top_token_ids), list(result.top_logprobs)
    for n in result.top_counts:
        out.append((ids[at : at + n], lps[at : at + n]) if n else None)
        at += n
    return out


class RequestHandle:
    """What a gRPC handler holds: the request and its stream of deltas."""

    def __init__(self, req: Request, detok: IncrementalDetokenizer, engine: "Engine | None" = None) -> None:
        self.req = req
        self.detok = detok
        self.engine = engine  # the engine (model) serving it
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.done = False
        self.last_token_time: float | None = None
        self.span = None  # OpenTelemetry span when tracing is on
        self.seen_preemptions = 0
        self.held: Delta | None = None  # output not yet sent (server.stream_interval)

    def hold_or_send(self, delta: Delta, interval: int, first: bool) -> None:
        """Queues delta for the handler, or keeps it until `interval` tokens
        are pending; the first token goes out at once."""
        delta = self.take_held(delta)
        if first or len(delta.token_ids) >= interval:
            self.queue.put_nowait(delta)
        else:
            self.held = delta

    def take_held(self, delta: Delta) -> Delta:
        """delta with any held output in front of it."""
        if self.held is None:
            return delta
        held, self.held = self.held, None
        return held.merge(delta)

    async def next(self) -> Delta:
        return await self.queue.get()


@dataclass
class ExecutorFacts:
    model: str
    dtype: str
    vocab_size: int
    max_context: int
    block_size: int
    num_blocks: int
    num_swap_blocks: int
    attention_backend: str
    eos_token_ids: list[int]
    instance_id: int
    # The model's generation-config sampling values (the OpenAI API's defaults).
    sampling_defaults: dict[str, float] = field(default_factory=dict)


def _lower_priority(nice: int) -> None:
    """Runs in each tokenizer thread: Linux keeps a niceness per thread, so
    a large input's tokenization yields the cores to the event loop and a
    co-located executor. Raising one's own niceness needs no privilege."""
    if nice and sys.platform.startswith("linux"):  # elsewhere a thread id is no process id
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError as exc:  # a sandbox that forbids it: the thread keeps the loop's priority
            _LOGGER.warning("tokenizer thread priority unchanged", error=str(exc))


class Engine:
    def __init__(
        self,
        cfg: RouterConfig,
        tokenizer: Tokenizer,
        metrics: Metrics,
        client: ExecutorClient | None = None,
        on_executor_lost: Callable[[str], None] | None = None,
        tracer: RequestTracer | None = None,
        name: str = "default",
    ) -> None:
        self.cfg = cfg
        self.name = name  # the model's name: requests choose it by this; the metrics' `model` label
        self.tokenizer = tokenizer
        self.metrics = metrics.for_model(name) if isinstance(metrics, Metrics) else metrics
        self.client = client or ExecutorClient(cfg.executor)
        self.on_executor_lost = on_executor_lost
        self.tracer = tracer
        self.facts: ExecutorFacts | None = None
        self.scheduler: Scheduler | None = None
        self.handles: dict[str, RequestHandle] = {}
        try:  # who may call, and as which tenant (server.auth_*)
            self.auth = Authenticator(
                cfg.server.auth_token_file, cfg.server.auth_token_env, cfg.server.auth_tokens_file
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"server auth: {exc}") from exc
        self.ready = asyncio.Event()  # executor connected and sized
        self.accepting = True
        # Tokenization, chat templates and validation of large inputs: never
        # on the event loop (server.tokenizer_threads).
        self._pool = ThreadPoolExecutor(
            cfg.server.tokenizer_threads,
            thread_name_prefix="cbserve-tokenize",
            initializer=_lower_priority,
            initargs=(cfg.server.tokenizer_nice,),
        )
        self._wake = asyncio.Event()
        self._aborts: list[tuple[Request, Delta]] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._step_id = 0
        self._eos_ids: tuple[int, ...] = ()
        self.structured = None  # router/structured.py, once the executor's vocabulary is known
        self._last_result_t = 0.0  # perf_counter of the last step result
        self._decode_step_s: float | None = None  # the executor's last pure-decode step
        self._ready_callbacks: list[Callable[[bool], None]] = []
        self._seen: dict[int, int] = {}  # counter id -> scheduler total already exported
        self._gauge_policy = ""
        self._slo_met: deque[float] = deque()  # when requests met their SLO (the goodput gauge's window)
        # Tenants with requests in this engine (at most limits.max_tenants,
        # plus ~overflow), and the tenants that have metric series, least
        # recently used first: both bounded, whatever ids clients send.
        self.tenants_live: dict[str, int] = {}
        # LoRA adapters requests may choose by name (router/lora.py); empty
        # with LoRA off. Registered with each executor it connects to.
        self.loras: dict[str, LoraAdapter] = {a["name"]: LoraAdapter(a["name"], a["path"]) for a in cfg.lora.adapters}
        self._lora_series: tuple[str, ...] | None = None
        self._tenant_series: OrderedDict[str, None] = OrderedDict()

    # -- lifecycle --------------------------------------------------------------
    def on_ready_change(self, fn: Callable[[bool], None]) -> None:
        self._ready_callbacks.append(fn)

    def _set_ready(self, ready: bool) -> None:
        if ready:
            self.ready.set()
        else:
            self.ready.clear()
        self.metrics.executor_up.set(1 if ready else 0)
        for fn in self._ready_callbacks:
            fn(ready)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="cbserve-engine")

    async def off_loop(self, fn, *args):
        """fn(*args) on a tokenizer thread; the event loop keeps serving."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stop.set()
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        await self.client.close()

    async def _connect(self) -> None:
        d = await self.client.wait_ready(self._stop)
        facts = ExecutorFacts(
            d.model,
            d.dtype,
            d.vocab_size,
            d.max_context_length,
            d.block_size,
            d.num_blocks,
            d.num_swap_blocks,
            d.attention_backend,
            list(d.eos_token_ids),
            d.instance_id,
        )
        facts.sampling_defaults, refused = sampling_defaults(
            {f.name: v for f, v in d.sampling_defaults.ListFields()}, d.vocab_size
        )
        for name, why in refused.items():
            _LOGGER.warning("generation config default left out", model=self.name, field=name, reason=why)
        await self.client.reset()
        c = self.cfg.cache
        blocks = BlockManager(
            facts.num_blocks, facts.block_size, facts.num_swap_blocks, c.enable_prefix_caching, c.watermark
        )
        eos = facts.eos_token_ids or self.tokenizer.eos_token_ids
        policy = make_policy(self.cfg.scheduler)
        speculator = Speculator(self.cfg.speculative) if self.cfg.speculative.method else None
        slots = await self._register_loras(d)
        self.scheduler = Scheduler(self.cfg.scheduler, blocks, policy, eos, facts.max_context, speculator, slots)
        self._eos_ids = tuple(eos)
        if self.structured is None or self.structured.vocab_size != facts.vocab_size:
            from router.structured import Structured

            self.structured = Structured(self.tokenizer.hf, facts.vocab_size, eos[0] if eos else None)
        self._seen.clear()
        if self.facts is not None:
            self.metrics.executor_restarts.inc()
        self.facts = facts
        _LOGGER.info(
            "executor connected",
            model=self.name,
            loaded=facts.model,
            dtype=facts.dtype,
            num_blocks=facts.num_blocks,
            block_size=facts.block_size,
            backend=facts.attention_backend,
            policy=policy.name,
        )
        self._set_ready(True)

    async def _register_loras(self, d) -> LoraSlots | None:
        """Has a (new) executor read every adapter; drops, logging why, the
        ones it refuses. The slots, or None with LoRA off."""
        if not self.cfg.lora.enabled:
            return None
        if not d.max_loras:
            _LOGGER.error("LoRA is on but the executor has no adapter slots (start it with --max-loras)")
            self.loras.clear()
            return None
        for a in list(self.loras.values()):
            try:
                await self.register_lora(a)
            except LoraRefused as exc:
                _LOGGER.error("lora adapter refused by the executor; not served", adapter=a.name, reason=str(exc))
                del self.loras[a.name]
        return LoraSlots(d.max_loras)

    async def register_lora(self, a: LoraAdapter) -> None:
        r = await self.client.load_lora(a.name, a.path)
        a.rank, a.targets = r.rank, tuple(r.target_modules)
        _LOGGER.info("lora adapter", model=self.name, adapter=a.name, rank=a.rank, targets=list(a.targets))

    async def load_adapter(self, name: str, path: str, taken: set[str]) -> LoraAdapter:
        """A run-time load (vLLM's /v1/load_lora_adapter); RequestError
        when it cannot be served. `taken`: the names of models and adapters."""
        self._check_runtime_lora()
        if not adapter_name_ok(name):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "lora_name: 1-128 letters, digits, - _ . / :")
        if not path:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "lora_path: required (a PEFT directory)")
        if name in taken:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"the name {name!r} is already a model or adapter")
        adapter = LoraAdapter(name, path)
        try:
            await self.register_lora(adapter)
        except LoraRefused as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"lora adapter {name!r}: {exc}") from None
        except ExecutorUnavailable as exc:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        if name in self.loras:  # loaded twice at once: the first one stays
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"the name {name!r} is already an adapter")
        self.loras[name] = adapter
        return adapter

    def unload_adapter(self, name: str) -> None:
        """Refused while requests use the adapter (waiting, running or
        swapped out): they would have to fail or change model mid-way."""
        self._check_runtime_lora()
        adapter = self.loras.get(name)
        if adapter is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"no lora adapter {name[:128]!r} is loaded")
        users = [h for h in self.handles.values() if h.req.lora is adapter]
        if users:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"lora adapter {name!r} is in use by {len(users)} request(s); unload it when they end",
            )
        del self.loras[name]
        if self.scheduler is not None and self.scheduler.lora_slots is not None:
            self.scheduler.lora_slots.evict(name)
            self._wake.set()  # the slot is cleared with the next plan
        _LOGGER.info("lora adapter unloaded", model=self.name, adapter=name)

    def _check_runtime_lora(self) -> None:
        if not self.cfg.lora.allow_runtime_updates:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "loading and unloading LoRA adapters at run time is off (lora.allow_runtime_updates)",
            )
        if self.facts is None or self.scheduler is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the executor is not available")
        if self.scheduler.lora_slots is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "the executor has no LoRA adapter slots")

    # -- intake -----------------------------------------------------------------
    def bounded_tenant(self, tenant: str) -> str:
        """`tenant`, or the shared overflow tenant once limits.max_tenants
        other tenants have requests in flight."""
        if tenant in self.tenants_live or len(self.tenants_live) < self.cfg.limits.max_tenants:
            return tenant
        return OVERFLOW_TENANT

    def _tenant_in(self, tenant: str) -> None:
        self.tenants_live[tenant] = self.tenants_live.get(tenant, 0) + 1
        self._tenant_series[tenant] = None
        self._tenant_series.move_to_end(tenant)
        # Series of tenants with nothing in flight go, oldest first, beyond
        # the bound (they come back with the tenant's next request).
        excess = len(self._tenant_series) - (self.cfg.limits.max_tenants + 1)
        for name in list(self._tenant_series):
            if excess <= 0:
                break
            if name not in self.tenants_live:
                del self._tenant_series[name]
                for metric in (self.metrics.tenant_requests, self.metrics.tenant_service_tokens):
                    metric.remove_where(tenant=name)
                excess -= 1

    def _tenant_out(self, tenant: str) -> None:
        n = self.tenants_live.get(tenant, 0) - 1
        if n > 0:
            self.tenants_live[tenant] = n
        else:
            self.tenants_live.pop(tenant, None)

    def submit(self, req: Request) -> RequestHandle:
        handle = RequestHandle(
            req,
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.stopping.stop, req.stopping.min_tokens),
            self,
        )
        self.handles[req.request_id] = handle
        self._tenant_in(req.tenant)
        if self.tracer is not None:
            handle.span = self.tracer.start(req)
        self.scheduler.add(req)
        self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        self._wake.set()
        return handle

    def abort(self, req: Request, error: tuple[grpc.StatusCode, str] | None = None) -> None:
        """Ends a request from outside the loop (cancel, disconnect, deadline);
        its blocks are freed at the start of the next iteration."""
        if req.status == Status.FINISHED or req.abort_status is not None:
            return
        req.abort_status = error[0].name if error else "CANCELLED"
        self._aborts.append((req, Delta(finish=Finish.CANCELLED, error=error)))
        self._wake.set()

    def set_scheduler_config(self, cfg: RouterConfig) -> None:
        """Hot reload of the scheduler section (SIGHUP)."""
        policy = make_policy(cfg.scheduler)
        self.cfg.scheduler = cfg.scheduler
        if self.scheduler is not None:
            self.scheduler.set_policy(cfg.scheduler, policy)
        _LOGGER.info("scheduler config reloaded", model=self.name, policy=policy.name)

    # -- the loop -----------------------------------------------------------------
    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                await self._connect()
                await self._iterate_forever()
            except ExecutorUnavailable as exc:
                if self._stop.is_set():
                    return
                self._lost(str(exc))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not kill the server
                _LOGGER.exception("engine loop failed", error=str(exc))
                self._lost(f"internal error: {exc}")
                await asyncio.sleep(0.5)

    def _lost(self, why: str) -> None:
        _LOGGER.error("executor lost", model=self.name, error=why, in_flight=len(self.handles))
        self._set_ready(False)
        self._fail_all(grpc.StatusCode.UNAVAILABLE, f"executor unavailable: {why}")
        if self.on_executor_lost is not None:
            self.on_executor_lost(why)

    def _fail_all(self, code: grpc.StatusCode, message: str) -> None:
        if self.scheduler is not None:
            self.scheduler.reset()
        for req, delta in self._aborts:
            self._finish_handle(req, delta)
        self._aborts.clear()
        for handle in list(self.handles.values()):
            self._finish_handle(handle.req, Delta(finish=Finish.CANCELLED, error=(code, message)))

    async def _iterate_forever(self) -> None:
        """Schedule, send, apply, stream. In steady-state decode the next plan
        is sent before the current result is back (Scheduler.schedule_ahead),
        so the executor does not sit idle through the round trip and the
        router's own work."""
        sched = self.scheduler
        inflight: deque[tuple[asyncio.Task, SchedulerOutput, float]] = deque()
        # perf_counter at which the plan after inflight[-1] is sent; None when
        # it is planned (or not) at once.
        ahead_at: float | None = None
        try:
            while not self._stop.is_set():
                if not inflight:
                    self._between_steps()
                    if not sched.has_work():
                        self._update_gauges()
                        self._wake.clear()
                        await self._idle_wait()
                        continue
                    out = sched.schedule()
                    if out.is_empty():
                        self._update_gauges()
                        wake_at = sched.policy.next_wakeup(time.monotonic(), sched.waiting)
                        timeout = 0.05 if wake_at is None else max(0.0, wake_at - time.monotonic())
                        self._wake.clear()
                        try:
                            await asyncio.wait_for(self._wake.wait(), timeout=timeout)
                        except asyncio.TimeoutError:
                            pass
                        continue
                    inflight.append(self._launch(out))
                    ahead_at = self._ahead_at(out, inflight[-1][2])
                    if ahead_at is None:
                        self._launch_ahead(inflight)
                    continue
                if ahead_at is not None:
                    # The next plan is held until just before the step in
                    # flight ends; a step done sooner goes through schedule().
                    task = inflight[0][0]
                    delay = ahead_at - time.perf_counter()
                    if delay > 0:
                        await asyncio.wait((task,), timeout=delay)
                    ahead_at = None
                    if not task.done():
                        self._between_steps()
                        self._launch_ahead(inflight)
                task, out, t_launch = inflight.popleft()
                try:
                    result = await task
                except PlanRejected as exc:
                    # The executor refused the plan: a router bug. Fail what was
                    # in it and start both sides from a clean slate.
                    _LOGGER.error("plan rejected", error=str(exc))
                    raise ExecutorUnavailable(str(exc)) from exc
                for plp in result.prompt_logprobs:
                    _store_prompt_logprobs(sched.by_seq.get(plp.seq_id), plp)
                now = time.perf_counter()
                events = sched.update(
                    out,
                    list(result.seq_ids),
                    list(result.token_ids),
                    list(result.logprobs),
                    tops=_tops(result) if result.top_counts else None,
                    counts=list(result.token_counts) or None,
                )
                self._emit(events, out)
                self._count_service(out, events)
                for seq_id, why in zip(result.failed_seq_ids, result.failed_reasons):
                    req = sched.by_seq.get(seq_id)
                    if req is not None:  # one request's inputs: it fails, the batch goes on
                        _LOGGER.error("executor refused a sequence", request_id=req.request_id, reason=why)
                        self.abort(req, (grpc.StatusCode.INTERNAL, f"the executor could not run this request: {why}"))
                # A step's share of the wall clock: from its launch, or from the
                # previous result when it was sent ahead.
                self._observe(out, result, now - max(t_launch, self._last_result_t))
                self._last_result_t = now
                if out.is_decode_only:
                    self._decode_step_s = result.step_seconds
                if inflight:
                    # The plan sent ahead started when this result was sent.
                    ahead_at = self._ahead_at(inflight[-1][1], now)
                    if ahead_at is None:
                        self._between_steps()
                        self._launch_ahead(inflight)
        finally:
            # Steps still in flight failed with the stream or are abandoned.
            # A cancelled one may still end with the stream's error (its result
            # arrived in the same loop turn), so each is retrieved once done:
            # never logged as "exception was never retrieved".
            for task, _, _ in inflight:
                task.add_done_callback(_retrieve)
                task.cancel()

    async def _idle_wait(self) -> None:
        """Waits for work. Meanwhile the executor is watched, so one that dies
        while nothing runs is noticed at once (health NOT_SERVING, then the
        reconnect) rather than by the next request: its connection closing
        wakes this up, and every IDLE_CHECK_S it must still answer Describe as
        the same instance. Raises ExecutorUnavailable when it does not."""
        wake = asyncio.ensure_future(self._wake.wait())
        try:
            while True:
                waiters = {wake}
                if self.client.connected():
                    waiters.add(asyncio.ensure_future(self.client.wait_connection_change()))
                done, pending = await asyncio.wait(waiters, timeout=IDLE_CHECK_S, return_when=asyncio.FIRST_COMPLETED)
                for task in pending - {wake}:
                    task.cancel()
                if wake in done or self._stop.is_set():
                    return
                try:
                    d = await self.client.describe(timeout=IDLE_CHECK_TIMEOUT_S, wait_for_ready=False)
                except ExecutorUnavailable:
                    # Worded apart from a hung step's deadline: the supervisor
                    # kills an executor only for that.
                    raise ExecutorUnavailable("the executor stopped answering while idle") from None
                if self.facts is not None and d.instance_id != self.facts.instance_id:
                    raise ExecutorUnavailable("the executor restarted while idle")
        finally:
            wake.cancel()

    def _launch(self, out: SchedulerOutput) -> tuple[asyncio.Task, SchedulerOutput, float]:
        self._step_id += 1
        if self.tracer is not None:
            self._trace_plan(out)
        plan = encode_plan(self._step_id, out, self._eos_ids)
        return asyncio.ensure_future(self.client.step(plan)), out, time.perf_counter()

    def _between_steps(self) -> None:
        """What is due before a plan is made: SLO and deadline expiries and
        the cancels that came in meanwhile."""
        self._expire_slo()
        self._apply_aborts()
        self._expire_deadlines()

    def _ahead_at(self, running: SchedulerOutput, started: float) -> float | None:
        """When to send the plan after `running`, a step that began at
        `started`: `pipeline_lead_ms` before its predicted end, predicted from
        the executor's last pure-decode step (only such steps are followed by
        one planned ahead). None = now: no prediction yet, late binding off,
        or too little time left to hold it."""
        lead = self.cfg.scheduler.pipeline_lead_ms / 1e3
        if lead <= 0 or self._decode_step_s is None or not self.cfg.scheduler.pipeline_decode:
            return None
        if not running.is_decode_only:
            return None
        at = started + self._decode_step_s - lead
        return at if at > time.perf_counter() else None

    def _launch_ahead(self, inflight: deque) -> None:
        """Sends the next plan now if the scheduler can plan it ahead."""
        if not self.cfg.scheduler.pipeline_decode or self._aborts:
            return
        out = self.scheduler.schedule_ahead(inflight[-1][1])
        if out is not None:
            inflight.append(self._launch(out))

    def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        aborts, self._aborts = self._aborts, []
        for req, delta in aborts:
            if req.status != Status.FINISHED:
                self.scheduler.finish(req, Finish.CANCELLED)
            self._finish_handle(req, delta)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for handle in list(self.handles.values()):
            req = handle.req
            if req.deadline is not None and now >= req.deadline and req.abort_status is None:
                self.abort(req, (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))
        self._apply_aborts()

    def _emit(self, events, out: SchedulerOutput) -> None:
        sched = self.scheduler
        interval = self.cfg.server.stream_interval
        now = time.monotonic()
        for ev in events:
            req = ev.req
            handle = self.handles.get(req.request_id)
            if handle is None:
                continue
            try:
                self._detokenize(handle, ev)
                if handle.detok.stopped and req.finish is None:
                    sched.finish(req, Finish.STOP_SEQUENCE)
                text = handle.detok.take(final=req.finish is not None)
            except Exception as exc:  # one request's output must not harm others
                _LOGGER.exception("output processing failed", request_id=req.request_id)
                sched.finish(req, Finish.CANCELLED)
                self._finish_handle(
                    req,
                    Delta(
                        finish=Finish.CANCELLED, error=(grpc.StatusCode.INTERNAL, f"output processing failed: {exc}")
                    ),
                )
                continue
            m = self.metrics
            m.generation_tokens.inc(len(ev.token_ids))
            n_out = len(req.output_token_ids)
            if n_out == 1:
                m.time_to_first_token.observe(now - req.arrival_time)
                RequestTracer.event(handle.span, "first_token")
            elif handle.last_token_time is not None:
                m.inter_token_latency.observe(now - handle.last_token_time)
            handle.last_token_time = now
            delta = Delta(token_ids=ev.token_ids, text=text, logprobs=ev.logprobs, top=ev.top, finish=req.finish)
            if req.finish is not None:
                self._finish_handle(req, delta)
            else:
                handle.hold_or_send(delta, interval, first=n_out == len(ev.token_ids))
                if handle.queue.qsize() > self.cfg.limits.max_stream_buffer:
                    # A client that stopped reading: its output must not pile
                    # up in the router. Its blocks are freed at the next step.
                    self.abort(
                        req,
                        (
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"the client did not read its stream ({handle.queue.qsize()} messages waiting)",
                        ),
                    )

    @staticmethod
    def _detokenize(handle: RequestHandle, ev) -> None:
        """ev's tokens into the request's text. Several tokens at once (drafts
        accepted) with stop strings go one by one, and those after the one
        that completes a stop string are dropped, as decoding one token a
        step would never have made them."""
        detok = handle.detok
        if len(ev.token_ids) == 1 or not detok.stop:
            detok.add(ev.token_ids)
            return
        for i, tok in enumerate(ev.token_ids):
            detok.add([tok])
            if detok.stopped:
                extra = len(ev.token_ids) - i - 1
                if extra:
                    req = ev.req
                    del req.output_token_ids[-extra:]
                    del ev.token_ids[-extra:]
                    if ev.logprobs:
                        del req.output_logprobs[-extra:]
                        del ev.logprobs[-extra:]
                    del ev.top[len(ev.token_ids) :]
                return

    def _finish_handle(self, req: Request, delta: Delta) -> None:
        handle = self.handles.pop(req.request_id, None)
        if handle is None or handle.done:
            return
        handle.done = True
        self._tenant_out(req.tenant)
        if delta.error is None and delta.finish is not None:
            delta = handle.take_held(delta)
            delta.text += handle.detok.take(final=True)
            delta.prompt_logprobs = req.prompt_lps
        handle.queue.put_nowait(delta)
        now = time.monotonic()
        m = self.metrics
        if delta.error:
            status = delta.error[0].name
        else:
            status = "CANCELLED" if delta.finish == Finish.CANCELLED else "OK"
        reason = (delta.finish or Finish.CANCELLED).name
        m.requests.labels(finish_reason=reason, status=status).inc()
        m.tenant_requests.labels(tenant=req.tenant, status=status).inc()
        outcome = self._slo_outcome(req, status, now)
        if outcome is not None:
            self.count_slo(req, outcome)
        if handle.span is not None:
            RequestTracer.finish(handle.span, req, status, reason)
        m.e2e_latency.observe(now - req.arrival_time)
        if req.first_scheduled_time is not None:
            m.queue_time.observe(req.first_scheduled_time - req.arrival_time)
        _LOGGER.info(
            "request finished",
            request_id=req.request_id,
            tenant=req.tenant,
            slo_class=req.slo_class or None,
            finish_reason=reason,
            status=status,
            prompt_tokens=len(req.prompt_token_ids),
            output_tokens=len(req.output_token_ids),
            cached_prompt_tokens=req.num_cached_prompt_tokens,
            preemptions=req.num_preemptions,
            queue_s=round(req.first_scheduled_time - req.arrival_time, 4) if req.first_scheduled_time else None,
            ttft_s=round(req.first_token_time - req.arrival_time, 4) if req.first_token_time else None,
            e2e_s=round(now - req.arrival_time, 4),
            **_spec_fields(req),
        )

    def count_slo(self, req: Request, outcome: str) -> None:
        if not req.slo_class:
            return
        self.metrics.slo_requests.labels(**{"class": req.slo_class, "outcome": outcome}).inc()
        if outcome == "met":
            self._slo_met.append(time.monotonic())

    def _slo_outcome(self, req: Request, status: str, now: float) -> str | None:
        """met / missed for a request of a class that ended OK; None for one
        that ended otherwise (cancelled, failed: no service to judge)."""
        if not req.slo_class or status != "OK" or req.first_token_time is None:
            return None
        ttft_ok = req.ttft_deadline is None or req.first_token_time <= req.ttft_deadline
        n = len(req.output_token_ids)
        tpot = ((req.last_token_time or now) - req.first_token_time) / (n - 1) if n > 1 else 0.0
        tpot_ok = req.tpot_s is None or tpot <= req.tpot_s
        return "met" if ttft_ok and tpot_ok else "missed"

    def _expire_slo(self) -> None:
        """scheduler.slo.on_miss: reject: waiting requests that can no longer
        meet their TTFT end now with RESOURCE_EXHAUSTED."""
        sched = self.scheduler
        if sched is None or not rejects_misses(sched):
            return
        now = time.monotonic()
        for req in [r for r in sched.waiting if sched.policy.cannot_meet(r, now)]:
            if req.abort_status is None:
                self.count_slo(req, "rejected")
                self.abort(req, (grpc.StatusCode.RESOURCE_EXHAUSTED, miss_message(req)))

    def _trace_plan(self, out: SchedulerOutput) -> None:
        for item in out.seqs:
            handle = self.handles.get(item.req.request_id)
            if handle is not None and item.num_prompt_tokens:
                RequestTracer.event(handle.span, "prefill_chunk", tokens=item.num_prompt_tokens, step=self._step_id)
        if out.num_preempted:
            for handle in self.handles.values():
                if handle.req.num_preemptions > handle.seen_preemptions:
                    handle.seen_preemptions = handle.req.num_preemptions
                    RequestTracer.event(handle.span, "preempted", mode=self.cfg.scheduler.preemption_mode)

    def _observe(self, out: SchedulerOutput, result, seconds: float) -> None:
        m = self.metrics
        m.iteration_tokens.observe(out.num_tokens)
        m.batch_size.observe(len(out.seqs))
        m.iteration_seconds.observe(seconds)
        m.executor_step_seconds.observe(result.step_seconds)
        m.executor_forward_seconds.observe(result.forward_seconds)
        m.prompt_tokens_computed.inc(out.num_prompt_tokens)
        self._update_gauges()

    def _count_service(self, out: SchedulerOutput, events) -> None:
        """cbserve_tenant_service_tokens: what each tenant got from a step."""
        served: dict[tuple[str, str], int] = {}
        for item in out.seqs:
            if item.num_prompt_tokens:
                key = (item.req.tenant, "prompt")
                served[key] = served.get(key, 0) + item.num_prompt_tokens
        for ev in events:
            key = (ev.req.tenant, "output")
            served[key] = served.get(key, 0) + len(ev.token_ids)
        for (tenant, kind), n in served.items():
            self.metrics.tenant_service_tokens.labels(tenant=tenant, kind=kind).inc(n)

    def _update_tenant_counters(self, policy) -> None:
        counters = policy.counters() if hasattr(policy, "counters") else {}
        gauge = self.metrics.tenant_counter
        for name in gauge.label_values("tenant") - counters.keys():
            gauge.remove_where(tenant=name)
        for name, value in counters.items():
            gauge.labels(tenant=name).set(value)

    def _update_gauges(self) -> None:
        sched = self.scheduler
        if sched is None:
            return
        m = self.metrics
        m.num_requests_running.set(len(sched.running))
        m.num_requests_waiting.set(len(sched.waiting))
        m.num_requests_swapped.set(len(sched.swapped))
        m.kv_cache_usage_ratio.set(sched.blocks.usage())
        m.swap_usage_ratio.set(sched.blocks.swap_usage())
        policy = sched.policy.name
        if policy != self._gauge_policy:  # a reload: drop the old policy's series
            m.queue_requests.clear()
            self._gauge_policy = policy
        for name, queue in (("waiting", sched.waiting), ("running", sched.running), ("swapped", sched.swapped)):
            m.queue_requests.labels(policy=policy, queue=name).set(len(queue))
        self._update_tenant_counters(sched.policy)
        horizon = time.monotonic() - SLO_GOODPUT_WINDOW_S
        while self._slo_met and self._slo_met[0] < horizon:
            self._slo_met.popleft()
        m.slo_goodput.set(len(self._slo_met) / SLO_GOODPUT_WINDOW_S)
        b = sched.blocks
        for counter, total in (
            (m.num_preemptions, sched.num_preemptions),
            (m.num_swaps, sched.num_swaps),
            (m.prefix_cache_queries, b.prefix_queries),
            (m.prefix_cache_hits, b.prefix_hits),
            (m.spec_decode_num_drafts, sched.spec_drafts),
            (m.spec_decode_num_draft_tokens, sched.spec_draft_tokens),
            (m.spec_decode_num_accepted_tokens, sched.spec_accepted),
        ):
            self._inc_to(counter, total)
        for pos, total in enumerate(sched.spec_accepted_per_pos):
            self._inc_to(m.spec_decode_num_accepted_tokens_per_pos.labels(position=str(pos)), total)
        self._update_lora_gauge(sched)

    def _update_lora_gauge(self, sched: Scheduler) -> None:
        def names(reqs) -> str:
            return ",".join(sorted({r.lora.name for r in reqs if r.lora is not None}))

        # With LoRA off: max_lora 0 (the gateway's LoRA scorer sends no adapter here).
        max_lora = sched.lora_slots.max_loras if sched.lora_slots is not None else 0
        labels = (str(max_lora), names(sched.running + sched.swapped), names(sched.waiting))
        m = self.metrics
        if labels != self._lora_series:
            if self._lora_series is not None:
                m.lora_requests_info.remove_where(
                    max_lora=self._lora_series[0],
                    running_lora_adapters=self._lora_series[1],
                    waiting_lora_adapters=self._lora_series[2],
                )
                m.vllm_lora_requests_info.remove(*self._lora_series)
            self._lora_series = labels
        now = time.time()
        keys = dict(zip(("max_lora", "running_lora_adapters", "waiting_lora_adapters"), labels))
        m.lora_requests_info.labels(**keys).set(now)
        m.vllm_lora_requests_info.labels(*labels).set(now)

    def _inc_to(self, counter, total: int) -> None:
        """Advances a Prometheus counter to the scheduler's running total (the
        scheduler restarts from 0 after an executor reconnect)."""
        seen = self._seen.get(id(counter), 0)
        if total > seen:
            counter.inc(total - seen)
        self._seen[id(counter)] = total

    # -- drain ----------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self.handles and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for handle in list(self.handles.values()):
            self.abort(handle.req, None)
        end = time.monotonic() + 2.0
        while self.handles and time.monotonic() < end:
            await asyncio.sleep(0.02)


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Delta]]:
    """(index, delta) of every handle as the engine produces them, until each
    has its final delta."""
    if len(handles) == 1:
        while True:
            d = await handles[0].next()
            yield 0, d
            if d.finish is not None:
                return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        while True:
            d = await h.next()
            queue.put_nowait((i, d))
            if d.finish is not None:
                return

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(handles)
        while left:
            i, d = await queue.get()
            left -= d.finish is not None
            yield i, d
    finally:
        for t in tasks:
            t.cancel()
