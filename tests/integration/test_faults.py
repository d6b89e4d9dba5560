"""Failures with real processes: the executor killed or hung mid-generation,
and a graceful drain on SIGTERM."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import psutil
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cbserve.v1 import generation_pb2 as gpb
from router.tokenizer import build_tiny_tokenizer
from tests.conftest import REPO, free_port, start_server, wait_serving
from tests.integration.helpers import gen_request, popen_serve, run_serve, stub, wait_idle


def _stream_in_thread(server, results, i, max_new=1500):
    try:
        with server.channel() as ch:
            n = 0
            for msg in stub(ch).Generate(gen_request([5, 6, 7 + i], max_new=max_new)):
                n += len(msg.token_ids)
                if msg.finish_reason:
                    results[i] = ("finished", gpb.FinishReason.Name(msg.finish_reason), n)
                    return
    except grpc.RpcError as exc:
        results[i] = ("error", exc.code(), time.monotonic())


def _start_streams(server, n, max_new=1500):
    results = [None] * n
    threads = [threading.Thread(target=_stream_in_thread, args=(server, results, i, max_new)) for i in range(n)]
    for t in threads:
        t.start()
    end = time.monotonic() + 10
    while server.metrics()["cbserve_num_requests_running"] < n and time.monotonic() < end:
        time.sleep(0.05)
    return results, threads


def _health(server) -> int:
    with server.channel() as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return -1


def _assert_recovered(server, router_pid):
    wait_serving(server.address, 60)
    assert server.proc.pid == router_pid and server.proc.poll() is None  # no router restart
    with server.channel() as ch:
        out = stub(ch).Complete(gen_request([5, 6, 7], max_new=4))
    assert len(out.token_ids) == 4
    wait_idle(server)


@pytest.fixture(scope="module")
def recovering():
    """One server whose executor the next three tests kill or hang: each
    leaves it recovered (SERVING on a new executor, idle) for the next: serve's
    own executor, which serve restarts."""
    server = start_server("tiny", config={"executor": {"step_timeout_s": 2.0}}, share_executor=False)
    yield server
    server.stop()


UNAVAILABLE_CANCELS = "cbserve_requests_total{finish_reason=CANCELLED,status=UNAVAILABLE}"


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_executor_failure_ends_requests_unavailable_and_recovers(fault, recovering):
    server = recovering
    cancelled = server.metrics().get(UNAVAILABLE_CANCELS, 0)
    router_pid = server.proc.pid
    exe = server.executor_pid()
    results, threads = _start_streams(server, 4)
    t0 = time.monotonic()
    os.kill(exe, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    saw_not_serving = False
    while any(t.is_alive() for t in threads) and time.monotonic() - t0 < 15:
        saw_not_serving |= _health(server) == health_pb2.HealthCheckResponse.NOT_SERVING
        time.sleep(0.05)
    for t in threads:
        t.join(1)
    assert all(r is not None and r[0] == "error" and r[1] == grpc.StatusCode.UNAVAILABLE for r in results), results
    assert max(r[2] for r in results) - t0 < 10
    end = time.monotonic() + 5
    while not saw_not_serving and time.monotonic() < end:
        saw_not_serving = _health(server) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert saw_not_serving or _health(server) == health_pb2.HealthCheckResponse.SERVING
    if fault == "hang":
        # The supervisor kills a hung executor: the stopped process is gone.
        end = time.monotonic() + 10
        while _alive(exe) and time.monotonic() < end:
            time.sleep(0.1)
    _assert_recovered(server, router_pid)
    assert server.executor_pid() != exe
    assert server.metrics()[UNAVAILABLE_CANCELS] - cancelled >= 4


def test_an_executor_killed_while_the_router_is_idle_is_noticed_without_a_request(recovering):
    """Nothing runs when the executor dies: the router notices by itself
    (the connection closes), reports NOT_SERVING or logs the loss, and is
    SERVING again on the restarted executor before any request arrives."""
    server = recovering
    cancelled = server.metrics().get(UNAVAILABLE_CANCELS, 0)
    router_pid = server.proc.pid
    exe = server.executor_pid()
    before = server.metrics()["cbserve_executor_reconnects_total"]
    log_at = len(server.log())
    os.kill(exe, signal.SIGKILL)
    end = time.monotonic() + 30
    while "executor lost" not in server.log()[log_at:] and time.monotonic() < end:
        time.sleep(0.05)
    assert "executor lost" in server.log()[log_at:], server.log()[log_at:][-2000:]
    wait_serving(server.address, 60)
    end = time.monotonic() + 30
    while server.metrics()["cbserve_executor_reconnects_total"] <= before and time.monotonic() < end:
        time.sleep(0.1)
    assert server.metrics()["cbserve_executor_reconnects_total"] == before + 1
    assert server.metrics().get(UNAVAILABLE_CANCELS, 0) == cancelled
    _assert_recovered(server, router_pid)


def test_sigterm_drains_in_flight_then_exits_zero():
    server = start_server("tiny", config={"server": {"drain_timeout_s": 20.0}}, share_executor=False)  # serve's child
    exe = server.executor_pid()
    results, threads = _start_streams(server, 3, max_new=300)
    server.proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + 5
    while _health(server) != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < end:
        time.sleep(0.02)
    assert _health(server) == health_pb2.HealthCheckResponse.NOT_SERVING
    with server.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            stub(ch).Complete(gen_request([5, 6], max_new=2))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    for t in threads:
        t.join(60)
    assert results == [("finished", "LENGTH", 300)] * 3  # in-flight requests completed
    assert server.proc.wait(30) == 0
    end = time.monotonic() + 10
    while _alive(exe) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _alive(exe)


def test_drain_timeout_cancels_what_is_left():
    server = start_server("tiny", config={"server": {"drain_timeout_s": 1.0}})
    results, threads = _start_streams(server, 2, max_new=1900)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert server.proc.wait(30) == 0
    assert time.monotonic() - t0 < 15
    assert all(r is not None and (r[:2] == ("finished", "CANCELLED")) for r in results), results


def _serve_refused(*args: str, model: str = "tiny", why: str = "refused its arguments or model") -> str:
    """Runs `cbserve serve` (tiny model) expecting the executor not to start:
    exit status 2, after the router drained, and no restart of the executor.
    Returns the log."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            "--model",
            model,
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--http-port",
            "0",
            "--host",
            "127.0.0.1",
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 2, log[-3000:]
    assert f"executor {why}; stopping" in log and "router stopped" in log
    assert "executor exited; restarting" not in log and log.count("executor started") == 1
    return log


def test_a_checkpoint_that_is_not_a_causal_lm_is_refused_by_name(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    T5ForConditionalGeneration(cfg).save_pretrained(tmp_path)
    build_tiny_tokenizer().save_pretrained(tmp_path)  # the router's refusal of a tokenizer-less dir would come first
    log = _serve_refused("--device", "cpu", model=str(tmp_path))
    assert "T5ForConditionalGeneration (model_type t5): not a decoder-only causal LM" in log


def _small_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)


def test_a_broken_checkpoint_is_refused_with_the_reason(tmp_path):
    _small_llama(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # truncated on the way
    log = _serve_refused("--device", "cpu", model=str(tmp_path))
    assert "LlamaForCausalLM (model_type llama) at" in log and "does not load" in log


def test_an_incomplete_checkpoint_is_refused_naming_what_it_lacks(tmp_path):
    """transformers fills a weight the files lack with random values and
    only warns: served, such a model would answer nonsense."""
    from safetensors.torch import load_file, save_file

    _small_llama(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    log = _serve_refused("--device", "cpu", model=str(tmp_path))
    assert "LlamaForCausalLM (model_type llama) at" in log
    assert "is incomplete: no weights for model.layers.1.mlp.down_proj.weight" in log


def test_a_checkpoint_whose_config_does_not_match_its_weights_is_refused(tmp_path):
    import json

    _small_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    log = _serve_refused("--device", "cpu", model=str(tmp_path))
    assert "does not load" in log and "size mismatch" in log.lower()


def test_a_checkpoint_larger_than_memory_is_refused_before_loading(tmp_path):
    """The safetensors headers say what the weights take: a 2 TiB tensor is
    refused with both sizes named, before a byte of it is read."""
    import json
    import struct

    _small_llama(tmp_path)
    header = json.dumps(
        {"model.embed_tokens.weight": {"dtype": "BF16", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 0]}}
    )
    (tmp_path / "model-extra.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())
    log = _serve_refused("--device", "cpu", "--dtype", "float32", model=str(tmp_path))
    assert "its weights take 4096.0 GiB in float32, more than the" in log and "GiB of cpu memory available" in log


def test_a_checkpoint_without_a_tokenizer_stops_serve_with_the_reason(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    ).save_pretrained(tmp_path)
    out = run_serve("--model", str(tmp_path), "--device", "cpu")
    assert (
        out.returncode == 2
        and "cbserve: cannot start:" in out.stderr
        and "no tokenizer the router can load" in out.stderr
    )
    assert "Traceback" not in out.stderr


def test_an_executor_address_in_use_is_refused_with_the_reason(tmp_path):
    cfg = tmp_path / "tcp.yaml"
    cfg.write_text(yaml.safe_dump({"executor": {"allow_insecure_tcp": True}}))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = _serve_refused("--device", "cpu", "--config", str(cfg), "--executor-address", f"127.0.0.1:{port}")
    assert f"cannot listen on 127.0.0.1:{port}" in log


def test_a_plaintext_tcp_executor_is_refused_unless_allowed():
    out = run_serve("--executor-address", "127.0.0.1:1")
    assert out.returncode == 2 and "TCP without TLS" in out.stderr and "allow_insecure_tcp" in out.stderr
    # The executor alone refuses it too.
    out = subprocess.run(
        [sys.executable, "-m", "executor", "--model", "tiny", "--device", "cpu", "--listen", "127.0.0.1:1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--allow-insecure-tcp" in out.stdout + out.stderr


def test_an_executor_that_dies_before_it_is_ready_is_not_restarted():
    # Killed while it loads: whatever the cause, a restart would most likely
    # die the same way, so serve stops instead of looping.
    proc = popen_serve("--device", "cpu")
    end, killed = time.monotonic() + 30, None
    while killed is None and time.monotonic() < end:
        for child in psutil.Process(proc.pid).children(recursive=True):
            if "executor" in " ".join(child.cmdline()):
                child.kill()
                killed = child.pid
        time.sleep(0.01)
    log, _ = proc.communicate(timeout=60)
    assert killed is not None and proc.returncode == 2, log[-3000:]
    assert "executor exited before it was ready; stopping" in log and log.count("executor started") == 1
    assert '"executor ready"' not in log


@pytest.mark.parametrize("device", ["cuda:{count}", "tpu"])
def test_a_device_the_executor_cannot_use_stops_serve_instead_of_restarting(device):
    # --device cuda:N beyond what torch sees (cuda:0 on a CPU-only machine):
    # a restart would be refused the same way.
    import torch

    device = device.format(count=torch.cuda.device_count())
    log = _serve_refused("--device", device)
    assert ("torch sees" if device.startswith("cuda") else "is not auto|cpu|cuda|cuda:N") in log


def test_a_kv_cache_larger_than_memory_stops_serve_with_a_clear_error(tmp_path):
    # 16 TiB of blocks: refused before any allocation (an overcommitted one
    # would fail later, in the OOM killer), not restarted every 10 s.
    cfg = tmp_path / "huge.yaml"
    cfg.write_text(yaml.safe_dump({"cache": {"kv_cache_bytes": 1 << 44}}))
    log = _serve_refused("--device", "cpu", "--config", str(cfg))
    assert "the KV cache does not fit" in log and "lower cache.kv_cache_bytes" in log


def _serve_without_config():
    port = free_port()
    proc = popen_serve("--device", "cpu", port=str(port), start_new_session=True)
    wait_serving(f"127.0.0.1:{port}", 120, proc)
    return proc, port


def _alive(pid: int) -> bool:
    """Running and not a zombie; a process that exits while asked is not."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _executor_of(proc) -> int:
    return next(c.pid for c in psutil.Process(proc.pid).children(recursive=True) if "executor" in " ".join(c.cmdline()))


def test_sighup_without_config_is_ignored_by_both_processes():
    proc, port = _serve_without_config()
    try:
        exe = _executor_of(proc)
        proc.send_signal(signal.SIGHUP)
        os.kill(exe, signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None and _alive(exe)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert len(stub(ch).Complete(gen_request([5, 6, 7], max_new=3), timeout=30).token_ids) == 3
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "SIGHUP ignored" in log
    finally:
        if proc.poll() is None:
            proc.kill()


def _load(port: int, state: str, stop: threading.Event) -> list[threading.Thread]:
    """Requests that keep the executor in `state` until the router dies:
    long prompts for one token each (prefill steps), or long streams
    (pipelined decode: a plan always waits for the one before it)."""

    def prefill(i):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            while not stop.is_set():
                try:
                    stub(ch).Complete(gen_request([5 + (i + j) % 90 for j in range(900)], max_new=1), timeout=10)
                except grpc.RpcError:
                    return

    def decode(i):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                for _ in stub(ch).Generate(gen_request([5, 6, 7 + i], max_new=1500), timeout=30):
                    if stop.is_set():
                        return
            except grpc.RpcError:
                return

    threads = [threading.Thread(target=prefill if state == "prefill" else decode, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    return threads


def _kill_serve_while(state: str, delay: float, config: str) -> tuple[str, float, bool]:
    """Starts `cbserve serve`, brings its executor to `state`, SIGKILLs the
    serve `delay` seconds later; returns how long its executor outlived it,
    and whether serve's private socket directory outlived them both."""
    port = free_port()
    proc = popen_serve("--device", "cpu", "--config", config, port=str(port), start_new_session=True)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        end = time.monotonic() + 60
        exe = None
        while exe is None and time.monotonic() < end and proc.poll() is None:
            kids = psutil.Process(proc.pid).children()
            exe = next((k.pid for k in kids if "executor" in " ".join(k.cmdline())), None)
            time.sleep(0.01)
        assert exe is not None, "no executor started"
        argv = psutil.Process(exe).cmdline()
        run_dir = os.path.dirname(argv[argv.index("--listen") + 1].removeprefix("unix://"))
        if state != "starting":
            wait_serving(f"127.0.0.1:{port}", 60, proc)
            if state != "idle":
                threads = _load(port, state, stop)
                time.sleep(0.3)
        time.sleep(delay)
        t0 = time.monotonic()
        proc.kill()
        while _alive(exe) and time.monotonic() - t0 < 30:
            time.sleep(0.02)
        return state, round(time.monotonic() - t0, 2), os.path.exists(run_dir)
    finally:
        stop.set()
        proc.kill()
        proc.communicate(timeout=60)  # the log pipe is read only now, as when its reader died with serve
        for t in threads:
            t.join(timeout=30)


# A minute of server starts: `make soak` runs it (CI too), `make test` does not.
@pytest.mark.soak
def test_the_executor_exits_within_5_s_of_a_serve_killed_at_random_moments(tmp_path):
    """`cbserve serve` SIGKILLed 20 times at random moments, five in each
    state: the executor starting (importing, loading the model, connecting),
    idle, in prefill and in decode. Each time its executor must be gone within
    5 s (executor/lifeline.py), and serve's private socket directory with it.
    Two servers at a time, small KV pools (a quicker start)."""
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump({"cache": {"num_blocks": 256, "block_size": 16}}))
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    rounds = [(s, rng.uniform(0.0, 2.5 if s == "starting" else 0.7)) for s in ("starting", "idle", "prefill", "decode")]
    with futures.ThreadPoolExecutor(2) as pool:
        exits = list(pool.map(lambda r: _kill_serve_while(*r, str(config)), rounds * 5))
    slow = [e for e in exits if e[1] > 5.0]
    assert not slow, f"executors outlived their serve by more than 5 s: {slow} of {exits} (seed {seed})"
    left = [e for e in exits if e[2]]  # the executors remove the directory serve could not (lifeline)
    assert not left, f"serve's socket directory outlived it: {left} of {exits} (seed {seed})"
