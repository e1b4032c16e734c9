"""Entry point of one training worker, started by torchrun (see tessera.launch).

``python -m tessera.worker RESOLVED_CONFIG.yaml``. Errors are recorded with torchrun's error
file, so the launcher reports the failing rank with its traceback.
"""

from __future__ import annotations

import sys

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from tessera.config import load_config
from tessera.run import run_training


@record
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m tessera.worker RESOLVED_CONFIG.yaml")
    try:
        run_training(load_config(argv[0]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
