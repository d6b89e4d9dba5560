"""The Dockerfiles agree with the manifests and with the code, without Docker:
the ports, the user, the writable paths, the environment and the command
lines of deploy/base/deployment.yaml are what the images provide, and the
build's own rules hold (the checks import the installed packages, the
mirror / proxy build arguments exist, no frontend image is pulled)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from executor.args import parse_args as executor_args
from router.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "cuda": DOCKER / "Dockerfile.cuda"}
BUILD_ARGS = ("TORCH_INDEX_URL", "INDEX_URL", "EXTRA_INDEX_URL")
# What finish-venv.sh drops from the image: no module of the two processes may
# import these (the smoke imports every module inside the built image too).
DROPPED = ("pip", "setuptools", "pkg_resources", "wheel", "pybind11", "ninja", "grpc_tools", "matplotlib")
PROCESS_PACKAGES = ("router", "executor", "common", "native", "protos")


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _runtime(path: Path) -> list[tuple[str, str]]:
    """The instructions of the last stage (the image that runs)."""
    ins = _instructions(path)
    last = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[last:]


def _env(stage) -> dict[str, str]:
    env = {}
    for w, rest in stage:
        if w == "ENV":
            for part in shlex.split(rest):
                key, _, value = part.partition("=")
                env[key] = value
    return env


@pytest.fixture(scope="module")
def pod() -> dict:
    docs = list(yaml.safe_load_all((REPO / "deploy" / "base" / "deployment.yaml").read_text()))
    return next(d for d in docs if d and d.get("kind") == "Deployment")["spec"]["template"]["spec"]


def _containers(pod) -> dict[str, dict]:
    return {c["name"]: c for c in pod["containers"] + pod.get("initContainers", [])}


def _expand(args: list[str], env: list[dict]) -> list[str]:
    values = {e["name"]: e.get("value", "") for e in env}
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in args]


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_no_frontend_image_is_pulled_and_the_mirror_arguments_exist(kind):
    text = DOCKERFILES[kind].read_text()
    assert not any(line.startswith("# syntax=") for line in text.splitlines())
    declared = {rest.split("=")[0] for w, rest in _instructions(DOCKERFILES[kind]) if w == "ARG"}
    assert set(BUILD_ARGS) <= declared
    assert '--index-url "$TORCH_INDEX_URL"' in text and text.count(". cbserve-pip-env") >= 3


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_the_torch_index_serves_torch_alone_and_only_the_build_stage_sees_the_mirror(kind):
    text = re.sub(r"\\\n", " ", DOCKERFILES[kind].read_text())
    torch_line = next(line for line in text.splitlines() if '--index-url "$TORCH_INDEX_URL"' in line)
    # torch's own dependencies come from INDEX_URL, not from the torch index.
    assert "--no-deps" in torch_line and "-u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL" in torch_line
    assert "COPY deploy/docker/build-ca/ " in text
    runtime = _runtime(DOCKERFILES[kind])
    for w, rest in runtime:
        assert w != "ARG" or rest.split("=")[0] not in BUILD_ARGS, rest
        assert "build-ca" not in rest and "cbserve-pip-env" not in rest, rest
    copies = [rest for w, rest in runtime if w == "COPY"]
    assert copies == ["--from=build /opt/venv /opt/venv"]


def test_the_ca_file_reaches_the_build_context_and_never_git():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not _ignored("deploy/docker/build-ca/extra-ca.pem", patterns)
    assert "deploy/docker/build-ca/*.pem" in (REPO / ".gitignore").read_text().split()
    make = (REPO / "Makefile").read_text()
    assert 'cp "$(IMAGE_CA_FILE)" "$$ca"' in make and "trap 'rm -f \"$$ca\"'" in make


def _imported_top_levels(path: Path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_of_the_two_processes_imports_what_the_image_drops():
    script = (DOCKER / "finish-venv.sh").read_text()
    for tool in ("pybind11", "ninja", "wheel", "setuptools", "pip"):
        assert re.search(rf"pip uninstall[^\n]* {tool}\b", script), tool
    for path in ("torch/include", "torch/share", "torch/test"):
        assert path in script, path
    # torch.utils.checkpoint imports torch.testing._internal: it stays.
    assert not [line for line in script.splitlines() if line.startswith("rm ") and "testing" in line]
    # The last step imports every module of both processes, after the removals.
    assert script.rindex("importlib.import_module") > script.rindex("rm -rf")
    seen = {}
    for pkg in PROCESS_PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            for name in _imported_top_levels(path) & set(DROPPED):
                seen.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert not seen, seen
    # ... nor is any of them a runtime dependency of the package.
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ \[]", d)[0].replace("-", "_").lower() for d in deps}
    assert not names & {"pybind11", "grpcio_tools", "matplotlib", "setuptools", "ninja"}


def test_the_smoke_runs_the_probes_of_the_manifest(pod):
    smoke = (DOCKER / "smoke.sh").read_text()
    executor = _containers(pod)["executor"]
    for probe in ("startupProbe", "livenessProbe"):
        assert f'executor_probe="{" ".join(executor[probe]["exec"]["command"])}"' in smoke
    router = _containers(pod)["router"]
    port = {router[p]["grpc"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert port == {50051}
    assert 'router_probe="cbserve health --address 127.0.0.1:50051 ' in smoke
    assert "docker kill -s KILL" in smoke and 'docker start "$name-executor"' in smoke


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_the_build_checks_the_installed_packages_from_outside_the_source_tree(kind):
    text = DOCKERFILES[kind].read_text()
    assert "sh deploy/docker/finish-venv.sh /opt/venv" in text and "import native" not in text
    script = (DOCKER / "finish-venv.sh").read_text()
    cd = script.index("\ncd /\n")
    assert cd < script.index("import common, executor, router, native")  # not /src's native/ (no _C there)
    assert "strip --strip-debug" in script and "native/csrc" in script
    assert re.search(r"compileall -q -x '[^']*1\[2-9\][^']*'", script)  # py312_intrinsics.py and later


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_ports_user_paths_and_environment_match_the_pod(kind, pod):
    stage = _runtime(DOCKERFILES[kind])
    exposed = {int(p) for w, rest in stage if w == "EXPOSE" for p in rest.split()}
    router = _containers(pod)["router"]
    assert exposed == {p["containerPort"] for p in router["ports"]}
    user = next(rest for w, rest in stage if w == "USER")
    for c in _containers(pod).values():
        sc = c["securityContext"]
        assert user == f"{sc['runAsUser']}:{sc['runAsGroup']}"
        assert sc["readOnlyRootFilesystem"] and sc["capabilities"]["drop"] == ["ALL"]
    image_env = _env(stage)
    executor = _containers(pod)["executor"]
    for e in executor["env"]:
        if "value" in e and e["name"] in image_env:
            assert image_env[e["name"]] == e["value"], e["name"]
    mounts = {m["mountPath"] for c in _containers(pod).values() for m in c.get("volumeMounts", [])}
    made = next(rest for w, rest in stage if w == "RUN" and "mkdir" in rest)
    for path in ("/cache", "/sock"):
        assert path in made and path in mounts
    assert image_env["CBSERVE_CACHE_DIR"] == "/cache" and image_env["HOME"] == "/tmp" and "/tmp" in mounts


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_the_command_lines_parse_with_the_cli(kind, pod):
    stage = _runtime(DOCKERFILES[kind])
    entry = json.loads(next(rest for w, rest in stage if w == "ENTRYPOINT"))
    cmd = json.loads(next(rest for w, rest in stage if w == "CMD"))
    assert entry == ["cbserve"]
    build_parser().parse_args(cmd)  # the single-container default
    for name, c in _containers(pod).items():
        assert c["command"] == entry
        args = _expand(c["args"], c.get("env", []))
        if name == "executor":
            assert args[0] == "executor"
            executor_args(args[1:])
        else:
            build_parser().parse_args(args)


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches decides; `!` re-includes."""
    import fnmatch

    ignored = False
    for p in patterns:
        neg = p.startswith("!")
        p = p.lstrip("!").strip("/")
        if path == p or path.startswith(p + "/") or fnmatch.fnmatch(path, p):
            ignored = not neg
    return ignored


def test_what_the_builds_use_is_in_the_build_context():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for used in ("deploy/docker/pip-env.sh", "deploy/docker/finish-venv.sh", "pyproject.toml", "native/csrc/ops.cpp"):
        assert not _ignored(used, patterns), used
    for left_out in (".venv/bin/python", "tests/conftest.py", "native/_C.so"):
        assert _ignored(left_out, patterns), left_out
