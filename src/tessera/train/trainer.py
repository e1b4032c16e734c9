"""The Trainer: data order, optimizer, LR schedule, clipping, metrics, checkpoints, progress.

It runs one worker's share of a job. Launch N of them with ``tessera train --nproc N`` (or
torchrun); with no launcher it runs as a world of one.

    trainer = Trainer(model, args, train_dataset, eval_dataset, strategy=Strategy.parse(...))
    result = trainer.train()
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from tessera.config import TrainingArguments
from tessera.data.dataset import GlobalBatchOrder, collate
from tessera.distributed import WorkerContext, init_distributed
from tessera.mesh import Mesh
from tessera.models.hf import flops_per_token as generic_flops_per_token
from tessera.parallel import parallelize
from tessera.strategy import Strategy
from tessera.train import checkpoint as ckpt
from tessera.train.engine import Engine
from tessera.train.metrics import MetricsWriter, Throughput, peak_flops
from tessera.train.optim import build_optimizer, build_scheduler
from tessera.train.progress import ProgressReporter


# Created by a scheduler (or a person) to make a run checkpoint and exit at its next logging
# step; `--resume` continues it, possibly on a different number of workers.
PAUSE_FILE = "PAUSE"


class NonFiniteError(FloatingPointError):
    """NaN or inf in the gradients; names the step and the first offending parameter."""


@dataclass
class TrainResult:
    """What a training run produced on this rank."""

    step: int  # steps completed in total (including those before a resume)
    losses: list[float] = field(default_factory=list)  # per-step mean loss over dp ranks
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    checkpoint: str | None = None  # the last checkpoint written, if any
    paused: bool = False  # stopped early because a pause was requested


class Trainer:
    """Trains a causal language model under a Strategy.

    Args:
        model: a single-device model returning logits (or an output with ``.logits``).
        args: optimisation, logging and checkpointing settings.
        train_dataset: map-style dataset of ``{"input_ids", "labels"}`` samples of equal length.
        eval_dataset: optional dataset of the same kind, for evaluation.
        strategy: the parallel layout; its world size must equal the number of workers.
        run_info: extra JSON-ready facts stored in checkpoints (e.g. the run config).
        callbacks: functions called with each metrics record (rank 0 only).
    """

    def __init__(self, model: nn.Module, args: TrainingArguments, train_dataset: Dataset,
                 eval_dataset: Dataset | None = None, strategy: Strategy | None = None,
                 run_info: dict[str, Any] | None = None,
                 callbacks: Sequence[Callable[[dict[str, Any]], None]] = ()) -> None:
        self.args, self.strategy = args, strategy or Strategy()
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.run_info, self.callbacks = run_info or {}, list(callbacks)
        self.strategy.require_available()
        self.ctx: WorkerContext = init_distributed(args.device)
        self.mesh = Mesh(self.strategy, self.ctx.device.type)
        self.model = model.to(self.ctx.device)
        self.model_meta = describe_model(self.model)
        self.plan = parallelize(self.model, self.strategy, self.mesh)
        self.wrapped = self.plan.module
        self.optimizer = build_optimizer(
            self.model, args.learning_rate, args.weight_decay, (args.adam_beta1, args.adam_beta2),
            args.adam_epsilon, self.ctx.device)
        self.scheduler = build_scheduler(self.optimizer, args.warmup_steps, args.max_steps,
                                         args.min_lr_ratio)
        self.engine = Engine(self.plan, self.strategy, self.ctx.device)
        self.order = GlobalBatchOrder(len(train_dataset), self.strategy.global_batch_size,
                                      args.seed)
        self.step = 0
        self.skipped_steps: list[int] = []  # steps whose update was skipped (nonfinite=skip)
        self.ckpt_root = ckpt.checkpoint_root(args.output_dir)

    # ------------------------------------------------------------------------------ public
    def train(self, until_step: int | None = None) -> TrainResult:
        """Train to ``args.max_steps`` (resuming first when ``args.resume`` or ``resume_from``).

        Args:
            until_step: stop early at this step, with a checkpoint, keeping the LR schedule
                of the whole run (to pause a job that will be resumed, e.g. when resized).
        """
        if self.args.resume or self.args.resume_from:
            self.resume()
        stop = self.args.max_steps if until_step is None else min(until_step, self.args.max_steps)
        result = TrainResult(step=self.step)
        progress = ProgressReporter(self.args.max_steps, self.step, self.args.progress,
                                    self.ctx.is_main)
        writer = MetricsWriter(Path(self.args.output_dir) / "metrics.jsonl"
                               if self.ctx.is_main else None)
        throughput = self._throughput()
        window: list[torch.Tensor] = []
        try:
            while self.step < stop:
                window.append(self._train_step())
                self.step += 1
                throughput.add(self.strategy.global_batch_size * self._seq_len())
                if self.step % self.args.logging_steps == 0 or self.step == stop:
                    record = self._log(window, throughput, result)
                    window = []
                    self._emit(record, writer, progress)
                    result.paused = self.step < stop and self._pause_requested()
                progress.update(self.step)
                self._maybe_evaluate(result, writer, progress)
                if self.args.save_steps and self.step % self.args.save_steps == 0:
                    result.checkpoint = str(self.save())
                if result.paused:
                    progress.message(f"pausing at step {self.step}: {PAUSE_FILE} found")
                    break
            if result.checkpoint is None or not result.checkpoint.endswith(
                    ckpt.step_dirname(self.step)):
                result.checkpoint = str(self.save())
        finally:
            progress.close()
        result.step = self.step
        return result

    def _pause_requested(self) -> bool:
        """Whether ``<output_dir>/PAUSE`` exists, agreed by all ranks (rank 0 decides).

        Checked at logging steps only, where the step already synchronises, so that a pause
        costs nothing on the other steps. The file is consumed so a resume runs on.
        """
        pause_file = Path(self.args.output_dir) / PAUSE_FILE
        flag = torch.tensor([float(self.ctx.is_main and pause_file.exists())],
                            device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.ctx.is_main:
            pause_file.unlink(missing_ok=True)
        return bool(flag.item())

    def evaluate(self) -> float:
        """Mean loss over ``args.eval_batches`` batches of the evaluation set (all dp ranks)."""
        if self.eval_dataset is None or len(self.eval_dataset) == 0:
            raise ValueError("evaluate() needs an eval_dataset")
        self.wrapped.eval()
        dp, dp_rank = self.mesh.size("dp"), self.mesh.rank("dp")
        per_rank = max(1, self.strategy.micro_batch_size)
        losses = []
        for b in range(self.args.eval_batches):
            start = (b * dp + dp_rank) * per_rank
            indices = [(start + i) % len(self.eval_dataset) for i in range(per_rank)]
            batch = collate([self.eval_dataset[i] for i in indices])
            losses.append(self.engine.evaluate(batch))
        self.wrapped.train()
        loss = torch.stack(losses).mean()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.plan.loss_group)
        return float(loss)

    def save(self) -> Path:
        """Write a checkpoint of the current step (all ranks call this)."""
        meta = {"model": self.model_meta, "strategy": self.strategy.to_text(),
                "samples_consumed": self.step * self.strategy.global_batch_size,
                "scheduler": self.scheduler.state_dict(), "run": self.run_info}
        return ckpt.save_checkpoint(self.ckpt_root, self.step, self.wrapped, self.optimizer,
                                    meta)

    def resume(self) -> bool:
        """Load ``args.resume_from``, else the newest complete checkpoint of ``output_dir``.

        Returns:
            True if a checkpoint was loaded, False if there was none to load.
        """
        latest = (Path(self.args.resume_from) if self.args.resume_from
                  else ckpt.find_latest(self.ckpt_root))
        if latest is None:
            return False
        ckpt.check_compatible(ckpt.read_meta(latest), self.model_meta, latest)
        meta = ckpt.load_checkpoint(latest, self.wrapped, self.optimizer)
        self.scheduler.load_state_dict(meta["scheduler"])
        self.step = int(meta["step"])
        return True

    # ---------------------------------------------------------------------------- private
    def _train_step(self) -> torch.Tensor:
        indices = self.order.rank_batch(self.step, self.mesh.rank("dp"), self.mesh.size("dp"))
        mbs = self.strategy.micro_batch_size
        micro_batches = [collate([self.train_dataset[int(i)] for i in indices[j: j + mbs]])
                         for j in range(0, len(indices), mbs)]
        result = self.engine.forward_backward(micro_batches)
        scaler = self.engine.scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        # The norm over all ranks' gradients (after the data-parallel reduction) is the same
        # on every rank, so every rank takes the same decision about a non-finite step.
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
        grad_norm = self.plan.clip_grad_norm(self.model, max_norm)
        if scaler is not None:  # fp16: the scaler skips overflowing steps and lowers its scale
            scaler.step(self.optimizer)
            scaler.update()
        elif torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self._non_finite(result.loss)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return result.loss

    def _non_finite(self, loss: torch.Tensor) -> None:
        """Stop, or skip the update, naming the step and the first non-finite gradient."""
        first = next((name for name, p in self.model.named_parameters()
                      if p.grad is not None and not torch.isfinite(p.grad).all()), "none here")
        message = (f"step {self.step + 1}: non-finite gradients (loss on this rank "
                   f"{float(loss):.4g}); first non-finite gradient: {first}")
        if self.args.nonfinite == "stop":
            raise NonFiniteError(message + ". Set train.nonfinite=skip to skip such steps.")
        self.skipped_steps.append(self.step + 1)
        if self.ctx.is_main:
            print(f"tessera: skipping the update of {message}", flush=True)

    def _log(self, window: list[torch.Tensor], throughput: Throughput,
             result: TrainResult) -> dict[str, Any]:
        # One all-reduce per logging window rather than per step keeps the step free of syncs.
        losses = torch.stack(window)
        dist.all_reduce(losses, op=dist.ReduceOp.AVG, group=self.plan.loss_group)
        values = losses.tolist()
        result.losses.extend(values)
        tokens_per_s, mfu = throughput.report()
        return {"step": self.step, "loss": sum(values) / len(values),
                "lr": self.scheduler.get_last_lr()[0], "tokens_per_s": tokens_per_s,
                "mfu": mfu, "time": time.time()}

    def _maybe_evaluate(self, result: TrainResult, writer: MetricsWriter,
                        progress: ProgressReporter) -> None:
        every = self.args.eval_steps
        last = self.step == self.args.max_steps
        if self.eval_dataset is None or not (every and (self.step % every == 0 or last)):
            return
        loss = self.evaluate()
        result.eval_losses.append((self.step, loss))
        self._emit({"step": self.step, "eval_loss": loss}, writer, progress)

    def _emit(self, record: dict[str, Any], writer: MetricsWriter,
              progress: ProgressReporter) -> None:
        if not self.ctx.is_main:
            return
        writer.write(record)
        progress.update(self.step, record)
        for callback in self.callbacks:
            callback(record)

    def _seq_len(self) -> int:
        return len(self.train_dataset[0]["input_ids"])

    def _throughput(self) -> Throughput:
        config = getattr(self.model, "config", None)
        if hasattr(config, "flops_per_token"):
            flops = config.flops_per_token(self._seq_len())
        else:
            flops = generic_flops_per_token(self.model, self._seq_len())
        peak, _ = peak_flops(self.ctx.device, self.strategy.precision)
        return Throughput(flops, peak, self.ctx.world_size)


def describe_model(model: nn.Module) -> dict[str, Any]:
    """Identity of a model for checkpoint compatibility: class, size, shapes, config."""
    shapes = sorted((name, tuple(p.shape)) for name, p in model.named_parameters())
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]
    info: dict[str, Any] = {"class": type(model).__name__,
                            "num_params": sum(p.numel() for p in model.parameters()),
                            "parameter_shapes_sha256": digest}
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict") and type(config).__module__.startswith("tessera"):
        info.update({k: v for k, v in config.to_dict().items() if k not in ("init_std",)})
    return info
