#!/bin/sh
# `make image-smoke`: the pod of deploy/base/deployment.yaml on a local Docker
# daemon. The executor and the router run as two containers of the image
# with what the manifests give them: a shared socket volume (/sock), the
# model cache (/cache), a tmpfs /tmp, a read-only root, uid 10001, no
# capabilities, no privilege escalation, the manifests' environment and
# command lines, and the ConfigMap's router.yaml. It waits for both to be
# healthy, asks the model a question over gRPC and over the OpenAI API,
# sends SIGTERM to both and checks that each exits 0.
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
wait_healthy "$name-executor" unix:///sock/executor.sock 600
# shellcheck disable=SC2086
docker run -d --name "$name-router" $pod -v "$name-cache:/cache:ro" "$image" \
  router --model smollm2 --config /etc/cbserve/router.yaml --executor-address unix:///sock/executor.sock \
  --port 50051 --metrics-port 9090 --http-port 8000 >/dev/null
wait_healthy "$name-router" 127.0.0.1:50051 300

answer=$(docker exec "$name-router" cbserve generate --address 127.0.0.1:50051 --chat --max-new-tokens 24 \
  "What is the capital of France? Answer in one word.")
echo "smoke: gRPC answered: $answer"
echo "$answer" | grep -qi paris
http=$(docker exec "$name-router" python -c '
import json, urllib.request
body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]}
req = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]["content"])')
echo "smoke: OpenAI API answered: $http"
echo "$http" | grep -qi paris

docker stop -t 60 "$name-router" >/dev/null
docker stop -t 60 "$name-executor" >/dev/null
for c in router executor; do
  rc=$(docker inspect -f '{{.State.ExitCode}}' "$name-$c")
  echo "smoke: $c exited $rc after SIGTERM"
  [ "$rc" = 0 ]
done
echo "smoke: passed"
