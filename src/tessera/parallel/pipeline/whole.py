"""The user's model, whole again after pipeline training.

Pipeline stages hold the user's own parameter objects, each rank only those of its stages:
after training, every rank's copy of the model has its stages' weights trained and the rest
as they were at the start. Hugging Face's Trainer leaves the model it was given trained in
place (``trainer.model.save_pretrained``, ``generate``, a custom evaluation read it), so
:func:`share_trained_weights` sends each weight from a rank holding it to the other ranks of
its pipeline. Where a rank never held the other stages' weights (a model built on the meta
device, materialised per stage) or keeps them in chunks (``memory=chunk``), calling the model
is refused instead (:func:`refuse_partial_model`), naming the way to the trained weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.models.materialize import has_meta, parameter_aliases
from tessera.parallel.pipeline.overlap import local_shard


class PartialModelError(RuntimeError):
    """The user's model holds only this rank's pipeline stages' weights."""


def share_trained_weights(model: nn.Module, stages: nn.Module,
                          pp_group: dist.ProcessGroup, memory: str) -> bool:
    """Give every rank of ``pp_group`` every trained weight of ``model`` (all ranks call it);
    where a rank cannot hold them, refuse calls of the model instead (every rank alike).

    ``stages``: this rank's StageModule, holding the same parameter objects as ``model``
    under their original names. Each weight is broadcast from the first pp rank holding it
    (weights shared by stages are equal on all holders); under tensor parallelism each tp
    rank's shard travels within its own pipeline. Buffers stay as they are (a causal LM's
    are constants). Returns whether the model is whole on every rank.
    """
    why = ("memory=chunk keeps each rank's weights in its chunks" if memory == "chunk" else
           "it was built on the meta device (each rank materialised only its stages' "
           "weights)" if has_meta(model) else None)
    held = {name for name, _ in stages.named_parameters(remove_duplicate=False)}
    views = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(views, (held, why), group=pp_group)
    why = next((reason for _, reason in views if reason), None)
    if why:
        refuse_partial_model(model, why)
        return False
    ranks = dist.get_process_group_ranks(pp_group)
    with torch.no_grad():
        for names in parameter_aliases(model).values():
            owner = next((i for i, (h, _) in enumerate(views) if names[0] in h), 0)
            param = model.get_parameter(names[0])
            dist.broadcast(local_shard(param.data), src=ranks[owner], group=pp_group)
    return True


def refuse_partial_model(model: nn.Module, why: str) -> None:
    """Make a call of ``model`` raise :class:`PartialModelError` naming ``why`` (the stages
    never call the user's top-level module: they run captured graph pieces). A capture is
    let through: another Trainer built on the model partitions it again, its stages then
    holding this rank's weights."""
    if getattr(model, "_tessera_partial", False):
        return
    model._tessera_partial = True

    def refuse(_module, _args, _kwargs):
        if torch.compiler.is_exporting():
            return
        raise PartialModelError(
            f"this model was trained in pipeline stages and {why}, so its other stages' "
            "weights are not the trained ones on this rank: write the whole model with "
            "trainer.save_model(dir) and load it back (from_pretrained, "
            "tessera.train.export.load_reference_model, or train.init_from)")

    model.register_forward_pre_hook(refuse, with_kwargs=True)
