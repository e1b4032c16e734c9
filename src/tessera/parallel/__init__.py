"""Apply a Strategy to a single-device model, in one ordered function.

Order (ARCHITECTURE.md): tensor parallel (1d | 2d) -> sequence parallel -> pipeline split and
recomputation -> memory manager (chunks / ZeRO / offload) -> data parallel. Each later
parallelism adds its step here; a Strategy asking for one that is not built yet is refused by
:meth:`tessera.strategy.Strategy.require_available` before anything is changed.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tessera.mesh import Mesh
from tessera.models.materialize import DeferredInit, has_meta
from tessera.parallel.data import wrap_data_parallel
from tessera.parallel.plan import Parallelized, refuse_extra_losses
from tessera.parallel.recompute import apply_recompute
from tessera.strategy import Strategy, StrategyError

__all__ = ["Parallelized", "parallelize"]


def parallelize(model: nn.Module, strategy: Strategy, mesh: Mesh,
                memory: Any = None, deferred: DeferredInit | None = None,
                stage_budget: int | None = None, seq_len: int | None = None,
                split_points: list[str] | None = None,
                leaf_modules: list[str] | None = None) -> Parallelized:
    """Lay ``model`` out under ``strategy`` on ``mesh``.

    The model's parameters must be on the mesh's device, or on the meta device with
    ``deferred`` saying how to materialise them: pipeline stages without tensor parallelism
    materialise only the weights this rank's stages hold; tensor parallelism materialises one
    block's weights at a time, each cut into this rank's shards at once (with pp, only the
    shards of this rank's stages); every other layout the whole model first
    (docs/pipeline.md, *Models larger than memory*). The returned ``module`` may
    wrap ``model`` (e.g. DistributedDataParallel); ``model`` keeps its parameter names, so
    checkpoints stay in the single-device layout. ``memory`` holds the chunk-memory options
    (the config's ``memory:`` section) used when ``strategy.memory == "chunk"``.
    ``stage_budget`` (bytes, pp > 1 only) has each stage recompute the least that fits it.
    ``seq_len``, the run's sequence length, is the length pipeline stages are partitioned at.
    ``split_points`` (pp > 1 only): module names that start the stages, instead of the
    partitioner's search (pipeline/split_points.py). ``leaf_modules`` (pp > 1 only): modules
    (names or patterns) captured as one opaque node each and run eagerly, for models
    torch.export cannot capture whole (pipeline/leaves.py).
    """
    plan = _lay_out(model, strategy, mesh, memory, deferred, stage_budget, seq_len,
                    split_points, leaf_modules)
    if strategy.tp > 1:  # the model holds shards: a direct call would give a logits slice
        from tessera.parallel.tensor.guard import guard_direct_calls

        guard_direct_calls(plan, strategy)
    return plan


def _lay_out(model: nn.Module, strategy: Strategy, mesh: Mesh, memory: Any,
             deferred: DeferredInit | None, stage_budget: int | None, seq_len: int | None,
             split_points: list[str] | None, leaf_modules: list[str] | None) -> Parallelized:
    strategy.require_available()
    refuse_extra_losses(model)  # a term no layout would add: refused, not dropped
    if stage_budget is not None and strategy.pp == 1:
        raise StrategyError("train.stage_memory_budget chooses pipeline stages' recomputation "
                            "and needs pp > 1; at pp=1 give the strategy's recompute= instead")
    strategy.check_split_points(split_points)
    strategy.check_leaf_modules(leaf_modules)
    if has_meta(model):
        if deferred is None:
            raise ValueError("the model has parameters on the meta device and no "
                             "DeferredInit says how to materialise them")
        if strategy.pp == 1 and strategy.tp == 1:
            deferred(model)
    on_meta = deferred if has_meta(model) else None
    plan = Parallelized(module=model, model=model, loss_group=mesh.group("dp"))
    stage_inputs = None  # what the pipeline's stages read besides input_ids (sp > 1)
    if strategy.tp > 1:
        # Tensor parallel (1d Megatron / 2d Optimus, see parallel/tensor/): layers replaced by
        # the model's policy, parameters become DTensor shards, loss over sharded logits.
        from tessera.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(plan, strategy, mesh, deferred=on_meta)
    if strategy.sp > 1:
        # Sequence parallel: attention swapped for ring/rsa/ulysses, each rank's loss over its
        # own tokens, loss group widened to dp x sp (see parallel/sequence/).
        from tessera.parallel.sequence import apply_sequence_parallel

        sequence = apply_sequence_parallel(plan, strategy, mesh)
        if strategy.pp > 1:  # stages read this rank's tokens, positions and token metadata
            stage_inputs = sequence.stage_inputs(model)
    if strategy.pp > 1:
        # Pipeline (issue 6): the model is captured with torch.export and cut into stages;
        # stage-aware recomputation and dp gradient averaging run inside the PipelineEngine.
        from tessera.parallel.pipeline import apply_pipeline
        from tessera.parallel.pipeline.leaves import mark_leaves

        mark_leaves(model, leaf_modules)  # every capture of the model hides them
        apply_pipeline(plan, strategy, mesh, stage_inputs, deferred, stage_budget, seq_len,
                       split_points)
        if strategy.memory == "chunk":
            # Chunk memory over this rank's stages (dp x pp): the stage pieces are the hooked
            # modules, the dp reduce-scatter runs after the pipeline drains (memory/stages.py).
            from tessera.memory.stages import apply_stage_chunk_memory

            apply_stage_chunk_memory(plan, strategy, mesh, memory)
        return plan
    if apply_recompute(model, strategy.stage_recompute(mesh.rank("pp"))):
        plan.features.append("recompute")
    if strategy.memory == "chunk":
        # Chunk memory (issue 3): parameters (under tp: each rank's local shards), gradients
        # and Adam states move into chunks, sharded ZeRO-style over dp (dp x sp under sequence
        # parallelism), which replaces the data-parallel wrap below; recomputed blocks re-enter
        # the chunk hooks in backward.
        from tessera.memory import apply_chunk_memory

        apply_chunk_memory(model, strategy, mesh, memory).attach(plan)
        return plan
    if strategy.tp > 1:
        return plan  # DDP cannot take DTensor shards: tensor/data_parallel.py averages them
    plan.module = wrap_data_parallel(plan.module, mesh)
    if plan.module is not model:
        plan.features.append("data_parallel")
    return plan
