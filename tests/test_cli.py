"""The command line end to end: real torchrun workers, checkpoints, resume, failures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera.testing import free_port
from tessera.train.checkpoint import find_latest, read_meta

TINY = ["model.preset=tiny", "data.seq_len=32", "data.max_bytes=200000",
        "train.progress=lines", "train.logging_steps=1", "train.warmup_steps=2"]


def tessera(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def start(*args: str) -> subprocess.Popen:
    # A new session stands for the terminal's process group: Ctrl-C signals all of it.
    return subprocess.Popen([sys.executable, "-m", "tessera.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def wait_for_checkpoint(out: Path, proc: subprocess.Popen, timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        latest = find_latest(out / "checkpoints")
        if latest is not None:
            return latest
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.5)
    raise AssertionError("no checkpoint appeared")


def worker_pids(out: Path) -> list[int]:
    """The training workers of the run writing to ``out``. torchrun's own command line names
    the worker module too, and with pids wrapping around it can hold the highest pid, so it
    is left out; so is anything a worker forks (same command line, parent a worker)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if (b"tessera.worker" in cmd and b"torch.distributed.run" not in cmd
                and str(out).encode() in b" ".join(cmd)):
            parents[int(entry.name)] = ppid
    return sorted(pid for pid, ppid in parents.items() if ppid not in parents)


@pytest.mark.parametrize("args, fragment", [
    (["strategy=dp=2,mbs=2,gbs=4", "--nproc", "3"], "must equal the world size 3"),
    (["data.corpus=/no/such/folder"], "folder /no/such/folder does not exist"),
    (["train.lerning_rate=0.1"], "train.lerning_rate: unknown key"),
    (["strategy=dp=2,mbs=1,gbs=2,memory=zero2"], "(memory=zero2) is not available yet"),
    (["train.device=cuda"], "train.device=cuda but this machine has no CUDA device"),
])
def test_bad_input_is_refused_before_workers_start(tmp_path, args, fragment):
    # In process (a subprocess costs 3 s of imports each); the real process's exit code 2 is
    # checked by test_train_then_resume_on_two_workers (a truncated checkpoint).
    from click.testing import CliRunner

    from tessera.cli import main

    result = CliRunner().invoke(main, ["train", *TINY, f"train.output_dir={tmp_path}", *args])
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr
    assert "worker(s)" not in result.stdout  # nothing was launched


def test_other_model_checkpoint_is_refused(tmp_path):
    out = tmp_path / "run"
    first = tessera("train", *TINY, f"train.output_dir={out}", "train.max_steps=1")
    assert first.returncode == 0, first.stderr
    result = tessera("train", *TINY, f"train.output_dir={out}", "model.n_layers=3", "--resume")
    assert result.returncode == 2
    assert "is from another model" in result.stderr and "n_layers" in result.stderr


@pytest.mark.slow
def test_train_then_resume_on_two_workers(tmp_path):
    out = tmp_path / "run"
    first = tessera("train", *TINY, "strategy=dp=2,mbs=2,gbs=8", f"train.output_dir={out}",
                    "train.max_steps=6", "train.save_steps=3", "--nproc", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    records = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in records)
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [
        "step_00000003", "step_00000006"]
    assert read_meta(find_latest(out / "checkpoints"))["strategy"] == "dp=2,tp=1,pp=1,mbs=2,gbs=8"

    second = tessera("train", *TINY, "strategy=dp=2,mbs=2,gbs=8", f"train.output_dir={out}",
                     "train.max_steps=8", "--nproc", "2", "--resume")
    assert second.returncode == 0, second.stdout + second.stderr
    steps = [r["step"] for r in metrics(out) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]  # continued at step 7, nothing repeated
    assert find_latest(out / "checkpoints").name == "step_00000008"

    # A truncated checkpoint is named before any worker starts, the previous one offered.
    shard = next((out / "checkpoints" / "step_00000008").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:16])
    broken = tessera("train", *TINY, "strategy=dp=2,mbs=2,gbs=8", f"train.output_dir={out}",
                     "train.max_steps=9", "--nproc", "2", "--resume")
    assert broken.returncode == 2
    assert f"{shard.name} has 16 bytes" in broken.stderr
    assert "previous complete checkpoint is" in broken.stderr and "step_00000006" in broken.stderr
    again = tessera("train", *TINY, "strategy=dp=2,mbs=2,gbs=8", f"train.output_dir={out}",
                    "train.max_steps=9", "--nproc", "2",
                    f"train.resume_from={out / 'checkpoints' / 'step_00000006'}")
    assert again.returncode == 0, again.stderr
    assert [r["step"] for r in metrics(out) if "loss" in r][-3:] == [7, 8, 9]


def test_a_failing_worker_is_reported_with_rank_and_traceback(tmp_path, capfd):
    from tessera.config import load_config
    from tessera.launch import LaunchOptions, run_workers, write_resolved_config

    # Skip the launcher's pre-flight checks to make the workers themselves fail.
    config = load_config(None, [*TINY, f"train.output_dir={tmp_path}",
                                "data.corpus=/vanished/corpus", "strategy=dp=2,mbs=2,gbs=4"])
    code = run_workers(write_resolved_config(config), LaunchOptions(nproc=2))
    err = capfd.readouterr().err
    assert code != 0
    assert "rank      : 0 (local_rank: 0)" in err and "rank      : 1 (local_rank: 1)" in err
    assert "Traceback" in err and "folder /vanished/corpus does not exist" in err


@pytest.mark.slow
def test_two_nodes_of_two_workers_on_localhost(tmp_path):
    out = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    common = [*TINY, "strategy=dp=4,mbs=2,gbs=8", f"train.output_dir={out}",
              "train.max_steps=3", "--nproc", "2", "--nnodes", "2",
              "--rdzv-endpoint", endpoint]
    nodes = [start("train", *common, "--node-rank", str(rank)) for rank in (0, 1)]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert [r["step"] for r in metrics(out) if "loss" in r] == [1, 2, 3]
    assert len(list((out / "checkpoints" / "step_00000003" / "rng").glob("rank_*.pt"))) == 4


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "kill-worker"])
def test_interruption_keeps_the_last_checkpoint(tmp_path, how):
    out = tmp_path / "run"
    proc = start("train", *TINY, "strategy=dp=2,mbs=2,gbs=8", f"train.output_dir={out}",
                 "train.max_steps=100000", "train.save_steps=2", "--nproc", "2")
    wait_for_checkpoint(out, proc)
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(worker_pids(out)[-1], signal.SIGKILL)
    output = proc.communicate(timeout=90)[0]
    assert proc.returncode != 0
    assert not worker_pids(out), "workers left running"
    if how == "kill-worker":
        assert "Signal 9 (SIGKILL)" in output and "rank" in output
    latest = find_latest(out / "checkpoints")
    assert (latest / ".metadata").is_file() and read_meta(latest)["step"] % 2 == 0
    assert not list((out / "checkpoints").glob("step_*.partial"))


@pytest.mark.slow
def test_killed_worker_restarts_and_resumes_from_the_last_checkpoint(tmp_path):
    args = [*TINY, "strategy=dp=2,mbs=2,gbs=8", "train.max_steps=120", "train.save_steps=4",
            "--nproc", "2"]
    proc = start("train", *args, f"train.output_dir={tmp_path / 'killed'}", "--max-restarts", "1")
    wait_for_checkpoint(tmp_path / "killed", proc)
    os.kill(worker_pids(tmp_path / "killed")[-1], signal.SIGKILL)
    output = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, output
    straight = tessera("train", *args, f"train.output_dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr

    # The worker group failed (torchrun names the first failure it polled: the killed worker,
    # exit -9, or its peer, whose collective broke); exit 0 above means torchrun restarted it.
    assert "failed (exitcode: " in output, output
    logged = [r for r in metrics(tmp_path / "killed") if "loss" in r]
    steps = [r["step"] for r in logged]
    # Steps logged after the checkpoint but before the kill are logged again after the
    # restart (none when the kill came right after the checkpoint); the last value counts.
    final = {r["step"]: r["loss"] for r in logged}
    assert sorted(final) == list(range(1, 121)) and steps[-1] == 120
    repeats = [s for i, s in enumerate(steps) if s in steps[:i]]
    assert not repeats or (min(repeats) - 1) % 4 == 0  # the restart resumed at a checkpoint
    expected = {r["step"]: r["loss"] for r in metrics(tmp_path / "straight") if "loss" in r}
    # Same world size and data order as the uninterrupted run: the losses agree to rounding.
    for step, loss in final.items():
        assert loss == pytest.approx(expected[step], abs=1e-6), step


def _command_paths(group, prefix=()):
    import click

    for name, command in group.commands.items():
        yield (*prefix, name)
        if isinstance(command, click.Group):
            yield from _command_paths(command, (*prefix, name))


def test_every_command_has_help():
    from click.testing import CliRunner

    from tessera.cli import main

    paths = [(), *_command_paths(main)]
    assert ("train",) in paths and ("strategy", "check") in paths
    for path in paths:
        result = CliRunner().invoke(main, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        assert "Usage:" in result.output and len(result.output) > 80, path


def test_torchrun_gets_the_node_rank_only_where_its_rendezvous_reads_it():
    from tessera.launch import LaunchOptions, torchrun_command

    def command(backend: str) -> list[str]:
        options = LaunchOptions(2, 2, 1, "127.0.0.1:29500", backend)
        return torchrun_command(options, Path("config.yaml"), "run")

    # c10d numbers nodes as they join and warns that --node-rank is ignored; static reads it.
    assert not any(arg.startswith("--node-rank") for arg in command("c10d"))
    assert "--node-rank=1" in command("static")
