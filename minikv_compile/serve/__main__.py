"""``python -m minikv_compile.serve``."""
import sys

from .cli import main

sys.exit(main())
