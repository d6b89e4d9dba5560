"""The router's connection to the executor: Describe, Step and Reset over one
gRPC channel (Unix socket when co-located, TCP with optional TLS otherwise).

Plans go on one long-lived StepStream call by default (`executor.step_stream`):
the router writes plans in order (a pipelined decode has two in flight) and
one reader task hands each StepResult to the plan that is first in line. A
broken stream fails every plan in flight the way a failed unary Step does,
and the next plan opens a new stream."""

from __future__ import annotations

import asyncio
from collections import deque

import grpc
import structlog

from cbserve.v1 import executor_pb2 as pb
from cbserve.v1 import executor_pb2_grpc as pb_grpc
from router.config import ExecutorConfig

_LOGGER = structlog.get_logger(__name__)
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class PlanRejected(Exception):
    """The executor refused a plan as inconsistent with its state (its
    PlanError, INVALID_ARGUMENT): a router bug; both sides must start over."""


class ExecutorUnavailable(Exception):
    """The executor is down, hung or restarted: in-flight work is lost."""


class LoraRefused(Exception):
    """The executor refused a LoRA adapter; the message says why."""


class ExecutorClient:
    def __init__(self, cfg: ExecutorConfig) -> None:
        self.cfg = cfg
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ExecutorStub | None = None
        self._stream: _StepStream | None = None

    def _open(self) -> None:
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.enable_retries", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            # While an executor starts (seconds of imports) the channel retries
            # at least every 250 ms: it connects soon after the executor listens.
            ("grpc.max_reconnect_backoff_ms", 250),
        ]
        if self.cfg.tls_ca_file and not self.cfg.address.startswith("unix:"):
            with open(self.cfg.tls_ca_file, "rb") as fh:
                ca = fh.read()
            key = cert = None
            if self.cfg.tls_client_cert_file:  # mTLS: the router proves who it is
                with open(self.cfg.tls_client_key_file, "rb") as k, open(self.cfg.tls_client_cert_file, "rb") as c:
                    key, cert = k.read(), c.read()
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            self._channel = grpc.aio.secure_channel(self.cfg.address, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(self.cfg.address, options=options)
        self._stub = pb_grpc.ExecutorStub(self._channel)

    async def close(self) -> None:
        self._drop_stream("the router closed the connection")
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None

    async def describe(self, timeout: float = 5.0, wait_for_ready: bool = True) -> pb.DescribeResponse:
        """The executor's facts; waits up to `timeout` for a connection unless
        `wait_for_ready` is false (then no connection fails at once)."""
        if self._stub is None:
            self._open()
        try:
            return await self._stub.Describe(pb.DescribeRequest(), timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as exc:
            raise ExecutorUnavailable(f"Describe failed: {exc.code().name}: {exc.details()}") from exc

    def connected(self) -> bool:
        """The channel holds a live connection to the executor now."""
        return self._channel is not None and self._channel.get_state() == grpc.ChannelConnectivity.READY

    async def wait_connection_change(self) -> None:
        """Returns once a live connection closes or fails (a Unix-socket
        executor that dies closes it at once); at once when none is live."""
        if self._channel is None:
            return
        state = self._channel.get_state()
        if state == grpc.ChannelConnectivity.READY:
            await self._channel.wait_for_state_change(state)

    async def wait_ready(self, stop: asyncio.Event | None = None, timeout: float = 5.0) -> pb.DescribeResponse:
        """Describe (each waiting up to `timeout` for the connection) with
        back-off until the executor answers."""
        delay = self.cfg.reconnect_backoff_s
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            try:
                return await self.describe(timeout)
            except ExecutorUnavailable as exc:
                _LOGGER.info("waiting for executor", address=self.cfg.address, error=str(exc), retry_in=delay)
            if stop is not None and stop.is_set():
                raise ExecutorUnavailable("stopping")
            # A Describe that waited out its deadline for the channel has
            # waited already (the channel's own back-off paces its connection
            # attempts); one that failed at once backs off before the next.
            if loop.time() - began < timeout * 0.9:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.cfg.reconnect_backoff_max_s)

    async def step(self, plan: pb.Plan) -> pb.StepResult:
        """Runs one plan. Raises PlanRejected when the executor rejected it and
        ExecutorUnavailable when it failed, hung past `step_timeout_s` or went away."""
        if self._stub is None:
            self._open()
        if not self.cfg.step_stream:
            try:
                return await self._stub.Step(plan, timeout=self.cfg.step_timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise _step_error(exc) from exc
        if self._stream is None or self._stream.broken:
            self._stream = _StepStream(self._stub.StepStream())
        stream = self._stream
        fut = await stream.send(plan)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.cfg.step_timeout_s)
        except asyncio.TimeoutError:
            # Worded as the unary call's deadline: the supervisor kills a hung executor on it.
            stream.fail(
                ExecutorUnavailable(
                    f"Step failed: DEADLINE_EXCEEDED: plan {plan.step_id} took over {self.cfg.step_timeout_s}s"
                )
            )
            raise fut.exception() from None

    def _drop_stream(self, why: str) -> None:
        if self._stream is not None:
            self._stream.fail(ExecutorUnavailable(why))
            self._stream = None

    async def load_lora(self, name: str, path: str, timeout: float = 60.0) -> pb.LoadLoraResponse:
        """Has the executor read and check an adapter. Raises LoraRefused
        (INVALID_ARGUMENT, FAILED_PRECONDITION: the message says why) or
        ExecutorUnavailable."""
        if self._stub is None:
            self._open()
        try:
            return await self._stub.LoadLora(pb.LoadLoraRequest(name=name, path=path), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                raise LoraRefused(exc.details()) from exc
            raise ExecutorUnavailable(f"LoadLora failed: {exc.code().name}: {exc.details()}") from exc

    async def reset(self) -> None:
        # Plans still on the old stream belong to the state being dropped.
        self._drop_stream("the executor was reset")
        if self._stub is None:
            self._open()
        try:
            await self._stub.Reset(pb.ResetRequest(), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            raise ExecutorUnavailable(f"Reset failed: {exc.code().name}") from exc


def _step_error(exc: grpc.aio.AioRpcError) -> Exception:
    return _status_error(exc.code(), exc.details())


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _status_error(code: grpc.StatusCode, details: str) -> Exception:
    """What a plan fails with when its call ended with this status."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return PlanRejected(f"executor rejected the plan: {details}")
    return ExecutorUnavailable(f"Step failed: {code.name}: {details}")


class _StepStream:
    """One StepStream call: plans written in order, results matched in order."""

    def __init__(self, call) -> None:
        self.call = call
        self.broken = False
        self._pending: deque[tuple[int, asyncio.Future]] = deque()
        self._write_lock = asyncio.Lock()
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="cbserve-step-stream")

    async def send(self, plan: pb.Plan) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        if self.broken:
            fut.set_exception(ExecutorUnavailable("Step failed: the step stream is closed"))
            return fut
        self._pending.append((plan.step_id, fut))
        try:
            async with self._write_lock:
                await self.call.write(plan)
        except grpc.aio.AioRpcError as exc:
            self.fail(_step_error(exc))
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as exc:  # the call ended under us
            self.fail(await self._why_ended(exc))
        return fut

    async def _why_ended(self, exc: Exception) -> Exception:
        """What the plans in flight fail with when a write finds the call
        over: its status, as the reader would report it (INVALID_ARGUMENT is
        a PlanRejected, not an executor that went away). The executor
        answers a rejected plan in the stream and ends the call only after
        this side has, so this is for calls that end otherwise."""
        try:
            code = await asyncio.wait_for(self.call.code(), 1.0)
            details = await self.call.details()
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.CancelledError):
            return ExecutorUnavailable(f"Step failed: {exc}")
        return _status_error(code, details)

    async def _read(self) -> None:
        try:
            while True:
                result = await self.call.read()
                if result is grpc.aio.EOF:
                    self.fail(ExecutorUnavailable("Step failed: the executor ended the step stream"))
                    return
                if not self._pending:
                    self.fail(ExecutorUnavailable(f"Step failed: unexpected result {result.step_id}"))
                    return
                step_id, fut = self._pending[0]
                if result.step_id != step_id:
                    self.fail(ExecutorUnavailable(f"Step failed: result {result.step_id} for plan {step_id}"))
                    return
                if result.error_code:
                    # The plan did not run: the stream is over for every plan
                    # in flight (the executor runs none behind it), and
                    # cancelling ends the call before any other write.
                    code = _STATUS_CODES.get(result.error_code, grpc.StatusCode.UNKNOWN)
                    self.fail(_status_error(code, result.error))
                    return
                self._pending.popleft()
                if not fut.done():
                    fut.set_result(result)
        except grpc.aio.AioRpcError as exc:
            self.fail(_step_error(exc))
        except asyncio.CancelledError:
            self.fail(ExecutorUnavailable("Step failed: the step stream was closed"))

    def fail(self, exc: Exception) -> None:
        """Ends the stream: every plan still in flight gets `exc`."""
        if not self.broken:
            self.broken = True
            self.call.cancel()
            if self._reader is not asyncio.current_task():
                self._reader.cancel()
        while self._pending:
            _, fut = self._pending.popleft()
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved: a cancelled caller must not log "never retrieved"
