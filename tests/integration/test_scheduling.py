"""Scheduling end to end (issue #4): preemption (recompute, swap, swap falling
back to recompute) keeps greedy outputs exact; SIGHUP reload of the policy;
priority, SJF and static-vs-fcfs orderings. Tiny model, fp32.

Servers are module-scoped (a start costs ~10 s on a 2-core machine); tests
switch the scheduler section with SIGHUP, which is itself under test.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time

import grpc
import pytest
import yaml

from cbserve.v1 import generation_pb2 as gpb
from tests.conftest import BLOCK_BYTES_TINY_FP32, start_server
from tests.integration.helpers import executor_held, gen_request, stub, wait_idle, wait_metric, wait_submitted


# -- helpers ----------------------------------------------------------------------
def _stream(server, req, out: dict, key, cancel: threading.Event | None = None) -> None:
    """Records one stream under `key`; when `cancel` is set it hangs up at the
    next message, as a client that goes away does."""
    rec = {"start": time.monotonic(), "first": None, "ids": [], "finish": None, "usage": None}
    try:
        with server.channel() as ch:
            for m in stub(ch).Generate(req, timeout=120):
                if cancel is not None and cancel.is_set():
                    break
                if m.token_ids and rec["first"] is None:
                    rec["first"] = time.monotonic()
                rec["ids"].extend(m.token_ids)
                if m.finish_reason:
                    rec["finish"], rec["usage"] = m.finish_reason, m.usage
    except Exception as exc:  # reported by the asserting test
        rec["error"] = repr(exc)
    rec["end"] = time.monotonic()
    out[key] = rec


def start_streams(
    server, reqs: dict, out: dict | None = None, cancel: threading.Event | None = None
) -> tuple[dict, list[threading.Thread]]:
    out = {} if out is None else out
    threads = [threading.Thread(target=_stream, args=(server, r, out, k, cancel), daemon=True) for k, r in reqs.items()]
    for t in threads:
        t.start()
    return out, threads


def run_concurrent(server, reqs: dict) -> dict:
    out, threads = start_streams(server, reqs)
    for t in threads:
        t.join(180)
    assert len(out) == len(reqs)
    for k, rec in out.items():
        assert "error" not in rec, f"{k}: {rec['error']}"
    return out


def reload_count(server, what: str = "scheduler config reloaded") -> int:
    return server.log().count(what)


def reconfigure(
    server, scheduler: dict | None = None, raw: str | None = None, expect: str = "scheduler config reloaded"
) -> None:
    """Rewrites the server's config file (scheduler section replaced, or raw
    text) and sends SIGHUP; waits for the router to log the outcome."""
    before = reload_count(server, expect)
    if raw is None:
        with open(server.config_path, encoding="utf-8") as fh:
            cfg = yaml.safe_load(fh)
        cfg["scheduler"] = scheduler or {}
        raw = yaml.safe_dump(cfg)
    with open(server.config_path, "w", encoding="utf-8") as fh:
        fh.write(raw)
    server.proc.send_signal(signal.SIGHUP)
    end = time.monotonic() + 10
    while reload_count(server, expect) <= before:
        assert time.monotonic() < end, f"no {expect!r} in the log after SIGHUP"
        time.sleep(0.05)


def policy_of(server) -> str:
    with server.channel() as ch:
        return stub(ch).ModelInfo(gpb.ModelInfoRequest()).policy


def pressure_requests(n: int = 8, prompt_len: int = 20, max_new: int = 60) -> dict:
    rng = random.Random(4)
    return {
        f"p{i}": gen_request([rng.randrange(3, 259) for _ in range(prompt_len + i % 3)], max_new=max_new)
        for i in range(n)
    }


def outputs(res: dict) -> dict:
    return {k: r["ids"] for k, r in res.items()}


# -- servers ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big():
    """Large KV pool: the reference outputs, and the policy tests."""
    server = start_server("tiny")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(big):
    reconfigure(big, {"policy": "fcfs"})
    res = run_concurrent(big, pressure_requests())
    assert all(r["finish"] == gpb.LENGTH and len(r["ids"]) == 60 for r in res.values())
    wait_idle(big)
    return outputs(res)


# -- preemption keeps outputs exact -----------------------------------------------------
def _pressure_run(server, reference) -> tuple[float, float]:
    m0 = server.metrics()
    res = run_concurrent(server, pressure_requests())
    for k, r in res.items():
        assert r["finish"] == gpb.LENGTH and r["usage"].completion_tokens == 60, k
    assert outputs(res) == reference
    m1 = wait_idle(server)
    assert m1["cbserve_num_requests_swapped"] == 0
    assert m1["cbserve_swap_usage_ratio"] == 0  # host blocks returned too
    return (
        m1["cbserve_num_preemptions_total"] - m0["cbserve_num_preemptions_total"],
        m1["cbserve_num_swaps_total"] - m0["cbserve_num_swaps_total"],
    )


def test_recompute_preemption_is_exact(tiny_pool, reference):
    reconfigure(tiny_pool, {"policy": "fcfs", "preemption_mode": "recompute"})
    preemptions, swaps = _pressure_run(tiny_pool, reference)
    assert preemptions > 0, "the tiny pool must force preemption"
    assert swaps == 0


def test_swap_preemption_is_exact(tiny_pool, reference):
    reconfigure(tiny_pool, {"policy": "fcfs", "preemption_mode": "swap"})
    preemptions, swaps = _pressure_run(tiny_pool, reference)
    assert preemptions > 0 and swaps > 0


def test_swap_with_small_host_pool_falls_back_to_recompute(reference):
    server = start_server(
        "tiny",
        config={
            "cache": {"num_blocks": 12, "block_size": 16, "swap_space_bytes": 3 * BLOCK_BYTES_TINY_FP32},
            "scheduler": {"preemption_mode": "swap"},
        },
    )
    try:
        preemptions, swaps = _pressure_run(server, reference)
    finally:
        server.stop()
    assert preemptions > swaps, "some victims did not fit the 3 host blocks: recomputed"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["priority", "sjf", "static", "dynamic"])
def test_every_policy_under_memory_pressure_is_exact(tiny_pool, reference, policy, mode):
    reconfigure(
        tiny_pool, {"policy": policy, "preemption_mode": mode, "static_batch_size": 5, "dynamic_max_wait_ms": 5.0}
    )
    reqs = pressure_requests()
    for i, r in enumerate(reqs.values()):
        r.priority = i % 3
        r.expected_output_tokens = 10 + 13 * (i % 4)
    m0 = tiny_pool.metrics()
    res = run_concurrent(tiny_pool, reqs)
    assert all(r["finish"] == gpb.LENGTH for r in res.values())
    assert outputs(res) == reference
    m1 = wait_idle(tiny_pool)
    assert m1["cbserve_num_requests_swapped"] == 0
    if policy != "static" and policy != "dynamic":
        assert m1["cbserve_num_preemptions_total"] > m0["cbserve_num_preemptions_total"]


def test_cancel_under_pressure_releases_everything(tiny_pool, reference):
    """Clients that go away while their requests run, wait or sit swapped out
    leave no block behind, and the next burst is still exact."""
    reconfigure(tiny_pool, {"policy": "fcfs", "preemption_mode": "swap"})
    with tiny_pool.channel() as ch:
        calls = [stub(ch).Generate(r) for r in pressure_requests(max_new=150).values()]
        wait_metric(
            tiny_pool,
            lambda m: (
                m["cbserve_num_requests_swapped"] > 0
                or m["cbserve_num_preemptions_total"] > 0
                and m["cbserve_num_requests_waiting"] > 0
            ),
        )
        for c in calls[::2]:
            c.cancel()
        time.sleep(0.3)
        for c in calls[1::2]:
            c.cancel()
    m = wait_idle(tiny_pool)
    assert m["cbserve_num_requests_swapped"] == 0
    reqs = pressure_requests()
    assert outputs(run_concurrent(tiny_pool, reqs)) == reference
    wait_idle(tiny_pool)


# -- SIGHUP reload ---------------------------------------------------------------------
def test_sighup_switches_policy_mid_run_without_losing_requests(big):
    reconfigure(big, {"policy": "fcfs", "max_num_seqs": 4})
    assert policy_of(big) == "fcfs"
    rng = random.Random(7)
    reqs = {
        f"r{i}": gen_request([rng.randrange(3, 259) for _ in range(12)], max_new=40 + i, priority=i % 3)
        for i in range(16)
    }
    # The executor is held while the 16 streams connect, so all of them are in
    # the queue at once whatever this machine's speed; four run at a time, so
    # after resuming there are three finishing rounds in which tokens flow and
    # requests still wait.
    submitted = big.metrics()["cbserve_prompt_tokens_total"]
    with executor_held(big):
        out, threads = start_streams(big, reqs)
        wait_submitted(big, submitted, 16 * 12)
    wait_metric(big, lambda m: m["cbserve_generation_tokens_total"] > 0 and m["cbserve_num_requests_waiting"] > 0)
    reconfigure(big, {"policy": "priority", "max_num_seqs": 4})
    for t in threads:
        t.join(120)
    for i in range(16):
        r = out[f"r{i}"]
        assert "error" not in r, r.get("error")
        assert r["finish"] == gpb.LENGTH and len(r["ids"]) == 40 + i == r["usage"].completion_tokens
    assert policy_of(big) == "priority"
    m = wait_idle(big)
    # The per-policy queue gauges follow the reload; the old policy's series are gone.
    assert m["cbserve_queue_requests{policy=priority,queue=waiting}"] == 0
    assert not any("policy=fcfs" in k for k in m)


def test_sighup_with_invalid_config_is_refused(big):
    reconfigure(big, {"policy": "priority"})
    refused = "config reload refused"
    reconfigure(big, {"policy": "no-such-policy"}, expect=refused)
    assert policy_of(big) == "priority"
    reconfigure(big, {"policy": "priority", "max_num_seqs": -1}, expect=refused)
    reconfigure(big, {"policy": "no_such_module_xyz:Policy"}, expect=refused)  # validates, cannot load
    with open(big.config_path, encoding="utf-8") as fh:
        good = fh.read()
    reconfigure(big, raw="scheduler: [unclosed\n", expect=refused)
    assert policy_of(big) == "priority"
    with open(big.config_path, "w", encoding="utf-8") as fh:
        fh.write(good)
    assert big.proc.poll() is None
    with big.channel() as ch:
        r = stub(ch).Complete(gen_request([5, 6, 7], max_new=5))
    assert r.finish_reason == gpb.LENGTH and len(r.token_ids) == 5
    reconfigure(big, {"policy": "fcfs"})  # a valid file is taken again
    assert policy_of(big) == "fcfs"


# -- orderings ----------------------------------------------------------------------------
def test_priority_request_overtakes_running_low_priority_ones(big):
    reconfigure(big, {"policy": "priority", "max_num_seqs": 2})
    lows = {f"low{i}": gen_request([10 + i] * 16, max_new=400, priority=0) for i in range(4)}
    out, threads = start_streams(big, lows)
    wait_metric(big, lambda m: m["cbserve_num_requests_running"] == 2 and m["cbserve_num_requests_waiting"] == 2)
    # Held while the high-priority stream connects: the first two low ones
    # cannot finish (and free their seats) before it is queued.
    submitted = big.metrics()["cbserve_prompt_tokens_total"]
    with executor_held(big):
        assert not out, "the low-priority requests must still run when the high one arrives"
        _, t_high = start_streams(big, {"high": gen_request([99] * 16, max_new=20, priority=10)}, out)
        wait_submitted(big, submitted, 16)
    for t in threads + t_high:
        t.join(120)
    assert all(r["finish"] == gpb.LENGTH for r in out.values()), out
    assert len(out["high"]["ids"]) == 20
    assert out["high"]["end"] < min(out[k]["end"] for k in lows)
    wait_idle(big)


def _finish_order(server, ids: set[str]) -> list[dict]:
    """The router's "request finished" records of these ids, in log order."""
    order = []
    for line in server.log().splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if obj.get("event") == "request finished" and obj.get("request_id") in ids:
            order.append(obj)
    return order


def test_sjf_runs_the_short_job_before_the_long_one(big):
    reconfigure(big, {"policy": "sjf", "max_num_seqs": 1, "sjf_max_wait_s": 1000.0})
    tag = f"sjf-{time.monotonic_ns()}"
    ids = {k: f"{tag}-{k}" for k in ("occupier", "long", "short")}
    out, threads = start_streams(big, {"occupier": gen_request([20] * 16, max_new=600, request_id=ids["occupier"])})
    wait_metric(big, lambda m: m["cbserve_num_requests_running"] == 1 and m["cbserve_generation_tokens_total"] > 0)
    # Held while both jobs connect (the long one first): the occupier cannot
    # finish and hand its seat to the long one before the short one is queued.
    submitted = big.metrics()["cbserve_prompt_tokens_total"]
    with executor_held(big):
        assert "occupier" not in out, "both jobs must queue while the seat is taken"
        _, t2 = start_streams(
            big, {"long": gen_request([30] * 16, max_new=200, expected_output_tokens=200, request_id=ids["long"])}, out
        )
        wait_submitted(big, submitted, 16)
        _, t3 = start_streams(
            big, {"short": gen_request([40] * 16, max_new=10, expected_output_tokens=10, request_id=ids["short"])}, out
        )
        wait_submitted(big, submitted, 32)
    for t in threads + t2 + t3:
        t.join(120)
    assert all(r["finish"] == gpb.LENGTH for r in out.values()), out
    # The router's own order: with one seat and no preemption each job runs
    # alone, so finishing order is running order. (Client-side clocks of two
    # streams in two threads can disagree by more than the one step between
    # one job's last token and the next job's first.)
    done = _finish_order(big, set(ids.values()))
    assert [d["request_id"] for d in done] == [ids["occupier"], ids["short"], ids["long"]]
    assert all(d["preemptions"] == 0 for d in done), done
    wait_idle(big)


@pytest.mark.parametrize("policy", ["static", "fcfs"])
def test_static_batch_blocks_newcomers_fcfs_does_not(big, policy):
    reconfigure(big, {"policy": policy, "static_batch_size": 2})
    tag = f"{policy}-{time.monotonic_ns()}"
    # A warm-up runs alone so that the two batch requests queue together
    # (static admits whatever waits when nothing runs) and start as one batch.
    # Its length does not decide when it ends: it is cancelled once both batch
    # requests are in, and the executor is held while they connect, so on no
    # machine can the warm-up end first and let one start a batch alone.
    cancel = threading.Event()
    out, t0 = start_streams(big, {"warmup": gen_request([45] * 16, max_new=2000)}, cancel=cancel)
    wait_metric(big, lambda m: m["cbserve_num_requests_running"] == 1)
    submitted = big.metrics()["cbserve_prompt_tokens_total"]
    try:
        with executor_held(big):
            assert "warmup" not in out, "the warm-up must still run when the batch arrives"
            # 1,000 steps: at ~1 ms a step the batch still has hundreds left
            # however long the newcomer takes to arrive.
            batch = {f"b{i}": gen_request([50 + i] * 16, max_new=1000, request_id=f"{tag}-b{i}") for i in range(2)}
            _, threads = start_streams(big, batch, out)
            wait_submitted(big, submitted, 2 * 16)
    finally:
        cancel.set()
    wait_metric(big, lambda m: "warmup" in out and m["cbserve_num_requests_running"] == 2)
    _, t2 = start_streams(big, {"late": gen_request([60] * 16, max_new=80, request_id=f"{tag}-late")}, out)
    for t in t0 + threads + t2:
        t.join(120)
    assert out["warmup"]["finish"] is None and "error" not in out["warmup"], out["warmup"]
    assert all(r["finish"] == gpb.LENGTH for k, r in out.items() if k != "warmup"), out
    # Server-side records (see test_sjf_...): finishing order, and how long the
    # newcomer queued against how long it then ran (80 steps: long enough that
    # one stall of the router while it joins cannot outlast its run).
    done = {d["request_id"].rsplit("-", 1)[1]: d for d in _finish_order(big, {f"{tag}-b0", f"{tag}-b1", f"{tag}-late"})}
    order = list(done)  # log order
    late = done["late"]
    ran_s = late["e2e_s"] - late["queue_s"]
    if policy == "static":
        # Hundreds of batch-of-2 steps left when it arrives against its own 80 steps.
        assert order[-1] == "late", f"static: the newcomer waits for the whole batch: {order}"
        assert late["queue_s"] > ran_s, late
    else:
        assert order[0] == "late", f"fcfs: the newcomer joins at once: {order}"
        assert late["queue_s"] < ran_s, late
    wait_idle(big)


# -- fair share (scheduler.policy: fair) -----------------------------------------------------
TENANT_HEADER = "x-gateway-inference-fairness-id"


def _tenant_stream(server, req, out: dict, key, tenant: str) -> None:
    rec = {"ids": [], "finish": None}
    out[key] = rec  # visible while it streams; "end" is set when it ends
    try:
        with server.channel() as ch:
            for m in stub(ch).Generate(req, timeout=120, metadata=[(TENANT_HEADER, tenant)]):
                rec["ids"].extend(m.token_ids)
                if m.finish_reason:
                    rec["finish"] = m.finish_reason
    except Exception as exc:  # reported by the asserting test
        rec["error"] = repr(exc)
    rec["end"] = time.monotonic()


def _tenant_streams(server, reqs: dict, tenant: str, out: dict) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=_tenant_stream, args=(server, r, out, k, tenant), daemon=True) for k, r in reqs.items()
    ]
    for t in threads:
        t.start()
    return threads


def test_fair_share_serves_a_light_tenant_through_a_flood_and_keeps_counters_on_reload(big):
    """Tenants from the gateway's header (auth off). A flood starts under
    fcfs, the policy becomes fair under load (SIGHUP), a light tenant's
    request then runs at once (it preempts the flood's newest request) and
    ends before every flooding one; a reload that keeps fair keeps the
    counters."""
    reconfigure(big, {"policy": "fcfs", "max_num_seqs": 2})
    before = big.metrics()
    # One token a step (no drafts: the repeated prompts would let n-gram
    # speculation finish a running flood request before the light one ends).
    heavy = {f"heavy{i}": gen_request([50 + i] * 16, max_new=150, speculative=False) for i in range(6)}
    out: dict = {}
    threads = _tenant_streams(big, heavy, "heavy", out)
    wait_metric(big, lambda m: m["cbserve_num_requests_running"] == 2 and m["cbserve_num_requests_waiting"] == 4)
    reconfigure(big, {"policy": "fair", "max_num_seqs": 2})
    assert policy_of(big) == "fair"
    m = wait_metric(big, lambda m: m.get("cbserve_tenant_counter{tenant=heavy}", 0) > 0)
    counter = m["cbserve_tenant_counter{tenant=heavy}"]
    # Same policy, other weights: the counters carry over.
    reconfigure(big, {"policy": "fair", "max_num_seqs": 2, "fair": {"weights": {"light": 2}}})
    assert big.metrics()["cbserve_tenant_counter{tenant=heavy}"] >= counter
    submitted = big.metrics()["cbserve_prompt_tokens_total"]
    with executor_held(big):  # the flood cannot move on while the light request connects
        threads += _tenant_streams(big, {"light": gen_request([99] * 16, max_new=10)}, "light", out)
        wait_submitted(big, submitted, 16)
        left = {k: 150 - len(out[k]["ids"]) for k in heavy}
    for t in threads:
        t.join(120)
    assert all("error" not in r and r["finish"] == gpb.LENGTH for r in out.values()), out
    # The light request takes 10 steps. A running flood request with fewer
    # steps left may end first; every other one (a step in flight and stream
    # lag allowed for) must end after it. Under fcfs all six would end first.
    behind = [k for k in heavy if left[k] > 10 + 8]
    assert len(behind) >= 4, left
    assert out["light"]["end"] < min(out[k]["end"] for k in behind), (left, out)
    m = wait_idle(big)
    served = "cbserve_tenant_service_tokens_total{kind=output,tenant=%s}"
    assert m[served % "light"] - before.get(served % "light", 0) == 10
    assert m[served % "heavy"] - before.get(served % "heavy", 0) == 6 * 150
    assert m["cbserve_num_preemptions_total"] > before["cbserve_num_preemptions_total"]


def test_tenant_from_the_http_header_then_the_user_field(big):
    import httpx

    reconfigure(big, {"policy": "fair"})
    base = f"http://127.0.0.1:{big.http_port}/v1"
    model = httpx.get(f"{base}/models").json()["data"][0]["id"]
    long_user = "a user id with spaces and more than sixty-four characters, which is hashed"

    def complete(headers=None, user=None):
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
        if user is not None:
            body["user"] = user
        r = httpx.post(f"{base}/completions", json=body, headers=headers or {}, timeout=60)
        assert r.status_code == 200, r.text

    before = big.metrics()
    complete(headers={TENANT_HEADER: "web-team"}, user="ignored-when-the-header-is-there")
    complete(user="alice@example.com")
    complete(user=long_user)
    complete()
    m = big.metrics()

    def served(tenant):
        key = f"cbserve_tenant_service_tokens_total{{kind=output,tenant={tenant}}}"
        return m.get(key, 0) - before.get(key, 0)

    hashed = [k for k in m if k.startswith("cbserve_tenant_service_tokens_total{kind=output,tenant=#")]
    assert served("web-team") == 3 and served("alice@example.com") == 3 and served("default") == 3
    assert served("ignored-when-the-header-is-there") == 0
    assert len(hashed) == 1 and served(hashed[0].split("tenant=")[1].rstrip("}")) == 3
    wait_idle(big)


# -- SLO classes -------------------------------------------------------------------------------
def test_slo_classes_by_field_and_header_counted_and_unknown_ones_refused(big):
    import httpx

    classes = {"interactive": {"ttft_ms": 60_000, "tpot_ms": 60_000}, "tight": {"ttft_ms": 0.001, "tpot_ms": 1}}
    reconfigure(big, {"policy": "slo", "slo_classes": classes, "default_slo_class": "interactive"})
    before = big.metrics()
    with big.channel() as ch:
        r = stub(ch).Complete(gen_request([5, 6, 7], max_new=4, slo_class="interactive"))
        assert r.finish_reason == gpb.LENGTH
        stub(ch).Complete(gen_request([5, 6, 8], max_new=4))  # the default class
        with pytest.raises(grpc.RpcError) as err:
            stub(ch).Complete(gen_request([5, 6, 9], max_new=4), metadata=[("x-slo-class", "gold")])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'gold'" in err.value.details()
    base = f"http://127.0.0.1:{big.http_port}/v1"
    model = httpx.get(f"{base}/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
    r = httpx.post(f"{base}/completions", json={**body, "slo_class": "platinum"}, timeout=60)
    assert r.status_code == 400 and "platinum" in r.json()["error"]["message"]
    assert httpx.post(f"{base}/completions", json=body, headers={"x-slo-class": "interactive"}, timeout=60).is_success
    m = big.metrics()
    met = "cbserve_slo_requests_total{class=interactive,outcome=met}"
    assert m[met] - before.get(met, 0) == 3
    # `tight` cannot be met (1 us to the first token): deprioritized it is
    # still served, counted missed; with on_miss reject it is refused (429).
    with big.channel() as ch:
        assert stub(ch).Complete(gen_request([5, 6, 7], max_new=2, slo_class="tight")).finish_reason == gpb.LENGTH
    missed = "cbserve_slo_requests_total{class=tight,outcome=missed}"
    assert big.metrics()[missed] - before.get(missed, 0) == 1
    reconfigure(big, {"policy": "slo", "slo_classes": classes, "slo": {"on_miss": "reject"}})
    with big.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            stub(ch).Complete(gen_request([5, 6, 7], max_new=2, slo_class="tight"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tight" in err.value.details()
    r = httpx.post(f"{base}/completions", json={**body, "slo_class": "tight"}, timeout=60)
    assert r.status_code == 429
    m = big.metrics()
    rejected = "cbserve_slo_requests_total{class=tight,outcome=rejected}"
    assert m[rejected] - before.get(rejected, 0) == 2
    assert "cbserve_slo_goodput_requests_per_second" in m
    wait_idle(big)
