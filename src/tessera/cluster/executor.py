"""The executor interface: what runs the jobs a policy schedules.

The simulator advances jobs with the fitted models. Real mode runs real tessera training jobs
through :class:`tessera.cluster.real_executor.RealExecutor`, which implements this protocol:
each round the policy's :data:`~tessera.cluster.policies.Schedule` is handed to
:meth:`Executor.apply`, and progress comes back through :meth:`Executor.poll`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tessera.cluster.policies.base import Schedule


@dataclass(frozen=True)
class JobProgress:
    """What an executor reports about one job.

    Attributes:
        job: job id.
        samples: samples processed so far.
        progress: base-batch-equivalent samples towards the target (goodput integral).
        throughput: recent samples per second at the current allocation.
        finished: the job reached its target.
        failed: the job crashed and will not be retried; ``error`` says why.
        step: optimizer steps done (batches may differ between launches).
    """

    job: int
    samples: float
    progress: float
    throughput: float
    finished: bool = False
    failed: bool = False
    error: str = ""
    step: int = 0


class Executor(Protocol):
    """Runs jobs on GPUs as schedules dictate.

    ``apply`` must stop every job that lost GPUs (checkpointing it), restart every job whose
    GPUs changed from its latest checkpoint with the new device count, and start new jobs;
    jobs whose GPUs are unchanged keep running. A schedule is complete: a running job it does
    not mention is preempted.
    """

    def apply(self, schedule: Schedule, time: float) -> None:
        """Make the running jobs match ``schedule``."""

    def poll(self, time: float) -> list[JobProgress]:
        """Progress of every job that holds GPUs or changed state since the last poll."""
