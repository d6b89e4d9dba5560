"""The executor reads the `cache:` section of the router's YAML file through
common.config: a bad value there is refused with the key named and exit
status 2 (no traceback, no restart loop), the other sections are left to the
router."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.config import CacheConfig, ConfigError, load_cache_config
from tests.conftest import REPO


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "router.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_the_cache_section_is_read_and_the_router_sections_left_alone(tmp_path):
    path = _write(tmp_path, "scheduler:\n  policy: sjf\ncache:\n  block_size: 32\n  num_blocks: 64\n")
    assert load_cache_config(path) == CacheConfig(block_size=32, num_blocks=64)
    assert load_cache_config(None) == CacheConfig()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cache:\n  block_size: 24\n", "cache.block_size: must be a power of two"),
        ("cache:\n  blocks: 3\n", "config.cache.blocks: unknown key"),
        ("cache:\n  kv_cache_bytes: lots\n", "expected an integer"),
        ("- a list\n", "expected a mapping"),
    ],
)
def test_a_bad_cache_section_is_refused_with_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_cache_config(_write(tmp_path, text))


def test_the_executor_exits_2_on_a_bad_cache_section(tmp_path):
    path = _write(tmp_path, "cache:\n  watermark: 0.9\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "executor",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--config",
            path,
            "--listen",
            f"unix://{tmp_path}/x.sock",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "cache.watermark: must be in [0, 0.5)" in proc.stderr
    assert "Traceback" not in proc.stderr
