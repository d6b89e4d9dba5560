"""The README documents every configuration key and every CLI command."""

import dataclasses
import os
import re

from router.config import RouterConfig
from tests.conftest import REPO


def _readme() -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
        return fh.read()


def test_every_config_key_is_documented():
    text = _readme()
    cfg = RouterConfig()
    missing = []
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            # Keys are listed as `section.key`, or `section.a` / `section.b` on one row.
            if not re.search(rf"`{section.name}\.{f.name}`", text):
                missing.append(f"{section.name}.{f.name}")
    assert not missing, f"README lacks: {missing}"


def test_every_cli_command_is_documented():
    from router.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    text = _readme()
    for name in sub.choices:
        assert f"cbserve {name}" in text
