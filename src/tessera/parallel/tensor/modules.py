"""nn.Modules that replace a model's layers: parameters as DTensors, compute in the functions.

Each module keeps the parameter names of the layer it replaces (``weight``, ``bias``), so the
model's state-dict keys do not change. ``conv1d`` marks GPT-2's Conv1D, whose weight is
(in, out) rather than nn.Linear's (out, in).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.parallel.recompute import in_checkpointed_block
from tessera.parallel.tensor.comm import (CopyToTP, GatheredInput, GatherSeq, GatherSeqWhole,
                                          Grid, ScatterSeq, TPGroup)
from tessera.parallel.tensor.layers1d import ColumnLinearFn, RowLinearFn, VocabEmbeddingFn
from tessera.parallel.tensor.layers2d import (AddBias2DFn, Conv1D2DFn, Embedding2DFn,
                                              Linear2DFn, Norm2DFn)
from tessera.parallel.tensor.ops import tp_add_bias, tp_copy, tp_reduce
from tessera.parallel.tensor.ops_seq import (tp_seq_gather, tp_seq_gather_whole, tp_seq_linear,
                                             tp_seq_reduce_scatter, tp_seq_scatter)
from tessera.parallel.tensor.ops2d import (summa_add_bias, summa_embedding, summa_linear,
                                           summa_norm)
from tessera.parallel.tensor.shard import local

# 1D modules run through autograd Functions by default. With ``export_group`` set (the name
# of their group in tensor/ops.py) they use the custom ops instead, so torch.export keeps
# their collectives, backward included, as graph nodes (pipeline stages; see ops.py), and
# Megatron sequence parallelism's those of ops_seq.py.
# The 2D modules likewise switch to the ops of tensor/ops2d.py when ``export_grid`` is set.

def _opt(param: nn.Parameter | None) -> torch.Tensor | None:
    return None if param is None else local(param)


class ColumnLinear(nn.Module):
    """1D column-parallel linear: output features split over the tp group.

    ``mode``: "replicated", "gather" or "gathered" (see :class:`ColumnLinearFn`; inside an
    attention or MLP block "gathered": its :class:`BlockInput` sums the gradient). ``rows``
    (optional) picks rows of a replicated weight: the key/value heads this rank needs when
    there are fewer key/value heads than ranks (grouped-query attention).
    """

    def __init__(self, weight, bias, group: TPGroup, mode: str, conv1d: bool,
                 rows: slice | None = None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.mode, self.conv1d, self.rows = group, mode, conv1d, rows
        self.export_group: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = local(self.weight), _opt(self.bias)
        w = w.t() if self.conv1d else w  # (O/tp, C)
        if self.export_group is not None:
            return self._exportable(x, w, b, self.export_group)
        if self.rows is not None:
            # Replicated weight: every rank's slice adds to it, so its gradient is summed.
            w = CopyToTP.apply(w, self.group)[self.rows]
            b = None if b is None else CopyToTP.apply(b, self.group)[self.rows]
        # Under sequence parallelism the block's pre-hook gathered x: keep its shard instead
        gathered = getattr(x, GatheredInput.ATTRIBUTE, None) if self.mode == "gathered" else None
        return ColumnLinearFn.apply(x, w, b, self.group, self.mode, gathered)

    def _exportable(self, x, w, b, name: str) -> torch.Tensor:
        if self.rows is not None:  # replicated k/v weight: every rank's slice adds to it
            w = tp_copy(w, name)[self.rows]
            b = None if b is None else tp_copy(b, name)[self.rows]
        if self.mode == "gather":  # x: (B, T/tp, C), kept; gathered again in backward
            return tp_seq_linear(tp_seq_gather(x, name, ""), x, w, b, name, "")
        if self.mode == "replicated":  # else the enclosing block's BlockInput applied f
            x = tp_copy(x, name)
        # Under sequence parallelism the block's pre-hook gathered x: keep its shard instead
        shard = getattr(x, BlockInput.SHARD, None) if self.mode == "gathered" else None
        if shard is not None:
            return tp_seq_linear(x, shard[0], w, b, name, shard[1])
        return F.linear(x, w, b)  # (B, T, O/tp)


def map_input(module: nn.Module, args: tuple, kwargs: dict, fn, why: str
              ) -> tuple[tuple, dict]:
    """A forward pre-hook's (args, kwargs) with ``fn`` applied to the module's input: the first
    positional argument, or the ``hidden_states`` keyword (Hugging Face decoder layers pass
    it to the attention that way)."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise TypeError(f"tensor parallelism: {type(module).__name__} was called without a "
                    f"positional input or a hidden_states keyword; its input cannot be {why}")


class BlockInput:
    """Forward pre-hook of an attention or MLP block: its input enters tensor parallelism once.

    Every column layer inside the block (q, k, v; gate, up) reads the same input, and each
    rank's gradient of that input is a partial sum over its output features. Summing once
    here with Megatron's f (identity forward, all-reduce backward) replaces one all-reduce per
    column layer; those layers run in mode "gathered" and do not sum. Under Megatron sequence
    parallelism the input is a sequence slice: it is all-gathered here instead (backward:
    reduce-scatter), and the gathered input carries its shard (:class:`GatheredInput`) so
    that the column layers keep the shard for backward. With ``export_group`` set, f is the
    custom op ``tp_copy`` (tensor/ops.py), so torch.export keeps its backward all-reduce.

    Exportable and under sequence parallelism, the gather is the custom op
    ``tp_seq_gather`` and the gathered input carries (shard, ``key``) as :attr:`SHARD`: the
    block's column layers keep the shard through ``tp_seq_linear``, which shares one
    re-gather per block by ``key`` (tensor/ops_seq.py).

    Registered with ``with_kwargs=True``: Hugging Face decoder layers pass ``hidden_states``
    to the attention as a keyword.

    The two blocks of a parallel layer (Cohere's ``x + attn(norm(x)) + mlp(norm(x))``) share
    a :class:`SharedEntry` (``shared``): the second block handed the very tensor the first
    entered takes the first one's result, so the input enters once for both.
    """

    SHARD = "tessera_gathered_shard"  # exportable: (shard, block key) on the gathered input

    def __init__(self, group: TPGroup, seq_parallel: bool, key: str = "") -> None:
        self.group, self.seq_parallel, self.key = group, seq_parallel, key
        self.export_group: str | None = None
        self.shared: SharedEntry | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        fn = self.enter if self.shared is None else self._enter_shared
        return map_input(module, args, kwargs, fn, "marked for the one input-gradient "
                         "all-reduce of the block")

    def _enter_shared(self, x: torch.Tensor) -> torch.Tensor:
        entered = self.shared.take(x)
        return self.shared.keep(x, self.enter(x)) if entered is None else entered

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """f (or the sequence gather) applied to the block input (B, T, C)."""
        if self.seq_parallel and self.export_group is not None:
            full = tp_seq_gather(x, self.export_group, self.key)  # (B, T/tp, C) -> (B, T, C)
            setattr(full, self.SHARD, (x, self.key))
            return full
        if self.seq_parallel:
            full = GatherSeq.apply(x, self.group)  # (B, T/tp, C) -> (B, T, C)
            # In a checkpointed block the column layers keep the gathered input whole: the
            # checkpoint drops it after the forward, and the recomputation gathers it again
            # just before the block's backward, which then needs no gather of its own.
            if not in_checkpointed_block():
                setattr(full, GatheredInput.ATTRIBUTE, (x, GatheredInput(self.group)))
            return full
        if self.export_group is not None:
            return tp_copy(x, self.export_group)
        return CopyToTP.apply(x, self.group)


class SharedEntry:
    """What the first block of a parallel layer entered, for the second (both pre-hooks hold
    this object). Entering a tensor once for two readers is exact: f is the identity forward
    and all-reducing the sum of two partial gradients equals summing two all-reduces (a
    gather and a reduce-scatter likewise), so a second block handed another tensor, or the
    same one changed in place, enters its own. Autograd adds both blocks' gradients before
    the one backward collective; under sequence parallelism both blocks' column layers then
    share one re-gather. The entry is held from the first block's pre-hook to the second's
    (the layer's forward hook, ``clear``, drops one the second never took)."""

    def __init__(self) -> None:
        self._input: torch.Tensor | None = None
        self._entered: torch.Tensor | None = None
        self._version = -1

    def take(self, x: torch.Tensor) -> torch.Tensor | None:
        """The entered ``x`` if it was kept for it (and ``x`` is unchanged), else None."""
        held, entered = self._input, self._entered
        self.clear()
        if held is x and not x.is_inference() and x._version == self._version:
            return entered
        return None

    def keep(self, x: torch.Tensor, entered: torch.Tensor) -> torch.Tensor:
        if not x.is_inference():  # (an inference tensor has no version to check)
            self._input, self._entered, self._version = x, entered, x._version
        return entered

    def clear(self, *hook_args) -> None:
        self._input = self._entered = None


class RowLinear(nn.Module):
    """1D row-parallel linear: input features split over the tp group, output summed."""

    def __init__(self, weight, bias, group: TPGroup, seq_parallel: bool, conv1d: bool) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.seq_parallel, self.conv1d = group, seq_parallel, conv1d
        self.export_group: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = local(self.weight)
        w = w.t() if self.conv1d else w  # (O, C/tp)
        if self.export_group is not None:
            return self._exportable(F.linear(x, w), self.export_group)  # (B, T, O) partials
        return RowLinearFn.apply(x, w, _opt(self.bias), self.group, self.seq_parallel)

    def _exportable(self, partial: torch.Tensor, name: str) -> torch.Tensor:
        if not self.seq_parallel:
            y = tp_reduce(partial, name)  # (B, T, O), summed
            return y if self.bias is None else tp_add_bias(y, local(self.bias))
        y = tp_seq_reduce_scatter(partial, name)  # (B, T/tp, O): this rank's tokens, summed
        # each rank adds the bias to 1/tp of the tokens: its gradient is summed over tp
        return y if self.bias is None else tp_add_bias(y, tp_copy(local(self.bias), name))


class VocabEmbedding(nn.Module):
    """1D vocabulary-parallel embedding."""

    def __init__(self, weight, group: TPGroup, seq_parallel: bool,
                 scale: float | None = None) -> None:
        super().__init__()
        self.weight, self.group, self.seq_parallel = weight, group, seq_parallel
        self.scale = scale  # Gemma's embedding multiplier sqrt(hidden), None for none
        self.export_group: str | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.seq_parallel:
            check_sequence_length(ids.shape[-1], self.group.size)
        out = self._lookup(ids)
        if self.scale is None:
            return out
        # As Gemma's ScaledWordEmbedding: the scale held in fp32, then rounded to the
        # weight's dtype (directly from the Python float it could round differently).
        scale = torch.tensor(self.scale, dtype=torch.float32, device=out.device)
        return out * scale.to(self.weight.dtype)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.export_group is not None:
            w = local(self.weight)  # (V/tp, C): rows [start, start + V/tp)
            local_ids = ids - self.group.rank * w.shape[0]
            outside = (local_ids < 0) | (local_ids >= w.shape[0])
            out = F.embedding(local_ids.masked_fill(outside, 0), w)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C), a partial sum
            if self.seq_parallel:  # (B, T/tp, C): this rank's tokens
                return tp_seq_reduce_scatter(out, self.export_group)
            return tp_reduce(out, self.export_group)
        return VocabEmbeddingFn.apply(ids, local(self.weight), self.group, self.seq_parallel)


def check_sequence_length(length: int, tp: int) -> None:
    """Refuse a batch Megatron sequence parallelism cannot split evenly over tp ranks."""
    if length % tp:
        raise ValueError(f"tp_seq=on splits the sequence over tp={tp}: this batch's length "
                         f"{length} is not divisible by tp (pad the batch to a multiple, or "
                         "use tp_seq=off)")


class SequenceScatter:
    """Forward pre-hook of a Hugging Face model's first decoder layer under Megatron sequence
    parallelism: the embeddings stay whole up to here (the model builds its attention masks
    and positions from their length), and each rank keeps its chunk of the sequence from
    here on (backward: the gradient all-gathered); :func:`gather_layer_output` makes the last
    layer's output whole again, since the model reshapes it by the whole length (GPT-2). The
    reference model scatters in its embedding and gathers in its LM head instead.
    Registered ``with_kwargs=True`` (``hidden_states`` may be a keyword)."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.export_group: str | None = None  # pipeline stages: the custom op

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return map_input(module, args, kwargs, self.cut, "split over the sequence (tp_seq=on)")

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        check_sequence_length(x.shape[1], self.group.size)
        if self.export_group is not None:
            return tp_seq_scatter(x, self.export_group)
        return ScatterSeq.apply(x, self.group)  # (B, T, C) -> (B, T/tp, C)


class LayerOutputGather:
    """Forward hook of a Hugging Face model's last decoder layer under Megatron sequence
    parallelism: its output (a tensor, or a tuple led by one) gathered to the whole sequence,
    which every rank then carries alike through the final norm and the head (backward: this
    rank's chunk of the gradient)."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.export_group: str | None = None  # pipeline stages: the custom op

    def __call__(self, module: nn.Module, args, output):
        if isinstance(output, tuple):
            return (self.gather(output[0]), *output[1:])
        return self.gather(output)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T/tp, C) -> (B, T, C), equal on every rank."""
        if self.export_group is not None:
            return tp_seq_gather_whole(x, self.export_group)
        return GatherSeqWhole.apply(x, self.group)


class ReplicatedEmbedding(nn.Module):
    """A small table every rank holds (learned positions); under SP each keeps its positions."""

    def __init__(self, weight, group: TPGroup, seq_parallel: bool) -> None:
        super().__init__()
        self.weight, self.group, self.seq_parallel = weight, group, seq_parallel
        self.export_group: str | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = local(self.weight)
        if not self.seq_parallel:
            return F.embedding(ids, w)
        # each rank reads its positions' rows: the weight's gradient is summed over tp
        w = (CopyToTP.apply(w, self.group) if self.export_group is None
             else tp_copy(w, self.export_group))
        out = F.embedding(ids, w)  # (..., T, C)
        return out.chunk(self.group.size, dim=-2)[self.group.rank]  # (..., T/tp, C)


class Norm1D(nn.Module):
    """LayerNorm or RMSNorm (also Gemma's ``x_hat * (1 + w)``, and per-head weights) with
    replicated parameters; under SP on a sequence slice. The math is :func:`normalize`."""

    def __init__(self, weight, bias, eps: float, rms: bool, group: TPGroup,
                 seq_parallel: bool, unit_offset: bool = False, sum_grad: bool = False) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.eps, self.rms, self.group, self.seq_parallel = eps, rms, group, seq_parallel
        self.unit_offset = unit_offset  # Gemma: x_hat * (1 + weight), in fp32
        # A weight shared by all heads applied to this rank's heads only (Gemma 3's q/k norms):
        # each rank's weight gradient is a partial sum over heads.
        self.sum_grad = sum_grad
        self.export_group: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = local(self.weight), _opt(self.bias)
        # Each rank normalised different tokens (SP) or heads: sum their gradients.
        if self.seq_parallel or self.sum_grad:
            w = self._summed_grad(w)
            b = None if b is None else self._summed_grad(b)
        return normalize(x, w, b, self.eps, self.rms, self.unit_offset)

    def _summed_grad(self, t: torch.Tensor) -> torch.Tensor:
        if self.export_group is not None:  # pipeline stages: the collective as a graph node
            return tp_copy(t, self.export_group)
        return CopyToTP.apply(t, self.group)


def normalize(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float, rms: bool,
              unit_offset: bool = False) -> torch.Tensor:
    """The norms tensor parallelism builds, over ``x``'s last dimension.

    LayerNorm (``rms`` False) as ``nn.LayerNorm``, or with a per-head weight ``w`` (H, D) over
    ``x`` (..., H, D) in fp32 (Cohere's q/k norms); RMSNorm in fp32, times ``w`` in ``x``'s
    dtype (Llama), or times ``1 + w`` in fp32 (``unit_offset``: Gemma).
    """
    if not rms and w.dim() > 1:
        return (F.layer_norm(x.float(), (x.shape[-1],), None, None, eps) * w.float()).type_as(x)
    if not rms:
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + w.float())).type_as(x)
    return normed.type_as(x) * w


class Linear2D(nn.Module):
    """2D (SUMMA) linear; the weight is a (rows/q, cols/q) block, the bias a column slice."""

    def __init__(self, weight, bias, grid: Grid, conv1d: bool) -> None:
        super().__init__()
        self.weight, self.bias, self.grid, self.conv1d = weight, bias, grid, conv1d
        self.export_grid: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.export_grid is not None:
            y = summa_linear(x, local(self.weight), self.export_grid, self.conv1d)
            return y if self.bias is None else summa_add_bias(y, local(self.bias),
                                                              self.export_grid)
        fn = Conv1D2DFn if self.conv1d else Linear2DFn
        y = fn.apply(x, local(self.weight), self.grid)  # (B/q, T, O/q)
        return y if self.bias is None else AddBias2DFn.apply(y, local(self.bias), self.grid)


class Embedding2D(nn.Module):
    """2D embedding: the (V, C) table in q x q blocks, output (B/q, T, C/q)."""

    def __init__(self, weight, grid: Grid) -> None:
        super().__init__()
        self.weight, self.grid = weight, grid
        self.export_grid: str | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.export_grid is not None:
            return summa_embedding(ids, local(self.weight), self.export_grid)
        return Embedding2DFn.apply(ids, local(self.weight), self.grid)


class Norm2D(nn.Module):
    """2D LayerNorm / RMSNorm over features split by grid column."""

    def __init__(self, weight, bias, eps: float, rms: bool, features: int, grid: Grid) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.eps, self.rms, self.features, self.grid = eps, rms, features, grid
        self.export_grid: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.export_grid is not None:
            return summa_norm(x, local(self.weight), _opt(self.bias), self.eps, self.rms,
                              self.features, self.export_grid)[0]
        return Norm2DFn.apply(x, local(self.weight), _opt(self.bias), self.eps, self.rms,
                              self.features, self.grid)
