"""The router's connection to the executor: Describe, Step and Reset over one
gRPC channel (Unix socket when co-located, TCP with optional TLS otherwise)."""

from __future__ import annotations

import asyncio

import grpc
import structlog

from cbserve.v1 import executor_pb2 as pb
from cbserve.v1 import executor_pb2_grpc as pb_grpc
from router.config import ExecutorConfig

_LOGGER = structlog.get_logger(__name__)
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class ExecutorUnavailable(Exception):
    """The executor is down, hung or restarted: in-flight work is lost."""


class ExecutorClient:
    def __init__(self, cfg: ExecutorConfig) -> None:
        self.cfg = cfg
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ExecutorStub | None = None

    def _open(self) -> None:
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.enable_retries", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if self.cfg.tls_ca_file and not self.cfg.address.startswith("unix:"):
            with open(self.cfg.tls_ca_file, "rb") as fh:
                creds = grpc.ssl_channel_credentials(root_certificates=fh.read())
            self._channel = grpc.aio.secure_channel(self.cfg.address, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(self.cfg.address, options=options)
        self._stub = pb_grpc.ExecutorStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None

    async def describe(self, timeout: float = 5.0) -> pb.DescribeResponse:
        if self._stub is None:
            self._open()
        try:
            return await self._stub.Describe(pb.DescribeRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            raise ExecutorUnavailable(f"Describe failed: {exc.code().name}: {exc.details()}") from exc

    async def wait_ready(self, stop: asyncio.Event | None = None) -> pb.DescribeResponse:
        """Describe with back-off until the executor answers."""
        delay = self.cfg.reconnect_backoff_s
        while True:
            try:
                return await self.describe()
            except ExecutorUnavailable as exc:
                _LOGGER.info("waiting for executor", address=self.cfg.address, error=str(exc), retry_in=delay)
            if stop is not None and stop.is_set():
                raise ExecutorUnavailable("stopping")
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.cfg.reconnect_backoff_max_s)

    async def step(self, plan: pb.Plan) -> pb.StepResult:
        if self._stub is None:
            self._open()
        try:
            return await self._stub.Step(plan, timeout=self.cfg.step_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(f"executor rejected the plan: {exc.details()}") from exc
            raise ExecutorUnavailable(f"Step failed: {exc.code().name}: {exc.details()}") from exc

    async def reset(self) -> None:
        if self._stub is None:
            self._open()
        try:
            await self._stub.Reset(pb.ResetRequest(), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            raise ExecutorUnavailable(f"Reset failed: {exc.code().name}") from exc
