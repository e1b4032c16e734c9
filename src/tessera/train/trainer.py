"""The Trainer: data order, optimizer, LR schedule, clipping, metrics, checkpoints, progress.

It runs one worker's share of a job. Launch N of them with ``tessera train --nproc N`` (or
torchrun); with no launcher it runs as a world of one.

    trainer = Trainer(model, args, train_dataset, eval_dataset, strategy=Strategy.parse(...))
    result = trainer.train()
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from tessera.config import TrainingArguments
from tessera.data.dataset import GlobalBatchOrder, collate
from tessera.data.stream import StreamSamples, check_same_stream, sample_count
from tessera.distributed import WorkerContext, init_distributed
from tessera.mesh import Mesh
from tessera.models.materialize import DeferredInit, has_meta
from tessera.models.hf import flops_per_token as generic_flops_per_token
from tessera.parallel import parallelize
from tessera.parallel.loss_weights import label_count, token_weights
from tessera.parallel.pipeline.engine import PipelineEngine
from tessera.parallel.pipeline.recompute import strategy_text
from tessera.parallel.pipeline.whole import share_trained_weights
from tessera.parallel.plan import fit_batch
from tessera.parallel.rank_rng import rank_stream, step_seed
from tessera.strategy import Strategy
from tessera.train import checkpoint as ckpt
from tessera.train.engine import Engine
from tessera.train.evaluation import check_eval_micro_batch, eval_micro_batches
from tessera.train.export import load_safetensors_weights
from tessera.train.model_identity import describe_model
from tessera.train.metrics import MetricsWriter, Throughput, peak_flops
from tessera.train.optim import PeakRamp, build_optimizer, build_scheduler
from tessera.train.progress import ProgressReporter


# Created by a scheduler (or a person) to make a run checkpoint and exit at its next logging
# step; `--resume` continues it, possibly on a different number of workers.
PAUSE_FILE = "PAUSE"


class CollectiveError(RuntimeError):
    """A collective failed or timed out; names this rank, the operation and the step."""


def _is_communication_failure(err: RuntimeError) -> bool:
    text = str(err)
    return any(sign in text for sign in ("Timed out", "timed out", "Connection closed by peer",
                                         "Connection reset by peer", "NCCL"))


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0][:300]


class NonFiniteError(FloatingPointError):
    """NaN or inf in the gradients; names the step and the first offending parameter."""


@dataclass
class TrainResult:
    """What a training run produced on this rank."""

    step: int  # steps completed in total (including those before a resume)
    losses: list[float] = field(default_factory=list)  # per-step mean loss over dp ranks
    # (step, eval_loss) of the evaluation set; a dict of named sets reports each in its
    # records (eval_<name>_loss), not here
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    checkpoint: str | None = None  # the last checkpoint written, if any
    paused: bool = False  # stopped early because a pause was requested
    first_step: int = 0  # steps completed when this call began (after its resume)


class Trainer:
    """Trains a causal language model under a Strategy.

    Args:
        model: a single-device model returning logits (or an output with ``.logits``). A
            model built under ``torch.device("meta")`` is materialised by the layout with
            weights seeded per name by ``args.seed`` (models/materialize.py): under pipeline
            stages without tensor parallelism each rank materialises only its stages' share.
        args: optimisation, logging and checkpointing settings.
        train_dataset: map-style dataset of ``{"input_ids", "labels"}`` samples of equal length
            (None: a Trainer that evaluates only; ``train()`` is refused).
        eval_dataset: optional dataset of the same kind, for evaluation.
        strategy: the parallel layout; its world size must equal the number of workers.
        run_info: extra JSON-ready facts stored in checkpoints (e.g. the run config).
        callbacks: functions called with each metrics record (rank 0 only; the Hugging
            Face front's events go through ``record_hooks``, called on every rank).
        data_collator: turns a list of samples into a batch (default: stack equal lengths).
        memory: chunk-memory options (the config's ``memory:`` section) for memory=chunk.

    ``args.init_from`` (a folder written by ``save_model`` or ``save_pretrained``) replaces
    the model's weights before parallelisation; a resumed checkpoint then replaces them again.
    """

    def __init__(self, model: nn.Module, args: TrainingArguments,
                 train_dataset: Dataset | None,
                 eval_dataset: Dataset | None = None, strategy: Strategy | None = None,
                 run_info: dict[str, Any] | None = None,
                 callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
                 data_collator: Callable[[list], dict[str, torch.Tensor]] | None = None,
                 memory: Any = None) -> None:
        if train_dataset is None and eval_dataset is None:
            raise ValueError("a Trainer needs a train_dataset or an eval_dataset")
        self.args, self.strategy = args, strategy or Strategy()
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.data_collator = data_collator or collate
        self._row_length: int | None = None  # tokens per batch row, read once (_seq_len)
        self.stop_requested = False  # set on any rank (e.g. by a callback) to pause like PAUSE
        self.run_info, self.callbacks = run_info or {}, list(callbacks)
        # Every rank: with each metrics record (all ranks hold the same), after each save.
        self.record_hooks: list[Callable[[dict[str, Any]], None]] = []
        self.save_callbacks: list[Callable[[Path], None]] = []
        # An evaluation step's metrics, one record per evaluated set (the HF front's named sets).
        self.evaluations: Callable[[], list[dict[str, float]]] = \
            lambda: [{"eval_loss": self.evaluate()}]
        self.strategy.require_available()
        check_eval_micro_batch(args.eval_micro_batch_size, self.strategy)
        self.ctx: WorkerContext = init_distributed(
            args.device, timeout_s=args.collective_timeout_s)
        self.phase = "set-up"  # what the ranks are doing together, for error messages
        self.mesh = Mesh(self.strategy, self.ctx.device.type)
        self.coordinates = self.mesh.coordinates()  # keys this rank's dropout stream
        # Weights from args.init_from replace the initial ones before parallelisation, so that
        # every strategy starts alike; a meta-device model is materialised (and loaded) by the
        # layout, only the share this rank keeps under pipeline stages.
        load = ((lambda m: load_safetensors_weights(m, args.init_from))
                if args.init_from else None)
        deferred = DeferredInit(self.ctx.device, args.seed, load) if has_meta(model) else None
        self.model = model if deferred else model.to(self.ctx.device)
        if load and not deferred:
            load(self.model)
        self.model_meta = describe_model(self.model)
        budget = args.stage_memory_budget
        self.plan = parallelize(self.model, self.strategy, self.mesh, memory=memory,
                                deferred=deferred, stage_budget=budget, seq_len=self._seq_len(),
                                split_points=args.pipeline_split_points,
                                leaf_modules=args.pipeline_leaf_modules)
        if budget and self.ctx.is_main:
            print(f"tessera: stage_memory_budget={budget:,} bytes: recomputation per "
                  f"stage {strategy_text(self.stage_recompute)}", flush=True)
        self.wrapped = self.plan.module
        # A layout that keeps parameters in its own storage (chunk memory) brings its optimizer.
        self.optimizer = (self.plan.build_optimizer or build_optimizer)(
            self.model, args.learning_rate, args.weight_decay, (args.adam_beta1, args.adam_beta2),
            args.adam_epsilon, self.ctx.device)
        self.peak_ramp = PeakRamp()  # warms a changed learning rate up after a resume
        self.scheduler = build_scheduler(self.optimizer, args.warmup_steps, args.max_steps,
                                         args.min_lr_ratio, args.lr_scheduler_type,
                                         self.peak_ramp, args.warmup_from_zero)
        # pp > 1: the pipeline engine runs the schedule over this rank's stages.
        engine_cls = PipelineEngine if self.strategy.pp > 1 else Engine
        self.engine = engine_cls(self.plan, self.strategy, self.ctx.device)
        if self.plan.grad_scaler is not None:
            self.engine.scaler = self.plan.grad_scaler
        self.order = (GlobalBatchOrder(sample_count(train_dataset),
                                       self.strategy.global_batch_size, args.seed)
                      if train_dataset is not None else None)
        self._stream_unchecked = False  # a stream's samples not yet compared across ranks
        self.step = 0
        self.skipped_steps: list[int] = []  # steps whose update was skipped (nonfinite=skip)
        self.ckpt_root = ckpt.checkpoint_root(args.output_dir)

    # ------------------------------------------------------------------------------ public
    @property
    def stage_recompute(self) -> list[float]:
        """The recomputation ratio each pipeline stage runs with (virtual stages under
        interleaving; chosen from ``args.stage_memory_budget`` when it is set)."""
        pipeline = self.plan.pipeline
        return list(pipeline.ratios) if pipeline else list(self.strategy.recompute)

    def train(self, until_step: int | None = None) -> TrainResult:
        """Train to ``args.max_steps`` (resuming first when ``args.resume`` or ``resume_from``).

        Args:
            until_step: stop early at this step, with a checkpoint, keeping the LR schedule
                of the whole run (to pause a job that will be resumed, e.g. when resized).
        """
        if self.train_dataset is None:
            raise ValueError("train() needs a train_dataset: this Trainer was built to "
                             "evaluate only")
        if (self.args.resume or self.args.resume_from) and not self.resume() \
                and self.ctx.is_main:  # a restart before the first checkpoint: not an error
            print(f"tessera: resume asked for, but {self.ckpt_root} holds no complete "
                  "checkpoint: starting at step 0", flush=True)
        stop = self.args.max_steps if until_step is None else min(until_step, self.args.max_steps)
        result = TrainResult(step=self.step, first_step=self.step)
        self._stream_unchecked = isinstance(self.train_dataset, StreamSamples)
        progress = ProgressReporter(self.args.max_steps, self.step, self.args.progress,
                                    self.ctx.is_main)
        writer = MetricsWriter(Path(self.args.output_dir) / "metrics.jsonl"
                               if self.ctx.is_main and self.args.write_metrics else None)
        throughput = self._throughput()
        tokens_per_step = self.strategy.global_batch_size * self._seq_len()
        window: list[torch.Tensor] = []
        first = True  # a stop asked for before this call's first step is seen after it
        try:
            while self.step < stop:
                self.phase = "forward/backward with the data-parallel gradient all-reduce"
                window.append(self._train_step())
                self.step += 1
                throughput.add(tokens_per_step)
                logged = self.step % self.args.logging_steps == 0 or self.step == stop
                if logged:
                    self._emit(self._log(window, throughput, result), writer, progress)
                    window = []
                progress.update(self.step)
                evaluated = self._maybe_evaluate(result, writer, progress)
                saved = bool(self.args.save_steps and self.step % self.args.save_steps == 0)
                if saved:
                    result.checkpoint = str(self.save())
                # A stop can be asked for where callbacks run (a log, an evaluation, a save,
                # the start of train()): agreed there, so other steps stay free of syncs.
                if (first or logged or evaluated or saved) and self.step < stop:
                    result.paused = self._pause_requested()
                first = False
                if result.paused:
                    if window:  # the steps since the last log: their losses are not lost
                        self._emit(self._log(window, throughput, result), writer, progress)
                    progress.message(f"pausing at step {self.step}: {PAUSE_FILE} found or "
                                     "a stop requested")
                    break
            saved = (result.checkpoint or "").endswith(ckpt.step_dirname(self.step))
            ran = self.step > result.first_step  # a resume at max_steps trains nothing
            if ran and not saved and (self.args.save_final or self.step < self.args.max_steps):
                result.checkpoint = str(self.save())
            self._share_trained_weights()
        except RuntimeError as err:
            if not _is_communication_failure(err):
                raise
            raise CollectiveError(
                f"rank {self.ctx.rank}: {self.phase} at step {self.step + 1} failed: "
                f"{_first_line(err)}. A peer rank is stalled or has died; its log says which "
                f"(timeout: train.collective_timeout_s={self.args.collective_timeout_s:g})"
            ) from err
        finally:
            progress.close()
        result.step = self.step
        return result

    def _share_trained_weights(self) -> None:
        """Under pp, leave ``self.model`` trained on every rank, as Hugging Face's Trainer
        leaves the model it trains (or refuse calls of it where a rank cannot hold it)."""
        pipe = self.plan.pipeline
        if pipe is not None:
            self.phase = "sharing the pipeline stages' trained weights"
            share_trained_weights(self.model, pipe.module, pipe.pp_group, self.strategy.memory)

    def _pause_requested(self) -> bool:
        """Whether ``<output_dir>/PAUSE`` exists (rank 0 looks) or a callback on any rank
        asked to stop (``stop_requested``), agreed by all ranks.

        Checked after the first step of each ``train()`` call and at logging, evaluation and
        saving steps, where callbacks run and the step already synchronises, so that a pause
        costs nothing on the other steps. The file is consumed so a resume runs on.
        """
        self.phase = "the pause-flag all-reduce of a logging, evaluation or saving step"
        pause_file = Path(self.args.output_dir) / PAUSE_FILE
        wanted = self.stop_requested or (self.ctx.is_main and pause_file.exists())
        flag = torch.tensor([float(wanted)], device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.ctx.is_main:
            pause_file.unlink(missing_ok=True)
        return bool(flag.item())

    def evaluate(self) -> float:
        """Mean loss over the first ``args.eval_batches`` global batches of the evaluation set
        (``eval_batches * global_batch_size`` samples, wrapping around a shorter set), or over
        the whole set, each sample once, with ``eval_batches=0`` (micro-batch losses weighted
        by their samples, as Hugging Face's evaluation weighs its batches on one process; a
        micro-batch whose labels are all ignored is left out, as Hugging Face 5 leaves out
        its NaN loss, ``logging_nan_inf_filter``).

        The samples depend on the global batch size only, so strategies that differ in dp,
        micro-batch size or any other axis evaluate the same samples and report comparable
        losses: each dp rank takes its contiguous share of every global batch, in
        micro-batches (the shape the pipeline's captured program was built for).
        """
        if self.eval_dataset is None or len(self.eval_dataset) == 0:
            raise ValueError("evaluate() needs an eval_dataset")
        self.phase = "evaluation and its loss all-reduce"
        self.wrapped.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)  # sum w*loss, w
        mbs, dp = max(1, self.strategy.micro_batch_size), self.mesh.size("dp")
        eval_mbs = self.args.eval_micro_batch_size or mbs
        # Another micro-batch size: global batches of one micro-batch per dp rank.
        global_batch = self.strategy.global_batch_size if eval_mbs == mbs else eval_mbs * dp
        parts = eval_micro_batches(len(self.eval_dataset), global_batch, dp,
                                   self.mesh.rank("dp"), eval_mbs, self.args.eval_batches)
        for indices, real in parts:
            batch = self._batch(self.eval_dataset, indices)
            if real < len(indices):  # wrapped-around fill: its labels do not count
                batch["labels"] = batch["labels"].clone()
                batch["labels"][real:] = -100
            loss = self.engine.evaluate(batch)  # fill only too: every rank takes each step
            if real and label_count(batch) > 0:  # no labels: a loss of 0 that means nothing
                total[0] += loss.double() * real
                total[1] += real
        self.wrapped.train()
        dist.all_reduce(total, group=self.plan.loss_group)
        return float(total[0] / total[1])

    def save(self) -> Path:
        """Write a checkpoint of the current step (all ranks call this)."""
        self.phase = "the checkpoint save (barriers and shard writes)"
        meta = {"model": self.model_meta, "strategy": self.strategy.to_text(),
                "samples_consumed": self.order.samples_before(self.step),
                "scheduler": self.scheduler.state_dict(), "run": self.run_info,
                "peak_ramp": asdict(self.peak_ramp)}
        if self.engine.scaler is not None:  # fp16: a resume goes on with the same loss scale
            meta["loss_scale"] = self.engine.scaler.state_dict()
        path = ckpt.save_checkpoint(self.ckpt_root, self.step, self.wrapped, self.optimizer,
                                    meta, keep=self.args.save_total_limit)
        for callback in self.save_callbacks:
            callback(path)
        return path

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
        if self.engine.scaler is not None and "loss_scale" in meta:
            self.engine.scaler.load_state_dict(meta["loss_scale"])
        for name, value in meta.get("peak_ramp", {}).items():
            setattr(self.peak_ramp, name, value)
        self.step = int(meta["step"])
        # Continue the sample stream where it stopped, also when gbs changed (a resize).
        self.order = GlobalBatchOrder(
            sample_count(self.train_dataset), self.strategy.global_batch_size, self.args.seed,
            start_step=self.step, start_sample=int(meta["samples_consumed"]))
        self._apply_learning_rate()
        return True

    def _apply_learning_rate(self) -> None:
        """Use this run's learning_rate after a resume (a scheduler may rescale it with gbs).

        The schedule's position comes from the checkpoint; only its peak changes, so an
        unchanged config resumes with exactly the rates it would have had. A changed peak is
        reached at once, or over ``lr_rescale_warmup_steps`` steps when that is set.
        """
        old_peak, step = self.scheduler.base_lrs[0], self.scheduler.last_epoch
        if self.args.lr_rescale_warmup_steps and old_peak != self.args.learning_rate:
            self.peak_ramp.restart(step, old_peak, self.args.learning_rate,
                                   self.args.lr_rescale_warmup_steps)
        factor = self.scheduler.lr_lambdas[0](step)
        self.scheduler.base_lrs = [self.args.learning_rate] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.args.learning_rate
            group["lr"] = self.args.learning_rate * factor

    # ---------------------------------------------------------------------------- private
    def _batch(self, dataset: Dataset, indices) -> dict[str, torch.Tensor]:
        """The collated samples, as this layout reads them (plan.fit_batch)."""
        return fit_batch(self.data_collator([dataset[int(i)] for i in indices]),
                         self.plan.batch_keys)

    def _train_step(self) -> torch.Tensor:
        indices = self.order.rank_batch(self.step, self.mesh.rank("dp"), self.mesh.size("dp"))
        mbs = self.strategy.micro_batch_size
        micro_batches = [self._batch(self.train_dataset, indices[j: j + mbs])
                         for j in range(0, len(indices), mbs)]
        if self._stream_unchecked:  # once a train(): every rank read the same samples
            self._stream_unchecked = False
            end = self.order.samples_before(self.step + 1)
            check_same_stream(self.train_dataset.digest_through(end), self.ctx.device)
        # The step's loss is the mean over all its labels on every dp rank (loss_weights.py).
        weights = token_weights(micro_batches, self.ctx.device, self.mesh.group("dp"),
                                self.mesh.size("dp"), self.args.average_tokens_across_devices)
        shared = step_seed(self.args.seed, self.step)  # equal on every rank and on resume
        with rank_stream(self.coordinates, self.ctx.device, shared):  # dropout masks per rank
            result = self.engine.forward_backward(micro_batches, weights)
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
        # The rate this step trained at: the optimizer's (after a resume that changed the
        # peak, the scheduler's last rate is the checkpoint's until its next step).
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # [this rank's loss, the gradient norm before clipping (the same on every rank)]
        return torch.stack((result.loss.detach().float(),
                            grad_norm.detach().float().to(result.loss.device)))

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
        self.phase = "the loss all-reduce of a logging step"
        # One all-reduce per logging window rather than per step keeps the step free of syncs.
        steps = torch.stack(window)  # (steps, 2): loss, gradient norm
        dist.all_reduce(steps, op=dist.ReduceOp.AVG, group=self.plan.loss_group)
        values = steps[:, 0].tolist()
        result.losses.extend(values)
        tokens_per_s, mfu = throughput.report()
        return {"step": self.step, "loss": sum(values) / len(values),
                "grad_norm": float(steps[-1, 1]),  # the last step's, before clipping
                "lr": self.step_lr, "tokens_per_s": tokens_per_s,  # the last step's
                "mfu": mfu, "time": time.time()}

    def _maybe_evaluate(self, result: TrainResult, writer: MetricsWriter,
                        progress: ProgressReporter) -> bool:
        """Evaluate when ``args.eval_steps`` says so; returns whether it did."""
        every = self.args.eval_steps
        last = self.step == self.args.max_steps
        if self.eval_dataset is None or not (every and (self.step % every == 0 or last)):
            return False
        for metrics in self.evaluations():
            if "eval_loss" in metrics:  # the evaluation set's (named sets: in the records)
                result.eval_losses.append((self.step, metrics["eval_loss"]))
            self._emit({"step": self.step, **metrics}, writer, progress)
        return True

    def _emit(self, record: dict[str, Any], writer: MetricsWriter,
              progress: ProgressReporter) -> None:
        for hook in self.record_hooks:
            hook(record)
        if not self.ctx.is_main:
            return
        writer.write(record)
        progress.update(self.step, record)
        for callback in self.callbacks:
            callback(record)

    def _seq_len(self) -> int:
        """Tokens per row of a batch, the run's shape: the first sample as the collator
        makes it a batch (a Hugging Face-style sample is one token shorter after its shift,
        and pipeline stages are captured at this length); the evaluation set's without
        training data."""
        if self._row_length is None:
            data = self.train_dataset if self.train_dataset is not None else self.eval_dataset
            self._row_length = int(self.data_collator([data[0]])["input_ids"].shape[-1])
        return self._row_length

    def _throughput(self) -> Throughput:
        config = getattr(self.model, "config", None)
        if hasattr(config, "flops_per_token"):
            flops = config.flops_per_token(self._seq_len())
        else:
            flops = generic_flops_per_token(self.model, self._seq_len())
        # Measured where no data sheet applies (CPUs): all ranks at once, after a barrier, the
        # best rank's figure. A rank measuring while another still imports or builds its
        # model shares its core and reads a low peak (MFU above 1 in the demo's logs).
        dist.barrier()
        peak, _ = peak_flops(self.ctx.device, self.strategy.precision)
        best = torch.tensor(peak, dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(best, op=dist.ReduceOp.MAX)
        return Throughput(flops, float(best), self.ctx.world_size)
