"""Builds the native/ kernels as `native._C` (metadata lives in pyproject.toml).

torch.utils.cpp_extension is used (pybind11 underneath) because the ops take
and return torch tensors: it supplies the matching torch/ATen include paths,
libraries, ABI flags and at::parallel_for, and builds the CUDA twins with the
same machinery when a CUDA toolkit and a CUDA build of torch are present.
Nothing is downloaded; the build uses ninja when it is installed.
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError as exc:  # pragma: no cover - torch is installed first by `make install`
    raise SystemExit(
        "building cbserve's native/ kernels needs torch: install torch==2.13.0 first and build "
        "with `pip install --no-build-isolation -e .`"
    ) from exc

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("native", "csrc")
# CBSERVE_LINK_ARGS: extra linker arguments, e.g. for a compiler that links
# libstdc++ statically (see Build below): "-nodefaultlibs -l:libstdc++.so.6
# -lm -lc -lgcc_s -lgcc" links the shared one whatever the driver adds.
LINK_FLAGS = ["-fopenmp", *shlex.split(os.environ.get("CBSERVE_LINK_ARGS", ""))]


def _want_cuda() -> bool:
    if os.environ.get("CBSERVE_NATIVE_NO_CUDA"):
        return False
    if not torch.version.cuda:
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return bool(CUDA_HOME) or shutil.which("nvcc") is not None


def _ext_modules():
    cpp = sorted(glob.glob(os.path.join(CSRC, "*.cpp")))
    # -fopenmp: at::parallel_for is an OpenMP region compiled into *this*
    # library; without the flag it silently runs on one thread. The extension
    # then shares torch's own libgomp (same soname, already loaded).
    # -g0: no debug info (Python's own CFLAGS add -g), a third of each file's
    # compile time and most of the libraries' size.
    cxx_flags = ["-O3", "-g0", "-std=c++17", "-fno-math-errno", "-Wall", "-Wno-unknown-pragmas", "-fopenmp"]
    # No -march=native: the AVX2/AVX-512 code is compiled with function-level
    # target attributes and chosen at run time (see native/csrc/ops.cpp).
    if _want_cuda():
        cu = sorted(glob.glob(os.path.join(CSRC, "*.cu")))
        # CBSERVE_CUDA_ARCHS ("80;90" by default) unless only torch's own
        # TORCH_CUDA_ARCH_LIST is set (deploy/docker/Dockerfile.cuda): explicit
        # -gencode flags would make torch ignore it.
        archs = os.environ.get("CBSERVE_CUDA_ARCHS", "" if os.environ.get("TORCH_CUDA_ARCH_LIST") else "80;90")
        gencode = []
        for a in filter(None, archs.split(";")):
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        return [
            CUDAExtension(
                "native._C",
                cpp + cu,
                define_macros=[("CBSERVE_WITH_CUDA", "1")],
                extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", *gencode]},
                extra_link_args=LINK_FLAGS,
            ),
            _fused(cxx_flags),
        ]
    return [
        CppExtension("native._C", cpp, extra_compile_args={"cxx": cxx_flags}, extra_link_args=LINK_FLAGS),
        _fused(cxx_flags),
    ]


def _fused(cxx_flags):
    """native._fused, the CPU executor's layer kernels (native/csrc/linear/):
    the linear layers (amx_linear, amx_q4_rows_linear, avx512_linear and their
    SiLU-and-mul / argmax epilogues) and the element-wise ops around them
    (RMSNorm, residual-add + RMSNorm, SiLU-and-mul, rotary + cache write,
    greedy argmax)."""
    src = sorted(glob.glob(os.path.join(CSRC, "linear", "*.cpp")))
    return CppExtension("native._fused", src, extra_compile_args={"cxx": cxx_flags}, extra_link_args=LINK_FLAGS)


def shares_libstdcxx(path: str) -> bool | None:
    """Whether the built library loads the shared libstdc++ (None: no readelf)."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return None
    out = subprocess.run([readelf, "-d", path], capture_output=True, text=True, check=True).stdout
    return "libstdc++.so" in out


class Build(BuildExtension):
    """BuildExtension that refuses a library with its own copy of libstdc++.

    torch loads the shared libstdc++; an extension linked against the static
    one (a compiler wrapper that adds -static-libstdc++ does it: seen on a
    CUDA image whose CXX was such a wrapper) builds and passes its numeric
    tests, then crashes the process inside the first error message that
    formats a number (std::ostream from one copy, locale facets from the other).
    """

    def build_extension(self, ext):
        super().build_extension(ext)
        path = self.get_ext_fullpath(ext.name)
        if shares_libstdcxx(path) is False:
            os.remove(path)
            raise SystemExit(
                f"{ext.name}: the C++ compiler ({os.environ.get('CXX', 'c++')}) linked libstdc++ statically, "
                "which crashes next to torch's shared copy; build with one that links it dynamically, "
                "e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc"
            )


# BuildExtension compiles with ninja (parallel, incremental) when the `ninja`
# package is installed, as `make install` does; it falls back to plain
# setuptools otherwise.
setup(ext_modules=_ext_modules(), cmdclass={"build_ext": Build})
