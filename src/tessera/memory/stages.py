"""Chunk memory under pipeline parallelism (dp x tp x pp or dp x sp x pp, memory=chunk).

The pipeline runs exported graph pieces (``pipeline/split.py``), not the user's modules, but
each piece is a module that holds the very parameters of its stage: as its own attributes,
or in its segments' modules when sub-pipelined (``pipeline/subpipe.py``).
So the chunk manager is built over the rank's :class:`StageModule` (its parameters in the
order the graph reads them) and each piece is *the* hooked module: before a piece's forward
or backward of a micro-batch its chunks are brought to the device (all-gathered over the
stage's dp ranks), after it they may be released, and autograd saves views of chunks as
references (``hooks.py``), exactly as for an eager module.

What changes against pp = 1:

- The whole schedule runs under ``no_sync``: gradients of every micro-batch accumulate in
  each rank's local gradient chunks, and the dp reduce-scatter runs once, after the pipeline
  has drained (as the plain pipeline's dp all-reduce does).
- A weight tied across stages (an embedding reused as the LM head) lives in the chunks of
  every stage that reads it. Before the reduce-scatter, its slice of the local gradient chunk
  is summed over the pp group (stages without it add zeros): sum over pp then mean over dp is
  the one-device gradient, whichever dp rank owns the slot on each stage.
- The gradient norm sums each owned chunk's slots (a tied weight only on the lowest stage
  holding it), all-reduced over dp (the owners) and then over pp.
- Under bf16 a piece's floating inputs are cast to the compute dtype (see ``_cast_inputs``).
- Tensor-parallel stages (1d or 2d) hold DTensor parameters: chunks hold each rank's local
  shards, ZeRO-sharded over its dp ranks (``shards.py``), as at pp = 1; a tied weight's
  gradient is summed over pp shard by shard (the pp group joins the ranks of the same tp
  coordinate, which hold the same slice of it), and the norm counts a piece replicated over tp
  once and sums over tp as well.
- Sequence-parallel stages: the sp ranks of a dp rank hold the same weights, so chunks are
  ZeRO-sharded over dp x sp, as at pp = 1 (``runtime._zero_group``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.distributed as dist

from tessera.memory.chunk import Kind
from tessera.memory.manager import ChunkManager
from tessera.memory.runtime import _DTYPES, ChunkRuntime, _zero_group, as_options
from tessera.memory.shards import local_of, point_at
from tessera.parallel.pipeline.module import GradSync
from tessera.parallel.pipeline.stage import StageRunner
from tessera.parallel.pipeline.tp import tp_group_of


def apply_stage_chunk_memory(plan: Any, strategy, mesh, memory: Any = None) -> ChunkRuntime:
    """Put this rank's pipeline stages (``plan.pipeline``) into chunks (memory=chunk, pp > 1).

    Replaces the pipeline's gradient sync and the plan's optimizer and clipping hooks with
    chunk versions; hooks are added to each stage piece as the program builds it.
    """
    options = as_options(memory)
    if options.placement == "static" and "cpu" not in strategy.offload:
        raise ValueError("memory.placement=static keeps gradients and optimizer states on the "
                         "host: it needs offload=cpu in the strategy")
    pipe = plan.pipeline
    module = pipe.module
    device = local_of(next(module.parameters())).device
    # This rank's stages only; a tied weight under each of its names.
    own = dict(module.named_parameters(remove_duplicate=False))
    order = [own[name] for name in pipe.program.param_use_order() if name in own]
    runtime = ChunkRuntime(module, options, device, _DTYPES[strategy.precision],
                           strategy.offload, _zero_group(strategy, mesh),
                           tp_group_of(strategy, mesh), param_order=order)
    pipe.program.on_stage_built = functools.partial(_hook_stage, runtime)
    pipe.program.capture_context = functools.partial(_shaped_for_capture, runtime.manager)
    sync = ChunkStageSync(runtime, pipe.grad_sync)
    pipe.grad_sync = sync
    runtime.attach(plan)
    plan.build_optimizer = lambda _model, *args: runtime.build_optimizer(module, *args)
    plan.clip_grad_norm = lambda _model, max_norm: sync.clip(max_norm)
    return runtime


@contextlib.contextmanager
def _shaped_for_capture(manager: ChunkManager) -> Iterator[None]:
    """Give every chunked parameter its shape while torch.export captures a new shape.

    Released or evicted parameters are empty placeholders, which export cannot trace. The
    capture only reads shapes (it runs on fake tensors), so each gets a zero-storage fp32
    stand-in (a broadcast scalar): the graph is the one the partition was made on, whatever
    the compute dtype. The chunk views come back afterwards.
    """
    device = manager.device.device
    for param, (_, slot) in manager.slot_of.items():
        point_at(param, torch.zeros((), device=device).expand(slot.shape))
    try:
        yield
    finally:
        for chunk in manager.chunks:
            manager.set_views(chunk)


def _hook_stage(runtime: ChunkRuntime, runner: StageRunner) -> None:
    """Hook the head segments (recomputed part) and tail of a freshly built stage."""
    dtype = runtime.manager.dtype
    for part, piece in runner.pieces():
        if dtype != torch.float32:
            piece.module.register_forward_pre_hook(functools.partial(_cast_inputs, dtype))
        # A piece's weights wherever it holds them: a sub-pipelined piece (tp_overlap=subpipe)
        # keeps them in its segments' modules, and accumulates each once per backward.
        if runtime.hooks.hook_module(f"stage{runner.index}.{part}", piece.module, recurse=True):
            runtime.hooks.watch_saved(piece.module)


def _cast_inputs(dtype: torch.dtype, module: torch.nn.Module, args: tuple) -> tuple:
    """Boundary activations in the compute dtype, as the eager model would hand them on.

    Messages between stages travel as fp32 in the shapes and dtypes of the fp32 capture; with
    bf16 chunks the weights are bf16 and so was the activation the previous stage sent (the
    cast back is exact). Without it a layer norm would meet an fp32 input and a bf16 weight.
    """
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


class ChunkStageSync:
    """The pipeline's gradient sync and norm over gradient chunks (see module docstring).

    Args:
        runtime: the chunk runtime of this rank's StageModule.
        base: the plain pipeline's :class:`GradSync` (tied weights, norm ownership, groups).
    """

    def __init__(self, runtime: ChunkRuntime, base: GradSync) -> None:
        self.runtime, self.base = runtime, base
        norm_owned = {id(p) for p in base.norm_owned}
        self.skip_in_norm = {id(p) for p in base.params if id(p) not in norm_owned}

    def accumulate(self, key=None):
        """No reduce-scatter while the schedule runs: it happens in :meth:`sync` (``key``,
        the step's shape, is for the plain sync's overlap)."""
        return self.runtime.manager.no_sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Sum tied-weight gradients over pp, then reduce-scatter every group over dp."""
        m = self.runtime.manager
        for key, shape in self.base.tied:
            param = self.base.tied_local.get(key)
            local = self._local_grad(param) if param is not None else None
            buf = (local.float().to(m.device.device) if local is not None
                   else torch.zeros(shape, device=m.device.device).reshape(-1))
            dist.all_reduce(buf, group=self.base.pp_group)
            if local is not None:
                local.copy_(buf.to(local.device, local.dtype))
        self.runtime.hooks.flush()

    def _local_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's (not yet reduced) gradient slice of ``param`` in its chunk."""
        m = self.runtime.manager
        chunk, slot = m.slot_of[param]
        buf = self.runtime.readable(chunk, Kind.GRAD)
        if buf is None:  # no gradient arrived here: the tied sum still needs a slot
            buf = m.alloc(chunk, Kind.GRAD, m.grad_home(chunk), set())
            self.runtime.hooks.pending.add(chunk.index // m.world)
        return buf[slot.offset: slot.end]

    @torch.no_grad()
    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip all stages' gradient chunks to a global 2-norm; returns the norm before."""
        rt = self.runtime
        rt.hooks.flush()
        owned = [c for c in rt.manager.own_chunks() if Kind.GRAD in c.tier]
        total = rt.squared_grad_sum(owned, self.skip_in_norm)
        if rt.tp_group is not None:  # then scale_to_norm sums over the dp owners and pp
            dist.all_reduce(total, group=rt.tp_group)
        return rt.scale_to_norm(total, owned, max_norm, self.base.pp_group)
