"""Fault injection at small scale: does a run recover, and what does it lose?

Faults, each injected into a real `tessera train` run of 2 workers (tiny model):
- kill: SIGKILL a worker after a checkpoint; torchrun restarts the workers (--max-restarts),
  which resume from the newest complete checkpoint.
- stall: SIGSTOP a worker; the other rank's collective times out (collective_timeout_s),
  naming rank and operation; torchrun restarts and the run resumes.
- corrupt: truncate a shard of the newest checkpoint; resuming refuses it by name and offers
  the previous one, from which the run resumes.
- disk_full: a run with chunk memory spilling to a disk tier (one worker, offload=cpu+disk)
  whose directory is given a capacity (TESSERA_FAULT_DISK_CAPACITY, test-only) that a file
  written there after the first checkpoint fills, as another process filling the disk would.
  The run must stop with an error naming the directory and the bytes needed, leave its last
  checkpoint intact, and, once the file is removed, `--resume` must finish it.

Each faulty run is compared with an uninterrupted run of the same config: a recovered run
must log the same losses (to 1e-6) at every step after its resume point, so what is lost is
only the steps since the last checkpoint. Prints JSON lines (name, value, unit,
compared_against) and a summary with faults_injected, runs_recovered, steps_lost, bytes_lost.

    python benchmarks/bench_faults.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tessera.memory.tiers import FAULT_CAPACITY_ENV
from tessera.train.checkpoint import CheckpointError, find_latest, list_complete, verify_checkpoint

TINY = ["model.preset=tiny", "data.seq_len=32", "data.max_bytes=200000", "train.progress=lines",
        "train.logging_steps=1", "train.warmup_steps=2", "strategy=dp=2,mbs=2,gbs=8",
        "--nproc", "2"]


# One worker whose chunk memory spills about 2 MB to disk per step (host budget 1.5 MB).
DISK_TIER = ["strategy=dp=1,mbs=4,gbs=8,memory=chunk,offload=cpu+disk", "--nproc", "1",
             "memory.placement=auto", "memory.chunk_size=20000",
             "memory.device_budget=1500000", "memory.host_budget=1500000"]
DISK_CAPACITY = 8 * 2**20  # bytes the disk directory holds (its chunk files use ~1 MB)


def tessera(*args: str, wait: bool = True, env: dict[str, str] | None = None):
    cmd = [sys.executable, "-m", "tessera.cli", "train", *TINY, *args]
    env = {**os.environ, **(env or {})}
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)


def losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def workers(out: Path) -> list[int]:
    """Pids of the run's training workers; torchrun's own command line names the worker
    module too (and after a pid wrap-around it can hold the highest pid), so it is skipped."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if (b"tessera.worker" in cmd and b"torch.distributed.run" not in cmd
                and str(out).encode() in cmd):
            pids.append(int(entry.name))
    return sorted(pids)


def wait_checkpoint(out: Path, proc, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        latest = find_latest(out / "checkpoints")
        if latest is not None:
            return int(latest.name.split("_")[1])
        time.sleep(0.2)
    raise RuntimeError("no checkpoint appeared")


def compare(faulty: list[tuple[int, float]], reference: dict[int, float], steps: int) -> dict:
    """Steps redone after the fault, and whether every loss after the resume matches."""
    restart = next((i for i in range(1, len(faulty)) if faulty[i][0] <= faulty[i - 1][0]), None)
    resumed = faulty[restart:] if restart is not None else faulty
    matches = all(abs(loss - reference[step]) <= 1e-6 for step, loss in resumed)
    finished = faulty[-1][0] == steps
    redone = (faulty[restart - 1][0] - (faulty[restart][0] - 1)) if restart is not None else 0
    return {"recovered": matches and finished, "steps_lost": redone}


def inject_signal(root: Path, name: str, sig: int, steps: int, reference: dict[int, float],
                  extra: list[str]) -> dict:
    out = root / name
    proc = tessera(f"train.output_dir={out}", f"train.max_steps={steps}", "train.save_steps=4",
                   "--max-restarts", "1", *extra, wait=False)
    wait_checkpoint(out, proc)
    os.kill(workers(out)[-1], sig)
    proc.communicate(timeout=600)
    result = compare(losses(out), reference, steps) if proc.returncode == 0 else {
        "recovered": False, "steps_lost": steps}
    return {**result, "exit_code": proc.returncode}


def inject_corruption(root: Path, steps: int, reference: dict[int, float]) -> dict:
    out = root / "corrupt"
    # The whole run, then its newest checkpoint is damaged and the run resumed: the steps since
    # the previous checkpoint are replayed under the same schedule as the uninterrupted run.
    first = tessera(f"train.output_dir={out}", f"train.max_steps={steps}",
                    "train.save_steps=4")
    assert first.returncode == 0, first.stderr
    latest = find_latest(out / "checkpoints")
    shard = next(latest.glob("*.distcp"))
    lost_bytes = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: lost_bytes // 2])
    refused = tessera(f"train.output_dir={out}", f"train.max_steps={steps}", "--resume")
    named = refused.returncode == 2 and shard.name in refused.stderr
    previous = [p for p in list_complete(out / "checkpoints") if p.name < latest.name][-1]
    again = tessera(f"train.output_dir={out}", f"train.max_steps={steps}",
                    f"train.resume_from={previous}")
    result = compare(losses(out), reference, steps) if again.returncode == 0 else {
        "recovered": False}
    lost = int(latest.name.split("_")[1]) - int(previous.name.split("_")[1])
    return {"recovered": bool(named and result["recovered"]), "steps_lost": lost,
            "named_in_error": named, "corrupted_bytes": lost_bytes}


def inject_disk_full(root: Path, steps: int) -> dict:
    env = {FAULT_CAPACITY_ENV: str(DISK_CAPACITY)}

    def run(name: str, *extra: str, wait: bool = True):
        spill = root / f"{name}_spill"
        spill.mkdir(exist_ok=True)
        return tessera(*DISK_TIER, f"memory.disk_dir={spill}", f"train.output_dir={root / name}",
                       f"train.max_steps={steps}", "train.save_steps=4", *extra, wait=wait,
                       env=env)

    straight = run("disk_straight")
    assert straight.returncode == 0, straight.stderr
    reference = dict(losses(root / "disk_straight"))
    out, spill = root / "disk_full", root / "disk_full_spill"
    proc = run("disk_full", wait=False)
    wait_checkpoint(out, proc)
    with open(spill / "filler", "wb") as handle:  # sparse: counts as DISK_CAPACITY bytes
        handle.truncate(DISK_CAPACITY)
    report = proc.communicate(timeout=600)[0]
    named = (f"memory.disk_dir {spill} is full" in report
             and re.search(r"needs \d+ bytes", report) is not None)
    try:
        verify_checkpoint(find_latest(out / "checkpoints"))
        intact = True
    except CheckpointError:
        intact = False
    (spill / "filler").unlink()  # space freed
    again = run("disk_full", "--resume")
    result = compare(losses(out), reference, steps) if again.returncode == 0 else {
        "recovered": False, "steps_lost": steps}
    stopped = proc.returncode != 0
    return {"recovered": bool(stopped and named and intact and result["recovered"]),
            "steps_lost": result["steps_lost"], "stopped": stopped, "named_in_error": named,
            "checkpoint_intact": intact}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (< 3 min)")
    steps = 24 if parser.parse_args(argv).quick else 80
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        straight = tessera(f"train.output_dir={root / 'straight'}", f"train.max_steps={steps}",
                           "train.save_steps=4")
        assert straight.returncode == 0, straight.stderr
        reference = dict(losses(root / "straight"))
        faults = {
            "kill": inject_signal(root, "kill", signal.SIGKILL, steps, reference, []),
            "stall": inject_signal(root, "stall", signal.SIGSTOP, steps, reference,
                                   ["train.collective_timeout_s=5"]),
            "corrupt": inject_corruption(root, steps, reference),
            "disk_full": inject_disk_full(root, steps),
        }
    for name, result in faults.items():
        print(json.dumps({"name": f"fault_{name}_recovered", "value": int(result["recovered"]),
                          "unit": "bool", "compared_against": "uninterrupted run, same config",
                          **result}), flush=True)
    summary = {
        "faults_injected": len(faults),
        "runs_recovered": sum(r["recovered"] for r in faults.values()),
        "steps_lost": sum(r["steps_lost"] for r in faults.values()),
        # Model and optimizer state lost beyond the last checkpoint: none when every recovered
        # run's losses after its resume point equal the uninterrupted run's.
        "bytes_lost": 0 if all(r["recovered"] for r in faults.values()) else None,
    }
    print(json.dumps({"name": "fault_injection_summary", "value": summary["runs_recovered"],
                      "unit": "runs recovered", "compared_against": "faults injected",
                      "save_interval_steps": 4, **summary}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
