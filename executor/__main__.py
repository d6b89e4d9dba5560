import sys

from executor import lifeline

lifeline.hold()  # first: a router killed while this process starts is noticed too

from executor.affinity import bind_omp_threads  # noqa: E402

bind_omp_threads(sys.argv[1:])  # before torch loads OpenMP (executor/affinity.py)

from executor.args import checked  # noqa: E402

args_and_cache = checked(sys.argv[1:])  # what the arguments and the files they name refuse: before torch loads
if isinstance(args_and_cache, int):
    sys.exit(args_and_cache)

from executor.main import serve  # noqa: E402

sys.exit(serve(*args_and_cache))
