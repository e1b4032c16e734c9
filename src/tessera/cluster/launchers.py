"""Where real-mode job processes run: local subprocesses, or tasks on a Ray cluster.

A launcher starts one ``tessera train`` command line and returns a handle to poll or stop it.
The executor (:mod:`tessera.cluster.real_executor`) owns everything else (devices, pausing,
retries), so a backend only has to run a command somewhere and report its exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class Handle(Protocol):
    """A started job process."""

    def poll(self) -> int | None:
        """Exit code, or None while it runs."""

    def stop(self) -> None:
        """Stop it now (SIGTERM, then SIGKILL): the last checkpoint stays usable."""


class Launcher(Protocol):
    """Starts job command lines on ``devices`` devices of one node."""

    #: nodes the launcher can place jobs on and devices per node
    nodes: int
    devices_per_node: int

    def start(self, argv: list[str], env: dict[str, str], log: Path, devices: list[int],
              node: int) -> Handle:
        """Run ``argv`` with ``env`` on ``node``, appending its output to ``log``."""


class _LocalHandle:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        # torchrun forwards SIGTERM to its workers; the whole session is signalled in case
        # the launcher itself is gone.
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class LocalLauncher:
    """Jobs as local process groups; devices are this machine's GPUs or CPU worker slots."""

    devices_per_node: int
    nodes: int = 1
    use_gpus: bool = False

    def start(self, argv: list[str], env: dict[str, str], log: Path, devices: list[int],
              node: int = 0) -> Handle:
        if self.use_gpus:  # the job sees exactly its devices, renumbered from 0
            env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}
        with open(log, "ab") as out:
            # A session of its own: stopping a job signals its torchrun and all its workers.
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return _LocalHandle(proc)


def _run_on_node(argv: list[str], env: dict[str, str], log: str) -> int:
    """Body of the Ray task: run the command where Ray placed it, return its exit code."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait()
        finally:  # a cancelled task (KeyboardInterrupt/SystemExit inside Ray) stops the job
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()


class _RayHandle:
    def __init__(self, ray, ref) -> None:
        self.ray, self.ref, self.code = ray, ref, None

    def poll(self) -> int | None:
        if self.code is None:
            ready, _ = self.ray.wait([self.ref], timeout=0)
            if ready:
                try:
                    self.code = int(self.ray.get(self.ref))
                except Exception:  # the task itself died (node lost, cancelled)
                    self.code = -1
        return self.code

    def stop(self) -> None:
        if self.poll() is None:
            self.ray.cancel(self.ref, force=False)
            try:
                self.ray.get(self.ref, timeout=60)
            except Exception:
                pass
            self.code = -15


class RayLauncher:
    """Jobs as Ray tasks, one per job, pinned to a node and holding its devices in Ray.

    Each task asks Ray for the job's devices (``num_gpus`` on GPU nodes, ``num_cpus`` on CPU
    ones) so Ray also refuses to hand a device out twice, and a ``node:<ip>`` resource to run
    where the scheduler placed the job. Output directories must be on a filesystem every node
    shares (checkpoints and the PAUSE file travel through it).

    Args:
        address: an existing Ray cluster (``ray://...`` or ``auto``); None starts a local
            instance with ``local_devices`` CPUs.
        local_devices: CPUs of the local instance.
        use_gpus: count GPUs (True) or CPUs (False) as devices.
    """

    def __init__(self, address: str | None = None, local_devices: int = 2,
                 use_gpus: bool = False) -> None:
        import ray  # optional dependency: imported only for this backend

        self.ray, self.use_gpus = ray, use_gpus
        if not ray.is_initialized():
            if address is None:
                ray.init(num_cpus=local_devices, include_dashboard=False,
                         logging_level="ERROR", object_store_memory=80 * 2**20)
            else:
                ray.init(address=address, logging_level="ERROR")
        key = "GPU" if use_gpus else "CPU"
        alive = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get(key, 0) >= 1]
        self.node_ips = sorted(n["NodeManagerAddress"] for n in alive)
        per_node = [int(n["Resources"][key]) for n in alive]
        if not per_node:
            raise RuntimeError(f"the Ray cluster has no node with a {key}")
        # A homogeneous view (the policies' ClusterSpec): the smallest node sets the width.
        self.nodes, self.devices_per_node = len(per_node), min(per_node)
        self._task = ray.remote(_run_on_node)

    def start(self, argv: list[str], env: dict[str, str], log: Path, devices: list[int],
              node: int = 0) -> Handle:
        n = len(devices)
        options = {"num_gpus": n, "num_cpus": 0} if self.use_gpus else {"num_cpus": n}
        options["resources"] = {f"node:{self.node_ips[node]}": 0.001}
        ref = self._task.options(**options).remote(argv, env, str(log))
        return _RayHandle(self.ray, ref)

    def shutdown(self) -> None:
        """Disconnect from (or stop the local) Ray instance."""
        self.ray.shutdown()
