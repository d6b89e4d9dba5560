"""bench/speculative.py's workload: passages cut from a text, the request
bodies of each task (greedy chat for copy / extract, seeded sampling of
random ids), and the servers' draft counters read from Prometheus text."""

from __future__ import annotations

from bench.speculative import REPO, bodies, passages


def test_passages_are_distinct_runs_of_the_text():
    ps = passages(REPO / "docs" / "architecture.md", 6, words=40)
    assert len(ps) == 6 and len(set(ps)) == 6
    assert all(len(p.split()) == 40 for p in ps)


def test_each_task_asks_what_it_says():
    texts = ["alpha beta", "gamma delta"]
    copy = bodies("copy", "m", texts, 32, seed=0)
    assert [b["messages"][0]["content"].endswith(t) for b, t in zip(copy, texts)] == [True, True]
    assert all(b["temperature"] == 0 and b["max_tokens"] == 32 for b in copy)
    rnd = bodies("random", "m", texts, 32, seed=1)
    assert all(len(b["prompt"]) == 128 and b["temperature"] == 1.0 and b["ignore_eos"] for b in rnd)
    assert len({b["seed"] for b in rnd}) == 2  # each request its own seed: reproducible, not identical
    assert rnd == bodies("random", "m", texts, 32, seed=1)
