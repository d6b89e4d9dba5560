"""Fixtures of the native kernel tests."""

from __future__ import annotations

import pytest

import native
from tests.native.helpers import SUPPORTED_ISAS


@pytest.fixture(params=SUPPORTED_ISAS)
def isa(request):
    """Runs a test once per CPU kernel ISA this machine can execute."""
    before = native.cpu_features()["isa"]
    native._set_isa(request.param)
    yield request.param
    native._set_isa(before)
