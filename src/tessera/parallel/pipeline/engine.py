"""PipelineEngine: one optimizer step's micro-batches through the pipeline schedule.

Same interface as :class:`tessera.train.engine.Engine` (``forward_backward`` returning a
:class:`StepResult`, ``evaluate``), so the Trainer changes only in which engine it builds.
Each rank walks its action list: a forward receives its inputs (posted one action ahead, so
the message is usually there), runs, and sends its outputs on; a backward receives the output
gradients, runs, and sends the input gradients back (comm.message_plan, over one channel per
directed pair of ranks). Only the last stage sees the loss; it is
broadcast over the pp group so every rank reports the same value.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tessera.loss_scale import GradLossScaler
from tessera.parallel.loss_weights import TokenWeights, check_weights, equal_weights
from tessera.parallel.pipeline.comm import StageLink, message_plan
from tessera.parallel.pipeline.partition import in_flight
from tessera.parallel.pipeline.schedules import Action, recompute_early, recomputes
from tessera.parallel.plan import Parallelized, pad_batch
from tessera.strategy import Strategy

@dataclass
class Timeline:
    """Events of the last step on this rank: (kind, stage, micro-batch, seconds since start).

    Kinds: F forward, R recomputation, W gradient arrived, B backward done.
    """

    events: list[tuple[str, int, int, float]] = field(default_factory=list)
    start: float = 0.0

    def add(self, kind: str, stage: int, mb: int) -> None:
        self.events.append((kind, stage, mb, time.perf_counter() - self.start))


class PipelineEngine:
    """Runs the schedule of ``plan.pipeline`` (see :func:`apply_pipeline`).

    Args:
        plan: what :func:`tessera.parallel.parallelize` returned for pp > 1.
        strategy: gives the schedule and precision.
        device: where batches go.
    """

    def __init__(self, plan: Parallelized, strategy: Strategy, device: torch.device) -> None:
        self.plan, self.pipe, self.device = plan, plan.pipeline, device
        self.schedule = strategy.schedule
        # fp16: one loss scale for all stages, which skip an overflowing step together. Chunk
        # memory replaces it with its own (the Trainer takes plan.grad_scaler).
        self.scaler = (GradLossScaler(plan.module.parameters(), device=device)
                       if strategy.precision == "fp16" else None)
        self.timeline = Timeline()
        self._warned_length = False  # _check_budget_length warns once a run

    def _check_budget_length(self, length: int) -> None:
        """Warn (once) when a step is longer than the stage memory budget was planned for:
        its activations grow with the length, past the estimate the ratios were chosen by."""
        planned = self.pipe.budget_len
        if planned is None or self._warned_length:
            return
        # Compared per rank: under sp a longer sample may pad to the same share of tokens.
        if self.pipe.local_len(length) <= self.pipe.local_len(planned):
            return
        self._warned_length = True
        warnings.warn(
            f"tessera: a training step of {length} tokens per sample is longer than the "
            f"{planned} that train.stage_memory_budget's recomputation ratios were chosen at; "
            "its stages may exceed the budget. Make the training set's first sample as long "
            "as the longest (pad it), or set a lower budget", stacklevel=2)

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]],
                         weights: TokenWeights | None = None):
        """Accumulate gradients of ``sum_i weights[i] * loss_i`` over ``micro_batches`` on
        this rank's stages (weights: as :meth:`tessera.train.engine.Engine.forward_backward`).
        """
        # The stages of a step run one captured shape: micro-batches a collator padded to
        # their own longest sample are padded on to the step's longest (plan.pad_batch).
        length = max(b["input_ids"].shape[1] for b in micro_batches)
        self._check_budget_length(length)
        batches = [self.pipe.prepare({k: v.to(self.device) for k, v in
                                      pad_batch(b, length).items()}, training=True)
                   for b in micro_batches]
        n = len(batches)
        weights = equal_weights(n, self.device) if weights is None else weights
        check_weights(weights, n)
        built = self.pipe.program.get(tuple(batches[0]["input_ids"].shape), training=True)
        actions = self.pipe.actions(n)
        self._refresh_rows()
        key = (n, tuple(batches[0]["input_ids"].shape))
        # dp buckets launch inside as gradients become final (chunk memory: none mid-pipeline)
        held = max(in_flight(s, self.pipe.n_stages, n, self.pipe.schedule)
                   for s in self.pipe.local_stages)
        with self.pipe.grad_sync.accumulate(key), self.pipe.program.step_casts(built, held):
            total = self._run(built, batches, actions, train=True, weights=weights)
        weights.settle()  # stages without the loss never read a weight
        if self.pipe.rows is not None:  # before the tied and dp rules read the home's grad
            self.pipe.rows.reduce_grads()
        self.pipe.grad_sync.sync()
        loss = self._broadcast_loss(total)
        # Imported here: tessera.train imports this module (the Trainer picks the engine).
        from tessera.train.engine import StepResult

        return StepResult(loss=loss, tokens=sum(b["input_ids"].numel() for b in micro_batches))

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean loss of one batch without gradients (the last stage's, on every rank)."""
        batch = self.pipe.prepare({k: v.to(self.device) for k, v in batch.items()},
                                  training=False)
        built = self.pipe.program.get(tuple(batch["input_ids"].shape), training=False)
        actions = [Action("F", s, 0) for s in self.pipe.local_stages]
        self._refresh_rows()
        return self._broadcast_loss(self._run(built, [batch], actions, train=False,
                                              weights=equal_weights(1, self.device)))

    def _refresh_rows(self) -> None:
        """Row holders take their rows from the weight's home (after its last update)."""
        if self.pipe.rows is not None:
            self.pipe.rows.refresh()

    # ---------------------------------------------------------------------------- private
    def _run(self, built, batches, actions: list[Action], train: bool,
             weights: TokenWeights) -> torch.Tensor:
        pipe, n = self.pipe, len(batches)
        link = StageLink(pipe.channels, pipe.stage_rank, self.device)
        last = pipe.n_stages - 1
        pending, states, total = {}, {}, torch.zeros((), device=self.device)
        self.timeline = Timeline(start=time.perf_counter())
        for action, step in zip(actions, message_plan(actions, pipe.n_stages)):
            for key in step.receives:
                kind, s, _ = key
                specs = built.in_specs[s] if kind == "F" else built.out_specs[s]
                pending[key] = link.recv(specs, key)
            s, m = action.stage, action.mb
            runner = built.runners[s]
            if action.kind == "F":
                inputs = pending.pop(("F", s, m)).wait() if s > 0 else []
                rc = train and recomputes(self.schedule, s, pipe.n_stages, m, n, pipe.ratios[s],
                                          pipe.kept(s))
                state = runner.forward(inputs, batches[m], recompute=rc, grad=train)
                self.timeline.add("F", s, m)
                if s == last:
                    loss = pipe.loss(state.outputs[0], batches[m])
                    state.loss = loss * weights[m]
                    if train and self.scaler is not None:
                        state.loss = self.scaler.scale(state.loss)
                    total += loss.detach() * weights[m]
                else:
                    link.send(state.outputs, step.send)
                if train:
                    states[(s, m)] = state
                continue
            state = states.pop((s, m))
            if state.needs_recompute and recompute_early(self.schedule):
                runner.recompute(state)  # shifted critical path: inside the wait below
                self.timeline.add("R", s, m)
            grads = pending.pop(("B", s, m)).wait() if s < last else None
            self.timeline.add("W", s, m)
            if state.needs_recompute:  # segment by segment, inside the backward
                self.timeline.add("R", s, m)
            input_grads = runner.backward(state, grads)
            self.timeline.add("B", s, m)
            if s > 0:
                link.send(input_grads, step.send)
        link.flush()
        return total

    def _broadcast_loss(self, loss: torch.Tensor) -> torch.Tensor:
        pipe = self.pipe
        loss = loss.detach().float().reshape(()).clone()
        src = dist.get_global_rank(pipe.pp_group, pipe.stage_rank[pipe.n_stages - 1])
        dist.broadcast(loss, src=src, group=pipe.pp_group)
        return loss
