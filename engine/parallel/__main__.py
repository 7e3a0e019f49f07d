"""`python -m lockgate.engine.parallel FD`: a tensor-parallel rank's process (worker.py), its
control socket inherited as file descriptor FD. Started by executor.py, never by hand."""

import sys

from lockgate.engine.parallel.worker import main

sys.exit(main(sys.argv))
