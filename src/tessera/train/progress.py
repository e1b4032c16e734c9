"""Progress display on rank 0: a rich bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)


class ProgressReporter:
    """Shows step, loss, tokens/s and MFU.

    Args:
        total_steps: steps of the whole run.
        start_step: first step of this process (after a resume).
        mode: "bar", "lines", "off", or "auto" (bar on a terminal, lines otherwise).
        enabled: False on every rank but 0.
        console: where the bar draws (default: standard output).
    """

    def __init__(self, total_steps: int, start_step: int, mode: str, enabled: bool,
                 console: Console | None = None) -> None:
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode = mode if enabled else "off"
        self.total = total_steps
        self._progress = None
        if self.mode == "bar":
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=console or Console(), refresh_per_second=4)
            self._task = self._progress.add_task("train", total=total_steps,
                                                 completed=start_step, stats="")
            self._progress.start()

    def update(self, step: int, record: dict[str, Any] | None = None) -> None:
        """Advance to ``step``; show ``record`` (loss, tokens/s, MFU) when given."""
        if self.mode == "off":
            return
        text = format_record(record) if record else None
        if self._progress is not None:
            kwargs = {"stats": text} if text else {}
            self._progress.update(self._task, completed=step, **kwargs)
        elif text:
            print(f"step {step}/{self.total} | {text}", flush=True)

    def message(self, text: str) -> None:
        if self.mode == "off":
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def format_record(record: dict[str, Any]) -> str:
    parts = []
    if "loss" in record:
        parts.append(f"loss {record['loss']:.4f}")
    for key in (k for k in record if k.startswith("eval") and k.endswith("_loss")):
        parts.append(f"{key.removesuffix('_loss').replace('_', ' ')} {record[key]:.4f}")
    if "lr" in record:
        parts.append(f"lr {record['lr']:.2e}")
    if "tokens_per_s" in record:
        parts.append(f"{record['tokens_per_s'] / 1e3:.1f}k tok/s")
    if "mfu" in record:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    return " | ".join(parts)
