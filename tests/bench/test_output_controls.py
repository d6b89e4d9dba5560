"""bench.output_controls: the request shapes each variant sends, and the
report section's medians, pairing and targets from result files."""

from __future__ import annotations

import json

from bench import output_controls as oc
from cbserve.v1 import generation_pb2 as gpb


def test_variants_shape_the_requests():
    msg = gpb.GenerateRequest()
    oc._penalties(msg, 0)
    assert msg.logprobs and msg.top_logprobs == 5 and msg.sampling.presence_penalty == 0.5
    even, odd = gpb.GenerateRequest(), gpb.GenerateRequest()
    oc._half_json(even, 2)
    oc._half_json(odd, 3)
    assert json.loads(even.structured.json_schema) == oc.SCHEMA and not odd.HasField("structured")


def _runs(*tok_s):
    return [{"tok_s": t} for t in tok_s]


def test_render_reports_medians_pairs_and_targets(tmp_path):
    data = {
        "args": {"repeats": 3, "variants": "default,penalties+top_logprobs=5,half JSON schema"},
        "runs": {
            "baseline: default": _runs(100, 110, 90),
            "current: default": _runs(99, 100, 101),
            "current: penalties+top_logprobs=5": _runs(80, 84, 90),
            "current: half JSON schema": _runs(79, 78, 200),
        },
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    text = oc.render([path])
    assert "| current: default | 99 / 100 / 101 | 100 | 100.0 % |" in text
    assert "median 99.0 %" in text  # pairs 99 %, 91 %, 112 %
    assert "| default sampling vs the baseline | 100.0 % | >= 97 % | met |" in text
    assert "| penalties + top_logprobs=5 | 84.0 % | >= 85 % | missed |" in text
    assert "| half JSON schema | 79.0 % | >= 80 % | missed |" in text
