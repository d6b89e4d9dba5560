"""The executor's gRPC service: Describe, Step / StepStream, Reset, and grpc.health.v1."""

from __future__ import annotations

import os
import queue
import random
import threading
import time
from concurrent import futures

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cbserve.v1 import executor_pb2 as pb
from cbserve.v1 import executor_pb2_grpc as pb_grpc
from executor.args import check_listen
from executor.errors import PlanError
from executor.metrics import ExecutorMetrics
from executor.runner import ModelRunner

_LOGGER = structlog.get_logger(__name__)

# Plans for a full batch of long prompts are large; stay well above them.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# How long a plan that arrived early waits for its predecessor.
PLAN_ORDER_TIMEOUT_S = 30.0


class _Dropped(Exception):
    """A plan that will not run: its stream's state was reset or an earlier plan failed."""

    def __init__(self, message: str, reset: bool = False) -> None:
        super().__init__(message)
        self.reset = reset


class _Stopping(Exception):
    """A job still queued when the main thread's loop ended."""


class MainThreadWorker:
    """Runs model work on the main thread: torch/oneDNN keep per-thread OpenMP
    state, and the same step runs markedly slower from a gRPC worker thread
    (docs/operations.md, "Threads"), so gRPC handler threads hand their work
    over and wait."""

    # How long the loop waits for a job before it looks at `stop` again; a
    # stop that comes with wake() ends the wait at once.
    poll_s = 0.5

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_since: float | None = None  # monotonic start of the job running now

    def submit(self, fn, *args) -> futures.Future:
        """Queues fn(*args) for the main thread (jobs run in FIFO order)."""
        fut: futures.Future = futures.Future()
        self._jobs.put((fut, fn, args))
        return fut

    def call(self, fn, *args):
        return self.submit(fn, *args).result()

    def wake(self) -> None:
        """Ends the loop's wait for a job now, so a `stop` just set is seen
        (a cancelled job: it never runs). Safe in a signal handler
        (SimpleQueue.put is reentrant)."""
        fut: futures.Future = futures.Future()
        fut.cancel()
        self._jobs.put((fut, None, ()))

    def serve(self, stop: threading.Event) -> None:
        """The main thread's loop until `stop` is set; jobs still queued then
        fail, so no gRPC handler waits for them through the shutdown."""
        try:
            self._serve(stop)
        finally:
            while True:
                try:
                    fut, _, _ = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(_Stopping("the executor is stopping"))

    def _serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                fut, fn, args = self._jobs.get(timeout=self.poll_s)
            except queue.Empty:
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            self.busy_since = time.monotonic()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
            finally:
                self.busy_since = None


class ExecutorService(pb_grpc.ExecutorServicer):
    def __init__(
        self,
        runner: ModelRunner,
        model_name: str,
        eos_ids: list[int],
        metrics: ExecutorMetrics | None = None,
        sampling_defaults: dict[str, float] | None = None,
    ) -> None:
        self.runner = runner
        self.metrics = metrics or ExecutorMetrics()
        self.model_name = model_name
        self.eos_ids = eos_ids
        self.sampling_defaults = pb.SamplingDefaults(**(sampling_defaults or {}))
        self.instance_id = random.getrandbits(63)
        # One step at a time, in step_id order: the router may send plan N+1
        # while plan N runs (pipelined decode), and concurrent RPCs can reach
        # the handlers in either order. Reset starts a new epoch: plans still
        # waiting from before it are refused, never run on the new state.
        self._order = threading.Condition()
        self._next_step: int | None = None
        self._epoch = 0
        # Steps run on the process's main thread (see MainThreadWorker).
        self.worker = MainThreadWorker()

    def Describe(self, request, context):
        r = self.runner
        cfg = r.config
        return pb.DescribeResponse(
            model=self.model_name,
            dtype=str(r.dtype).removeprefix("torch."),
            vocab_size=cfg.vocab_size,
            max_context_length=r.max_context,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=r.cache_shape.num_kv_heads,
            head_dim=r.cache_shape.head_dim,
            block_size=r.block_size,
            num_blocks=r.kv.num_blocks,
            num_swap_blocks=r.kv.num_swap_blocks,
            attention_backend=r.backend,
            eos_token_ids=self.eos_ids,
            instance_id=self.instance_id,
            sampling_defaults=self.sampling_defaults,
            max_loras=r.lora.max_loras if r.lora is not None else 0,
            max_lora_rank=r.lora.max_rank if r.lora is not None else 0,
        )

    def LoadLora(self, request, context):
        lora = self.runner.lora
        if lora is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this executor serves no LoRA adapters (--max-loras 0)")
        from executor.lora import LoraError

        try:  # on the main thread, between steps: the host cache is the steps' too
            adapter = self.worker.call(lora.load, request.name, request.path)
        except (LoraError, OSError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.LoadLoraResponse(rank=adapter.rank, target_modules=adapter.targets)

    def Step(self, request: pb.Plan, context):
        with self._order:
            epoch = self._epoch
            in_turn = self._order.wait_for(
                lambda: self._epoch != epoch or self._next_step is None or request.step_id <= self._next_step,
                timeout=PLAN_ORDER_TIMEOUT_S,
            )
            if self._epoch != epoch or not context.is_active():
                context.abort(grpc.StatusCode.ABORTED, f"plan {request.step_id} dropped: state was reset")
            if not in_turn:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"plan {request.step_id} waited {PLAN_ORDER_TIMEOUT_S}s for plan {self._next_step}",
                )
            return self._run(request, context)

    def StepStream(self, request_iterator, context):
        """Plans in stream order (the stream is the order), one result each.

        A reader thread queues each plan for the main thread as soon as it
        arrives, so the plan the router sent ahead starts the moment the one
        before it ends, not after its result has been sent and the next
        message read (a hand-over that would leave the model idle). A plan
        that fails is answered with its status in the result
        (INVALID_ARGUMENT for a PlanError, INTERNAL for a failure of the
        executor's own) and the plans behind it do not run (ABORTED each);
        the call ends with the first failure's status once the router has
        ended its side (it cancels on the first failed result), so no write
        of the router's races the end of the call. A Reset from another call
        ends it (ABORTED) before its next plan runs."""
        with self._order:
            epoch = self._epoch
        queued: queue.SimpleQueue = queue.SimpleQueue()
        failed = threading.Event()

        def read_plans() -> None:
            try:
                for request in request_iterator:
                    with self._order:
                        if self._epoch != epoch:
                            queued.put((request, None))
                            return
                        self._advance(request)
                    queued.put((request, self.worker.submit(self._stream_step, request, epoch, failed)))
            except Exception:  # noqa: BLE001 - the call ended (cancelled, aborted, closed)
                pass
            finally:
                queued.put(None)

        threading.Thread(target=read_plans, name="cbserve-step-stream", daemon=True).start()
        first_failure: tuple[grpc.StatusCode, str] | None = None
        while (item := queued.get()) is not None:
            request, fut = item
            try:
                if fut is None:
                    raise _Dropped(f"plan {request.step_id} dropped: state was reset", reset=True)
                out = fut.result()
            except _Dropped as exc:
                if exc.reset:
                    context.abort(grpc.StatusCode.ABORTED, str(exc))
                yield self._failed_result(request, (grpc.StatusCode.ABORTED, str(exc)))
                continue
            except Exception as exc:  # noqa: BLE001 - answered by type
                failure = self._step_failure(request, exc)
                first_failure = first_failure or failure
                yield self._failed_result(request, failure)
                continue
            yield self._result(request, out)
        if first_failure is not None:
            context.abort(*first_failure)

    @staticmethod
    def _failed_result(request: pb.Plan, failure: tuple[grpc.StatusCode, str]) -> pb.StepResult:
        code, details = failure
        return pb.StepResult(step_id=request.step_id, error_code=code.value[0], error=details)

    def _stream_step(self, request: pb.Plan, epoch: int, failed: threading.Event):
        """On the main thread, in stream order."""
        if self._epoch != epoch:
            raise _Dropped(f"plan {request.step_id} dropped: state was reset", reset=True)
        if failed.is_set():
            raise _Dropped(f"plan {request.step_id} dropped: an earlier plan of the stream failed")
        try:
            return self.runner.step(request)
        except BaseException:
            failed.set()
            raise

    def _abort_failed_step(self, request: pb.Plan, exc: Exception, context) -> None:
        """Ends the call for a plan that did not run with its status."""
        context.abort(*self._step_failure(request, exc))

    def _step_failure(self, request: pb.Plan, exc: Exception) -> tuple[grpc.StatusCode, str]:
        """The status of a plan that did not run, logged and counted:
        INVALID_ARGUMENT for a PlanError (a rejected plan), UNAVAILABLE while
        stopping, INTERNAL for a failure of the executor's own (a kernel bug,
        out of memory; the traceback goes to the log)."""
        if isinstance(exc, PlanError):
            _LOGGER.warning("rejected plan", step_id=request.step_id, error=str(exc))
            self.metrics.rejected_plans.inc()
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        if isinstance(exc, _Stopping):
            return grpc.StatusCode.UNAVAILABLE, str(exc)
        _LOGGER.error("step failed", step_id=request.step_id, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        return grpc.StatusCode.INTERNAL, f"step {request.step_id} failed in the executor: {type(exc).__name__}: {exc}"

    def _advance(self, request: pb.Plan) -> None:
        """`request` is the plan now running: the next in turn is its successor (holds `_order`)."""
        self._next_step = request.step_id + 1
        self._order.notify_all()

    def _run(self, request: pb.Plan, context) -> pb.StepResult:
        """Runs one plan on the main thread; holds `_order`."""
        self._advance(request)
        try:
            out = self.worker.call(self.runner.step, request)
        except Exception as exc:  # noqa: BLE001 - answered by type
            self._abort_failed_step(request, exc, context)
        return self._result(request, out)

    def _result(self, request: pb.Plan, out) -> pb.StepResult:
        m = self.metrics
        m.steps.inc()
        m.step_seconds.observe(out.step_seconds)
        m.forward_seconds.observe(out.forward_seconds)
        m.step_tokens.observe(sum(s.num_tokens for s in request.seqs))
        m.sampled_tokens.inc(len(out.token_ids))
        m.sequences.set(len(self.runner.state))
        result = pb.StepResult(
            step_id=request.step_id,
            seq_ids=out.seq_ids,
            token_ids=out.token_ids,
            logprobs=out.logprobs or [],
            forward_seconds=out.forward_seconds,
            step_seconds=out.step_seconds,
            token_counts=out.token_counts or [],
        )
        for seq_id, reason in out.failed or []:
            result.failed_seq_ids.append(seq_id)
            result.failed_reasons.append(reason)
        for top in out.top or []:
            ids, lps = top if top is not None else ([], [])
            result.top_counts.append(len(ids))
            result.top_token_ids.extend(ids)
            result.top_logprobs.extend(lps)
        for plp in out.prompt_logprobs or []:
            result.prompt_logprobs.add(
                seq_id=plp.seq_id,
                first=plp.first,
                logprobs=plp.logprobs,
                ranks=plp.ranks,
                top_token_ids=[t for row in plp.top_ids for t in row],
                top_logprobs=[v for row in plp.top_logprobs for v in row],
            )
        return result

    def Reset(self, request, context):
        with self._order:
            self.worker.call(self.runner.reset)
            self._epoch += 1
            self._next_step = None
            self._order.notify_all()
        _LOGGER.info("state reset")
        return pb.ResetResponse()


def _unix_path(address: str) -> str | None:
    return address[len("unix://") :] if address.startswith("unix://") else None


def build_server(
    service: ExecutorService,
    address: str,
    tls_cert: str = "",
    tls_key: str = "",
    tls_client_ca: str = "",
    allow_insecure_tcp: bool = False,
) -> tuple[grpc.Server, health.HealthServicer]:
    """The executor's gRPC server on a Unix socket (created owner-only) or a
    TCP address (TLS required unless allow_insecure_tcp; with
    tls_client_ca, only clients with a certificate it signed)."""
    path = _unix_path(address)
    check_listen(address, tls_cert, allow_insecure_tcp)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    pb_grpc.add_ExecutorServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)
    # A unix socket is created with its final mode (owner only: the pod's
    # containers share a uid), never briefly open to others; gRPC binds it
    # in add_insecure_port() or start(), so the umask covers both.
    old = os.umask(0o177) if path else None
    try:
        if tls_cert and not path:
            with open(tls_key, "rb") as k, open(tls_cert, "rb") as c:
                pair = (k.read(), c.read())
            ca = None
            if tls_client_ca:
                with open(tls_client_ca, "rb") as fh:
                    ca = fh.read()
            creds = grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
        if not path and port == 0:
            raise OSError(f"cannot listen on {address}")
        server.start()
    finally:
        if old is not None:
            os.umask(old)
    if path:
        os.chmod(path, 0o600)
    _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer


def _set_health(health_servicer, status) -> None:
    """The same status for the server as a whole and for its one service."""
    for name in ("", "cbserve.v1.Executor"):
        health_servicer.set(name, status)


def watch_for_hangs(health_servicer, worker: MainThreadWorker, hang_s: float, stop: threading.Event) -> None:
    """Health NOT_SERVING while one job (a step) has run longer than hang_s,
    SERVING again once it ends: the liveness probe on the socket then fails,
    so Kubernetes restarts an executor that hangs (with `cbserve serve` the
    router's step timeout does it)."""
    hung = False
    while not stop.wait(min(1.0, hang_s / 4)):
        since = worker.busy_since
        now_hung = since is not None and time.monotonic() - since > hang_s
        if now_hung != hung:
            hung = now_hung
            status = health_pb2.HealthCheckResponse.NOT_SERVING if hung else health_pb2.HealthCheckResponse.SERVING
            _set_health(health_servicer, status)
            if hung:
                _LOGGER.error("a step has run too long: health NOT_SERVING", seconds=round(time.monotonic() - since, 1))
            else:
                _LOGGER.warning("the long step ended: health SERVING again")


def wait_forever(
    server: grpc.Server, health_servicer: health.HealthServicer, worker: MainThreadWorker, hang_s: float = 0
) -> None:
    import signal

    stop = threading.Event()
    if hang_s > 0:
        threading.Thread(
            target=watch_for_hangs, args=(health_servicer, worker, hang_s, stop), daemon=True, name="hang-watch"
        ).start()

    def _on_signal(signum, frame):
        # The stop first: the log line can fail or block (a pipe whose
        # reader died with the router), and must not keep the process alive.
        stop.set()
        worker.wake()
        try:
            _LOGGER.info("executor stopping", signal=signum)
        except OSError:
            pass

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    worker.serve(stop)
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=2.0).wait()
    time.sleep(0)
