import sys

from executor import lifeline

lifeline.hold()  # first: a router killed while this process starts is noticed too

from executor.affinity import bind_omp_threads  # noqa: E402

bind_omp_threads(sys.argv[1:])  # before torch loads OpenMP (executor/affinity.py)

from executor.args import early_exit  # noqa: E402

refused = early_exit(sys.argv[1:])  # what the arguments alone refuse: before torch loads
if refused is not None:
    sys.exit(refused)

from executor.main import main  # noqa: E402

sys.exit(main())
