#!/usr/bin/env bash
# The GPU checks of docs/native.md in one go, on a machine with an NVIDIA GPU
# and a CUDA build of torch but no cbserve venv: builds native._C with CUDA
# in place, runs the GPU tests, then times the decode step
# (python -m bench.gpu_step). Wheels in .whl/ (what that machine's Python
# lacks) are installed to a private target first. Logs and results go to
# $OUT (default: build/gpu-check).
#   bench/gpu_check.sh [build|test|bench|server|serve]...   (default: all five)
# serve takes CAPS (default "32 128 512") and SYSTEMS (default
# "cbserve-fcfs hf-static") from the environment.
set -uo pipefail
OUT=${OUT:-build/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cbserve-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/cbserve-site
fi
export PYTHONPATH=$PWD:$PWD/protos${PYTHONPATH:+:$PYTHONPATH}
steps=${*:-build test bench server serve}
rc=0
for step in $steps; do
  case $step in
    build)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
      t0=$(date +%s)
      # setup.py refuses a library that links libstdc++ statically (the CUDA
      # image's compiler, its CXX, does): the link names the shared one itself.
      export CBSERVE_LINK_ARGS=${CBSERVE_LINK_ARGS:-"-nodefaultlibs -l:libstdc++.so.6 -lm -lc -lgcc_s -lgcc"}
      echo "CXX=${CXX:-c++} CBSERVE_LINK_ARGS=$CBSERVE_LINK_ARGS"
      CBSERVE_CUDA_ARCHS=${CBSERVE_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-16} \
        $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
      echo "build: $(($(date +%s) - t0)) s"
      $PY -c "import native; assert native.has_cuda(), 'native._C built without CUDA'" || exit 1
      ;;
    test)
      # The nvcc compile test is what `build` just did for this GPU's arch.
      $PY -m pytest -q -p no:cacheprovider tests/executor/test_gpu_forward.py tests/executor/test_gpu_sampling.py \
        tests/native/test_native_cuda.py tests/executor/test_device.py \
        --deselect tests/native/test_native_cuda.py::test_cuda_sources_compile 2>&1 | tee "$OUT/test.log" | tail -25 || rc=1
      ;;
    bench)
      $PY -m bench.gpu_step --out "$OUT/gpu_step.json" 2>&1 | tee "$OUT/bench.log" | tail -20 || rc=1
      ;;
    server)
      $PY -m pytest -q -p no:cacheprovider tests/integration/test_cuda_server.py 2>&1 | tee "$OUT/server.log" \
        | tail -15 || rc=1
      ;;
    serve)
      # The classic workload through the whole server on the GPU, and HF
      # generate() static batches on the same GPU, same model shapes.
      dir=/tmp/cbserve-smollm2-shaped
      spec=$($PY -m bench.gpu_step --export "$dir" 2>/dev/null | tail -1) || exit 1
      mkdir -p "$OUT/serve"
      for cap in ${CAPS:-32 128 512}; do
        for sys in ${SYSTEMS:-cbserve-fcfs hf-static}; do
          $PY -m bench run --system "$sys" --device cuda --model "$spec" --model-dir "$dir" -n 64 --prompt-len 128 \
            --output-dist exponential --cap "$cap" --out "$OUT/serve/$sys-$cap.json" --no-progress 2>&1 \
            | grep "tok/s" | tee -a "$OUT/serve.log" || rc=1
        done
      done
      $PY -c "import glob, json, sys; json.dump({p: json.load(open(p)) for p in sorted(glob.glob(sys.argv[1] + '/*.json'))}, open(sys.argv[2], 'w'))" \
        "$OUT/serve" "$OUT/serve.json" && rm -rf "$OUT/serve"
      ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
exit $rc
