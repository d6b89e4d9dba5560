import sys

from executor.main import main

sys.exit(main())
