"""Start N local workers (and join multi-node jobs) through torch.distributed.run.

The launcher validates everything it can before a worker starts, writes the resolved config
into the run's output folder, and runs ``torchrun ... -m tessera.worker CONFIG``. A worker's
failure comes back as torchrun's report (the failing rank and its traceback); Ctrl-C stops
every worker.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from tessera.config import RunConfig
from tessera.data import iter_text_files, resolve_corpus
from tessera.distributed import resolve_device_type
from tessera.run import build_model, build_tokenizer
from tessera.train import checkpoint as ckpt
from tessera.train.export import check_importable
from tessera.train.model_identity import describe_model


@dataclass(frozen=True)
class LaunchOptions:
    """Where the workers run.

    Attributes:
        nproc: workers on this node.
        nnodes: nodes in the job.
        node_rank: this node's rank (multi-node).
        rdzv_endpoint: host:port of the rendezvous (multi-node).
        rdzv_backend: torchrun rendezvous backend for multi-node jobs.
        max_restarts: torchrun restarts of all workers after a failure.
    """

    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_backend: str = "c10d"
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.nnodes < 1:
            raise ValueError(f"--nproc and --nnodes must be >= 1, got {self.nproc}, {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank={self.node_rank} must lie in 0..{self.nnodes - 1}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT")

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


def torchrun_command(options: LaunchOptions, config_file: Path, run_id: str) -> list[str]:
    """The torch.distributed.run command line for these options."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={options.nproc}",
           f"--max-restarts={options.max_restarts}"]
    if options.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={options.nnodes}", f"--rdzv-backend={options.rdzv_backend}",
                f"--rdzv-endpoint={options.rdzv_endpoint}", f"--rdzv-id={run_id}"]
        if options.rdzv_backend == "static":  # c10d assigns node ranks as nodes join
            cmd.append(f"--node-rank={options.node_rank}")
    return cmd + ["-m", "tessera.worker", str(config_file)]


def write_resolved_config(config: RunConfig) -> Path:
    """Write the validated config to ``<output_dir>/config.yaml`` for the workers to read."""
    out = Path(config.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    tmp = out / ".config.yaml.tmp"
    tmp.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    os.replace(tmp, path)
    return path


def run_workers(config_file: Path, options: LaunchOptions) -> int:
    """Run the workers to completion; returns torchrun's exit code (0 on success).

    Ctrl-C (SIGINT) or SIGTERM to this process is forwarded to torchrun, which stops every
    worker; checkpoints are written atomically, so the last complete one stays usable.
    """
    run_id = hashlib.sha256(str(config_file.resolve()).encode()).hexdigest()[:12]
    env = dict(os.environ)
    # Each worker gets its share of the cores; oversubscribed threads slow everyone down.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // options.nproc)))
    proc = subprocess.Popen(torchrun_command(options, config_file, run_id), env=env)
    previous = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def prepare_run(config: RunConfig, options: LaunchOptions) -> Path:
    """Check everything that can be checked before workers start; write the resolved config.

    Raises:
        StrategyError, DataError, CheckpointError, WeightsImportError: naming the field,
            path or rule.
    """
    config.strategy.require_available()
    config.strategy.validate_for(world_size=options.world_size)
    resolve_device_type(config.train.device)
    # A missing or empty corpus is named here; a BPE tokenizer is trained once, here.
    next(iter_text_files(resolve_corpus(config.data.corpus), config.data.extensions))
    tokenizer = build_tokenizer(config)
    if config.train.resume or config.train.resume_from:
        _check_resumable(config, tokenizer.vocab_size)
    if config.train.init_from:
        check_importable(config.train.init_from, _shape_only_model(config, tokenizer.vocab_size))
    return write_resolved_config(config)


def _check_resumable(config: RunConfig, tokenizer_vocab: int) -> None:
    """The checkpoint to resume exists, is intact (sizes; workers check digests) and fits."""
    if config.train.resume_from:
        latest = Path(config.train.resume_from)
        ckpt.read_meta(latest)  # refuses a folder that is not a complete checkpoint
    else:
        latest = ckpt.find_latest(ckpt.checkpoint_root(config.train.output_dir))
        if latest is None:
            return  # nothing saved yet: --resume starts from scratch
    meta = ckpt.verify_checkpoint(latest, hashes=False)
    model = _shape_only_model(config, tokenizer_vocab)
    ckpt.check_compatible(meta, describe_model(model), latest)


def _shape_only_model(config: RunConfig, tokenizer_vocab: int) -> torch.nn.Module:
    """The run's model on the meta device: names and shapes, no memory, no initialisation."""
    with torch.device("meta"):
        return build_model(config, vocab_size=max(tokenizer_vocab,
                                                  config.model.build_config().vocab_size))
