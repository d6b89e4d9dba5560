"""`make image` then `make image-smoke` on a real Docker engine: the CPU image
builds, runs the pod of the manifests (deploy/docker/smoke.sh) and keeps no
build argument value (index addresses, the build's CA) in any layer or in
its history. Skipped, with the reason, when no Docker engine answers.

The build takes what `make image` takes from the environment (TORCH_INDEX_URL,
INDEX_URL, EXTRA_INDEX_URL, IMAGE_CA_FILE, IMAGE_NETWORK; docs/images.md).
It runs for 5-10 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("CBSERVE_TEST_IMAGE", "cbserve:test-cpu")


def _engine_answers() -> str | None:
    """None when a Docker engine answers, else why not."""
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    try:
        r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "`docker info` timed out"
    if r.returncode != 0:
        return "no Docker engine answers (`docker info` failed; docs/images.md says how to build the images)"
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_engine_answers() is not None, reason=str(_engine_answers())),
]


def _secret_values() -> dict[str, bytes]:
    """The values the build was given that must not reach the image."""
    values = {}
    for var in ("TORCH_INDEX_URL", "INDEX_URL", "EXTRA_INDEX_URL"):
        if os.environ.get(var):
            values[var] = os.environ[var].encode()
    ca = os.environ.get("IMAGE_CA_FILE")
    if ca:
        # The longest base64 line of the file's last certificate: its body.
        lines = [ln for ln in Path(ca).read_bytes().splitlines() if ln and not ln.startswith(b"-----")]
        values["IMAGE_CA_FILE"] = max(lines[-8:], key=len)
    values["build-ca folder"] = b"cbserve-build-ca"
    return values


def _layers(image: str, dest: Path):
    """(layer name, member name, bytes) of every regular file in every layer."""
    archive = dest / "image.tar"
    subprocess.run(["docker", "save", "-o", str(archive), image], check=True)
    with tarfile.open(archive) as outer:
        manifest = json.load(outer.extractfile("manifest.json"))
        for layer in manifest[0]["Layers"]:
            with tarfile.open(fileobj=outer.extractfile(layer)) as inner:
                for member in inner:
                    if member.isfile():
                        yield layer, member.name, inner.extractfile(member).read()


def test_make_image_builds_an_image_that_passes_the_smoke_and_keeps_no_build_value(tmp_path):
    env = {**os.environ, "IMAGE": IMAGE}
    build = subprocess.run(["make", "image"], cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    assert not list((REPO / "deploy/docker/build-ca").glob("*.pem")), "the CA copy was left in the tree"
    size = int(subprocess.check_output(["docker", "image", "inspect", "-f", "{{.Size}}", IMAGE], text=True))
    print(f"{IMAGE}: {size / 1e9:.2f} GB")

    history = subprocess.check_output(["docker", "history", "--no-trunc", "--format", "{{.CreatedBy}}", IMAGE])
    secrets = _secret_values()
    for what, value in secrets.items():
        assert value not in history, f"{what} is in `docker history {IMAGE}`"
    for layer, name, data in _layers(IMAGE, tmp_path):
        for what, value in secrets.items():
            assert value not in data, f"{what} is in {name} of layer {layer}"
        assert not name.startswith("src/"), name  # no sources in the image

    smoke = subprocess.run(["make", "image-smoke"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    print(smoke.stdout)
    assert smoke.returncode == 0, smoke.stdout[-6000:] + smoke.stderr[-4000:]
    out = smoke.stdout
    assert "smoke: passed" in out
    assert "first start on an empty cache volume converted the model" in out
    assert "reusing the converted model" in out
    assert "router probe: 127.0.0.1:50051: NOT_SERVING" in out or "router probe: 127.0.0.1:50051: UNAVAILABLE" in out
    assert out.count("modules import") == 2
    assert out.count("gRPC answered:") == 2
