"""bench.gpu_step's timing rows, driven on the CPU with the built-in tiny
model (the GPU-only parts, graphs and the kernel profile, need a GPU)."""

from __future__ import annotations

import torch

from bench import gpu_step
from executor.model_loader import load_model
from executor.model_source import resolve
from executor.runner import ModelRunner


def test_sampled_rows_time_both_samplers_and_restore_the_device_sampler():
    runner = ModelRunner(load_model(resolve("tiny"), torch.float32), gpu_step.BLOCK_SIZE, 64)
    rows = gpu_step._variants(runner, [1, 3], (8, 5, 3))
    assert [(r["mode"], r["batch"]) for r in rows] == [
        ("graphs, sampled, device", 1),
        ("graphs, sampled, device", 3),
        ("graphs, sampled, host", 1),
        ("graphs, sampled, host", 3),
    ]
    for r in rows:
        assert len(r["step_ms_all"]) == 3 and r["step_ms"] in r["step_ms_all"] and r["step_ms"] > 0
        # tok_s comes from the unrounded median, step_ms is rounded to 1 us:
        # at sub-millisecond steps that half microsecond moves the rate by more than 1.
        slack = 0.5 + r["batch"] * 1e3 * 0.0005 / (r["step_ms"] - 0.0005) ** 2
        assert abs(r["tok_s"] - r["batch"] * 1e3 / r["step_ms"]) <= slack
    assert runner.device_sampling is True


def test_models_of_the_lean_family_at_smollm2_shapes():
    """--arch builds Mistral and Qwen2 with SmolLM2's shapes through a
    checkpoint directory (loaded as --model DIR loads one)."""
    for arch, cls in (("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM")):
        model = gpu_step._model(arch, torch.device("cpu"))
        cfg = model.config
        assert type(model).__name__ == cls and cfg.model_type == arch
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (576, 30, 3)
        assert next(model.parameters()).dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's q/k/v biases
