#!/bin/sh
# `make image-smoke`: the pod of deploy/base/deployment.yaml on a local Docker
# daemon. The executor and the router run as two containers of the image
# with what the manifests give them: a shared socket volume (/sock), the
# model cache (/cache), a tmpfs /tmp, a read-only root, uid 10001, no
# capabilities, no privilege escalation, the manifests' environment and
# command lines, and the ConfigMap's router.yaml. It checks, in order:
#  - an empty cache volume: the executor's first start converts the model;
#  - both containers healthy through the probes' own commands (the
#    executor's exec probe; the router's gRPC probe as `cbserve health`);
#  - every module of both processes imports in the image (what the build
#    dropped is never imported);
#  - the model answers over gRPC and over the OpenAI API;
#  - the executor killed with SIGKILL: the router reports NOT_SERVING or
#    UNAVAILABLE, then serves again once the executor container restarts
#    (`docker start`, as the kubelet restarts a container), and that start
#    reuses the converted model in the cache volume;
#  - SIGTERM to both: each exits 0.
#   deploy/docker/smoke.sh [IMAGE]        (default cbserve:0.1.0-cpu)
set -eu
image=${1:-cbserve:0.1.0-cpu}
name=cbserve-smoke-$$
work=$(mktemp -d)
cleanup() {
  docker rm -f "$name-router" "$name-executor" >/dev/null 2>&1 || true
  docker volume rm -f "$name-sock" "$name-cache" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

# The ConfigMap's router.yaml (kustomize generates it from this file), as the
# pod mounts it at /etc/cbserve.
cp deploy/base/router.yaml "$work/router.yaml"
chmod 0755 "$work" && chmod 0644 "$work/router.yaml"
docker volume create "$name-sock" >/dev/null
docker volume create "$name-cache" >/dev/null
pod="--read-only --user 10001:10001 --cap-drop ALL --security-opt no-new-privileges
  --tmpfs /tmp:rw,mode=1777 -v $name-sock:/sock -v $work:/etc/cbserve:ro
  -e HOME=/tmp -e TMPDIR=/tmp -e HF_HOME=/tmp/hf -e XDG_CACHE_HOME=/tmp/.cache
  -e MPLCONFIGDIR=/tmp/matplotlib -e HF_HUB_OFFLINE=1 -e TRANSFORMERS_OFFLINE=1
  -e PYTHONUNBUFFERED=1 -e PYTHONDONTWRITEBYTECODE=1 -e CBSERVE_CACHE_DIR=/cache"

# shellcheck disable=SC2086
docker run -d --name "$name-executor" $pod -v "$name-cache:/cache" "$image" \
  executor --model smollm2 --dtype auto --device cpu --listen unix:///sock/executor.sock \
  --config /etc/cbserve/router.yaml >/dev/null
wait_healthy() {  # container, address, seconds
  i=0
  until docker exec "$1" cbserve health --address "$2" --timeout 4 >/dev/null 2>&1; do
    i=$((i + 5))
    if [ "$i" -gt "$3" ] || [ "$(docker inspect -f '{{.State.Running}}' "$1")" != true ]; then
      echo "smoke: $1 not healthy" >&2
      docker logs --tail 50 "$1" >&2
      exit 1
    fi
    sleep 5
  done
  echo "smoke: $1 healthy after ~${i}s"
}
# The probes of deploy/base/deployment.yaml, as the kubelet runs them
# (tests/deploy/test_images.py checks these against the manifest).
executor_probe="cbserve health --address unix:///sock/executor.sock --timeout 4"
router_probe="cbserve health --address 127.0.0.1:50051 --timeout 3"
probe() {  # container, probe command; prints the probe's output
  # shellcheck disable=SC2086
  docker exec "$1" $2 2>&1
}
wait_healthy "$name-executor" unix:///sock/executor.sock 600
conversions() { docker logs "$name-executor" 2>&1 | grep "converted GGUF checkpoint" | grep -vc reusing || true; }
reuses() { docker logs "$name-executor" 2>&1 | grep -c "reusing converted GGUF checkpoint" || true; }
[ "$(conversions)" = 1 ] || { echo "smoke: the first start on an empty cache did not convert the model" >&2; exit 1; }
echo "smoke: first start on an empty cache volume converted the model"
# shellcheck disable=SC2086
docker run -d --name "$name-router" $pod -v "$name-cache:/cache:ro" "$image" \
  router --model smollm2 --config /etc/cbserve/router.yaml --executor-address unix:///sock/executor.sock \
  --port 50051 --metrics-port 9090 --http-port 8000 >/dev/null
wait_healthy "$name-router" 127.0.0.1:50051 300
echo "smoke: executor liveness probe: $(probe "$name-executor" "$executor_probe")"
echo "smoke: router readiness/liveness probe: $(probe "$name-router" "$router_probe")"

# Every module of both processes, imported inside the image as the uid the
# pod runs (the executor's container and the router's alike).
imports='
import importlib, pkgutil
import common, executor, native, router
import cbserve.v1
names = []
for pkg in (common, executor, native, router, cbserve.v1):
    names.append(pkg.__name__)
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".") if not m.name.endswith("__main__")]
for n in names:
    importlib.import_module(n)
print(len(names), "modules import")'
for c in executor router; do
  echo "smoke: $c container: $(docker exec "$name-$c" python -c "$imports")"
done

ask() {
  answer=$(docker exec "$name-router" cbserve generate --address 127.0.0.1:50051 --chat --max-new-tokens 24 \
    "What is the capital of France? Answer in one word.")
  echo "smoke: gRPC answered: $answer"
  echo "$answer" | grep -qi paris
}
ask
http=$(docker exec "$name-router" python -c '
import json, urllib.request
body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]}
req = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]["content"])')
echo "smoke: OpenAI API answered: $http"
echo "$http" | grep -qi paris

# The executor dies without a word (OOM kill, node trouble): the router must
# say it cannot serve, so readiness takes the pod out of rotation.
docker kill -s KILL "$name-executor" >/dev/null
i=0
while out=$(probe "$name-router" "$router_probe"); do
  i=$((i + 1))
  [ "$i" -lt 60 ] || { echo "smoke: router still healthy 60 s after the executor died: $out" >&2; exit 1; }
  sleep 1
done
echo "smoke: executor killed (SIGKILL); router probe: $out"
echo "$out" | grep -Eq "NOT_SERVING|UNAVAILABLE"
docker start "$name-executor" >/dev/null
wait_healthy "$name-executor" unix:///sock/executor.sock 600
[ "$(conversions)" = 1 ] && [ "$(reuses)" = 1 ] \
  || { echo "smoke: the restart did not reuse the converted model ($(conversions) conversions)" >&2; exit 1; }
echo "smoke: executor restarted, reusing the converted model in the cache volume"
wait_healthy "$name-router" 127.0.0.1:50051 120
ask

docker stop -t 60 "$name-router" >/dev/null
docker stop -t 60 "$name-executor" >/dev/null
for c in router executor; do
  rc=$(docker inspect -f '{{.State.ExitCode}}' "$name-$c")
  echo "smoke: $c exited $rc after SIGTERM"
  [ "$rc" = 0 ]
done
echo "smoke: passed"
