"""Checks run inside the gloo workers of the tensor-parallel tests (importable by spawn).

Each check returns the largest absolute difference between the tensor-parallel result and the
single-device one, gathered to the single-device layout; the test files assert on them.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch
from torch import nn

from tessera.mesh import Mesh
from tessera.models import Transformer
from tessera.models.config import preset
from tessera.models.hf import build_hf_model, hf_config_from_reference
from tessera.models.materialize import DeferredInit, materialize, materialize_unit
from tessera.parallel import parallelize
from tessera.parallel.plan import Parallelized, default_forward_loss, lm_loss
from tessera.parallel.recompute import apply_recompute, find_blocks
from tessera.parallel.tensor import apply_tensor_parallel
from tessera.parallel.tensor import comm, layers1d, layers2d, loss
from tessera.parallel.tensor.apply import _Builder1D, _Builder2D
from tessera.parallel.tensor.comm import Grid, TPGroup
from tessera.parallel.tensor.policy import model_dims
from tessera.parallel.tensor.shard import local, unsharded
from tessera.strategy import Strategy

AUTOGRAD_FUNCTIONS = [comm.CopyToTP, comm.ReduceFromTP, comm.GatherSeq, layers1d.ColumnLinearFn,
                      layers1d.RowLinearFn,
                      layers1d.VocabEmbeddingFn, layers2d.Linear2DFn, layers2d.Conv1D2DFn,
                      layers2d.AddBias2DFn, layers2d.Norm2DFn, layers2d.Embedding2DFn,
                      loss.VocabParallelCrossEntropyFn]
B, T = 4, 16


def record_gradient_counts() -> dict[str, set]:
    """Wrap each Function's forward/backward to record (inputs, gradients returned)."""
    seen: dict[str, set] = {}
    for fn in AUTOGRAD_FUNCTIONS:
        fwd, bwd = fn.forward, fn.backward

        def forward(ctx, *args, _fwd=fwd):
            ctx.n_inputs = len(args)
            return _fwd(ctx, *args)

        def backward(ctx, *grads, _bwd=bwd, _name=fn.__name__):
            out = _bwd(ctx, *grads)
            out = out if isinstance(out, tuple) else (out,)
            seen.setdefault(_name, set()).add((ctx.n_inputs, len(out)))
            return out

        fn.forward, fn.backward = staticmethod(forward), staticmethod(backward)
    return seen


def _gradient_gap(single: nn.Module, parallel: nn.Module) -> dict:
    """The largest gradient difference between the tp model (shards gathered) and one
    device's: absolute, relative to the largest gradient, and how many were compared."""
    ref_grads, scale, worst, count = dict(single.named_parameters()), 0.0, 0.0, 0
    for name, p in parallel.named_parameters():
        owner = parallel.get_submodule(name.rpartition(".")[0])
        full = unsharded(owner, name.rpartition(".")[2], p.grad)
        worst = max(worst, _diff(full, ref_grads[name].grad))
        scale = max(scale, ref_grads[name].grad.abs().max().item())
        count += 1
    # Relative to the largest gradient: a missing reduction is off by a sizeable fraction.
    return {"grad": worst, "grad_rel": worst / scale, "params": count}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.detach().float() - b.detach().float()).abs().max().item()


def meshes() -> dict[str, Mesh]:
    """1D tp=2 (two tp groups under dp=2), 1D tp=4 and the 2x2 grid, on 4 ranks."""
    return {"1d_tp2": Mesh(Strategy(dp=2, tp=2, global_batch_size=2), "cpu"),
            "1d_tp4": Mesh(Strategy(tp=4), "cpu"),
            "2d_2x2": Mesh(Strategy(tp=4, tp_mode="2d", micro_batch_size=2,
                                    global_batch_size=2), "cpu")}


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "ref-gpt":
        return Transformer(preset("tiny"))
    if kind == "ref-llama":
        return Transformer(preset("tiny-llama"))
    arch = kind.split("-")[1]
    ref = preset("tiny" if arch == "gpt2" else "tiny-llama")
    if arch not in ("gpt2", "llama"):
        return _llama_layout(arch, hf_config_from_reference("llama", ref))
    return build_hf_model(arch, **hf_config_from_reference(arch, ref))


# Configs beyond Llama's shape: Granite's multipliers (embeddings, residuals, attention
# scores, logits), which a policy that bypassed the model's own forward would lose.
LLAMA_LAYOUT_EXTRA = {"granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                                      attention_multiplier=0.2, logits_scaling=2.0),
                      # 4 layers: the 4th has no rotary embedding (SmolLM3's NoPE layers)
                      "smollm3": dict(num_hidden_layers=4, no_rope_layer_interval=4),
                      # Hugging Face's Helium needs heads * head_dim == hidden (its o_proj)
                      "helium": dict(head_dim=16),
                      # logits not scaled down 16x (Cohere's default 0.0625 hides differences)
                      "cohere": dict(logit_scale=1.0),
                      # a LayerNorm per head on q and k (policy style head_norm)
                      "cohere_qk": dict(logit_scale=1.0, use_qk_norm=True),
                      # no grouped kv heads (Llama's count would be read as its)
                      "gpt_neox": dict(num_key_value_heads=None),
                      # rotary on half of each head's 16 features; its MLP width is n_inner
                      "gptj": dict(num_key_value_heads=None, rotary_dim=8, n_inner=128,
                                   intermediate_size=None),
                      # attention and MLP off one LayerNorm
                      "stablelm_par": dict(use_parallel_residual=True)}
# Test kinds that are a model type with other settings.
MODEL_TYPE_OF = {"cohere_qk": "cohere", "stablelm_par": "stablelm"}
# Classes whose norms are not Llama's (policy.py): their norm weights start at random values
# so that a norm computed as another class's shows in the outputs, not only in gradients
# (Gemma's start at 0, where x_hat * (1 + w) and x_hat * w differ anyway).
OTHER_NORMS = ("gemma", "gemma2", "gemma3_text", "cohere", "cohere_qk", "phi", "gpt_neox",
               "gptj", "qwen3", "stablelm", "stablelm_par")


def _llama_layout(kind: str, llama: dict) -> nn.Module:
    """A class that tensor parallelism lays out with Llama's policy or one derived from it
    (policy.LLAMA_LAYOUT, Gemma, Cohere), at tiny Llama's shape."""
    import transformers

    config = transformers.AutoConfig.for_model(
        MODEL_TYPE_OF.get(kind, kind), use_cache=False, pad_token_id=None,
        **{**llama, **LLAMA_LAYOUT_EXTRA.get(kind, {})})
    model = transformers.AutoModelForCausalLM.from_config(config)
    if kind in OTHER_NORMS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(-0.5, 0.5)
    return model


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (B, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :3] = -100  # ignored positions take part in the mean's count
    return {"input_ids": ids[:, :-1], "labels": labels}


def model_parity(mesh: Mesh, kind: str, sequence_parallel: bool = False) -> dict[str, float]:
    """Loss and every gradient of a TP model vs the same model on one device."""
    single = build(kind)
    parallel = copy.deepcopy(single)
    data = batch()
    ref_loss = default_forward_loss(single, data)
    ref_loss.backward()
    plan = Parallelized(module=parallel, model=parallel, loss_group=None)
    strategy = mesh.strategy.replace(tp_seq="on" if sequence_parallel else "off")
    apply_tensor_parallel(plan, strategy.replace(dp=1, global_batch_size=1)
                          if strategy.dp > 1 else strategy, mesh)
    tp_loss = plan.forward_loss(plan.module, data)
    tp_loss.backward()
    out = {"loss": abs(tp_loss.item() - ref_loss.item()), **_gradient_gap(single, parallel)}
    out["state_dict"] = _state_dict_roundtrip(single, parallel)
    return out


def _state_dict_roundtrip(single: nn.Module, parallel: nn.Module) -> float:
    """Unsharded state dict equals the single-device one; loading a changed one lands."""
    worst = 0.0
    ref = single.state_dict()
    saved = parallel.state_dict()
    for key, value in saved.items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        worst = max(worst, _diff(full, ref[key]))
    changed = {k: v + 1.0 if v.is_floating_point() else v for k, v in ref.items()}
    parallel.load_state_dict(changed)
    for key, value in parallel.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        worst = max(worst, _diff(full, changed[key]))
    return worst


# ------------------------------------------------------------------------------ layer checks
def _layer_case(build_fn, single: nn.Module, x: torch.Tensor, split_in, split_out,
                owner_name: str = "weight") -> dict[str, float]:
    """Run a single-device layer and its TP version on the same input and loss weights."""
    torch.manual_seed(2)
    single.zero_grad(set_to_none=True)  # modules are reused across cases
    x = x.clone().requires_grad_(x.is_floating_point())
    y = single(x)
    r = torch.randn_like(y)
    (y * r).sum().backward()
    par = build_fn(copy.deepcopy(single))
    xl = split_in(x.detach()).requires_grad_(x.is_floating_point())
    yl = par(xl)
    (yl * split_out(r)).sum().backward()
    out = {"out": _diff(yl, split_out(y))}
    if x.is_floating_point():
        out["dx"] = _diff(xl.grad, split_in(x.grad))
    for name, p in par.named_parameters():
        out[f"d{name}"] = _diff(unsharded(par, name, p.grad), getattr(single, name).grad)
    return out


def _ce_case(vocab_logits, labels, split_logits, split_labels, vocab: TPGroup,
             batch_group: TPGroup | None) -> dict[str, float]:
    logits = vocab_logits.clone().requires_grad_(True)
    ref = lm_loss(logits, labels)
    ref.backward()
    local = split_logits(vocab_logits).requires_grad_(True)
    got = loss.sharded_lm_loss(local, split_labels(labels), vocab, batch_group)
    got.backward()
    return {"out": abs(got.item() - ref.item()), "dx": _diff(local.grad, split_logits(logits.grad))}


def layer_checks(mesh: Mesh) -> dict[str, dict[str, float]]:
    """Every layer kind of this mesh's mode against its single-device module."""
    from transformers.pytorch_utils import Conv1D

    from tessera.models.transformer import RMSNorm

    dims = model_dims(build("ref-gpt"))
    torch.manual_seed(3)
    C, O, V = 64, 128, 256
    x = torch.randn(B, T, C)
    ids = torch.randint(0, V, (B, T))
    labels = torch.randint(0, V, (B, T))
    labels[1, :4] = -100
    logits = torch.randn(B, T, V)
    lin, conv = nn.Linear(C, O), Conv1D(O, C)
    nn.init.normal_(conv.bias)
    ln, rms, emb = nn.LayerNorm(C), RMSNorm(C, 1e-5), nn.Embedding(V, C)
    for norm in (ln, rms):
        nn.init.normal_(norm.weight)
    if mesh.strategy.tp_mode == "2d":
        grid = Grid.from_mesh(mesh)
        b = _Builder2D(dims, grid, mesh.submesh("tp_row", "tp_col"))
        rows = lambda t: t.chunk(grid.q, 0)[grid.i]  # noqa: E731  batch slice i
        blk = lambda t: rows(t).chunk(grid.q, -1)[grid.j]  # noqa: E731  (B/q, T, C/q)
        return {
            "linear": _layer_case(lambda m: b.build("colwise", m), lin, x, blk, blk),
            "conv1d": _layer_case(lambda m: b.build("rowwise", m), conv, x, blk, blk),
            "layernorm": _layer_case(lambda m: b.build("norm", m), ln, x, blk, blk),
            "rmsnorm": _layer_case(lambda m: b.build("norm", m), rms, x, blk, blk),
            "embedding": _layer_case(lambda m: b.build("vocab_embed", m), emb, ids, rows, blk),
            "cross_entropy": _ce_case(logits, labels, blk, rows, grid.row, grid.col),
        }
    g = TPGroup(mesh.group("tp"))
    dense = _Builder1D(dims, g, mesh.submesh("tp"), False)
    sp = _Builder1D(dims, g, mesh.submesh("tp"), True)
    same = lambda t: t  # noqa: E731
    feat = lambda t: t.chunk(g.size, -1)[g.rank]  # noqa: E731  (.., C/tp)
    seq = lambda t: t.chunk(g.size, 1)[g.rank]  # noqa: E731  (B, T/tp, ..)
    h = torch.randn(B, T, O)  # input of the row layers

    def case(builder, style, module, inp, split_in, split_out):
        return _layer_case(lambda m: builder.build(style, m), module, inp, split_in, split_out)

    def column(module):  # a lone column layer is its own block: its BlockInput sums dx
        layer = dense.build("colwise", module)
        dense.hook_block_input(layer)
        return layer

    return {
        "column": _layer_case(column, lin, x, same, feat),
        "row": case(dense, "rowwise", nn.Linear(O, C), h, feat, same),
        "conv1d_column": _layer_case(column, conv, x, same, feat),
        "conv1d_row": case(dense, "rowwise", Conv1D(C, O), h, feat, same),
        "vocab_embedding": case(dense, "vocab_embed", emb, ids, same, same),
        "layernorm": case(dense, "norm", ln, x, same, same),
        "sp_column": case(sp, "vocab_head", lin, x, seq, feat),  # gathers the sequence itself
        "sp_row": case(sp, "rowwise", nn.Linear(O, C), h, feat, seq),
        "sp_rmsnorm": case(sp, "norm", rms, x, seq, seq),
        "sp_vocab_embedding": case(sp, "vocab_embed", emb, ids, same, seq),
        "cross_entropy": _ce_case(logits, labels, feat, same, g, None),
    }


def refusals(mesh: Mesh) -> dict[str, str]:
    """Messages of the bad inputs apply_tensor_parallel refuses (2D mesh)."""
    cases = {"mbs": (Strategy(tp=4, tp_mode="2d"), preset("tiny")),
             "vocab": (mesh.strategy, preset("tiny", vocab_size=255)),
             "kv_heads": (mesh.strategy, preset("tiny-llama", n_heads=4, n_kv_heads=1))}
    out = {}
    for name, (strategy, config) in cases.items():
        model = Transformer(config)
        try:
            apply_tensor_parallel(Parallelized(model, model, None), strategy, mesh)
            out[name] = ""
        except ValueError as err:
            out[name] = str(err)
    return out


def refusal_one_d_style(mesh: Mesh) -> str:
    """The message refusing Gemma (its norms' style rmsnorm_1p is 1D only) on the 2D grid."""
    model = build("hf-gemma")
    try:
        apply_tensor_parallel(Parallelized(model, model, None), mesh.strategy, mesh)
    except ValueError as err:
        return str(err)
    return ""


def refusal_direct_call(mesh: Mesh) -> dict[str, str | float]:
    """After parallelize: the plan's loss runs; the model called directly is refused (each
    rank would get its vocabulary slice of the logits as the whole)."""
    from tessera.parallel import parallelize

    model = build("hf-gpt2")
    plan = parallelize(model, mesh.strategy, mesh)
    out: dict[str, str | float] = {"loss": float(plan.loss(batch()))}
    try:
        model(batch()["input_ids"])
        out["message"] = ""
    except RuntimeError as err:
        out["message"] = str(err)
    return out


# Hugging Face kinds built at tiny Llama's shape with their embedding and residual dropout on
RESIDUAL_DROPOUT = {"hf-phi": {"resid_pdrop": 0.1, "embd_pdrop": 0.1},
                    "hf-gpt_neox": {"hidden_dropout": 0.1},
                    "hf-gptj": {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.0}}


def megatron_sp_dropout_parity(mesh: Mesh, kind: str = "ref") -> dict[str, float]:
    """Loss and gradients of the reference model (``kind`` "ref"), Hugging Face GPT-2
    ("hf-gpt2"), Phi ("hf-phi": its one residual dropout module drops both blocks' outputs,
    in parallel layers), GPT-NeoX or GPT-J with embedding and residual dropout
    under 1D tp with Megatron sequence parallelism against one device's, from one seed.

    Attention dropout is set to 0 on both: under tp it runs hashed masks per head
    (attention.py), one device SDPA's own, so those masks differ by design (their parity is
    attention_dropout_parity's). The embedding and residual dropout, on sequence chunks here
    (GPT-2's embedding dropout before its first layer, on the whole sequence), must drop
    exactly what one device drops."""
    torch.manual_seed(0)
    if kind == "ref":
        single = Transformer(preset("tiny", dropout=0.1))
    elif kind in RESIDUAL_DROPOUT:
        config = hf_config_from_reference("llama", preset("tiny-llama"))
        arch = kind.removeprefix("hf-")
        single = _llama_layout(arch, {**config, **RESIDUAL_DROPOUT[kind]}).train()
    else:
        config = hf_config_from_reference("gpt2", preset("tiny", dropout=0.1))
        single = build_hf_model("gpt2", **config).train()
    for module in single.modules():
        if hasattr(module, "attention_fn"):
            module.dropout = 0.0
        if hasattr(module, "attn_dropout"):  # GPT-2's
            module.attn_dropout.p = 0.0
    parallel = copy.deepcopy(single)
    data = batch()
    torch.manual_seed(7)
    ref_loss = default_forward_loss(single, data)
    ref_loss.backward()
    plan = Parallelized(module=parallel, model=parallel, loss_group=None)
    strategy = mesh.strategy.replace(tp_seq="on")
    apply_tensor_parallel(plan, strategy.replace(dp=1, global_batch_size=1)
                          if strategy.dp > 1 else strategy, mesh)
    torch.manual_seed(7)
    tp_loss = plan.forward_loss(plan.module, data)
    tp_loss.backward()
    torch.manual_seed(8)  # another mask: the losses must differ (dropout took effect)
    with torch.no_grad():
        other = default_forward_loss(single, data).item()
    return {"loss": abs(tp_loss.item() - ref_loss.item()), **_gradient_gap(single, parallel),
            "other_mask_loss_gap": abs(other - ref_loss.item())}


def checkpoint_roundtrip(mesh: Mesh, kind: str, folder: str) -> dict[str, float]:
    """After one AdamW step: get_state_dict holds the single-device model and Adam states;
    torch.distributed.checkpoint saves them and loads them into a fresh TP model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tessera.train.optim import build_optimizer

    def step(model, builder):
        # eps well above gradient rounding (1e-8): Adam's first step divides g by |g| + eps,
        # which would blow up the rounding of near-zero gradients into O(lr) differences.
        return builder(model, 1e-2, 0.1, (0.9, 0.95), 1e-3, torch.device("cpu"))

    single = build(kind)
    opt = step(single, build_optimizer)
    default_forward_loss(single, batch()).backward()
    opt.step()
    plans = []
    for _ in range(2):  # the trained one, then a fresh one to load into
        model = build(kind)
        plan = Parallelized(module=model, model=model, loss_group=None)
        apply_tensor_parallel(plan, mesh.strategy, mesh)
        plans.append((plan, step(model, plan.build_optimizer or build_optimizer)))
    (plan, tp_opt), (fresh, fresh_opt) = plans
    plan.forward_loss(plan.module, batch()).backward()
    tp_opt.step()
    model_sd, optim_sd = get_state_dict(plan.model, tp_opt)
    ref_model, ref_optim = get_state_dict(single, opt)
    out = {"saved": _max_state_diff(model_sd, ref_model, optim_sd, ref_optim)}
    saved_model, saved_optim = _gathered(model_sd), _gathered(optim_sd)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    new_model, new_optim = get_state_dict(fresh.model, fresh_opt)
    state = {"model": new_model, "optim": new_optim}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(fresh.model, fresh_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    model_sd, optim_sd = get_state_dict(fresh.model, fresh_opt)
    out["loaded"] = _max_state_diff(model_sd, saved_model, optim_sd, saved_optim)  # exact
    out["permuted"] = float(kind == "hf-gpt2" and bool(plan.build_optimizer))
    return out


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _gathered(sd):
    """A state dict (nested) with every DTensor gathered (all ranks call this)."""
    if isinstance(sd, dict):
        return {k: _gathered(v) for k, v in sd.items()}
    return _full(sd).clone() if torch.is_tensor(sd) else sd


def _max_state_diff(model_sd, ref_model, optim_sd, ref_optim) -> float:
    full = _full
    worst = max(_diff(full(v), ref_model[k]) for k, v in model_sd.items())
    for fqn, state in optim_sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            worst = max(worst, _diff(full(state[key]), ref_optim["state"][fqn][key]))
    return worst


@contextlib.contextmanager
def counted(method: str) -> Iterator[list[tuple[int, ...]]]:
    """The shapes of the tensors every ``TPGroup.<method>`` call is given inside the block."""
    seen: list[tuple[int, ...]] = []
    original = getattr(TPGroup, method)

    def counting(self, tensor, *args, **kwargs):
        seen.append(tuple(tensor.shape))
        return original(self, tensor, *args, **kwargs)

    setattr(TPGroup, method, counting)
    try:
        yield seen
    finally:
        setattr(TPGroup, method, original)


def backward_all_reduces(mesh: Mesh, kind: str, layers: str = "eager") -> dict[str, int]:
    """How many all-reduces one backward of a 1D TP model issues, by what they sum.

    ``activations``: (B, T, C) input gradients (each block input, the output layer's input);
    ``other``: anything else (e.g. replicated k/v weights when kv heads < tp). ``layers``:
    "ops" builds them as the custom ops pipeline stages use (run eagerly here), "chunk"
    under chunk memory (whose hooks wrap each parameter owner's output; a mesh of dp=1).
    """
    model = build(kind)
    strategy = mesh.strategy.replace(dp=1, global_batch_size=1)
    if layers == "chunk":
        plan = parallelize(model, strategy.replace(memory="chunk", offload="cpu"), mesh)
    else:
        plan = Parallelized(module=model, model=model, loss_group=None)
        # pp > 1 is what switches the layers to tensor/ops.py
        apply_tensor_parallel(plan, strategy.replace(pp=2) if layers == "ops" else strategy,
                              mesh)
    loss_value = plan.forward_loss(plan.module, batch())
    with counted("all_reduce") as seen:
        loss_value.backward()
    width = model_dims(model).d_model
    n_act = sum(shape == (B, T, width) for shape in seen)
    return {"activations": n_act, "other": len(seen) - n_act,
            "layers": model.config.n_layers if hasattr(model.config, "n_layers")
            else model.config.num_hidden_layers}


def recomputed_block_gathers(mesh: Mesh, kind: str) -> dict[str, float]:
    """Megatron sequence parallelism (tp_seq=on) with every block checkpointed, against the
    same model without checkpoints: all-gathers in one backward (the recomputation's block
    inputs, which the column layers then keep, against the column layers' re-gathers of their
    kept shard), and the largest difference between the two runs' gradients."""
    strategy = mesh.strategy.replace(dp=1, global_batch_size=1, tp_seq="on")
    out: dict[str, float] = {}
    grads = []
    for recompute in (False, True):
        model = build(kind)
        plan = Parallelized(module=model, model=model, loss_group=None)
        apply_tensor_parallel(plan, strategy, mesh)
        apply_recompute(model, 1.0 if recompute else 0.0)
        loss_value = plan.forward_loss(plan.module, batch())
        with counted("all_gather") as seen:
            loss_value.backward()
        out["recomputed" if recompute else "kept"] = len(seen)
        grads.append([local(p.grad) for p in model.parameters()])
    out["grad"] = max(_diff(a, b) for a, b in zip(*grads))
    out["layers"] = len(find_blocks(model))
    return out


def refusal_without_block(mesh: Mesh) -> str:
    """The message when a policy's column layers have no attention / MLP block to sum dx."""
    from tessera.parallel.tensor import policy as tp_policy

    saved = tp_policy.POLICIES["Transformer"]
    tp_policy.POLICIES["Transformer"] = [(p, s) for p, s in saved if s not in ("attention", "mlp")]
    try:
        return _tiny_refusal(mesh)
    finally:
        tp_policy.POLICIES["Transformer"] = saved


def refusal_parallel_layer(mesh: Mesh) -> str:
    """The message when policy.PARALLEL_LAYERS names a module that does not hold an
    attention and an MLP (the reference model's final norm)."""
    from tessera.parallel.tensor import policy as tp_policy

    tp_policy.PARALLEL_LAYERS["Transformer"] = r"norm"
    try:
        return _tiny_refusal(mesh)
    finally:
        del tp_policy.PARALLEL_LAYERS["Transformer"]


def _tiny_refusal(mesh: Mesh) -> str:
    """The message applying tensor parallelism to the tiny reference model raises, or ""."""
    model = Transformer(preset("tiny"))
    try:
        apply_tensor_parallel(Parallelized(model, model, None), mesh.strategy.replace(
            dp=1, global_batch_size=1), mesh)
        return ""
    except ValueError as err:
        return str(err)


def refusals_tp_seq(mesh: Mesh) -> dict[str, str]:
    """Megatron sequence parallelism (tp_seq=on): a batch length tp does not divide, a
    Hugging Face model (whose masks follow the local length) with a dropout module its
    policy does not place."""
    strategy = mesh.strategy.replace(dp=1, global_batch_size=1, tp_seq="on")
    out = {}
    model = Transformer(preset("tiny"))
    plan = Parallelized(module=model, model=model, loss_group=None)
    apply_tensor_parallel(plan, strategy, mesh)
    ids = torch.randint(0, 256, (1, mesh.strategy.tp * 8 + 1))
    hf = build("hf-llama")
    hf_plan = Parallelized(module=hf, model=hf, loss_group=None)
    apply_tensor_parallel(hf_plan, strategy, mesh)
    for key, runs in (("length", plan), ("hf_length", hf_plan)):
        try:
            runs.forward_loss(runs.module, {"input_ids": ids, "labels": ids})
            out[key] = ""
        except ValueError as err:
            out[key] = str(err)
    ref = preset("tiny", dropout=0.1)
    dropping = build_hf_model("gpt2", **hf_config_from_reference("gpt2", ref))
    dropping.transformer.h[1].mlp.extra = nn.Dropout(0.1)  # of no dropout style
    try:
        apply_tensor_parallel(Parallelized(dropping, dropping, None), strategy, mesh)
        out["hf_dropout"] = ""
    except ValueError as err:
        out["hf_dropout"] = str(err)
    return out


def grad_scaler_overflow(mesh: Mesh) -> dict[str, float]:
    """torch's GradScaler (the fp16 path at pp=1) on a DTensor weight whose gradient is inf
    in tp rank 0's shard only: every tp rank must see the overflow, skip and halve the scale,
    or the shards would train different steps. Pins torch behaviour tessera relies on."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tp = mesh.submesh("tp")
    weight = nn.Parameter(distribute_tensor(torch.ones(4, 2), tp, [Shard(0)]))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    grad = torch.ones(4, 2)
    grad[0, 0] = float("inf")  # rows 0-1: tp rank 0's shard
    weight.grad = distribute_tensor(grad, tp, [Shard(0)])
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # sets the scale, as scaling the loss does
    scaler.unscale_(optimizer)
    found = sum(v.item() for v in scaler._found_inf_per_device(optimizer).values())
    scaler.step(optimizer)
    scaler.update()
    return {"found_inf": found, "scale": scaler.get_scale(),
            "moved": _diff(weight.to_local(), torch.ones(2, 2))}


class _CountingInit(DeferredInit):
    """DeferredInit that records the parameter bytes each call left materialised."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), seed=0)
        self.held: list[int] = []

    def __call__(self, model, names=None):
        done = super().__call__(model, names)
        self.held.append(sum(p.numel() * p.element_size() for p in model.parameters()
                             if not p.is_meta))
        return done


def from_meta(mesh: Mesh, kind: str) -> dict[str, float]:
    """The model built on meta and given to tensor parallelism with a DeferredInit against the
    same model materialised whole first: the same shards (exactly), the same loss, and at most
    one unit's weights (a transformer block, else a module) whole at a time."""
    with torch.device("meta"):
        on_meta = build(kind)
    whole = copy.deepcopy(on_meta)
    materialize(whole, "cpu", seed=0)
    units: dict[str, int] = {}
    for path, module in whole.named_modules():
        units[materialize_unit(path)] = units.get(materialize_unit(path), 0) + sum(
            p.numel() * p.element_size() for p in module.parameters(recurse=False))
    model_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    strategy = mesh.strategy.replace(dp=1, global_batch_size=1) if mesh.strategy.dp > 1 \
        else mesh.strategy
    init = _CountingInit()
    plans = []
    for model, deferred in ((on_meta, init), (whole, None)):
        plan = Parallelized(module=model, model=model, loss_group=None)
        apply_tensor_parallel(plan, strategy, mesh, deferred=deferred)
        plans.append(plan)
    mine = dict(whole.named_parameters())
    shards = [(p.to_local(), mine[name].to_local()) for name, p in on_meta.named_parameters()]
    losses = [float(plan.forward_loss(plan.module, batch())) for plan in plans]
    return {"shard_diff": max(_diff(a, b) for a, b in shards),
            "shard_std": float(torch.cat([b.flatten() for _, b in shards]).std()),
            "loss_diff": abs(losses[0] - losses[1]), "loss": losses[1],
            "left_on_meta": sum(p.is_meta or p.to_local().is_meta
                                for p in on_meta.parameters()),
            "peak_over_largest_unit": max(init.held) / max(units.values()),
            "requests": len(init.held) - 1, "units": sum(1 for b in units.values() if b),
            "peak_over_model": max(init.held) / model_bytes}


# ------------------------------------------------------------------ attention dropout (1D)
P_ATTN = 0.3  # attention dropout of the parity checks; every other dropout is 0
MASK_SEED = 5  # torch's seed before the probe of head_group_mask


def with_attention_dropout(model: nn.Module, p: float) -> nn.Module:
    """``model`` with attention dropout ``p`` and no other dropout (so parity is exact)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0  # residual and embedding dropout (GPT-2's attn_dropout: below)
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            if hasattr(module, "attn_dropout"):  # HF GPT-2
                module.attn_dropout.p = p
            elif hasattr(module, "attention_dropout"):  # HF Llama
                module.attention_dropout = p
            else:  # the reference model's Attention
                module.dropout = p
    return model.train()


def dense_dropped_attention(q, k, v, dropout_p: float = 0.0, scale: float | None = None):
    """One device's causal attention, fp32 through autograd, dropping the pairs the hashed
    mask drops over *all* heads; the seed is drawn as tensor/attention.py draws it."""
    from tessera.parallel.sequence.dropout import AttentionDropout
    from tessera.parallel.tensor.attention import SEED_RANGE

    Bq, nh, Tq, hs = q.shape
    k, v = (t.repeat_interleave(nh // k.shape[1], dim=1) for t in (k, v))  # (B, nh, T, hs)
    scores = (q @ k.transpose(-1, -2)) * (hs ** -0.5 if scale is None else scale)
    causal = torch.ones(Tq, Tq, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    if dropout_p > 0:
        seed = int(torch.randint(0, SEED_RANGE, (), dtype=torch.int64))
        index = torch.arange(Tq).expand(Bq, Tq)
        meta = torch.stack((index, torch.zeros_like(index)), -1)  # (B, T, 2)
        probs = probs * AttentionDropout(dropout_p, seed).keep_scale(meta, meta, nh)
    return probs @ v


def _hf_dense(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    assert attention_mask is None  # unregistered for masks: transformers passes none
    return dense_dropped_attention(query, key, value, dropout, scaling).transpose(1, 2), None


def _use_dense_attention(model: nn.Module) -> None:
    if hasattr(model, "set_attn_implementation"):
        from transformers import AttentionInterface

        AttentionInterface.register("tessera_test_dense_dropout", _hf_dense)
        model.set_attn_implementation("tessera_test_dense_dropout")
        return
    for block in model.blocks:
        block.attn.attention_fn = dense_dropped_attention


def attention_dropout_parity(mesh: Mesh, kind: str, exportable: bool = False) -> dict:
    """1D tp with attention dropout against one device dropping the same pairs: loss and
    every gradient (training), the loss in eval (SDPA there), and for the reference model the
    mask its installed attention draws on this rank's first head. ``exportable`` builds the
    model as pipeline stages run it (the op in eval too), run eagerly here."""
    single = with_attention_dropout(build(kind), P_ATTN)
    parallel = copy.deepcopy(single)
    _use_dense_attention(single)
    data = batch()
    torch.manual_seed(11)  # both sides draw one seed per layer from here, in the same order
    ref_loss = default_forward_loss(single, data)
    ref_loss.backward()
    plan = Parallelized(module=parallel, model=parallel, loss_group=None)
    strategy = mesh.strategy
    if strategy.dp > 1:
        strategy = strategy.replace(dp=1, global_batch_size=1)
    apply_tensor_parallel(plan, strategy.replace(pp=2) if exportable else strategy, mesh)
    torch.manual_seed(11)
    tp_loss = plan.forward_loss(plan.module, data)
    tp_loss.backward()
    out = {"loss": abs(tp_loss.item() - ref_loss.item()), **_gradient_gap(single, parallel),
           "features": list(plan.features)}
    with torch.no_grad():
        single.eval(), parallel.eval()
        eval_loss = default_forward_loss(single, data)
        out["eval_loss"] = abs(plan.forward_loss(plan.module, data).item() - eval_loss.item())
        out["dropped"] = abs(eval_loss.item() - ref_loss.item())  # dropout took effect
    if kind.startswith("ref"):
        out["mask"] = head_group_mask(parallel.blocks[0].attn.attention_fn)
    return out


def head_group_mask(attention_fn) -> torch.Tensor:
    """(T, T) bool: the pairs ``attention_fn`` (a tp rank's installed attention) keeps on its
    first local head, read off a probe: zero scores make the probabilities of query i 1/(i+1)
    on keys 0..i, and identity values copy each (query, key) probability to the output."""
    heads = 2  # local heads of the probe; kv heads alike
    q = torch.zeros(1, heads, T, T)
    v = torch.eye(T).expand(1, heads, T, T)  # (1, heads, T keys, hs = T)
    torch.manual_seed(MASK_SEED)
    out = attention_fn(q, q.clone(), v, dropout_p=P_ATTN)  # (1, heads, T, T)
    return out[0, 0] > 0
