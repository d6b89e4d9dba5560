"""The committed gRPC stubs are exactly what grpc_tools.protoc generates,
but for the grpcio version each _grpc.py stub is stamped with: that stamp is
the oldest grpcio the stub accepts at import, which follows the installed
grpcio-tools release (a fresh venv may hold a newer patch release than the
one that wrote the committed stubs), not the .proto files."""

import os
import re
import subprocess
import sys

from tests.conftest import REPO


def test_committed_stubs_match_fresh_protoc(tmp_path):
    protos = os.path.join(REPO, "protos")
    files = ["cbserve/v1/generation.proto", "cbserve/v1/executor.proto"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{protos}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *files,
        ],
        check=True,
    )
    for name in (
        "generation_pb2.py",
        "generation_pb2.pyi",
        "generation_pb2_grpc.py",
        "executor_pb2.py",
        "executor_pb2.pyi",
        "executor_pb2_grpc.py",
    ):
        fresh = tmp_path / "cbserve" / "v1" / name
        committed = os.path.join(protos, "cbserve", "v1", name)
        assert _unstamped(fresh) == _unstamped(committed), f"{name} is stale: run `make protos`"


_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.MULTILINE)


def _unstamped(path) -> str:
    with open(path, encoding="utf-8") as fh:
        return _STAMP.sub("GRPC_GENERATED_VERSION = ''", fh.read())


def test_the_project_never_installs_a_grpcio_the_stubs_refuse():
    """The stubs refuse a grpcio older than their stamp: pyproject's floor
    must be at least that."""
    with open(os.path.join(REPO, "protos", "cbserve", "v1", "generation_pb2_grpc.py"), encoding="utf-8") as fh:
        stamp = _STAMP.search(fh.read()).group(1)
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as fh:
        floor = re.search(r'"grpcio>=([0-9.]+)"', fh.read()).group(1)
    assert tuple(map(int, floor.split("."))) >= tuple(map(int, stamp.split("."))), (floor, stamp)
