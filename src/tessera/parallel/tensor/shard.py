"""Parameters of tensor-parallel layers: local shards wrapped as DTensors.

Every parameter of a tensor-parallel model is a DTensor on the tensor-parallel DeviceMesh
(1D: the ``tp`` axis; 2D: ``tp_row`` x ``tp_col``) whose local tensor is this rank's shard.
The layers compute with ``to_local()`` (their own autograd functions communicate), while the
DTensor wrapper tells torch.distributed.checkpoint, the optimizer and state dicts what the
unsharded tensor is. So a state dict gathers to the single-device layout and loads from it,
and optimizer states (created with ``zeros_like``) are sharded the same way.

Fused q|k|v weights (GPT-2's ``c_attn``) need each shard to hold q, k and v of the same heads,
which no contiguous shard of the fused dimension gives. They are stored permuted (each shard's
q, k and v side by side); state-dict hooks on the module and on the optimizer undo the
permutation, so checkpoints still hold the original layout (weights and Adam moments).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard


def local_chunk(full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
                ) -> torch.Tensor:
    """This rank's piece of ``full`` under ``placements`` (no communication)."""
    coords = mesh.get_coordinate()
    piece = full
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            piece = piece.chunk(mesh.size(mesh_dim), dim=placement.dim)[coords[mesh_dim]]
    return piece.contiguous()


def make_param(full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...],
               requires_grad: bool = True) -> nn.Parameter:
    """A DTensor parameter holding this rank's shard of ``full``.

    Every rank built the same model from the same seed, so each cuts its own shard and
    nothing is sent.
    """
    local = local_chunk(full.detach(), mesh, placements).clone()
    dt = DTensor.from_local(local, mesh, placements, run_check=False)
    return nn.Parameter(dt, requires_grad=requires_grad)


def replicated(full: torch.Tensor, mesh: DeviceMesh) -> nn.Parameter:
    """A parameter every tensor-parallel rank holds whole."""
    return make_param(full, mesh, tuple(Replicate() for _ in range(mesh.ndim)))


def local(param: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor parameter (differentiable); plain tensors pass through."""
    return param.to_local() if isinstance(param, DTensor) else param


def fused_perm(n: int, parts: int, shards: int) -> torch.Tensor:
    """Index order putting shard s's slice of every part side by side.

    Worked example: n=12 (q|k|v of 4 each), parts=3, shards=2 gives
    [0,1, 4,5, 8,9, 2,3, 6,7, 10,11]: shard 0 holds q0 k0 v0, shard 1 holds q1 k1 v1.
    """
    part, per = n // parts, n // parts // shards
    idx = [p * part + s * per + k for s in range(shards) for p in range(parts) for k in range(per)]
    return torch.tensor(idx, dtype=torch.long)


def add_unpermute_hooks(module: nn.Module, name: str, dim: int, perm: torch.Tensor) -> None:
    """Save ``module.<name>`` unpermuted and whole; load a whole tensor back permuted.

    The saved value is a plain tensor equal on every rank (checkpoint writers keep one copy).
    """
    inverse = torch.argsort(perm)
    permuted = getattr(module, "tp_permuted", {})
    permuted[name] = (dim, perm)
    object.__setattr__(module, "tp_permuted", permuted)

    def save_hook(mod, state_dict, prefix, local_metadata):
        key = prefix + name
        value = state_dict[key]
        full = value.full_tensor() if isinstance(value, DTensor) else value
        state_dict[key] = full.index_select(dim, inverse.to(full.device)).detach()
        return state_dict

    def load_hook(mod, state_dict, prefix, *args):
        key = prefix + name
        if key not in state_dict:
            return
        value = state_dict[key]
        full = value.full_tensor() if isinstance(value, DTensor) else value
        param = getattr(mod, name)
        permuted = full.index_select(dim, perm.to(full.device))
        with torch.no_grad():
            param.to_local().copy_(local_chunk(permuted, param.device_mesh, param.placements))
        state_dict[key] = param.detach()

    module._register_state_dict_hook(save_hook)
    module._register_load_state_dict_pre_hook(load_hook, with_module=True)


def unsharded(module: nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` (the parameter ``module.<name>`` or a same-layout tensor such as its gradient)
    gathered whole, in the single-device layout. All tp ranks must call it (it communicates).
    """
    full = value.full_tensor() if isinstance(value, DTensor) else value
    dim, perm = getattr(module, "tp_permuted", {}).get(name, (None, None))
    if perm is not None:
        full = full.index_select(dim, torch.argsort(perm).to(full.device))
    return full


def accept_full_tensors(module: nn.Module) -> None:
    """Let ``module.load_state_dict`` take whole (single-device) tensors for DTensor params.

    torch.distributed.checkpoint already loads DTensors; this is for a plain state dict,
    e.g. one saved by an unsharded model. Each rank cuts its own shard (no communication).
    """

    def load_hook(mod, state_dict, prefix, *args):
        permuted = getattr(mod, "tp_permuted", {})
        for name, param in mod.named_parameters(recurse=False):
            key = prefix + name
            value = state_dict.get(key)
            if name in permuted or not isinstance(param, DTensor) or value is None:
                continue
            if not isinstance(value, DTensor) and tuple(value.shape) == tuple(param.shape):
                piece = local_chunk(value.to(param.device), param.device_mesh, param.placements)
                state_dict[key] = DTensor.from_local(piece, param.device_mesh, param.placements,
                                                     run_check=False)

    module._register_load_state_dict_pre_hook(load_hook, with_module=True)


def permuted_params(model: nn.Module) -> dict[int, tuple[int, torch.Tensor]]:
    """id(parameter) -> (dim, perm) for every parameter stored permuted."""
    out = {}
    for module in model.modules():
        for name, entry in getattr(module, "tp_permuted", {}).items():
            out[id(getattr(module, name))] = entry
    return out


def add_optimizer_unpermute_hooks(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Optimizer states of permuted parameters (Adam moments) save and load unpermuted too.

    ``optimizer.state_dict()`` keys states by position in the param groups (torch's
    set_state_dict loads them keyed by name); the hooks map each key back to its parameter
    and convert the states shaped like it.
    """
    permuted = permuted_params(model)
    by_name = dict(model.named_parameters())

    def convert(state_dict, to_saved: bool):
        ordered = [p for group in optimizer.param_groups for p in group["params"]]
        for pid, state in list(state_dict["state"].items()):
            # Keys are positions, or parameter names when torch's set_state_dict loads.
            param = by_name[pid] if isinstance(pid, str) else ordered[pid]
            if id(param) not in permuted:
                continue
            dim, perm = permuted[id(param)]
            new = dict(state)  # the live state is not touched
            for key, value in state.items():
                if not torch.is_tensor(value) or tuple(value.shape) != tuple(param.shape):
                    continue
                if to_saved and isinstance(value, DTensor):
                    inverse = torch.argsort(perm).to(value.device)
                    new[key] = value.full_tensor().index_select(dim, inverse)
                elif not to_saved and not isinstance(value, DTensor):
                    piece = local_chunk(value.index_select(dim, perm.to(value.device)),
                                        param.device_mesh, param.placements)
                    new[key] = DTensor.from_local(piece, param.device_mesh, param.placements,
                                                  run_check=False)
            state_dict["state"][pid] = new
        return state_dict

    optimizer.register_state_dict_post_hook(lambda opt, sd: convert(sd, True))
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: convert(sd, False))
