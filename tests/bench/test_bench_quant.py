"""bench/quant.py (`cbserve bench quant`): its prompts, the numbers it reads
from a server's log and process tree, and a workload's statistics."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.quant import _stats, bodies, cbserve_settings, cbserve_weights_mb, tree_rss_mb, vocab_size


def test_prompts_are_random_ids_inside_the_vocabulary():
    bs = bodies(5, vocab=300, max_tokens=16, seed=3)
    assert len(bs) == 5 and all(len(b["prompt"]) == 128 for b in bs)
    assert all(100 <= t < 300 for b in bs for t in b["prompt"])
    assert all(b["ignore_eos"] and b["temperature"] == 0 and b["max_tokens"] == 16 for b in bs)
    assert bodies(5, 300, 16, seed=3) == bs and bodies(5, 300, 16, seed=4) != bs


def test_weights_come_from_the_last_executor_ready_line(tmp_path):
    log = tmp_path / "server.log"
    log.write_text('x\nexecutor ready weights_mb=374 gguf_file_mb=94\n{"event": "executor ready", "weights_mb": 92}\n')
    assert cbserve_weights_mb(log) == 92.0
    log.write_text("nothing here\n")
    assert cbserve_weights_mb(log) is None


def test_tree_rss_counts_the_children():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(30)",
        ]
    )
    try:
        import time

        time.sleep(1.5)
        alone = tree_rss_mb(child.pid)
        mine = tree_rss_mb(os.getpid())
        assert alone >= 64 and mine >= alone
    finally:
        child.kill()
        child.wait()


def test_statistics_of_a_workload():
    res = [
        {"tokens": 4, "gaps": [0.01, 0.01, 0.03], "seconds": 0.15},
        {"tokens": 4, "gaps": [0.02, 0.02, 0.02], "seconds": 0.26},
    ]
    s = _stats(2.0, res)
    assert s["tok_s"] == 4.0 and s["tokens"] == 8
    assert s["itl_p50_ms"] == 20.0 and s["itl_p99_ms"] == 30.0
    assert round(s["ttft_p50_ms"]) == 200  # seconds minus the gaps: 0.10 and 0.20


def test_vocab_size_reads_the_files_token_list(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.integration.gguf_writer import write_gguf
    from tests.small_configs import small

    torch.manual_seed(0)
    path = tmp_path / "tiny.gguf"
    write_gguf(LlamaForCausalLM(LlamaConfig(**small(vocab_size=300))).eval(), str(path))
    assert vocab_size(str(path)) == 300


def test_cbserve_runs_as_serve_does_by_default():
    """--dtype auto as `cbserve serve --model FILE` (fp32 on an AVX2 CPU,
    where a fixed bf16 would take another kernel); the expansion only by
    CBSERVE_GGUF_BLOCKS=0; drafts off unless asked."""
    import argparse

    off, on = argparse.Namespace(speculative=False), argparse.Namespace(speculative=True)
    blocks, expanded = cbserve_settings("cbserve blocks", off), cbserve_settings("cbserve expanded", off)
    assert blocks["dtype"] == expanded["dtype"] == "auto"
    assert blocks["env"] == {} and expanded["env"] == {"CBSERVE_GGUF_BLOCKS": "0"}
    assert cbserve_settings("cbserve bf16-act", off)["env"] == {"CBSERVE_GGUF_ACTIVATIONS": "bf16"}
    assert cbserve_settings("cbserve int8-act", off)["env"] == {"CBSERVE_GGUF_ACTIVATIONS": "int8"}
    assert blocks["config_overrides"] == {"extra": {"speculative": {"method": ""}}}
    assert cbserve_settings("cbserve blocks", on)["config_overrides"] == {}
