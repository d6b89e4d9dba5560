"""The layering rules of docs/architecture.md hold (import-linter contracts in
pyproject.toml), and the check really fails when a rule is broken."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.conftest import REPO

LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")


def _lint(cwd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": cwd}
    return subprocess.run(
        [LINT_IMPORTS, "--config", os.path.join(cwd, "pyproject.toml"), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_keeps_every_layering_contract():
    res = _lint(REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def _package(root: str, name: str, body: str = "") -> None:
    os.makedirs(os.path.join(root, name), exist_ok=True)
    with open(os.path.join(root, name, "__init__.py"), "w", encoding="utf-8") as fh:
        fh.write(body)


def test_a_router_module_importing_the_executor_breaks_the_check(tmp_path):
    """The same contracts over a small tree with one forbidden import each."""
    root = str(tmp_path)
    shutil.copy(os.path.join(REPO, "pyproject.toml"), root)
    for name in ("executor", "native", "common", "bench", "tests", "tests/executor"):
        _package(root, name)
    _package(root, "router", "import executor\n")
    res = _lint(root)
    assert res.returncode != 0
    assert "router never imports executor" in res.stdout and "BROKEN" in res.stdout
    # Fixed there, the next rule breaks: an executor test that imports bench.
    _package(root, "router")
    _package(root, "tests/executor", "import bench\n")
    res = _lint(root)
    assert res.returncode != 0 and "executor tests never import bench" in res.stdout
