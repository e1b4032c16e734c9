"""Pipeline schedules as per-rank action lists, and where recomputation happens.

An action is a forward ``F`` or a backward ``B`` of one micro-batch on one virtual stage.
Communication follows from the actions (a forward receives from the previous stage and sends
to the next; a backward the other way), so a schedule is only the order of compute on each
rank. Timelines for pp=3 stages, 4 micro-batches (digits are micro-batches, b backwards):

    gpipe        1f1b                   interleaved (2 chunks per rank: stages r and r+3)
    0123....0123 012..0.1.2.3.          each rank alternates chunks in groups of pp
    .0123...0123 .01..0.1.2.3.          micro-batches; the bubble shrinks by the number
    ..0123..0123 ..0 0 1 1 2 2 3 3      of chunks at the price of more messages

Shifted critical path ("scp", Merak): 1F1B with recomputation, where the last stage skips
recomputation (its backward follows its forward at once), the last S-1-s micro-batches of
stage s keep their activations (the pipeline drains after them, so recomputing them would sit
on the critical path), and recomputation runs *before* waiting for the incoming gradient,
inside the time the stage would otherwise idle; and stage S-2 runs its third forward before
its first backward, which would otherwise wait for the last stage. Skipping and keeping cost
memory: the partitioner allows them only within the peak 1F1B with the same recomputation
reaches (Partition.keep), and ahead of the gradient only the last recomputed segment runs,
the one 1F1B's backward rematerialises first (stage.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.strategy import chunks_for  # noqa: F401  (the pipeline's name for it)
from tessera.strategy import pipeline_size_problem

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "scp")


class ScheduleError(ValueError):
    """The schedule cannot run with these sizes; the message names the rule."""


@dataclass(frozen=True)
class Action:
    """``kind`` "F" or "B" of micro-batch ``mb`` on virtual stage ``stage``."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def check_sizes(schedule: str, pp: int, micro_batches: int) -> None:
    """Refuse sizes a schedule cannot run, naming the rule."""
    if schedule not in SCHEDULE_NAMES:
        raise ScheduleError(f"schedule must be one of {', '.join(SCHEDULE_NAMES)}, got "
                            f"{schedule!r}")
    problem = pipeline_size_problem(schedule, pp, micro_batches)
    if problem:
        raise ScheduleError(problem)


def build(schedule: str, pp: int, micro_batches: int) -> list[list[Action]]:
    """Each rank's actions for one step, in execution order."""
    check_sizes(schedule, pp, micro_batches)
    if schedule == "gpipe":
        return [_gpipe(r, micro_batches) for r in range(pp)]
    if schedule == "interleaved":
        return [interleaved_actions(r, pp, micro_batches, chunks_for(schedule))
                for r in range(pp)]
    actions = [_one_f_one_b(r, pp, micro_batches) for r in range(pp)]
    if schedule == "scp" and micro_batches >= 3:
        actions[pp - 2] = _swap_first_backward(actions[pp - 2])
    return actions


def _swap_first_backward(actions: list[Action]) -> list[Action]:
    """Stage S-2 runs its third forward before its first backward (Merak's scp): the
    gradient of micro-batch 0 needs the last stage's F1 and B0 first, so F2 fills that wait."""
    out, stage = list(actions), actions[0].stage
    f2, b0 = out.index(Action("F", stage, 2)), out.index(Action("B", stage, 0))
    out[f2], out[b0] = out[b0], out[f2]
    return out


def _gpipe(rank: int, m: int) -> list[Action]:
    return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    warmup = min(pp - 1 - rank, m)
    actions = [Action("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", rank, warmup + i), Action("B", rank, i)]
    actions += [Action("B", rank, i) for i in range(m - warmup, m)]
    return actions


def interleaved_actions(rank: int, pp: int, m: int, chunks: int) -> list[Action]:
    """Megatron's interleaved 1F1B: forwards walk the chunks in groups of pp micro-batches."""
    total = m * chunks
    warmup = min((pp - rank - 1) * 2 + (chunks - 1) * pp, total)

    def mb_of(i: int) -> int:
        return (i // (pp * chunks)) * pp + i % pp

    def fwd(i: int) -> Action:
        return Action("F", ((i // pp) % chunks) * pp + rank, mb_of(i))

    def bwd(i: int) -> Action:
        return Action("B", (chunks - 1 - (i // pp) % chunks) * pp + rank, mb_of(i))

    actions = [fwd(i) for i in range(warmup)]
    for i in range(total - warmup):
        actions += [fwd(warmup + i), bwd(i)]
    actions += [bwd(i) for i in range(total - warmup, total)]
    return actions


def recomputes(schedule: str, stage: int, n_stages: int, mb: int, micro_batches: int,
               ratio: float, keep: int | None = None) -> bool:
    """Whether micro-batch ``mb`` on virtual stage ``stage`` drops and recomputes activations.

    Under scp the last ``keep`` micro-batches of a stage keep theirs; None keeps the most
    the schedule allows, :func:`max_kept` (the partitioner lowers it to fit the memory of
    1F1B, Partition.keep).
    """
    if ratio <= 0:
        return False
    if schedule != "scp":
        return True
    kept = max_kept(stage, n_stages, micro_batches) if keep is None else keep
    return mb < micro_batches - kept


def max_kept(stage: int, n_stages: int, micro_batches: int) -> int:
    """Micro-batches scp may keep whole on ``stage``: every one on the last stage (its
    backward follows its forward at once), else the last S-1-s, which only the drain follows."""
    if stage == n_stages - 1:
        return micro_batches
    return min(micro_batches, n_stages - 1 - stage)


def recompute_early(schedule: str) -> bool:
    """Whether recomputation runs before waiting for the gradient (scp) or after it."""
    return schedule == "scp"
