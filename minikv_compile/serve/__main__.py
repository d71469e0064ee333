"""``python -m minikv_compile.serve``."""
import logging
import os
import sys

from .cli import main

try:
    status = main()
except SystemExit as e:  # a flag's error (its message printed), or the SIGTERM that ended it
    status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    if isinstance(e.code, str):
        print(e.code, file=sys.stderr)
# Exit past the interpreter's teardown: everything is shut down by now, and there triton's
# nanobind module printed ~27 lines of "leaked" objects at every shutdown.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)
