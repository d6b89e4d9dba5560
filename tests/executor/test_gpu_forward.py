"""The GPU lean forward and its CUDA graphs (executor/gpu/).

The kernels against the transformers code they replace (fresh random inputs,
outputs poisoned before each run), the lean forward against the transformers
forward, and graph replay against the same steps run eagerly: across bucket
boundaries, with seeded sampling, and across a preemption. The `cuda` tests
need a GPU and an extension built with CUDA; what needs neither (the ops
refuse CPU tensors, the bucket sizes, the CPU runner never builds any of it)
runs everywhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import native
from cbserve.v1 import executor_pb2 as pb
from executor import model_loader, model_source
from executor.gpu import lean_forward
from executor.gpu.graphs import buckets
from executor.runner import ModelRunner
from native import _C
from tests.integration.test_architectures import _checkpoint
from tests.integration.test_architectures import _prompts as long_prompts
from tests.small_configs import ARCHS

needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and native.has_cuda()), reason="needs a CUDA GPU and native._C built with CUDA"
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# One unit in the last place, relative: what a different summation order can
# move a value by after rounding to the dtype.
ULP = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def test_the_gpu_ops_refuse_cpu_tensors():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        _C.add_rms_norm_(x, x.clone(), torch.ones(8), 1e-5, True)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        _C.silu_and_mul(torch.empty(2, 4), x)


def test_buckets_cover_every_batch_up_to_the_largest():
    assert buckets(256)[:6] == [1, 2, 4, 8, 16, 32] and buckets(256)[-1] == 256
    assert buckets(1) == [1] and buckets(20) == [1, 2, 4, 8, 16, 20]
    for top in (1, 5, 64, 100):
        bs = buckets(top)
        assert all(any(b >= n for b in bs) for n in range(1, top + 1)) and max(bs) == top


def test_the_cpu_runner_builds_no_gpu_forward():
    model = model_loader.load_model(model_source.resolve("tiny"), torch.float32)
    assert lean_forward.supported(model) == "not on a CUDA device"
    runner = ModelRunner(model, 16, 32)
    assert runner.gpu is None and runner.graphs is None


def test_the_gpu_lean_forward_takes_the_llama_family_and_says_why_not_others():
    for name in ("mistral", "qwen2"):
        assert lean_forward.supported(ARCHS[name]()) == "not on a CUDA device", name
    for name in ("gemma2", "qwen3", "phi3"):
        why = lean_forward.supported(ARCHS[name]())
        assert why.startswith("model_type") and "is not one of llama, mistral, qwen2" in why, why


# -- the kernels -----------------------------------------------------------------
def _randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("add", [False, True])
def test_add_rms_norm_is_the_transformers_residual_add_and_norm(dtype, add):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    T, H, eps = 37, 576, 1e-5
    x, res = _randn(T, H, dtype=dtype), _randn(T, H, dtype=dtype)
    norm = LlamaRMSNorm(H, eps=eps).to("cuda", dtype)
    norm.weight.data = _randn(H, dtype=dtype, scale=0.2) + 1
    want_res = res + x if add else x.clone()
    want_x = norm(want_res)
    got_x, got_res = x.clone(), res.clone()
    _C.add_rms_norm_(got_x, got_res, norm.weight.data, eps, add)
    torch.cuda.synchronize()
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got_x, want_x, rtol=ULP[dtype], atol=ULP[dtype])


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_cache_is_the_transformers_rotary_and_the_cache_write(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    T, hq, hkv, D, P, nb, bs = 23, 6, 2, 64, 300, 8, 16
    cfg = LlamaConfig(hidden_size=hq * D, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=D, rope_theta=1e4)
    rope = LlamaRotaryEmbedding(cfg).to("cuda")
    cos, sin = rope(torch.empty(0, dtype=dtype, device="cuda"), torch.arange(P, device="cuda")[None])
    cos, sin = cos[0].contiguous(), sin[0].contiguous()
    qkv = _randn(T, (hq + 2 * hkv) * D, dtype=dtype)
    positions = torch.randint(0, P, (T,), device="cuda", dtype=torch.int32)
    slots = torch.randperm(nb * bs, device="cuda")[:T].to(torch.int32)
    slots[::5] = -1  # not written
    kc = torch.full((nb, bs, hkv, D), 7.0, dtype=dtype, device="cuda")
    vc = torch.full_like(kc, 7.0)
    q_out = torch.full((T, hq, D), float("nan"), dtype=dtype, device="cuda")
    _C.rotary_cache(q_out, qkv, positions, cos, sin, kc, vc, slots)
    torch.cuda.synchronize()

    q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=1)
    c, s = cos[positions.long()][None], sin[positions.long()][None]
    q_ref, k_ref = apply_rotary_pos_emb(
        q.view(T, hq, D).transpose(0, 1)[None], k.view(T, hkv, D).transpose(0, 1)[None], c, s
    )
    q_ref, k_ref = q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)
    tol = ULP[dtype] if dtype == torch.float32 else 0.0
    torch.testing.assert_close(q_out, q_ref, rtol=tol, atol=tol)
    written = slots >= 0
    flat_k, flat_v = kc.view(nb * bs, hkv, D), vc.view(nb * bs, hkv, D)
    idx = slots[written].long()
    torch.testing.assert_close(flat_k[idx], k_ref[written], rtol=tol, atol=tol)
    assert torch.equal(flat_v[idx], v.view(T, hkv, D)[written])
    untouched = torch.ones(nb * bs, dtype=torch.bool, device="cuda")
    untouched[idx] = False
    assert bool((flat_k[untouched] == 7).all()) and bool((flat_v[untouched] == 7).all())


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_the_transformers_mlp_activation(dtype):
    T, inter = 19, 1536
    gate_up = _randn(T, 2 * inter, dtype=dtype, scale=3.0)
    out = torch.full((T, inter), float("nan"), dtype=dtype, device="cuda")
    _C.silu_and_mul(out, gate_up)
    g, u = gate_up.chunk(2, dim=1)
    torch.testing.assert_close(out, F.silu(g) * u, rtol=ULP[dtype], atol=ULP[dtype])


# -- the forward and its graphs ---------------------------------------------------
def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return model_loader.load_model(model_source.resolve("tiny"), dtype, torch.device("cuda"))


def _drive(runner, prompts, steps, sampling=None, preempt=None):
    """Prefills `prompts` (one plan), then `steps` decode steps of all of
    them; `preempt=(step, seq)` frees that sequence before that step and
    re-admits it with everything it has (recompute). Returns the tokens
    sampled per sequence."""
    per = -(-(max(map(len, prompts)) + steps + 1) // runner.block_size)
    sampling = sampling or (lambda i: pb.SeqSampling())
    out = {i: [] for i in range(len(prompts))}
    runner.reset()

    def new(i, tokens, num_output):
        return pb.ScheduledSeq(
            seq_id=i,
            num_tokens=len(tokens),
            new_block_ids=list(range(i * per, (i + 1) * per)),
            replace_block_table=True,
            new=pb.NewSeq(token_ids=tokens, sampling=sampling(i), num_output_tokens=num_output),
        )

    res = runner.step(pb.Plan(seqs=[new(i, p, 0) for i, p in enumerate(prompts)]))
    for _ in range(steps):
        for s, t in zip(res.seq_ids, res.token_ids):
            out[s].append(t)
        plan = pb.Plan()
        for i in range(len(prompts)):
            if preempt is not None and len(out[preempt[1]]) == preempt[0] and i == preempt[1]:
                plan.free_seq_ids.append(i)
                plan.seqs.append(new(i, prompts[i] + out[i], len(out[i])))
                preempt = None
            else:
                plan.seqs.append(pb.ScheduledSeq(seq_id=i, num_tokens=1))
        res = runner.step(plan)
    runner.reset()
    return [out[i] for i in range(len(prompts))]


def _prompts(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(3, 259, (length,), generator=g).tolist() for length in lengths]


@needs_gpu
def test_the_lean_forward_gives_the_transformers_forwards_greedy_tokens():
    model = _model()
    prompts = _prompts(6)
    reference = _drive(ModelRunner(model, 16, 256, lean_forward=False), prompts, 16)
    lean = ModelRunner(model, 16, 256, cuda_graph_max_batch=0)
    assert lean.gpu is not None and lean.graphs is None
    assert _drive(lean, prompts, 16) == reference


@needs_gpu
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_mistral_and_qwen2_run_the_lean_forward_and_its_graphs_with_their_windows(tmp_path, name):
    # Mistral's 16-token window on every layer; Qwen2's q/k/v biases and its
    # window. Prompts of up to 150 tokens: the window matters (the CPU test
    # of the same checkpoints shows it changes the tokens).
    source = model_source.resolve(str(_checkpoint(tmp_path, name)))
    model = model_loader.load_model(source, torch.float32, torch.device("cuda"))
    prompts = long_prompts()
    reference = _drive(ModelRunner(model, 16, 256, lean_forward=False), prompts, 12)
    lean = ModelRunner(model, 16, 256, cuda_graph_max_batch=0)
    assert lean.gpu is not None and {L.window for L in lean.gpu.layers} == {16}
    assert (lean.gpu.layers[0].qkv_bias is not None) == (name == "qwen2")
    assert _drive(lean, prompts, 12) == reference
    graphed = ModelRunner(model, 16, 256, cuda_graph_max_batch=8)
    assert _drive(graphed, prompts, 12) == reference and graphed.graphs.replays == 12


@needs_gpu
@pytest.mark.parametrize("batch", [1, 3, 5, 16, 17, 32])
def test_graph_replay_gives_the_eager_tokens_at_every_bucket(batch):
    model = _model()
    prompts = _prompts(batch, seed=batch)
    eager = _drive(ModelRunner(model, 16, 512, cuda_graph_max_batch=0), prompts, 12)
    graphed = ModelRunner(model, 16, 512, cuda_graph_max_batch=32)
    assert graphed.graph_capture["buckets"] == len(buckets(32))
    assert _drive(graphed, prompts, 12) == eager
    assert graphed.graphs.replays == 12  # every decode step


@needs_gpu
def test_a_step_beyond_the_largest_bucket_runs_eagerly_with_the_same_tokens():
    model = _model()
    prompts = _prompts(9, seed=3)
    eager = _drive(ModelRunner(model, 16, 512, cuda_graph_max_batch=0), prompts, 6)
    graphed = ModelRunner(model, 16, 512, cuda_graph_max_batch=8)
    assert _drive(graphed, prompts, 6) == eager and graphed.graphs.replays == 0


@needs_gpu
def test_seeded_sampling_through_graphs_is_the_eager_sampling_and_batch_independent():
    model = _model()
    prompts = _prompts(5, seed=4)

    def sampling(i):
        return pb.SeqSampling(temperature=0.9, top_p=0.9, top_k=40, seed=100 + i)

    eager = _drive(ModelRunner(model, 16, 512, cuda_graph_max_batch=0), prompts, 12, sampling)
    graphed = ModelRunner(model, 16, 512, cuda_graph_max_batch=16)
    assert _drive(graphed, prompts, 12, sampling) == eager
    alone = _drive(graphed, prompts[2:3], 12, lambda i: sampling(2))
    assert alone[0] == eager[2]


@needs_gpu
def test_graph_replay_continues_exactly_after_a_recompute_preemption():
    model = _model()
    prompts = _prompts(5, seed=5)
    graphed = ModelRunner(model, 16, 512, cuda_graph_max_batch=8)
    straight = _drive(graphed, prompts, 14)
    assert _drive(graphed, prompts, 14, preempt=(6, 2)) == straight
