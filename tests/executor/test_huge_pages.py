"""Weights moved onto huge pages (executor/cpu/huge_pages.py): same values, every
view re-pointed and still aliasing its base, small tensors left alone, the
memory backed by 2 MB pages where the kernel allows, and a runner whose
weights were moved gives the same tokens."""

from __future__ import annotations

import pytest
import torch

from executor import model_loader, model_source
from executor.cpu.huge_pages import module_tensors, movable, move_to_huge_pages
from executor.runner import ModelRunner
from tests.executor.helpers import anon_huge_kb, greedy, mapping_of, thp_mode


def test_moved_tensors_keep_their_values_and_views_alias_their_base():
    lin = torch.nn.Linear(512, 256)  # parameters that require grad
    base = torch.randn(64, 1024)
    lin.packed = base  # a plain tensor attribute, as PackedLinear keeps its tiles
    lin.view = base[8:40, 100:300]  # a strided view of the same storage
    lin.small = torch.randn(16)  # under min_bytes: stays where it is
    want = {name: t.clone() for name, t in (("w", lin.weight), ("b", lin.bias), ("base", base), ("view", lin.view))}
    x = torch.randn(3, 512)
    y = lin(x)
    small_ptr, base_ptr = lin.small.data_ptr(), base.data_ptr()
    moved = move_to_huge_pages(module_tensors([lin]), min_bytes=1024)
    assert moved % 64 == 0 and moved >= (512 * 256 + 256 + 64 * 1024) * 4
    assert lin.small.data_ptr() == small_ptr and base.data_ptr() != base_ptr
    got = {"w": lin.weight, "b": lin.bias, "base": base, "view": lin.view}
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert isinstance(lin.weight, torch.nn.Parameter) and lin.weight.requires_grad
    start, end = mapping_of(base.data_ptr())
    assert all(start <= t.data_ptr() < end for t in (lin.weight, base, lin.view))
    assert lin.view.data_ptr() == base.data_ptr() + (8 * 1024 + 100) * 4
    base[8, 100] = 123.0  # one storage: a write through the base shows in the view
    assert lin.view[0, 0].item() == 123.0
    assert torch.equal(lin(x), y)


def test_nothing_to_move():
    assert move_to_huge_pages([torch.zeros(4), torch.zeros(0)]) == 0


def test_opaque_onednn_weights_are_left_where_they_are():
    """oneDNN's prepacked weights (the bf16 linear path on CPUs without AMX)
    have no storage to move: they are skipped, the dense ones still move."""
    opaque, dense = torch.randn(256, 256).to_mkldnn(), torch.randn(256, 256)
    values, dense_ptr = opaque.to_dense(), dense.data_ptr()
    assert not movable(opaque) and movable(dense)
    assert move_to_huge_pages([opaque, dense]) == 256 * 256 * 4
    assert dense.data_ptr() != dense_ptr and torch.equal(opaque.to_dense(), values)


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_moved_weights_sit_on_huge_pages():
    w = torch.randn(4096, 1024)  # 16 MB
    move_to_huge_pages([w])
    huge_kb = anon_huge_kb(w.data_ptr(), w.data_ptr() + w.numel() * 4)
    assert huge_kb >= 8 * 1024, f"{huge_kb} kB of huge pages under a 16 MB weight"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_runner_weights_are_moved_and_moving_them_again_changes_no_token(dtype):
    runner = ModelRunner(model_loader.load_model(model_source.resolve("tiny"), dtype), 16, 64)
    model = runner.model
    held = module_tensors([*model.modules(), *runner._lean_modules()])
    big = [t for t in held if movable(t)]
    assert big
    start, end = mapping_of(big[0].data_ptr())
    assert all(start <= t.data_ptr() < end for t in big)  # one mapping holds them all
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompts = [[(3 * i + L) % 200 + 5 for i in range(L)] for L in (1, 17, 40)]
    before = greedy(runner, prompts, 6)
    runner.reset()
    move_to_huge_pages(held)
    assert mapping_of(big[0].data_ptr()) != (start, end)
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied
    assert greedy(runner, prompts, 6) == before
