"""bench/speculative.py's workload (`cbserve bench spec`): passages cut from
a text, each task's request bodies, and a table row from timed results."""

from __future__ import annotations

from bench.speculative import REPO, _row, bodies, passages


def test_passages_are_distinct_runs_of_the_text():
    ps = passages(REPO / "docs" / "architecture.md", 6, words=40)
    assert len(ps) == 6 and len(set(ps)) == 6
    assert all(len(p.split()) == 40 for p in ps)


def test_each_task_asks_what_it_says():
    texts = passages(REPO / "docs" / "architecture.md", 2)
    for task in ("rewrite", "quote"):
        bs = bodies(task, texts, 32, seed=0)
        assert [t in b["messages"][0]["content"] for b, t in zip(bs, texts)] == [True, True]
        assert all(b["temperature"] == 0 and b["max_tokens"] == 32 for b in bs)
    rewrite = bodies("rewrite", texts, 32, seed=0)[0]["messages"][0]["content"]
    word = rewrite.split("'")[1]
    assert f"'{word.upper()}'" in rewrite and word in texts[0]
    rnd = bodies("random", texts, 32, seed=1)
    assert all(len(b["prompt"]) == 128 and b["temperature"] == 0 and b["ignore_eos"] for b in rnd)
    sampled = bodies("sampled", texts, 32, seed=1)
    assert [b["prompt"] for b in sampled] == [b["prompt"] for b in rnd]
    assert all(b["temperature"] == 1.0 for b in sampled) and len({b["seed"] for b in sampled}) == 2


def test_a_row_reports_speed_latency_acceptance_and_sameness():
    res = lambda texts, gaps: [{"text": t, "tokens": 10, "gaps": gaps} for t in texts]  # noqa: E731
    plain = [(2.0, res(["a", "b"], [0.02] * 9))]
    spec = [(1.0, res(["a", "c"], [0.01] * 9))]
    row = _row("rewrite", 1, "x", 10.0, spec, (4, 12, 6), plain)
    assert row["tok_s"] == 20.0 and row["speedup"] == 2.0
    assert row["itl_p50_ms"] == 10.0 and row["itl_p99_ms"] == 10.0
    assert row["acceptance"] == 0.5 and row["mean_accepted_length"] == 2.5
    assert row["identical"] == "1/2" and row["differs"] == ("c", "b")
