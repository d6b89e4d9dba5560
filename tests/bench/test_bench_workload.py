import json

import numpy as np
import pytest

from bench.workload import PROMPT_ID_LOW, Workload, WorkloadSpec, materialise


def test_deterministic_and_seed_sensitive():
    spec = WorkloadSpec(num_requests=16, prompt_len=32, cap=64, seed=7)
    a, b = materialise(spec), materialise(WorkloadSpec(**vars(spec)))
    assert [r.prompt_ids for r in a.requests] == [r.prompt_ids for r in b.requests]
    assert [r.max_new_tokens for r in a.requests] == [r.max_new_tokens for r in b.requests]
    c = materialise(WorkloadSpec(num_requests=16, prompt_len=32, cap=64, seed=8))
    assert [r.prompt_ids for r in a.requests] != [r.prompt_ids for r in c.requests]


def test_prompts_shape_and_vocab():
    w = materialise(WorkloadSpec(num_requests=8, prompt_len=128, vocab_size=1000))
    assert all(len(r.prompt_ids) == 128 for r in w.requests)
    ids = np.array([r.prompt_ids for r in w.requests])
    assert ids.min() >= PROMPT_ID_LOW and ids.max() < 1000


def test_arrival_process_does_not_change_prompts_or_lengths():
    a = materialise(WorkloadSpec(num_requests=10, prompt_len=8, seed=3))
    b = materialise(WorkloadSpec(num_requests=10, prompt_len=8, seed=3, arrival="poisson", rate=4.0))
    assert [r.prompt_ids for r in a.requests] == [r.prompt_ids for r in b.requests]
    assert [r.max_new_tokens for r in a.requests] == [r.max_new_tokens for r in b.requests]
    assert all(r.arrival_s == 0 for r in a.requests)
    arr = [r.arrival_s for r in b.requests]
    assert arr[0] == 0 and arr == sorted(arr) and arr[-1] > 0


@pytest.mark.parametrize("cap", [1, 32, 128, 512])
def test_exponential_lengths_capped(cap):
    w = materialise(WorkloadSpec(num_requests=500, prompt_len=1, cap=cap, seed=1))
    lens = [r.max_new_tokens for r in w.requests]
    assert min(lens) >= 1 and max(lens) <= cap
    if cap >= 32:
        # mean cap/3 before capping; capping and rounding only pull it down a bit
        assert 0.2 * cap < np.mean(lens) < 0.4 * cap
        assert max(lens) == cap  # P(Exp > 3*mean) ~ 5%: some hit the cap at n=500


def test_fixed_and_uniform():
    f = materialise(WorkloadSpec(num_requests=20, prompt_len=1, output_dist="fixed", cap=17))
    assert {r.max_new_tokens for r in f.requests} == {17}
    u = materialise(WorkloadSpec(num_requests=300, prompt_len=1, output_dist="uniform", output_min=5, cap=9))
    assert {r.max_new_tokens for r in u.requests} == {5, 6, 7, 8, 9}


def test_validation():
    with pytest.raises(ValueError):
        materialise(WorkloadSpec(arrival="poisson"))
    with pytest.raises(ValueError):
        materialise(WorkloadSpec(output_dist="zipf"))
    with pytest.raises(ValueError):
        materialise(WorkloadSpec(cap=0))


def test_json_roundtrip_and_prompt_file(tmp_path):
    w = materialise(WorkloadSpec(num_requests=4, prompt_len=5, arrival="poisson", rate=2.0))
    p = tmp_path / "w.json"
    w.save(p)
    assert Workload.load(p).to_dict() == w.to_dict()

    pf = tmp_path / "prompts.json"
    pf.write_text(json.dumps([[1, 2, 3], [4, 5]]))
    w2 = materialise(WorkloadSpec(num_requests=3, prompt_file=str(pf)))
    assert [r.prompt_ids for r in w2.requests] == [[1, 2, 3], [4, 5], [1, 2, 3]]
    tf = tmp_path / "prompts.txt"
    tf.write_text("hello world\n\nabc\n")
    with pytest.raises(ValueError):
        materialise(WorkloadSpec(num_requests=2, prompt_file=str(tf)))
    w3 = materialise(WorkloadSpec(num_requests=2, prompt_file=str(tf)), tokenize=lambda s: [len(s)])
    assert [r.prompt_ids for r in w3.requests] == [[11], [3]]
