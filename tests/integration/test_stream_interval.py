"""server.stream_interval: Generate sends tokens in groups (the first at once,
then every N, the rest with the final message) and nothing else changes:
same tokens, text, logprobs and usage as a server that streams every token
(the session's tiny_server), stop strings still cut, and a cancelled stream
still frees its blocks. Bad values are refused at start-up."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from cbserve.v1 import generation_pb2 as gpb
from tests.conftest import REPO, start_server
from tests.integration.helpers import gen_request, stub, wait_idle

PROMPT = [5, 17, 42, 99, 100, 101, 7, 8, 9, 10, 11, 12]
INTERVAL = 4


@pytest.fixture(scope="module")
def grouped():
    server = start_server(
        "tiny", config={"server": {"stream_interval": INTERVAL}, "scheduler": {"max_num_batched_tokens": 256}}
    )
    yield server
    server.stop()


def _stream(server, req) -> list[gpb.GenerateResponse]:
    with server.channel() as ch:
        return list(stub(ch).Generate(req))


def test_tokens_arrive_in_groups_with_the_same_output(grouped, tiny_server):
    req = gen_request(PROMPT, max_new=11, logprobs=True)
    msgs = _stream(grouped, req)
    assert [len(m.token_ids) for m in msgs] == [1, 4, 4, 2]
    assert all(len(m.logprobs) == len(m.token_ids) for m in msgs)
    ref = _stream(tiny_server, req)
    assert len(ref) == 11  # every token on its own
    assert [t for m in msgs for t in m.token_ids] == [t for m in ref for t in m.token_ids]
    # Two processes, same weights and batch shapes; only the packing of messages differs.
    assert [x for m in msgs for x in m.logprobs] == pytest.approx(
        [x for m in ref for x in m.logprobs], rel=1e-4, abs=1e-4
    )
    assert "".join(m.text for m in msgs) == "".join(m.text for m in ref)
    assert msgs[-1].finish_reason == gpb.LENGTH and msgs[-1].usage == ref[-1].usage


def test_stop_string_and_complete_are_unchanged(grouped, tiny_server):
    with tiny_server.channel() as ch:
        full = stub(ch).Complete(gen_request(PROMPT, max_new=24))
    stop = full.text[5:7]
    cut = full.text.find(stop)
    msgs = _stream(grouped, gen_request(PROMPT, max_new=24, stop=[stop]))
    assert msgs[-1].finish_reason == gpb.STOP_SEQUENCE
    assert "".join(m.text for m in msgs) == full.text[:cut]
    assert msgs[-1].usage.completion_tokens == sum(len(m.token_ids) for m in msgs)
    with grouped.channel() as ch:
        whole = stub(ch).Complete(gen_request(PROMPT, max_new=24))
    assert list(whole.token_ids) == list(full.token_ids) and whole.text == full.text


def test_cancelled_grouped_stream_frees_its_blocks(grouped):
    with grouped.channel() as ch:
        it = stub(ch).Generate(gen_request(PROMPT, max_new=1500))
        sizes = []
        for msg in it:
            sizes.append(len(msg.token_ids))
            if len(sizes) == 3:
                break
        assert sizes == [1, INTERVAL, INTERVAL]
        it.cancel()
    m = wait_idle(grouped)
    assert m["cbserve_requests_total{finish_reason=CANCELLED,status=CANCELLED}"] >= 1


@pytest.mark.parametrize("value", [0, -2, "many"])
def test_bad_stream_interval_is_refused_at_start(tmp_path, value):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"server": {"stream_interval": value}}))
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--model", "tiny", "--config", str(cfg)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "server.stream_interval" in out.stderr + out.stdout
