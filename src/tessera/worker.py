"""Entry point of one training worker, started by torchrun (see tessera.launch).

``python -m tessera.worker RESOLVED_CONFIG.yaml``. Errors are recorded with torchrun's error
file, so the launcher reports the failing rank with its traceback.

Run as a script, a worker that trained to the end leaves without finalising the interpreter
(see :func:`_exit_without_finalizing`).
"""

from __future__ import annotations

import atexit
import os
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


def _exit_without_finalizing() -> None:
    """Run the exit handlers, flush, and end the process with status 0 at once.

    Why: gloo's worker threads outlive ``destroy_process_group`` (a core dump showed seven
    still running while Python finalised) and free each finished collective's tensors after
    ``wait()`` returns. When that free comes after Python has begun finalising, the thread
    asks for the GIL, CPython ends it with ``pthread_exit``, and the unwinding through a
    ``noexcept`` destructor calls ``std::terminate``: "terminate called without an active
    exception", SIGABRT, and a run that trained to the end reported as failed (8 of 88 runs
    of the two-worker CLI test under load; the core's stack:
    ``AsyncAllgatherWork::~AsyncAllgatherWork`` in ``ProcessGroupGloo::runLoop``,
    ``take_gil``, ``PyThread_exit_thread``). Checkpoints and reports are written durably
    before this point, so skipping finalisation loses nothing.
    """
    # The handlers Python would run: logging's shutdown (registered there), temporary
    # folders, compile workers.
    atexit._run_exitfuncs()  # noqa: SLF001 (CPython has no public way to run them early)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()  # raises on failure: torchrun's error file and a nonzero status as usual
    _exit_without_finalizing()
