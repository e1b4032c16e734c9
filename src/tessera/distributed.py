"""Process-group set-up for one worker: from torchrun's environment, or a world of one."""

from __future__ import annotations

import atexit
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tessera.config import ConfigError
from tessera.mesh import backend_for


@dataclass(frozen=True)
class WorkerContext:
    """Where this worker stands: global rank, world size, local rank and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device_type(requested: str = "auto") -> str:
    """"cuda" or "cpu"; asking for CUDA without a GPU is refused."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but this machine has no CUDA device "
                          "(torch.cuda.is_available() is False)")
    return requested


def init_distributed(device_type: str = "auto", timeout_s: float = 600.0) -> WorkerContext:
    """Initialise torch.distributed (gloo on CPU, NCCL on CUDA) unless already initialised.

    Every collective (also on the mesh's sub-groups, which inherit it) fails after
    ``timeout_s`` seconds instead of hanging.

    Under torchrun the rendezvous comes from its environment (RANK, WORLD_SIZE, MASTER_*).
    Without it, a single-process group is created so that one code path serves both cases.
    """
    device_type = resolve_device_type(device_type)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            from tessera.testing import free_port

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group(backend_for(device_type), rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s))
        else:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend_for(device_type), store=_attempt_store(rank, world),
                                    rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s),
                                    device_id=device if device_type == "cuda" else None)
    _quiesce_at_exit()
    return WorkerContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


_QUIESCE_REGISTERED = False


def _quiesce_at_exit() -> None:
    """At interpreter exit, give gloo's worker threads a moment to release the tensors of
    finished collectives, then tear the process group down. Without it a rank whose script
    ends right after a collective (``trainer.evaluate()``'s all-reduce) aborted about one
    exit in ten with "terminate called without an active exception" (SIGABRT) under load:
    a worker thread asking for the GIL while Python finalises (pytorch#190489). No barrier:
    a rank exiting on an error must not wait for its peers."""
    global _QUIESCE_REGISTERED
    if _QUIESCE_REGISTERED:
        return
    _QUIESCE_REGISTERED = True

    def quiesce() -> None:
        if dist.is_initialized():
            time.sleep(0.2)  # releases the GIL to the worker threads
            dist.destroy_process_group()

    atexit.register(quiesce)


def _attempt_store(rank: int, world_size: int) -> dist.Store:
    """The rendezvous store under a key prefix of its own for each torchrun restart.

    torchrun keeps one store across restarts of its workers. Without a prefix per attempt,
    a restarted rank can read the address that a dead rank of the previous attempt
    published, and time out connecting to it.
    """
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_hosts and rank == 0, timeout=timedelta(minutes=10))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"tessera/attempt_{attempt}", store)


def reduce_scatter_flat(out: torch.Tensor, flat: torch.Tensor, group=None,
                        async_op: bool = False):
    """Sum ``flat`` over ``group`` and keep this rank's part in ``out``.

    ``flat`` is ``(group size, *out.shape)`` and scratch: gloo reduces it in place, so its
    contents are undefined afterwards (pass it contiguous, or it is copied first). Rank r
    keeps part r. The flat form, not the list form: on 4 gloo CPU workers the list form took
    15-18 ms a call whatever the size, the flat one 5-8 ms (NCCL flattens a list itself, a
    copy more). Gloo takes the parts concatenated along the first dimension only, hence the
    flatten. The op's name changed in torch 2.13 (``reduce_scatter_tensor`` warns there).
    With ``async_op`` it returns the work to ``wait()`` on (else None).
    """
    size = dist.get_world_size(group)
    if flat.shape != (size, *out.shape):
        raise ValueError(f"reduce_scatter_flat: input {tuple(flat.shape)} is not (group size "
                         f"{size}, *output {tuple(out.shape)})")
    # (size, *out) -> (size * out[0], *out[1:]): the same memory, concatenated
    concatenated = flat.flatten(0, 1) if out.dim() else flat
    op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return op(out, concatenated, group=group, async_op=async_op)
