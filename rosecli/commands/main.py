"""The `rose` executable: Typer wiring only."""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

from rosecli.commands import bench
from rosecli.commands.generate import generate
from rosecli.commands.profile import profile
from rosecli.commands.serve import serve_local


class _OneLineErrors(TyperGroup):
    """Click's usage errors (a non-number for a number, a missing argument, an unknown option)
    as one line naming the option and where the options are listed, exit code 2, like every
    other user error (`options.fail`)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as e:  # click's exceptions, as Typer ships them
            if type(e).__name__ == "NoArgsIsHelpError":  # the help is already printed
                sys.exit(e.exit_code)
            ctx = getattr(e, "ctx", None)
            where = f" (see {ctx.command_path} --help)" if ctx is not None and e.exit_code == 2 else ""
            typer.echo(f"error: {' '.join(e.format_message().split())}{where}", err=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(name="rose", cls=_OneLineErrors,
                  help="rose: fast LLM inference from the command line (generate, serve, benchmark, profile).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
app.command("generate")(generate)

bench_app = typer.Typer(help="Benchmarks: streaming (TTFT/TPOT/ITL) and scheduler throughput.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


app.command("serve-local")(serve_local)
app.command("profile")(profile)
bench_app.command("stream")(bench.stream)
bench_app.command("sched")(bench.sched)
bench_app.command("compare")(bench.compare)
bench_app.command("serve")(bench.serve)
sweep_app = typer.Typer(help="Curves over load: one bench stream or bench serve workload at several request rates, "
                        "concurrencies, batch limits or lengths; --slo finds the highest load meeting SLOs.",
                        no_args_is_help=True)
bench_app.add_typer(sweep_app, name="sweep")
sweep_app.command("stream")(bench.sweep_stream)
sweep_app.command("serve")(bench.sweep_serve)
bench_app.command("plot")(bench.plot)
