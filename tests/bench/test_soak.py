"""The 2-minute soak: mixed traffic, two executor kills and a hang, nothing
lost (`cbserve bench soak --minutes 2`, a real server on loopback)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_a_two_minute_soak_loses_nothing(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "soak",
            "--minutes",
            "2",
            "--out",
            str(out),
            "--plot",
            str(tmp_path / "rss.png"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["faults"]) == 3 and result["executor_incarnations"] >= 3
    assert result["undefined"] == {} and not any(result["leftover"].values())
    kinds = {k.split(":")[0] for k in result["outcomes"]}
    assert {"stream", "cancel", "deadline", "invalid", "oversized", "slow_reader"} <= kinds
    assert (tmp_path / "rss.png").stat().st_size > 0
