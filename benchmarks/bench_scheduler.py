"""Cluster-scheduler benchmark: ONES vs baselines, job-model fidelity, simulator speed.

Prints one JSON object per line: {"name", "value", "unit", "compared_against", ...context}.

    .venv/bin/python benchmarks/bench_scheduler.py            # every workload file and load
    .venv/bin/python benchmarks/bench_scheduler.py --quick    # a subset, < 3 minutes on 2 cores

Figures:
* ``ones_vs_tiresias_avg_jct_ratio`` / ``ones_vs_optimus_avg_jct_ratio``: geometric mean over the
  Pollux workload files of ONES's average JCT divided by the baseline's (64 GPUs, same
  simulator, same seed). Per-file, per-policy average JCTs are printed too. The full run also
  reports ``ones_artifact_vs_*``: ONES configured as its public artifact (``ONES.artifact()``).
* ``fidelity_*``: job-model prediction errors against the measured profiles.
* ``sim_10k_jobs_1024_gpus_s``: wall seconds to simulate 10,000 consecutive Philly-derived jobs
  on 1,024 GPUs under ONES.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from tessera.cluster.fidelity import fit_report
from tessera.cluster.job_model import JobModels
from tessera.cluster.policies import ONES, ClusterSpec, make_policy
from tessera.cluster.profiles import APPS, default_profile_dir, load_profile
from tessera.cluster.report import summarize
from tessera.cluster.simulator import SimConfig, Simulator
from tessera.cluster.traces import assign_philly_apps, load_trace

LOADS = ("workloads-0.5", "workloads", "workloads-1.5", "workloads-2.0", "workloads-realistic")
POLICIES = ("ones", "tiresias", "optimus", "pollux", "srtf", "fifo")
PHILLY_START = 40000  # a busy stretch of the trace (about 5.6 days, offered load ~0.8 of 1024)


def emit(name: str, value: float, unit: str, compared_against: str | None, **context) -> None:
    print(json.dumps({"name": name, "value": value, "unit": unit,
                      "compared_against": compared_against, **context}), flush=True)


def fidelity(models: JobModels, root: Path) -> None:
    step, loo = [], []
    for app in APPS:
        r = fit_report(models, load_profile(root, app))
        step.append(r.step_time_mape)
        loo.append(r.epochs_loo_mape)
        emit(f"fidelity_step_time_mape_{app}", round(r.step_time_mape, 4), "fraction",
             "measured step times", samples=r.step_samples, max_err=round(r.step_time_max_err, 3))
        emit(f"fidelity_epochs_to_target_mape_{app}", round(r.epochs_loo_mape, 4), "fraction",
             "measured epochs to target (leave-one-run-out)",
             in_sample=round(r.epochs_mape, 4),
             runs=[list(p) for p in r.epochs_pairs])
    emit("fidelity_step_time_mape", round(float(np.mean(step)), 4), "fraction",
         "measured step times (mean over 6 apps)")
    emit("fidelity_epochs_to_target_mape", round(float(np.mean(loo)), 4), "fraction",
         "measured epochs to target (leave-one-run-out, mean over 6 apps)")


def policy_for(name: str):
    if name == "ones-artifact":  # ONES as its public artifact implements it, for comparison
        p = ONES.artifact()
        p.name = name
        return p
    return make_policy(name)


def workloads(models: JobModels, root: Path, files: list[Path], policies: tuple[str, ...],
              seed: int) -> dict[str, dict[str, float]]:
    cluster, config = ClusterSpec.with_gpus(64), SimConfig(seed=seed)
    avg: dict[str, dict[str, float]] = {}
    for path in files:
        jobs = load_trace(path, max_gpus=64, apps=models.names)
        key = f"{path.parent.name}/{path.name}"
        avg[key] = {}
        for name in policies:
            s = summarize(Simulator(jobs, cluster, models, config).run(policy_for(name)))
            avg[key][name] = s.avg_jct
            emit("avg_jct_s", round(s.avg_jct, 1), "s", None, workload=key, policy=name,
                 gpus=64, seed=seed, median_jct_s=round(s.median_jct, 1),
                 p95_jct_s=round(s.p95_jct, 1), makespan_s=round(s.makespan, 1),
                 utilization=round(s.utilization, 3), resizes=s.resizes, restarts=s.restarts)
    return avg


def ratios(avg: dict[str, dict[str, float]], ones: str = "ones") -> None:
    loads = sorted({k.split("/")[0] for k in avg}) + ["all"]
    for base in ("tiresias", "optimus", "pollux", "srtf", "fifo"):
        for load in loads:
            keys = [k for k in avg if load == "all" or k.startswith(load + "/")]
            keys = [k for k in keys if base in avg[k] and ones in avg[k]]
            if not keys:
                continue
            gm = math.exp(np.mean([math.log(avg[k][ones] / avg[k][base]) for k in keys]))
            name = f"{ones.replace('-', '_')}_vs_{base}_avg_jct_ratio"
            target = {"tiresias": 0.7, "optimus": 0.6}.get(base) if ones == "ones" else None
            emit(name if load == "all" else f"{name}[{load}]", round(gm, 3), "ratio",
                 base, files=len(keys), gpus=64, aggregate="geometric mean over files",
                 **({"target": f"<= {target}"} if target else {}))


def philly(models: JobModels, root: Path, seed: int) -> None:
    jobs = load_trace(root / "philly.csv", max_gpus=1024, limit=10000, start=PHILLY_START)
    jobs = assign_philly_apps(jobs, seed)
    started, cpu = time.perf_counter(), time.process_time()
    result = Simulator(jobs, ClusterSpec.with_gpus(1024), models, SimConfig(seed=seed)).run(
        make_policy("ones"))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    s = summarize(result)
    # cpu_s tells a slow run from a busy machine (wall >> cpu when others share the cores).
    emit("sim_10k_jobs_1024_gpus_s", round(wall, 2), "s", "target 60 s", cpu_s=round(cpu, 2),
         jobs=s.jobs,
         finished=s.finished, rounds=len(result.timeline_t), avg_jct_s=round(s.avg_jct, 1),
         utilization=round(s.utilization, 3), philly_start=PHILLY_START, policy="ones")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="subset of workloads (< 3 min)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profiles", type=Path, default=None)
    ap.add_argument("--skip-philly", action="store_true")
    args = ap.parse_args(argv)
    root = args.profiles or default_profile_dir()
    models = JobModels.fit(root)
    fidelity(models, root)
    if args.quick:
        files = [root.parent / "workloads" / f"workload-{i}.csv" for i in (1, 2, 3)]
        policies = ("ones", "tiresias", "optimus", "pollux")
    else:
        files = [root.parent / load / f"workload-{i}.csv" for load in LOADS for i in range(1, 9)]
        policies = (*POLICIES, "ones-artifact")
    avg = workloads(models, root, files, policies, args.seed)
    ratios(avg)
    if "ones-artifact" in policies:
        ratios(avg, "ones-artifact")
    if not args.skip_philly:
        philly(models, root, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
