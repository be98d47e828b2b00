"""Sub-commands of the ``npu-pool`` CLI (see npu_pool/cli.py)."""
