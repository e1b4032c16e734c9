"""Draw the per-moment memory timeline of one iteration (non-model, chunks, budget, evictions)."""

from __future__ import annotations

from pathlib import Path

from tessera.memory.tracer import Moment


def timeline_rows(moments: list[Moment]) -> list[dict]:
    """Plain records of an iteration's moments (for JSON output and tests)."""
    return [{"moment": i, "label": m.label, "nonmodel_peak_bytes": m.nonmodel_peak,
             "accounted_peak_bytes": m.peak_chunks + m.peak_nonmodel,
             "chunk_bytes_at_peak": m.peak_chunks, "evictions": m.evictions}
            for i, m in enumerate(moments)]


def draw_timeline(moments: list[Moment], budget: int | None, path: str | Path,
                  title: str = "") -> Path:
    """Save a PNG: chunk bytes stacked on non-model bytes per moment, the budget as a line,
    evictions as marks, forward / backward / optimizer phases shaded."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    x = list(range(len(moments)))
    mib = 1 / 2 ** 20
    # Both bars are taken at the same instant (the moment's accounted peak), so their sum is
    # what the budget caps.
    nonmodel = [m.peak_nonmodel * mib for m in moments]
    chunks = [m.peak_chunks * mib for m in moments]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    _shade_phases(ax, moments)
    ax.bar(x, nonmodel, width=1.0, color="#d98c3f", label="non-model (activations)")
    ax.bar(x, chunks, width=1.0, bottom=nonmodel, color="#4a7ab5", label="chunks on device")
    if budget:
        ax.axhline(budget * mib, color="black", linestyle="--", label="device budget")
    evicted = [i for i, m in enumerate(moments) if m.evictions]
    if evicted:
        top = max(n + c for n, c in zip(nonmodel, chunks)) * 1.04
        ax.scatter(evicted, [top] * len(evicted), marker="v", color="#b03030",
                   label="eviction(s)")
    ax.set_xlabel("moment (module pre-forward / pre-backward, chunk Adam update)")
    ax.set_ylabel("MiB")
    ax.set_title(title or "memory per moment of one iteration")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _shade_phases(ax, moments: list[Moment]) -> None:
    colors = {"fwd": "#eef5ee", "bwd": "#f5eeee", "adam": "#eeeef8"}
    for i, m in enumerate(moments):
        phase = m.label.split(" ", 1)[0]
        ax.axvspan(i - 0.5, i + 0.5, color=colors.get(phase, "white"), linewidth=0)
