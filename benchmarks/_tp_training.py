"""dp x tp training steps for bench_tensor_parallel.py: tessera's Trainer against PyTorch's 2D
recipe (parallelize_module for tp, FSDP2's fully_shard over dp), the same model, batch shape,
loss, clipping and AdamW. Both run in the caller's 4 workers (dp=2 x tp=2)."""

from __future__ import annotations

import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from tessera.models import Transformer
from tessera.models.config import ModelConfig

LR, CLIP = 1e-4, 1.0


def tessera_step(config: ModelConfig, micro_batch: int, folder: str):
    """A one-step callable of tessera's Trainer at dp=2 x tp=2 (memory=ddp), and its loss."""
    from tessera.config import TrainingArguments
    from tessera.strategy import Strategy
    from tessera.train.trainer import Trainer

    strategy = Strategy.parse(f"dp=2,tp=2,mbs={micro_batch},gbs={2 * micro_batch}")
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, config.vocab_size, (64, config.max_seq_len + 1), generator=gen)
    data = [{"input_ids": r[:-1], "labels": r[1:]} for r in rows]
    args = TrainingArguments(output_dir=folder, max_steps=10**6, warmup_steps=0,
                             learning_rate=LR, max_grad_norm=CLIP, progress="off",
                             device="cpu", logging_steps=10**6)
    torch.manual_seed(0)
    trainer = Trainer(Transformer(config), args, data, strategy=strategy)

    def step() -> float:
        loss, _grad_norm = trainer._train_step()  # (2,): this rank's loss, the norm
        trainer.step += 1
        return float(loss)
    return step


def torch_2d_step(config: ModelConfig, micro_batch: int):
    """A one-step callable of PyTorch's own dp x tp: ColwiseParallel / RowwiseParallel with a
    vocabulary-parallel loss on the tp dimension, FSDP2 over dp (parameters kept gathered
    between forward and backward, as close to replication as FSDP2 goes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Transformer(config)
    model = parallelize_module(model, mesh["tp"], torch_tp_plan(model))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, foreach=True)
    gen = torch.Generator().manual_seed(1 + mesh["dp"].get_local_rank())
    ids = torch.randint(0, config.vocab_size, (micro_batch, config.max_seq_len + 1),
                        generator=gen)

    def step() -> float:
        with loss_parallel():
            logits = model(ids[:, :-1])  # DTensor (B, T, V) sharded on V
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        _clip(params, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())
    return step


def torch_tp_plan(model: Transformer) -> dict:
    """parallelize_module's plan for the reference model, Megatron's layout: q, k, v and the
    MLP's up column-parallel, o and down row-parallel, a vocabulary-parallel embedding and a
    head whose logits stay sharded over the vocabulary (for loss_parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"embed": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.up_proj"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.down_proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def _clip(params: list[nn.Parameter], max_norm: float) -> None:
    """clip_grad_norm_ for parameters on two meshes (tp-sharded ones on dp x tp, norms on dp
    alone), which torch's own refuses to stack: one total norm per mesh, then combined."""
    by_mesh: dict[int, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(id(p.device_mesh), []).append(p.grad.norm())
    squares = sum(torch.stack(norms).full_tensor().pow(2).sum() for norms in by_mesh.values())
    scale = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(scale)


def tokens_per_s(config: ModelConfig, micro_batch: int, rounds: int, steps: int
                 ) -> dict[str, float]:
    """Best-round tokens/s of each side (dp ranks together), rounds alternating."""
    with tempfile.TemporaryDirectory() as folder:
        sides = {"tessera": tessera_step(config, micro_batch, folder),
                 "torch_2d": torch_2d_step(config, micro_batch)}
        tokens = 2 * micro_batch * config.max_seq_len  # both dp ranks' batches
        return race(sides, tokens, rounds, steps)


def race(sides: dict, tokens: int, rounds: int, steps: int) -> dict[str, float]:
    """Best-round tokens/s of each side's step callable (``tokens`` a step), rounds
    alternating between the sides; each round starts with an untimed warm-up step and is
    timed between barriers (the slowest rank ends it)."""
    best = {name: 0.0 for name in sides}
    for _ in range(rounds):
        for name, step in sides.items():
            step()  # warm-up of this round
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            dist.barrier()
            best[name] = max(best[name], steps * tokens / (time.perf_counter() - start))
    return best
