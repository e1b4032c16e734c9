"""Model description from a captured graph: the planner's ModelConfig read off torch.export.

For a causal LM whose config the planner does not know (a Hugging Face ``model_type`` other
than GPT-2 / Llama, or a user's own module), the shape the simulator needs is read from the
graph the pipeline partitioner captures (``tessera.parallel.pipeline.capture``), on the meta
device, so nothing is allocated:

- vocabulary and width from the token embedding (the ``embedding`` op fed by ``input_ids``);
  a second embedding table read with positions means learned positions, else rotary;
- layers from the parameters' block indices (``h.N.`` / ``layers.N.`` / ``blocks.N.``), all
  blocks holding the same parameter shapes (the simulator prices identical blocks);
- in block 0, the attention op (SDPA, or an eager softmax then product) gives heads and head
  width; the weight matmuls feeding it give the key/value heads (their output width is
  ``(heads + 2 kv_heads) * head_dim``); the first weight matmul after it is the output
  projection; the others are the MLP, whose input-side width is ``d_ff`` (one up projection)
  or ``2 d_ff`` (gated: swiglu-priced);
- norms, biases and weight tying from the ops and the placeholders they read.

The description is then checked against the graph: its forward matmul FLOPs and its parameter
count must agree within :data:`MAX_GAP`, or the model is refused with both figures, since a
planner pricing the wrong model would mislead more than it helps.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, replace

import torch
from torch import fx, nn

from tessera.models.config import ModelConfig, ModelConfigError
from tessera.parallel.pipeline.capture import (_BLOCK_INDEX, CaptureError, ProxyGraph, ProxyNode,
                                               capture)
from tessera.parallel.pipeline.cost import VIEW_OPS, matmul_flops, op_name
from tessera.planner.model_spec import ModelSpecError

# The description may differ from the graph by this much in forward matmul FLOPs and in
# parameters: biases on some projections only (Qwen2), a bias on the LM head (Phi), a position
# table sized differently from the priced length (OPT's offset of 2) stay well inside it.
MAX_GAP = 0.05
_MATMULS = frozenset({"linear", "addmm", "mm", "bmm", "matmul"})
_ATTENTION = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                        "_scaled_dot_product_efficient_attention"})
_PASS_THROUGH = VIEW_OPS | {"numpy_T", "to", "_to_copy", "type_as"}  # ops a weight is read via
_RMS_OPS = frozenset({"rms_norm", "_fused_rms_norm", "rsqrt"})
_LAYER_NORM_OPS = frozenset({"layer_norm", "native_layer_norm"})


@dataclass(frozen=True)
class GraphDescription:
    """A ModelConfig read off a captured graph, with the figures it was checked against.

    Attributes:
        config: the description the planner prices.
        graph_params: parameters the graph reads (a tied weight once).
        config_params: parameters of ``config`` with the graph's position table, if learned
            (the priced length may differ from the table's).
        graph_fwd_flops: forward matmul FLOPs of the captured graph (its batch and length).
        config_fwd_flops: the same for ``config`` at the captured batch and length.
        notes: what the description approximates (e.g. biases on some projections only).
    """

    config: ModelConfig
    graph_params: int
    config_params: int
    graph_fwd_flops: float
    config_fwd_flops: float
    notes: tuple[str, ...] = ()

    @property
    def param_gap(self) -> float:
        return abs(self.config_params - self.graph_params) / self.graph_params

    @property
    def flops_gap(self) -> float:
        return abs(self.config_fwd_flops - self.graph_fwd_flops) / self.graph_fwd_flops


def describe_module(model: nn.Module, seq_len: int, capture_len: int = 16
                    ) -> GraphDescription:
    """Capture ``model`` (best on the meta device) and describe it, priced at ``seq_len``.

    The capture uses ``capture_len`` tokens (shapes are read from it, not costs). A Hugging
    Face model's ``use_cache`` is off during the capture and restored after it. The
    description's ``notes`` (biases on only some projections, priced on all) are also warned
    about; positions other than a learned table are priced as rotary without a warning.

    Raises:
        ModelSpecError: when the graph is not a stack of identical transformer blocks, naming
            what differs, or torch.export's failure to capture it (the operation it failed on).
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()  # dropout off: the graph holds no random ops
    try:
        graph = capture(model, 1, capture_len)  # use_cache off inside
    except CaptureError as err:
        raise ModelSpecError(str(err)) from err
    finally:
        for module, training in modes:  # each as it was (a user may freeze some in eval)
            module.training = training
    described = describe_graph(graph, seq_len)
    residual, attention = module_dropout(model)
    # The graph, captured in eval, holds no dropout: the modules say.
    described = replace(described, config=described.config.replace(
        dropout=residual, attention_dropout=attention))
    for note in described.notes:  # what the planner prices differently from the model
        warnings.warn(f"{type(model).__name__} read from its graph: {note}", stacklevel=2)
    return described


def module_dropout(model: nn.Module) -> tuple[float, float | None]:
    """(residual, attention) dropout probabilities ``model`` trains with. Attention's: its
    attention modules' float ``attention_dropout`` (Llama-style attention passes it to SDPA)
    and ``nn.Dropout`` modules named for attention (GPT-2's ``attn_dropout``); None where
    the model has neither, so that the residual's is priced for attention too. Residual: the
    largest of the other ``nn.Dropout`` modules."""
    attention, residual = [], [0.0]
    for name, module in model.named_modules():
        if isinstance(getattr(module, "attention_dropout", None), float):
            attention.append(module.attention_dropout)
        if isinstance(module, nn.Dropout):
            own = name.rpartition(".")[2].lower()
            (attention if "attn" in own or "attention" in own else residual).append(module.p)
    return max(residual), max(attention) if attention else None


def describe_graph(graph: ProxyGraph, seq_len: int | None = None) -> GraphDescription:
    """Describe a captured causal LM for the planner; ``seq_len`` is the length it prices
    (default: the captured length).

    Raises:
        ModelSpecError: naming what the planner cannot price (no blocks, blocks that differ,
            no attention, an MLP that is not one up and one down projection, FLOPs or
            parameters that the description misses by more than MAX_GAP).
    """
    reader = _GraphReader(graph)
    batch, length = reader.batch_shape()
    vocab, width, embed = reader.token_embedding()
    layers = reader.check_blocks()
    heads, head_dim, qkv_width, mlp = reader.attention()
    notes: list[str] = []
    if heads * head_dim != width:
        raise ModelSpecError(f"attention has {heads} heads of width {head_dim}, which is not "
                             f"the hidden width {width}: the planner prices head_dim = "
                             "hidden / heads; describe the model with the shorthand instead")
    kv_heads = _kv_heads(qkv_width, heads, head_dim)
    ffn, gated = _mlp_shape(mlp, width)
    bias_flags = [reader.has_bias(n) for n in reader.block_matmuls]
    if any(bias_flags) and not all(bias_flags):
        notes.append("biases on some projections only: priced as biases on all")
    table_rows = reader.position_table(embed)
    norm = reader.norm()
    try:
        config = ModelConfig(
            vocab_size=vocab, n_layers=layers, d_model=width, n_heads=heads,
            n_kv_heads=kv_heads, d_ff=ffn, max_seq_len=seq_len or length, norm=norm,
            activation="swiglu" if gated else "gelu",
            position="learned" if table_rows else "rope",
            tie_embeddings=reader.head_reads(embed), bias=any(bias_flags))
    except ModelConfigError as err:
        raise ModelSpecError(f"the captured graph gives an invalid model: {err}") from None
    as_captured = config.replace(max_seq_len=table_rows) if table_rows else config
    described = GraphDescription(
        config, reader.param_count(), as_captured.num_params(),
        graph_fwd_flops=sum(matmul_flops(graph.nodes[n].node) for n in graph.compute),
        config_fwd_flops=_config_fwd_flops(config, batch, length), notes=tuple(notes))
    _check_gaps(described)
    return described


def _kv_heads(qkv_width: int, heads: int, head_dim: int) -> int:
    kv_width = qkv_width - heads * head_dim
    if kv_width <= 0 or kv_width % (2 * head_dim) or heads % (kv_width // (2 * head_dim)):
        raise ModelSpecError(f"the projections into attention are {qkv_width} wide, which is "
                             f"not (heads {heads} + 2 x key/value heads) x head_dim {head_dim}")
    return kv_width // (2 * head_dim)


def _mlp_shape(mlp: list[tuple[int, int]], width: int) -> tuple[int, bool]:
    """(d_ff, gated) from the MLP's weight matmuls as (in, out) widths, in graph order: the
    last is the down projection back to the hidden width, the others project up from it."""
    ups = [out for inp, out in mlp[:-1] if inp == width]
    downs = [inp for inp, out in mlp[-1:] if out == width]
    if len(downs) != 1 or len(ups) + 1 != len(mlp) or not ups:
        raise ModelSpecError(f"block 0's MLP has weight matmuls (in, out) {mlp}; the planner "
                             "prices one or two up projections from the hidden width and one "
                             "down projection (no mixture of experts)")
    ffn, up_width = downs[0], sum(ups)
    if up_width not in (ffn, 2 * ffn):
        raise ModelSpecError(f"block 0's MLP projects up to {up_width} but down from {ffn}: "
                             "neither a plain nor a gated MLP")
    return ffn, up_width == 2 * ffn


def _config_fwd_flops(config: ModelConfig, batch: int, length: int) -> float:
    """Forward matmul FLOPs of ``config`` for (batch, length) tokens: a third of training's."""
    return config.flops_per_token(length) / 3.0 * batch * length


def _check_gaps(described: GraphDescription) -> None:
    for what, gap, ours, theirs in (
            ("forward matmul FLOPs", described.flops_gap, described.config_fwd_flops,
             described.graph_fwd_flops),
            ("parameters", described.param_gap, described.config_params,
             described.graph_params)):
        if gap > MAX_GAP:
            raise ModelSpecError(
                f"the model read from the graph misses its {what} by {gap:.1%} (described "
                f"{ours:.4g}, graph {theirs:.4g}; at most {MAX_GAP:.0%}): it holds something "
                "the planner does not price; describe it with the shorthand instead")


class _GraphReader:
    """Queries on one captured graph (names are fx node names)."""

    def __init__(self, graph: ProxyGraph) -> None:
        self.graph = graph
        self.block0 = [n for n in graph.compute if graph.nodes[n].block == 0]
        self.block_matmuls = [n for n in self.block0 if self._weight_of(n) is not None]

    # ----------------------------------------------------------------- inputs and embedding
    def batch_shape(self) -> tuple[int, int]:
        ids = self.graph.nodes[self.graph.inputs[0]].node.meta["val"]
        return int(ids.shape[0]), int(ids.shape[-1])

    def token_embedding(self) -> tuple[int, int, str]:
        """(vocab, width, weight placeholder) of the embedding fed by the token ids."""
        ids = self.graph.inputs[0]
        for name in self.graph.compute:
            node = self.graph.nodes[name].node
            if op_name(node) == "embedding" and self._root(node.args[1]) == ids:
                weight = self._root(node.args[0])
                rows, width = self._val(weight).shape
                return int(rows), int(width), weight
        raise ModelSpecError("no token embedding found (an embedding op reading input_ids): "
                             "the planner describes causal language models")

    def position_table(self, embed: str) -> int:
        """Rows of a second embedding table (learned positions), 0 when there is none."""
        for name in self.graph.compute:
            node = self.graph.nodes[name].node
            table = self._root(node.args[0]) if op_name(node) == "embedding" else None
            if table not in (embed, None):
                return int(self._val(table).shape[0])
        return 0

    def head_reads(self, embed: str) -> bool:
        """Whether the output head's matmul reads the token embedding (tied weights)."""
        heads = [n for n in self.graph.compute
                 if self.graph.nodes[n].block is None and self._weight_of(n) is not None]
        return bool(heads) and self._weight_of(heads[-1]) == embed

    # ----------------------------------------------------------------------------- blocks
    def check_blocks(self) -> int:
        """Number of blocks, after checking that all hold block 0's parameter shapes."""
        shapes: dict[int, Counter] = {}
        for name, node in self.graph.nodes.items():
            if node.kind != "param":
                continue
            match = _BLOCK_INDEX.search("." + node.fqn)
            if match:
                suffix = node.fqn[match.end() - 1:]
                shapes.setdefault(int(match.group(1)), Counter())[
                    (suffix, tuple(self._val(name).shape))] += 1
        if not shapes:
            raise ModelSpecError("no transformer blocks found: parameters are not named "
                                 "'h.N.', 'layers.N.' or 'blocks.N.'")
        if sorted(shapes) != list(range(len(shapes))):
            raise ModelSpecError(f"block indices {sorted(shapes)} are not 0..{len(shapes) - 1}")
        for index, counter in shapes.items():
            if counter != shapes[0]:
                differ = sorted((counter - shapes[0]) + (shapes[0] - counter))[0]
                raise ModelSpecError(
                    f"block {index} differs from block 0 (parameter {differ[0]} {differ[1]}): "
                    "the planner prices identical blocks; describe the model with the "
                    "shorthand of its largest block")
        if not self.block0:
            raise ModelSpecError("block 0 computes nothing")
        return len(shapes)

    def attention(self) -> tuple[int, int, int, list[tuple[int, int]]]:
        """(heads, head_dim, width of the projections into attention, the MLP's weight
        matmuls as (in, out) widths in graph order). The output projection, the first weight
        matmul after the attention op, is in neither."""
        anchor, heads, head_dim = self._attention_op()
        before = self._ancestors(anchor)
        qkv = [n for n in self.block_matmuls if n in before]
        after = [n for n in self.block_matmuls if n not in before]
        downstream = self._descendants(anchor)
        o_proj = next((n for n in after if n in downstream), None)
        if not qkv or o_proj is None:
            raise ModelSpecError("block 0's attention is not fed by weight projections and "
                                 "followed by an output projection")
        mlp = [self._dims(n) for n in after if n != o_proj]
        return heads, head_dim, sum(self._dims(n)[1] for n in qkv), mlp

    def _attention_op(self) -> tuple[fx.Node, int, int]:
        nodes = [self.graph.nodes[n].node for n in self.block0]
        for node in nodes:
            if op_name(node) in _ATTENTION:
                q = self._val(node.args[0].name).shape  # (B, heads, T, head_dim)
                return node, int(q[1]), int(q[-1])
        batch = self.batch_shape()[0]
        for node in nodes:  # eager attention: softmax(q k^T) then p @ v
            if op_name(node) not in ("softmax", "_softmax"):
                continue  # (other nodes' values may be lists: a split's)
            scores = self._val(node.name).shape  # (B, heads, T, T) or (B * heads, T, T)
            if len(scores) not in (3, 4):
                continue
            pv = next((u for u in self._descendant_nodes(node) if op_name(u) in _MATMULS
                       and self._weight_of(u.name) is None), None)
            if pv is not None:  # (B, heads, T, head_dim) or (B * heads, T, head_dim)
                heads = scores[1] if len(scores) == 4 else scores[0] // batch
                return pv, int(heads), int(self._val(pv.name).shape[-1])
        raise ModelSpecError("no attention found in block 0 (scaled_dot_product_attention, or "
                             "a softmax over (B, heads, T, T) or (B * heads, T, T) scores "
                             "followed by a product)")

    def norm(self) -> str:
        ops = {op_name(self.graph.nodes[n].node) for n in self.block0}
        return "rmsnorm" if ops & _RMS_OPS and not ops & _LAYER_NORM_OPS else "layernorm"

    def has_bias(self, name: str) -> bool:
        node = self.graph.nodes[name].node
        if op_name(node) == "addmm":
            return True
        return op_name(node) == "linear" and len(node.args) > 2 and node.args[2] is not None

    def param_count(self) -> int:
        """Parameters the graph reads. torch.export lifts each name of a tied weight as its own
        placeholder and reads one of them, so unread placeholders are not counted."""
        return sum(self._val(n).numel() for n, p in self.graph.nodes.items()
                   if p.kind == "param" and p.node.users)

    # ---------------------------------------------------------------------------- helpers
    def _val(self, name: str) -> torch.Tensor:
        return self.graph.nodes[name].node.meta["val"]

    def _root(self, arg) -> str | None:
        """The placeholder a value is read from through views and casts, else None."""
        while isinstance(arg, fx.Node):
            proxy: ProxyNode | None = self.graph.nodes.get(arg.name)
            if proxy is not None and proxy.kind in ("param", "input", "buffer"):
                return arg.name
            if proxy is not None and proxy.kind == "param_view":
                arg = arg.all_input_nodes[0]
                continue
            if op_name(arg) not in _PASS_THROUGH or not arg.all_input_nodes:
                return None
            arg = arg.all_input_nodes[0]
        return None

    def _weight_of(self, name: str) -> str | None:
        """The parameter a matmul node multiplies by, else None."""
        node = self.graph.nodes[name].node
        if op_name(node) not in _MATMULS:
            return None
        for arg in node.all_input_nodes:
            root = self._root(arg)
            if root is not None and self.graph.nodes[root].kind == "param" \
                    and len(self._val(root).shape) == 2:
                return root
        return None

    def _dims(self, name: str) -> tuple[int, int]:
        """(in, out) widths of a weight matmul: the activation's last dim and the output's."""
        node = self.graph.nodes[name].node
        activation = node.args[1] if op_name(node) == "addmm" else node.args[0]
        return int(activation.meta["val"].shape[-1]), int(node.meta["val"].shape[-1])

    def _ancestors(self, node: fx.Node) -> set[str]:
        seen: set[str] = set()
        stack = list(node.all_input_nodes)
        while stack:
            current = stack.pop()
            if current.name not in seen:
                seen.add(current.name)
                stack.extend(current.all_input_nodes)
        return seen

    def _descendant_nodes(self, node: fx.Node) -> list[fx.Node]:
        block0 = set(self.block0)
        seen: dict[str, fx.Node] = {}
        stack = list(node.users)
        while stack:
            current = stack.pop()
            if current.name in block0 and current.name not in seen:
                seen[current.name] = current
                stack.extend(current.users)
        order = {name: i for i, name in enumerate(self.block0)}
        return sorted(seen.values(), key=lambda n: order[n.name])

    def _descendants(self, node: fx.Node) -> set[str]:
        return {n.name for n in self._descendant_nodes(node)}
