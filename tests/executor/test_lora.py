"""LoRA adapters in the runner (executor/lora.py) against PEFT: random
adapters made with the `peft` package on tiny random models; greedy tokens,
their logprobs and the prompt's logprobs must be PEFT's, alone and in a
batch that mixes four adapters with the base model. Bad adapters are refused
naming what is wrong."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from cbserve.v1 import executor_pb2 as pb
from executor import model_loader, model_source
from executor.errors import PlanError
from executor.lora import LoraError
from executor.runner import ModelRunner
from tests.executor.helpers import avx512_bf16
from tests.lora_adapters import make_adapter, peft_reference
from tests.small_configs import ARCHS

BS = 16
N_NEW = 8
PROMPTS = [[5, 9, 3, 17, 40, 9, 3, 17, 5, 9, 22, 41, 7], [100, 3, 250, 7, 7, 31], [12] * 20, [66, 67, 68, 69]]


def run(runner: ModelRunner, seqs: list[tuple[list[int], int]], n: int, slots: dict[int, tuple[str, str]]):
    """Prefills every (prompt, lora slot) in one plan that first fills
    `slots`, then decodes n - 1 steps; per sequence (tokens, logprobs,
    prompt logprobs)."""
    sampling = pb.SeqSampling(logprobs=True, prompt_logprobs=True)
    plan = pb.Plan(lora_slots=[pb.LoraSlot(slot=s, name=nm, path=p) for s, (nm, p) in slots.items()])
    nb = 0
    for i, (prompt, slot) in enumerate(seqs):
        need = -(-(len(prompt) + n) // BS)
        plan.seqs.append(
            pb.ScheduledSeq(
                seq_id=i,
                num_tokens=len(prompt),
                new_block_ids=list(range(nb, nb + need)),
                new=pb.NewSeq(token_ids=prompt, sampling=sampling, lora_slot=slot),
            )
        )
        nb += need
    out = {i: ([], [], []) for i in range(len(seqs))}
    runner.reset()
    res = runner.step(plan)
    assert not res.failed, res.failed
    for p in res.prompt_logprobs:
        out[p.seq_id][2].extend(p.logprobs)
    for _ in range(n):
        for s, t, lp in zip(res.seq_ids, res.token_ids, res.logprobs):
            out[s][0].append(t)
            out[s][1].append(lp)
        if len(out[0][0]) == n:
            break
        res = runner.step(pb.Plan(seqs=[pb.ScheduledSeq(seq_id=i, num_tokens=1) for i in range(len(seqs))]))
    runner.reset()
    return [out[i] for i in range(len(seqs))]


def _model(kind: str):
    torch.manual_seed(3)
    if kind == "llama":
        return model_loader.load_model(model_source.resolve("tiny"), torch.float32)
    return ARCHS[kind]().eval()


def _assert_matches(got, want, tol: float = 1e-4) -> None:
    tokens, lps, plp = got
    assert tokens == want[0]
    assert max(abs(a - b) for a, b in zip(lps, want[1])) < tol
    assert len(plp) == len(want[2]) and max(abs(a - b) for a, b in zip(plp, want[2])) < tol


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma2"])
def test_adapters_match_peft_alone_and_mixed_with_the_base(tmp_path, kind):
    base = _model(kind)
    adapters = {
        "all": make_adapter(base, str(tmp_path / "all"), seed=1),
        "attn": make_adapter(base, str(tmp_path / "attn"), ("q_proj", "v_proj", "o_proj"), r=4, seed=2),
        "mlp": make_adapter(base, str(tmp_path / "mlp"), ("gate_proj", "up_proj", "down_proj"), r=16, seed=3),
        "rs": make_adapter(base, str(tmp_path / "rs"), ("k_proj", "down_proj"), r=8, alpha=4, rslora=True, seed=4),
    }
    want = {name: peft_reference(base, path, PROMPTS[0], N_NEW) for name, path in adapters.items()}
    want[None] = peft_reference(base, None, PROMPTS[0], N_NEW)
    assert len({tuple(w[0]) for w in want.values()}) > 1, "the adapters should change the output"
    runner = ModelRunner(copy.deepcopy(base), BS, 64, max_loras=4)
    slots = {i + 1: (name, path) for i, (name, path) in enumerate(adapters.items())}
    for slot, name in [(0, None), *((s, nm) for s, (nm, _) in slots.items())]:
        (alone,) = run(runner, [(PROMPTS[0], slot)], N_NEW, slots)
        _assert_matches(alone, want[name])
    # One batch: the base and each adapter, twice, interleaved.
    order = [0, 1, 2, 3, 4, 0, 4, 3, 2, 1]
    mixed = run(runner, [(PROMPTS[0], s) for s in order], N_NEW, slots)
    for s, got in zip(order, mixed):
        _assert_matches(got, want[slots[s][0] if s else None])


@pytest.mark.skipif(not avx512_bf16(), reason="the bf16 lean forward's FusedMLP packing needs AVX512-BF16")
def test_bf16_lean_forward_with_adapters_is_batch_independent_and_near_peft(tmp_path):
    base = _model("llama").to(torch.bfloat16)
    paths = [make_adapter(base, str(tmp_path / f"a{i}"), seed=10 + i) for i in range(2)]
    runner = ModelRunner(copy.deepcopy(base), BS, 64, max_loras=2)
    assert runner.lean is not None
    slots = {1: ("a0", paths[0]), 2: ("a1", paths[1])}
    seqs = [(p, s) for p in PROMPTS for s in (0, 1, 2)]
    mixed = run(runner, seqs, N_NEW, slots)
    for (prompt, slot), got in zip(seqs, mixed):
        (alone,) = run(runner, [(prompt, slot)], N_NEW, slots)
        assert got[0] == alone[0] and got[1] == alone[1]
    # Against PEFT in bf16: the first token, its logprob within bf16's error.
    for (prompt, slot), got in zip(seqs[:3], mixed[:3]):
        want = peft_reference(base, paths[slot - 1] if slot else None, prompt, 1)
        assert abs(got[1][0] - want[1][0]) < 0.1


def test_fused_mlp_projection_then_activation_equals_the_fused_pass():
    from executor.cpu.fused_modules import FusedMLP

    if not avx512_bf16():
        pytest.skip("the interleaved gate|up packing runs on AVX512-BF16 CPUs")
    base = _model("llama").to(torch.bfloat16)
    mlp = FusedMLP(base.model.layers[0].mlp)
    h = torch.randn(37, base.config.hidden_size).to(torch.bfloat16)
    assert torch.equal(mlp.activate(mlp.projection(h)), mlp.act(h))
    ref = base.model.layers[0].mlp
    gu = torch.cat([ref.gate_proj(h), ref.up_proj(h)], -1)
    torch.testing.assert_close(mlp.projection(h).float(), gu.float(), rtol=2**-7, atol=1e-2)


@pytest.fixture(scope="module")
def llama_runner():
    return ModelRunner(_model("llama"), BS, 64, max_loras=2, max_lora_rank=16, max_cpu_loras=2)


def _edit_config(path: str, **changes) -> None:
    cfg_path = os.path.join(path, "adapter_config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg.update(changes)
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)


def test_bad_adapters_are_refused_naming_the_problem(tmp_path, llama_runner):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.small_configs import small

    lora = llama_runner.lora
    base = _model("llama")
    with pytest.raises(LoraError, match="not a directory"):
        lora.load("x", str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="no adapter_config.json"):
        lora.load("x", str(tmp_path / "empty"))
    big = make_adapter(base, str(tmp_path / "big"), r=32)
    with pytest.raises(LoraError, match="rank 32 is over lora.max_lora_rank"):
        lora.load("x", big)
    layers = base.config.num_hidden_layers
    other = LlamaForCausalLM(LlamaConfig(**small(hidden_size=64, head_dim=16, num_hidden_layers=layers)))
    wrong = make_adapter(other, str(tmp_path / "wrong"), ("q_proj",))
    with pytest.raises(LoraError, match=r"q_proj maps 64 -> 64 features; the model's q_proj maps \d+ -> \d+"):
        lora.load("x", wrong)
    emb = make_adapter(base, str(tmp_path / "emb"), ("embed_tokens",))
    with pytest.raises(LoraError, match="target module 'embed_tokens' is not one of q_proj"):
        lora.load("x", emb)
    _edit_config(emb, target_modules=".*embed.*")  # a pattern: the tensors say what it targets
    with pytest.raises(LoraError, match="not a LoRA weight of a decoder projection"):
        lora.load("x", emb)
    ok = make_adapter(base, str(tmp_path / "ok"), ("q_proj",))
    _edit_config(ok, use_dora=True)
    with pytest.raises(LoraError, match="use_dora is not supported"):
        lora.load("x", ok)
    _edit_config(ok, use_dora=False, target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoraError, match="target module 'lm_head'"):
        lora.load("x", ok)
    _edit_config(ok, target_modules=["q_proj"])
    os.remove(os.path.join(ok, "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="no adapter_model.safetensors"):
        lora.load("x", ok)
    with open(os.path.join(ok, "adapter_model.safetensors"), "wb") as fh:
        fh.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(LoraError, match="not a readable safetensors file"):
        lora.load("x", ok)
    assert not lora.cache


def test_slots_in_use_are_not_reassigned_and_broken_slots_fail_alone(tmp_path, llama_runner):
    runner = llama_runner
    base = _model("llama")
    good = make_adapter(base, str(tmp_path / "good"), ("q_proj",))
    slots = {1: ("good", good)}
    runner.reset()
    first = pb.Plan(
        lora_slots=[pb.LoraSlot(slot=1, name="good", path=good), pb.LoraSlot(slot=2, name="gone", path="/nonexistent")],
        seqs=[
            pb.ScheduledSeq(
                seq_id=i, num_tokens=4, new_block_ids=[i], new=pb.NewSeq(token_ids=[5, 6, 7, 8], lora_slot=i)
            )
            for i in (1, 2, 3)
        ],
    )
    res = runner.step(first)
    assert res.seq_ids == [1]
    failed = dict(res.failed)
    assert "'gone'" in failed[2] and "not a directory" in failed[2]
    assert "outside [1, 2]" in failed[3]
    with pytest.raises(PlanError, match="reassigned while a sequence uses it"):
        runner.step(pb.Plan(lora_slots=[pb.LoraSlot(slot=1, name="", path="")]))
    runner.reset()
    runner.step(pb.Plan(lora_slots=[pb.LoraSlot(slot=1, name="", path="")]))  # free now
    assert runner.lora.slots[1] is None
    del slots


def test_the_torch_path_off_the_cpu_kernel_gives_the_same(tmp_path):
    """The per-slot torch ops (what runs off the CPU: lora_add is CPU-only),
    here on the CPU with the native kernel set aside."""
    base = _model("llama")
    path = make_adapter(base, str(tmp_path / "a"), seed=5)
    want = peft_reference(base, path, PROMPTS[1], N_NEW)
    runner = ModelRunner(copy.deepcopy(base), BS, 64, max_loras=2)
    runner.lora._native = None
    got = run(runner, [(PROMPTS[1], 1), (PROMPTS[1], 0)], N_NEW, {1: ("a", path)})
    _assert_matches(got[0], want)
    _assert_matches(got[1], peft_reference(base, None, PROMPTS[1], N_NEW))
