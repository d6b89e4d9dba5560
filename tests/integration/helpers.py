"""Client-side helpers for the integration tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from cbserve.v1 import generation_pb2 as gpb
from cbserve.v1 import generation_pb2_grpc as gpb_grpc


def gen_request(ids=None, text=None, max_new=8, ignore_eos=True, **kw) -> gpb.GenerateRequest:
    req = gpb.GenerateRequest(
        stopping=gpb.StoppingCriteria(max_new_tokens=max_new, ignore_eos=ignore_eos, stop=kw.pop("stop", [])), **kw
    )
    if ids is not None:
        req.token_ids.ids.extend(ids)
    if text is not None:
        req.text = text
    return req


def stub(channel) -> gpb_grpc.GenerationStub:
    return gpb_grpc.GenerationStub(channel)


def wait_idle(server, timeout: float = 10.0) -> dict[str, float]:
    """Polls metrics until nothing runs, waits or sits swapped out and no KV
    block (device or host) is held. A request that ends while others are
    swapped out is a legitimate in-between state (running 0, swapped > 0 until
    the next iteration swaps them back in), so swapped is part of idle: one
    that stays swapped out makes this time out."""
    end = time.monotonic() + timeout
    m = {}
    while time.monotonic() < end:
        m = server.metrics()
        if (
            m.get("cbserve_num_requests_running") == 0
            and m.get("cbserve_num_requests_waiting") == 0
            and m.get("cbserve_num_requests_swapped", 0) == 0
            and m.get("cbserve_kv_cache_usage_ratio") == 0
            and m.get("cbserve_swap_usage_ratio", 0) == 0
        ):
            return m
        time.sleep(0.1)
    raise AssertionError(
        f"server not idle: running={m.get('cbserve_num_requests_running')} "
        f"waiting={m.get('cbserve_num_requests_waiting')} "
        f"swapped={m.get('cbserve_num_requests_swapped')} kv={m.get('cbserve_kv_cache_usage_ratio')} "
        f"swap={m.get('cbserve_swap_usage_ratio')}"
    )


def ask_capital_of_france(server, repo: str) -> subprocess.CompletedProcess:
    """`cbserve generate --chat "What is the capital of France?"` against `server`."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "router.cli",
            "generate",
            "--address",
            server.address,
            "--chat",
            "What is the capital of France?",
            "--max-new-tokens",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo,
    )


def serve_command(*args: str, port: str = "0") -> list[str]:
    """`cbserve serve` of the tiny model on loopback, ports chosen by the OS
    unless `port` is given; extra arguments after."""
    import sys

    return [
        sys.executable, "-m", "router.cli", "serve", "--model", "tiny", "--port", port,
        "--metrics-port", "0", "--http-port", "0", "--host", "127.0.0.1", *args,
    ]  # fmt: skip


def run_serve(*args: str, timeout: float = 120):
    """Runs `serve_command(*args)` to its end; its CompletedProcess (text)."""
    import subprocess

    from tests.conftest import REPO

    return subprocess.run(serve_command(*args), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def popen_serve(*args: str, port: str = "0", **kw):
    """Starts `serve_command(*args)`; output merged into a text pipe."""
    import subprocess

    from tests.conftest import REPO

    cmd = serve_command(*args, port=port)
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@contextlib.contextmanager
def executor_held(server):
    """Stops the server's executor (SIGSTOP) for the block and resumes it
    however the block ends. While it is held no step completes, so whatever
    runs keeps running and whatever arrives queues behind it, however slow
    this machine is to connect the new streams; the router keeps answering."""
    exe = server.executor_pid()
    os.kill(exe, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(exe, signal.SIGCONT)


def wait_metric(server, pred, timeout: float = 20.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if pred(m):
            return m
        assert time.monotonic() < end, "metric condition not reached"
        time.sleep(0.02)


def wait_submitted(server, since: float, tokens: int) -> None:
    """Waits until `tokens` prompt tokens arrived after the counter read
    `since` (the counter moves at submission; the queue gauges only at step
    boundaries, so they stand still while the executor is held)."""
    wait_metric(server, lambda m: m["cbserve_prompt_tokens_total"] - since == tokens)
