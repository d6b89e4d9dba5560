"""The committed gRPC stubs are exactly what grpc_tools.protoc generates."""

import filecmp
import os
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
        assert filecmp.cmp(fresh, committed, shallow=False), f"{name} is stale: run `make protos`"
