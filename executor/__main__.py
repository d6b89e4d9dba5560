import sys

from executor.affinity import bind_omp_threads

bind_omp_threads(sys.argv[1:])  # before torch loads OpenMP (executor/affinity.py)

from executor.main import main  # noqa: E402

sys.exit(main())
