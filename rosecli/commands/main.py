"""The `rose` executable: Typer wiring only."""

from __future__ import annotations

import typer

from rosecli.commands import bench
from rosecli.commands.generate import generate
from rosecli.commands.profile import profile

app = typer.Typer(name="rose", help="rose: fast LLM inference from the command line (generate, serve, "
                  "benchmark, profile).", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)
app.command("generate")(generate)

bench_app = typer.Typer(help="Benchmarks: streaming (TTFT/TPOT/ITL) and scheduler throughput.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _not_yet(name: str):
    def command() -> None:
        typer.echo(f"error: `rose {name}` is not available yet in this version", err=True)
        raise typer.Exit(3)
    command.__doc__ = f"(not available yet) {name}"
    return command


app.command("serve-local", help="OpenAI-compatible streaming HTTP server on loopback (not available yet).")(
    _not_yet("serve-local"))
app.command("profile")(profile)
bench_app.command("stream")(bench.stream)
bench_app.command("sched")(bench.sched)
bench_app.command("compare")(bench.compare)
