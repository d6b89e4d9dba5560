"""The docs a newcomer reads hold what they promise: every configuration key
in docs/configuration.md, every CLI command in docs/api.md, a README that
stays short with the Quick start near its top, and no file pointing outside
the repository for its design."""

import dataclasses
import os
import re
import subprocess

from router.config import ModelConfig, RouterConfig
from tests.conftest import REPO


def _read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts), encoding="utf-8") as fh:
        return fh.read()


def test_every_config_key_is_documented():
    text = _read("docs", "configuration.md")
    cfg = RouterConfig()
    missing = []
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if isinstance(value, list):  # models: its entries' keys, as `models[].key`
            for f in dataclasses.fields(ModelConfig):
                if not re.search(rf"`{section.name}\[\]\.{f.name}`", text):
                    missing.append(f"{section.name}[].{f.name}")
            continue
        for f in dataclasses.fields(value):
            # Keys are listed as `section.key`, or `section.a` / `section.b` on one row;
            # a nested section's as `section.key.sub`.
            sub = getattr(value, f.name)
            nested = dataclasses.is_dataclass(sub)
            keys = [f"{f.name}.{g.name}" for g in dataclasses.fields(sub)] if nested else [f.name]
            for key in keys:
                if not re.search(rf"`{section.name}\.{re.escape(key)}`", text):
                    missing.append(f"{section.name}.{key}")
    assert not missing, f"docs/configuration.md lacks: {missing}"


def test_every_cli_command_is_documented():
    from router.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    text = _read("docs", "api.md")
    missing = [name for name in sub.choices if f"cbserve {name}" not in text]
    assert not missing, f"docs/api.md lacks: {missing}"


def test_readme_is_short_and_starts_with_the_quick_start():
    raw = _read("README.md").encode("utf-8")
    assert len(raw) <= 12 * 1024, f"README.md is {len(raw)} bytes (at most 12 KB)"
    assert raw.find(b"## Quick start") != -1 and raw.find(b"## Quick start") < 3 * 1024
    assert b"make serve" in raw and b"make test" in raw


def test_docs_links_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists."""
    broken = []
    pages = ["README.md"] + [
        os.path.join("docs", p) for p in os.listdir(os.path.join(REPO, "docs")) if p.endswith(".md")
    ]
    for page in pages:
        base = os.path.dirname(os.path.join(REPO, page))
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _read(page)):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.normpath(os.path.join(base, target))):
                broken.append(f"{page} -> {target}")
    assert not broken, broken


def test_no_tracked_file_refers_outside_the_repository_for_its_design():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for path in files:
        if path.endswith((".png", ".so", ".whl")) or path == "tests/test_docs.py":
            continue
        try:
            text = _read(path)
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        if "../shared" in text:
            offenders.append(path)
    assert not offenders, offenders
