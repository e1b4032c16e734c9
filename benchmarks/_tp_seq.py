"""Megatron sequence parallelism for bench_tensor_parallel.py: tessera's 1D tp with
``tp_seq=on`` against PyTorch's own recipe for it (parallelize_module with SequenceParallel on
the norms, PrepareModuleInput gathering the sequence before attention and the MLP, row layers
scattering it after), and against tessera's plain 1D tp. The Llama-style reference model
(RoPE, no learned position table), the layout PyTorch's tutorial and torchtitan write the
recipe for."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from tessera.mesh import Mesh
from tessera.models import Transformer
from tessera.models.config import ModelConfig, preset
from tessera.parallel.plan import Parallelized
from tessera.parallel.tensor import apply_tensor_parallel
from tessera.strategy import Strategy

from _tp_training import race  # beside this file

T = 128
CONFIG = dict(vocab_size=256, d_model=256, n_heads=8, n_kv_heads=8, max_seq_len=T,
              tie_embeddings=False, n_layers=2)


def config() -> ModelConfig:
    return preset("tiny-llama", **CONFIG)


def torch_sp_plan(model: Transformer) -> dict:
    """parallelize_module's plan for Megatron sequence parallelism on the reference model, as
    PyTorch's tensor-parallel tutorial and torchtitan lay out Llama."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                       use_local_output=False)}
    for i in range(len(model.blocks)):
        block = f"blocks.{i}"
        plan[f"{block}.attn_norm"] = SequenceParallel()
        plan[f"{block}.mlp_norm"] = SequenceParallel()
        plan[f"{block}.attn"] = PrepareModuleInput(input_layouts=(Shard(1), None),
                                                   desired_input_layouts=(Replicate(), None))
        plan[f"{block}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                  desired_input_layouts=(Replicate(),))
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj",
                     "mlp.up_proj"):
            plan[f"{block}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.down_proj"):
            plan[f"{block}.{name}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def _batch(b: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (b, T + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor; a gather still in flight (PyTorch's redistribute hands its
    output over as an AsyncCollectiveTensor), waited for."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _saved_bytes(model: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> int:
    """Distinct storages autograd saves in one forward (parameters excluded), then backward."""
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    loss.backward()
    return sum(seen.values())


def _tessera(mesh: Mesh, tp_seq: str) -> Parallelized:
    torch.manual_seed(0)
    model = Transformer(config())
    plan = Parallelized(module=model, model=model, loss_group=None)
    apply_tensor_parallel(plan, Strategy(tp=mesh.strategy.tp, tp_seq=tp_seq), mesh)
    return plan


def _torch_sp(mesh: Mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = Transformer(config())
    return parallelize_module(model, mesh.submesh("tp"), torch_sp_plan(model))


def _torch_loss(model: nn.Module, batch) -> torch.Tensor:
    """Inside ``loss_parallel()`` (its backward too; the context does not nest)."""
    logits = model(batch["input_ids"])  # DTensor (B, T, V) sharded on V
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def _torch_step(model: nn.Module, batch) -> torch.Tensor:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():  # the vocabulary-parallel loss's backward needs it too
        loss = _torch_loss(model, batch)
        loss.backward()
    return loss


def figures(mesh: Mesh, micro_batch: int, rounds: int, steps: int) -> dict[str, float]:
    """Saved bytes of one step (tessera 1D, tessera tp_seq, PyTorch SP), tokens/s of tessera
    tp_seq and PyTorch SP (best round, rounds alternating), and their loss difference."""
    batch = _batch(micro_batch)
    plain, ours, theirs = _tessera(mesh, "off"), _tessera(mesh, "on"), _torch_sp(mesh)
    out = {"saved_1d": _saved_bytes(plain.model, lambda: plain.forward_loss(plain.module, batch)),
           "saved_tp_seq": _saved_bytes(ours.model,
                                        lambda: ours.forward_loss(ours.module, batch))}
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        out["saved_torch_sp"] = _saved_bytes(theirs, lambda: _torch_loss(theirs, batch))
        theirs.zero_grad(set_to_none=True)
    with torch.no_grad(), loss_parallel():  # the same weights: both compute the same loss
        ref = _torch_loss(theirs, batch)
        ref = ref.full_tensor() if hasattr(ref, "full_tensor") else ref
        out["loss_diff"] = abs(ours.forward_loss(ours.module, batch).item() - ref.item())
    sides = {"tessera": lambda: ours.forward_loss(ours.module, batch).backward(),
             "torch_sp": lambda: _torch_step(theirs, batch)}
    best = race(sides, batch["input_ids"].numel(), rounds, steps)
    return {**out, **{f"tokens_{name}": value for name, value in best.items()}}
