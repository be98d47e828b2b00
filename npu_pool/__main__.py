"""``python -m npu_pool``: the ``npu-pool`` command (npu_pool.cli)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
