"""Apply 1D or 2D tensor parallelism to an unmodified model, by its architecture's policy.

The first step of :func:`tessera.parallel.parallelize`. Every module whose path matches the
policy is replaced by its tensor-parallel counterpart (same parameter names); the parameters
become DTensors holding this rank's shard; the plan gets the loss over vocabulary-sharded
logits and a gradient clip that counts each shard once.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from tessera.mesh import Mesh
from tessera.models.materialize import DeferredInit, FewAtATime, materialize_unit
from tessera.parallel.plan import Parallelized
from tessera.parallel.tensor.attention import install_head_dropout
from tessera.parallel.tensor.comm import CommCounter, Grid, TPGroup
from tessera.parallel.tensor.data_parallel import ShardGradSync
from tessera.parallel.tensor.deferred import PendingShards, ShardRecipe
from tessera.parallel.tensor.loss import (make_clip_grad_norm, make_forward_loss_1d,
                                          make_forward_loss_2d)
from tessera.parallel.tensor.layer_hooks import (check_block_inputs, scatter_at_first_layer,
                                                 share_block_entries)
from tessera.parallel.tensor.modules import (BlockInput, ColumnLinear, Embedding2D,
                                             LayerOutputGather, Linear2D, Norm1D, Norm2D,
                                             ReplicatedEmbedding, RowLinear, SequenceScatter,
                                             VocabEmbedding)
from tessera.parallel.tensor.ops import register_group
from tessera.parallel.tensor.probe import check_embedding, check_norm
from tessera.parallel.tensor.ops2d import register_grid
from tessera.parallel.tensor.policy import (DROPOUT_STYLES, ONE_D_STYLES, ModelDims,
                                            PolicyError, check_divisible, model_dims,
                                            policy_for, style_of)
from tessera.parallel.tensor.seq_dropout import SequenceChunkDropout, shard_sequence_dropouts
from tessera.parallel.tensor.shard import (accept_full_tensors, add_optimizer_unpermute_hooks,
                                           add_unpermute_hooks, fused_perm, make_param,
                                           permuted_params)
from tessera.strategy import Strategy


def apply_tensor_parallel(plan: Parallelized, strategy: Strategy, mesh: Mesh,
                          counter: CommCounter | None = None,
                          deferred: DeferredInit | None = None) -> None:
    """Shard ``plan.model`` in place over the mesh's tensor axes and set the plan's loss/clip.

    Args:
        plan: the plan being built; ``plan.model`` is changed in place.
        strategy: tp and tp_mode ("1d" Megatron, "2d" Optimus SUMMA); tp_seq="on" adds
            Megatron sequence parallelism around norms and dropout (1D; a Hugging Face model
            keeps its embeddings whole for its masks and splits at its first layer; its
            dropout modules need a dropout style in its policy, ``unplaced_dropouts``).
        mesh: gives the tp group (1D) or the grid's row and column groups (2D).
        counter: counts collective bytes (benchmarks).
        deferred: for a model on the meta device, how to materialise it. Each transformer
            block's weights (each other replaced module's) are then materialised whole just
            before being cut into this rank's shards (models/materialize.py, FewAtATime), so a
            rank never holds more than its shards and one block's weights whole. Under pp > 1
            the shards stay on meta and ``plan.pending_shards`` fills those of this rank's
            stages (deferred.py).

    Raises:
        PolicyError: unknown architecture, sizes not divisible, or an unsupported mix.
    """
    if strategy.tp == 1:
        return
    model = plan.model
    policy, dims = policy_for(model), model_dims(model)
    what = f"tp={strategy.tp} (tp_mode={strategy.tp_mode})"
    sequence_parallel = strategy.tp_seq == "on"
    _check_mix(strategy, what)
    if strategy.tp_mode == "2d":  # (Strategy refuses tp_seq=on with 2d)
        grid = Grid.from_mesh(mesh, counter)
        check_divisible(dims, grid.q, kv_ways_ok=False, what=what)
        builder = _Builder2D(dims, grid, mesh.submesh("tp_row", "tp_col"))
        plan.forward_loss = make_forward_loss_2d(grid)
    else:
        if sequence_parallel and dims.hf:
            _check_hf_dropouts(model, policy, what)
        group = TPGroup(mesh.group("tp"), counter)
        if sequence_parallel and not dims.hf:  # each chunk dropped as one device drops it
            shard_sequence_dropouts(model, group)  # (a Hugging Face model's: its policy's)
        check_divisible(dims, group.size, kv_ways_ok=True, what=what)
        builder = _Builder1D(dims, group, mesh.submesh("tp"), sequence_parallel)
        plan.forward_loss = make_forward_loss_1d(group)
    if deferred is not None:
        builder.source = FewAtATime(model, deferred)  # copied while on meta: no storage
        builder.defer = strategy.pp > 1  # the pipeline fills its stages' shards
        deferred(model, ())  # buffers only (RoPE tables, masks); weights come from ``source``
    _replace_modules(model, policy, builder)
    if builder.recipes:  # under pp: the pipeline fills its stages' shards
        plan.pending_shards = PendingShards(builder.source, builder.recipes)
    if isinstance(builder, _Builder1D):
        share_block_entries(model, builder)
        check_block_inputs(model, builder)
        if sequence_parallel and dims.hf:
            scatter_at_first_layer(model, builder)
    if strategy.pp > 1:  # the pipeline captures the model: collectives must be graph nodes
        _make_exportable(model, builder)
    if permuted_params(model):
        plan.build_optimizer = _with_unpermute_hooks(plan.build_optimizer)
    plan.clip_grad_norm = make_clip_grad_norm(TPGroup(mesh.group("tp")))
    # Weights are replicated over dp x sp; under pp the pipeline's GradSync averages instead,
    # under memory=chunk the chunks' reduce-scatter.
    if strategy.dp * strategy.sp > 1 and strategy.pp == 1 and strategy.memory != "chunk":
        ShardGradSync(model, mesh.flat_group("dp", "sp")).attach(plan.module)
    plan.features.append(f"tensor_parallel_{strategy.tp_mode}")
    if sequence_parallel:
        plan.features.append("tp_sequence_parallel")
    # 1D: attention dropout masks per head (attention.py); sp > 1 installs its own attention,
    # whose masks are already keyed by the layer's heads.
    if (isinstance(builder, _Builder1D) and strategy.sp == 1
            and install_head_dropout(model, builder.attentions, builder.group.rank,
                                     exportable=strategy.pp > 1)):
        plan.features.append("tp_attention_dropout")


def _make_exportable(model: nn.Module, builder: "_Builder1D | _Builder2D") -> None:
    """Switch the layers to custom ops (1D: tensor/ops.py, 2D: tensor/ops2d.py)."""
    if isinstance(builder, _Builder2D):
        name = register_grid(builder.grid)
        for module in model.modules():
            if isinstance(module, (Linear2D, Embedding2D, Norm2D)):
                module.export_grid = name
        return
    name = register_group(builder.group)
    for module in model.modules():
        if isinstance(module, (ColumnLinear, RowLinear, VocabEmbedding, Norm1D,
                               ReplicatedEmbedding)):
            module.export_group = name
    for hook in [*builder.block_inputs.values(), *builder.sequence_hooks]:
        hook.export_group = name


def _with_unpermute_hooks(base):
    """An optimizer builder whose state dicts hold fused q|k|v states unpermuted."""

    def build(model: nn.Module, *args, **kwargs):
        from tessera.train.optim import build_optimizer

        optimizer = (base or build_optimizer)(model, *args, **kwargs)
        add_optimizer_unpermute_hooks(optimizer, model)
        return optimizer

    return build


def _check_mix(strategy: Strategy, what: str) -> None:
    """Refuse option mixes this runtime does not compose yet, naming the rule (also for a
    direct call, which has not been through ``Strategy.require_available``)."""
    if strategy.sp > 1 and strategy.tp_mode == "2d":
        # sp x 1d works, with tp_seq=on too (parallel/sequence/compose.py); 2d does not.
        raise PolicyError(f"{what} with sp={strategy.sp}: context (sp) parallelism composes "
                          "with 1d tensor parallelism only; see docs/sequence_parallel.md")
    if strategy.pp > 1 and strategy.tp_mode == "2d" and strategy.tp_overlap == "subpipe":
        raise PolicyError(f"{what} with pp={strategy.pp}: tp_overlap=subpipe overlaps 1D "
                          "all-reduces; 2D (SUMMA) layers have none to overlap. Use "
                          "tp_overlap=none or tp_mode=1d")
    if strategy.memory not in ("ddp", "chunk"):
        raise PolicyError(f"{what} with memory={strategy.memory}: only memory=ddp and "
                          "memory=chunk (chunks holding the local shards) are built")
    q = strategy.tp_grid[0]
    if strategy.tp_mode == "2d" and strategy.micro_batch_size % q:
        raise PolicyError(f"{what} splits each micro-batch over the {q} grid rows: "
                          f"mbs={strategy.micro_batch_size} must be divisible by {q}")


def _replace_modules(model: nn.Module, policy, builder) -> None:
    for path, module in list(model.named_modules()):
        style = style_of(path, policy)
        if style is None:
            continue
        builder.fetch_wholes(model, path)
        try:
            new = builder.build(style, module)
        except PolicyError as err:
            raise PolicyError(f"{path}: {err}") from None
        if new is not None:
            accept_full_tensors(new)
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, name, new)
    builder.wholes = {}  # frees the last unit's whole values: the modules hold only shards
    missed = sorted({n.rpartition(".")[0] for n, p in model.named_parameters()
                     if not isinstance(p, DTensor)})
    if missed:
        raise PolicyError(
            f"modules {', '.join(missed)} of {type(model).__name__} have parameters but no "
            f"style: add patterns for them to POLICIES[{type(model).__name__!r}] in "
            "tessera/parallel/tensor/policy.py")


def unplaced_dropouts(model: nn.Module, policy) -> list[str]:
    """Paths of ``model``'s dropout modules that drop but have no dropout style in its
    policy (policy.DROPOUT_STYLES): Megatron sequence parallelism cannot tell whether they
    act on a sequence chunk, on a whole tensor or on attention probabilities. An attention
    module's own rate (Llama's ``attention_dropout``) goes to tensor/attention.py's per-head
    masks and needs no style."""
    return [path for path, m in model.named_modules()
            if isinstance(m, nn.Dropout) and m.p > 0
            and style_of(path, policy) not in DROPOUT_STYLES]


def _check_hf_dropouts(model: nn.Module, policy, what: str) -> None:
    """Megatron sequence parallelism on a Hugging Face model drops the sequence chunks of its
    ``seq_dropout`` modules as one device drops those tokens; a dropout module of no dropout
    style is refused (its tensor is not known)."""
    unplaced = unplaced_dropouts(model, policy)
    if unplaced:
        raise PolicyError(f"{what} with tp_seq=on: {type(model).__name__} drops activations "
                          f"in modules of no dropout style ({', '.join(unplaced[:3])}"
                          f"{', ...' if len(unplaced) > 3 else ''}): Megatron sequence "
                          "parallelism splits the tokens between the layers and must know "
                          "what each dropout acts on. Give them a style in the policy "
                          "(seq_dropout, whole_dropout or probs_dropout; "
                          "tessera/parallel/tensor/policy.py), set their p to 0, or use "
                          "tp_seq=off")


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"  # GPT-2: weight (in, out)


class _Builder:
    """Shared by both modes: parameter conversion (tied weights converted once)."""

    def __init__(self, dims: ModelDims, dmesh) -> None:
        self.dims, self.dmesh = dims, dmesh
        # id -> (original, converted): holding the original keeps its id from being reused.
        self._done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        # A model on meta (apply_tensor_parallel's ``deferred``): where whole values come from,
        # and whether shards stay on meta (``defer``), each with the recipe that fills it.
        self.source: FewAtATime | None = None
        self.defer = False
        self.wholes: dict[int, torch.Tensor] = {}  # id -> whole value of a meta parameter
        self.recipes: dict[int, ShardRecipe] = {}  # id(meta DTensor parameter) -> recipe
        self._unit: str | None = None  # the unit ``wholes`` holds

    def fetch_wholes(self, model: nn.Module, path: str) -> None:
        """Before the module at ``path`` is built: materialise whole, in one request, the
        weights not converted yet (a tied one is converted once) of its unit (its transformer
        block, else itself; materialize_unit), dropping the previous unit's."""
        unit = materialize_unit(path)
        if self.source is None or self.defer or unit == self._unit:
            return
        self.wholes = {}  # the previous unit's modules are built: only their shards remain
        owner = model.get_submodule(unit)
        self._unit = unit
        self.wholes = self.source.whole(p for p in owner.parameters()
                                        if id(p) not in self._done)

    def param(self, p, placements, perm=None, perm_dim=0):
        if p is None:
            return None
        if id(p) not in self._done:
            full = self.wholes.get(id(p), p).detach()
            if full.is_meta and not self.defer:  # a style reading a weight not its module's
                raise PolicyError(f"a {tuple(full.shape)} weight is still on the meta device "
                                  "when its tensor-parallel module is built")
            if perm is not None:
                full = full.index_select(perm_dim, perm.to(full.device))
            new = make_param(full, self.dmesh, placements, p.requires_grad)
            if full.is_meta:
                self.recipes[id(new)] = ShardRecipe(p, self.dmesh, placements, perm, perm_dim)
            self._done[id(p)] = (p, new)
        return self._done[id(p)][1]

    def attention(self, module: nn.Module, ways: int, kv_local: int) -> None:
        # Hugging Face attention reads these counts; the reference model infers them.
        heads = self.dims.n_heads // ways
        for name, value in (("num_heads", heads), ("n_heads", heads),
                            ("num_key_value_heads", kv_local), ("n_kv_heads", kv_local),
                            ("num_key_value_groups", heads // kv_local),
                            ("split_size", self.dims.d_model // ways)):
            if hasattr(module, name):
                setattr(module, name, value)


class _Builder1D(_Builder):
    def __init__(self, dims: ModelDims, group: TPGroup, dmesh, seq_parallel: bool) -> None:
        super().__init__(dims, dmesh)
        self.group, self.sp = group, seq_parallel
        # Column layers inside attention / MLP: the block's BlockInput pre-hook sums their
        # input gradient once (f), or under SP gathers the input (backward: reduce-scatter).
        self.inner = "gathered"
        self.block_inputs: dict[int, BlockInput] = {}  # id(block module) -> its pre-hook
        self.attentions: list[nn.Module] = []  # the modules of style "attention"
        # A Hugging Face model's scatter at its first layer, gather after its last (tp_seq)
        self.sequence_hooks: list[SequenceScatter | LayerOutputGather] = []

    def hook_block_input(self, block: nn.Module) -> None:
        """Give ``block`` (attention or MLP) the pre-hook that applies f to its input once
        (its key names the block for its column layers' shared re-gather under tp_seq)."""
        hook = BlockInput(self.group, self.sp, key=f"block{len(self.block_inputs)}")
        block.register_forward_pre_hook(hook, with_kwargs=True)
        self.block_inputs[id(block)] = hook

    def build(self, style: str, m: nn.Module) -> nn.Module | None:
        g, sp, rep, s0, s1 = self.group, self.sp, (Replicate(),), (Shard(0),), (Shard(1),)
        conv = _is_conv1d(m)
        out_dim, in_dim = (s1, s0) if conv else (s0, s1)  # weight dims of out / in features
        kv_split = self.dims.n_kv_heads % g.size == 0
        # The attention / MLP input gets f (under SP: is gathered) once, in a pre-hook, so the
        # column layers inside need no collective; the row layers all-reduce (SP:
        # reduce-scatter) their partial outputs.
        if style == "colwise" or (style == "colwise_kv" and kv_split):
            return ColumnLinear(self.param(m.weight, out_dim), self.param(m.bias, s0), g,
                                self.inner, conv)
        if style == "colwise_kv":  # fewer kv heads than ranks: replicate, pick this rank's head
            head = g.rank // (g.size // self.dims.n_kv_heads)
            rows = slice(head * self.dims.head_dim, (head + 1) * self.dims.head_dim)
            return ColumnLinear(self.param(m.weight, rep), self.param(m.bias, rep), g,
                                self.inner, conv, rows=rows)
        if style == "colwise_qkv":
            return self._fused_qkv(m, conv, out_dim)
        if style == "rowwise":
            return RowLinear(self.param(m.weight, in_dim), self.param(m.bias, rep), g, sp, conv)
        if style == "vocab_embed":
            scale = getattr(m, "scalar_embed_scale", None)  # Gemma's sqrt(hidden)
            check_embedding(m, style, scale)
            # A Hugging Face model's embeddings stay whole: its first layer scatters them
            return VocabEmbedding(self.param(m.weight, s0), g, sp and not self.dims.hf, scale)
        if style == "vocab_head":
            # a Hugging Face model's last layer gathers the sequence (scatter_at_first_layer)
            head_mode = "gather" if sp and not self.dims.hf else "replicated"
            return ColumnLinear(self.param(m.weight, s0), self.param(m.bias, s0), g, head_mode,
                                False)
        if style == "position":
            return ReplicatedEmbedding(self.param(m.weight, rep), g, sp and not self.dims.hf)
        if style in ("norm", "layernorm", "rmsnorm_1p"):
            rms = style == "rmsnorm_1p" or (style == "norm" and not isinstance(m, nn.LayerNorm))
            unit = style == "rmsnorm_1p"
            check_norm(m, style, _eps(m), rms, unit)
            return Norm1D(self.param(m.weight, rep), self.param(getattr(m, "bias", None), rep),
                          _eps(m), rms, g, sp, unit_offset=unit)
        # Norms over each head's features, after the column projections: their input holds
        # this rank's heads over the whole sequence (no Megatron sequence split there).
        if style in ("head_rmsnorm", "head_rmsnorm_1p"):  # (head_dim,) shared by all heads
            unit = style == "head_rmsnorm_1p"  # Gemma 3's x_hat * (1 + w); Qwen 3's x_hat * w
            check_norm(m, style, _eps(m), True, unit)
            return Norm1D(self.param(m.weight, rep), None, _eps(m), True, g, False,
                          unit_offset=unit, sum_grad=True)
        if style == "head_norm":  # Cohere's q/k LayerNorm, weight (heads, head_dim): by heads
            if m.weight.shape[0] % g.size:
                raise PolicyError(f"{style}: {m.weight.shape[0]} heads of a per-head norm are "
                                  f"not divisible by tp={g.size}")
            check_norm(m, style, _eps(m), False)
            return Norm1D(self.param(m.weight, s0), None, _eps(m), False, g, False)
        if style == "seq_dropout" and sp and m.p > 0:  # on this rank's sequence chunk
            return SequenceChunkDropout(m.p, g)
        if style in DROPOUT_STYLES:
            return None
        if style in ("attention", "mlp"):
            if style == "attention":
                kv = self.dims.n_kv_heads
                self.attention(m, g.size, kv // g.size if kv % g.size == 0 else 1)
                self.attentions.append(m)
            self.hook_block_input(m)
            return None
        raise PolicyError(f"unknown tensor-parallel style {style!r}")

    def _fused_qkv(self, m: nn.Module, conv: bool, out_dim) -> nn.Module:
        width = m.weight.shape[1 if conv else 0]
        perm = fused_perm(width, 3, self.group.size)
        w = self.param(m.weight, out_dim, perm, 1 if conv else 0)
        b = self.param(m.bias, (Shard(0),), perm, 0)
        new = ColumnLinear(w, b, self.group, self.inner, conv)
        _unpermute(new, perm, 1 if conv else 0)
        return new


class _Builder2D(_Builder):
    def __init__(self, dims: ModelDims, grid: Grid, dmesh) -> None:
        super().__init__(dims, dmesh)
        self.grid = grid

    def build(self, style: str, m: nn.Module) -> nn.Module | None:
        block, vec = (Shard(0), Shard(1)), (Replicate(), Shard(0))
        conv = _is_conv1d(m)
        if style in ("colwise", "colwise_kv", "rowwise", "vocab_head"):
            return Linear2D(self.param(m.weight, block), self.param(m.bias, vec), self.grid, conv)
        if style == "colwise_qkv":
            dim = 1 if conv else 0
            perm = fused_perm(m.weight.shape[dim], 3, self.grid.q)
            new = Linear2D(self.param(m.weight, block, perm, dim),
                           self.param(m.bias, vec, perm, 0), self.grid, conv)
            _unpermute(new, perm, dim)
            return new
        if style == "vocab_embed" and getattr(m, "scalar_embed_scale", None) not in (None, 1.0):
            raise PolicyError(f"{type(m).__name__} scales its embedding (Gemma's): built for "
                              "tp_mode=1d only")
        if style in ("vocab_embed", "position"):
            return Embedding2D(self.param(m.weight, block), self.grid)
        if style == "norm":
            check_norm(m, style, _eps(m), not isinstance(m, nn.LayerNorm))
            return Norm2D(self.param(m.weight, vec), self.param(getattr(m, "bias", None), vec),
                          _eps(m), not isinstance(m, nn.LayerNorm), self.dims.d_model, self.grid)
        if style == "attention":
            self.attention(m, self.grid.q, self.dims.n_kv_heads // self.grid.q)
        if style in ("attention", "mlp") or style in DROPOUT_STYLES:
            return None
        if style in ONE_D_STYLES:
            raise PolicyError(f"style {style!r} ({type(m).__name__}) is built for tp_mode=1d "
                              "only: use tp_mode=1d")
        raise PolicyError(f"unknown tensor-parallel style {style!r}")


def _unpermute(module: nn.Module, perm, weight_dim: int) -> None:
    add_unpermute_hooks(module, "weight", weight_dim, perm)
    if module.bias is not None:
        add_unpermute_hooks(module, "bias", 0, perm)


def _eps(norm: nn.Module) -> float:
    return getattr(norm, "eps", None) or getattr(norm, "variance_epsilon")
