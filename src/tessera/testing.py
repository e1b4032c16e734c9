"""Test helpers: run a function in N gloo processes; tiny runs for parity tests.

GPU-only tests carry ``@pytest.mark.gpu``; tests/conftest.py skips them without CUDA.

Example::

    def _check(rank, world_size, x):
        ...
        return value

    results = run_distributed(_check, world_size=4, args=(3,))  # one result per rank

The function must be importable by name (defined at module level): workers are started
with the "spawn" method, a fresh interpreter per rank as torchrun does. The test suite calls
:func:`use_fork_server` instead (tests/conftest.py): workers are then forked from a fork
server that imported torch, tessera's layouts and the Hugging Face model classes once
(``WORKER_PRELOAD``), not 4-5 s of CPU per rank (8 ranks on 2 cores waited about 20 s for
them). Measurements of worker memory keep spawn: a forked worker's resident set includes the
server's imports.
"""

from __future__ import annotations


import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

# Imported once by the fork server of :func:`use_fork_server`.
WORKER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.export",
                  "tessera.testing", "tessera.train.trainer", "tessera.parallel.pipeline",
                  "tessera.parallel.tensor", "tessera.parallel.sequence", "tessera.memory",
                  "transformers.models.gpt2.modeling_gpt2",
                  "transformers.models.llama.modeling_llama"]


class DistributedTestError(AssertionError):
    """A rank failed or timed out; the message holds its rank and traceback."""


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_distributed(fn: Callable[..., Any], world_size: int, args: tuple = (),
                    timeout: float = 180.0, backend: str = "gloo",
                    env: dict[str, str] | None = None,
                    collective_timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return their results.

    Each worker gets torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), one intra-op thread, and an initialised process group
    (whose collectives time out after ``collective_timeout_s`` when given).

    Raises:
        DistributedTestError: with the first failing rank's traceback, or the ranks that had
            not finished when ``timeout`` seconds passed.
    """
    ctx = mp.get_context(_START_METHOD)  # spawn, or the suite's fork server
    results: mp.Queue = ctx.Queue()
    base_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [ctx.Process(target=_worker, args=(fn, rank, world_size, args, backend, base_env,
                                               results, collective_timeout_s), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, results, world_size, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)


_START_METHOD = "spawn"


def use_fork_server() -> None:
    """Fork the workers of later :func:`run_distributed` calls from a fork server that
    imports ``WORKER_PRELOAD`` once (where the platform has one; spawn otherwise). No rank
    state exists before the fork: each worker sets its environment, threads and process group
    itself. Not for measuring worker memory (the server's imports count in its RSS)."""
    global _START_METHOD
    if "forkserver" in mp.get_all_start_methods():
        mp.get_context("forkserver").set_forkserver_preload(WORKER_PRELOAD)  # before it starts
        _START_METHOD = "forkserver"


def _collect(procs: list, results: mp.Queue, world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    outputs: dict[int, Any] = {}
    while len(outputs) < world_size:
        try:
            wait = max(0.1, min(1.0, deadline - time.monotonic()))
            rank, status, payload = results.get(timeout=wait)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if not p.is_alive() and p.exitcode not in (0, None) and r not in outputs]
            if dead:
                raise DistributedTestError(
                    f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                    f"(no Python traceback: killed or crashed)") from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise DistributedTestError(
                    f"timed out after {timeout:.0f}s waiting for ranks {missing}") from None
            continue
        if status == "error":
            raise DistributedTestError(f"rank {rank} failed:\n{payload}")
        outputs[rank] = pickle.loads(payload)
    return [outputs[r] for r in range(world_size)]


def _worker(fn, rank, world_size, args, backend, env, results, collective_timeout_s) -> None:

    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    try:
        timeout = {} if collective_timeout_s is None else {
            "timeout": timedelta(seconds=collective_timeout_s)}
        dist.init_process_group(backend, rank=rank, world_size=world_size, **timeout)
        # Plain pickle: torch's multiprocessing pickler would pass tensors through shared
        # memory that disappears when this process exits.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def tiny_run_config(output_dir, strategy: str = "dp=1,tp=1,pp=1,mbs=4,gbs=8", **sections):
    """A tiny-model run config that takes well under a second per step on one CPU core.

    Args:
        output_dir: the run's output folder.
        strategy: Strategy text.
        **sections: per-section overrides, e.g. ``train={"max_steps": 10}``.
    """
    from tessera.config import config_from_dict

    raw = {
        "model": {"preset": "tiny"},
        "strategy": strategy,
        "data": {"corpus": "stdlib", "seq_len": 32, "max_bytes": 200_000},
        "train": {"output_dir": str(output_dir), "max_steps": 5, "learning_rate": 3e-3,
                  "warmup_steps": 2, "logging_steps": 1, "progress": "off", "seed": 7},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    return config_from_dict(raw)


def tiny_trainer(out, strategy: str, steps: int = 5, **sections):
    """A Trainer for :func:`tiny_run_config` (with its memory section, if any), in this
    process (a worker). ``sections`` as for tiny_run_config; ``train`` keys add to max_steps."""
    from tessera.run import build_datasets, build_model, build_tokenizer
    from tessera.train.trainer import Trainer

    train = {"max_steps": steps, **sections.pop("train", {})}
    config = tiny_run_config(out, strategy, train=train, **sections)
    train_ds, val_ds = build_datasets(config, build_tokenizer(config))
    return Trainer(build_model(config), config.train, train_ds, val_ds,
                   strategy=config.strategy, memory=config.memory)


def train_tiny(out, strategy: str, steps: int = 5, until: int | None = None, **sections):
    """Train :func:`tiny_run_config` in this process (a worker); returns (result, parameters)."""
    trainer = tiny_trainer(out, strategy, steps, **sections)
    result = trainer.train(until_step=until)
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return result, params
