"""Start-up progress: visible from the first second (importing torch, loading weights, the one-time
conversion, kernel compilation, CUDA graph capture), gone once the engine is ready."""

from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

# stage -> what the status line says while it runs; stages with a known total also get a bar
_LABELS = {"import": "importing torch", "load": "loading weights", "convert": "converting the model (once)",
           "compile": "compiling kernels", "capture": "capturing CUDA graphs",
           "capture_prefill": "capturing prefill graphs"}
_BARS = ("convert", "capture", "capture_prefill")


@contextmanager
def startup_progress(console: Console, what: str = "Starting"):
    """Yields a callback ``progress(stage, done, total)``: one status line (spinner, the stage, time
    since start) shown at once and redrawn ten times a second, plus a bar for stages that count
    (conversion, graph capture). Nothing is printed when ``console`` is not a terminal."""
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, transient=True)
    status = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=True)
    bars: dict[str, int] = {}
    line = status.add_task(f"{what}: {_LABELS['import']}", total=None)

    def update(stage: str, done: int, total: int) -> None:
        status.update(line, description=f"{what}: {_LABELS.get(stage, stage)}")
        if stage in _BARS and total:
            if stage not in bars:
                bars[stage] = bar.add_task(_LABELS[stage], total=total)
            bar.update(bars[stage], completed=done, total=total)

    from rich.console import Group
    from rich.live import Live

    with Live(Group(status, bar), console=console, transient=True, refresh_per_second=10):
        yield update


def start_engine(config, console: Console, freeze_gc: bool = True):
    """Build the engine with start-up progress on ``console`` (stderr): the status line is up
    before torch is imported, the slowest second of a cold start.

    ``freeze_gc``: then freeze what start-up made out of the garbage collector (`gc_pauses.freeze_startup`), as
    the server does: otherwise the first requests after start-up pay a collection that walks it (on the H200,
    W1-cold's first burst waited 7.5-10 ms for a generation-1 collection of start-up's leftovers: TTFT p50 10-17 ms,
    3.4-3.8 frozen) and every later full collection walks it again. The freeze is one full collection, at
    start-up; a one-shot command (`rose generate`) leaves it out rather than delay its first text by it, and the
    servers freeze once their own set-up is made too."""
    with startup_progress(console, f"Starting {config.model}") as progress:
        from rosecli.engine.llm import LLMEngine

        engine = LLMEngine(config, progress=progress)
    if freeze_gc:
        from rosecli.engine.gc_pauses import freeze_startup

        freeze_startup()
    return engine
