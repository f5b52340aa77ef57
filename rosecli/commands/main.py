"""The `rose` executable: Typer wiring only."""

from __future__ import annotations

import typer

from rosecli.commands import bench
from rosecli.commands.generate import generate
from rosecli.commands.profile import profile
from rosecli.commands.serve import serve_local

app = typer.Typer(name="rose", help="rose: fast LLM inference from the command line (generate, serve, "
                  "benchmark, profile).", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)
app.command("generate")(generate)

bench_app = typer.Typer(help="Benchmarks: streaming (TTFT/TPOT/ITL) and scheduler throughput.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


app.command("serve-local")(serve_local)
app.command("profile")(profile)
bench_app.command("stream")(bench.stream)
bench_app.command("sched")(bench.sched)
bench_app.command("compare")(bench.compare)
