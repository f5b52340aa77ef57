"""Rich progress for start-up (model conversion, kernel compilation, graph capture)."""

from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

_LABELS = {"convert": "Converting model (once)", "load": "Loading weights", "capture": "Capturing CUDA graphs",
           "compile": "Compiling kernels"}


@contextmanager
def startup_progress(console: Console):
    """Yields a callback ``progress(stage, done, total)`` that drives one bar per stage."""
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=True)
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(_LABELS.get(stage, stage), total=total)
        bar.update(tasks[stage], completed=done, total=total)

    with bar:
        yield update
