"""Summaries of simulation results: JCT statistics, utilisation, resizes; a table and plots."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tessera.cluster.simulator import SimResult


@dataclass(frozen=True)
class Summary:
    """Headline figures of one simulation (times in seconds).

    Attributes:
        policy: policy name.
        jobs: jobs in the trace; finished: jobs that finished.
        avg_jct, median_jct, p95_jct: job completion time statistics over finished jobs.
        makespan: first arrival to last finish.
        utilization: time-averaged fraction of GPUs allocated, first arrival to last finish.
        resizes: GPU-count changes of running jobs; restarts: all allocation changes.
        wall_s: wall-clock seconds the simulation took.
    """

    policy: str
    jobs: int
    finished: int
    avg_jct: float
    median_jct: float
    p95_jct: float
    makespan: float
    utilization: float
    resizes: int
    restarts: int
    wall_s: float

    def as_dict(self) -> dict:
        """Plain-dict form for JSON."""
        return asdict(self)


def utilization(result: SimResult) -> float:
    """Time-weighted mean fraction of GPUs allocated over the run."""
    t, u = result.timeline_t, result.timeline_used
    if len(t) < 2:
        return 0.0
    dt = np.diff(t)
    return float((u[:-1] * dt).sum() / (dt.sum() * result.gpus))


def summarize(result: SimResult) -> Summary:
    """The headline figures of one result."""
    jct = result.jct
    done = ~np.isnan(result.finish)
    stat = (lambda f: float(f(jct)) if jct.size else float("nan"))  # noqa: E731
    makespan = (float(result.finish[done].max() - result.arrival.min()) if done.any()
                else float("nan"))
    return Summary(result.policy, len(result.names), int(done.sum()), stat(np.mean),
                   stat(np.median), stat(lambda x: np.percentile(x, 95)), makespan,
                   utilization(result), int(result.resizes.sum()), int(result.restarts.sum()),
                   float(result.wall_s))


def table(summaries: list[Summary], title: str = "cluster simulation"):
    """A rich Table of summaries (hours for times, one row per policy)."""
    from rich.table import Table

    tab = Table(title=title)
    for col in ("policy", "jobs", "avg JCT h", "median JCT h", "p95 JCT h", "makespan h",
                "GPU util", "resizes", "restarts", "sim s"):
        tab.add_column(col, justify="left" if col == "policy" else "right")
    for s in summaries:
        tab.add_row(s.policy, f"{s.finished}/{s.jobs}", f"{s.avg_jct / 3600:.2f}",
                    f"{s.median_jct / 3600:.2f}", f"{s.p95_jct / 3600:.2f}",
                    f"{s.makespan / 3600:.2f}", f"{s.utilization:.0%}", str(s.resizes),
                    str(s.restarts), f"{s.wall_s:.1f}")
    return tab


def write_plots(results: list[SimResult], folder: str | Path) -> list[Path]:
    """Write ``jct_cdf.png`` and ``utilization.png`` for the results into ``folder``.

    matplotlib is imported here, not at module level, so the rest of the package works
    without it.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        jct = np.sort(r.jct) / 3600
        ax.step(jct, np.arange(1, jct.size + 1) / max(jct.size, 1), where="post", label=r.policy)
    ax.set(xscale="log", xlabel="job completion time (h)", ylabel="fraction of jobs",
           title="JCT CDF")
    ax.legend()
    fig.tight_layout()
    cdf = folder / "jct_cdf.png"
    fig.savefig(cdf, dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in results:
        ax.step(r.timeline_t / 3600, r.timeline_used / r.gpus, where="post", label=r.policy,
                linewidth=0.8)
    ax.set(xlabel="time (h)", ylabel="GPUs allocated", ylim=(0, 1.05),
           title="GPU utilisation")
    ax.legend()
    fig.tight_layout()
    util = folder / "utilization.png"
    fig.savefig(util, dpi=120)
    plt.close(fig)
    return [cdf, util]
