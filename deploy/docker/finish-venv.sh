#!/bin/sh
# The last step of an image's build stage, after `pip install .`: check the
# installed packages (from outside the source tree, so that Python cannot
# import /src's native/ without its compiled extension), drop what the
# runtime stage does not need, strip the native extensions' debug info, and
# byte-compile what this Python can compile (the root filesystem is
# read-only at run time: no .pyc is written there).
set -eu
venv=${1:-/opt/venv}
cd /
python -c "import common, executor, router, native, native._C, native._fused; print('installed packages import')"
find "$venv" -type d -path '*/site-packages/native/csrc' -prune -exec rm -rf {} +
find "$venv" -type f -name '*.so' -path '*/site-packages/native/*' -exec strip --strip-debug {} +
# torch ships modules for newer Pythons (torch/testing/_internal/py312_intrinsics.py).
python -m compileall -q -x 'py3(1[2-9]|[2-9][0-9])_' "$venv"
