"""The `rose` executable: Typer wiring only."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from rosecli.commands import bench
from rosecli.commands.chat import chat
from rosecli.commands.generate import generate
from rosecli.commands.help import RoseCommand, RoseHelpGroup
from rosecli.commands.profile import profile
from rosecli.commands.serve import serve_local


def version_lines() -> list[str]:
    """rosecli, Python, torch, triton and the CUDA device torch sees (no model is loaded)."""
    import platform
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    lines = [f"rosecli {version('rosecli')}", f"python {platform.python_version()}", f"torch {version('torch')}",
             f"triton {version('triton')}"]
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            more = f" (+{torch.cuda.device_count() - 1} more)" if torch.cuda.device_count() > 1 else ""
            lines.append(f"CUDA device: {props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA "
                         f"{torch.version.cuda}{more}")
        else:
            built = f"torch built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build of torch"
            lines.append(f"CUDA device: none ({built}); rose runs on the CPU")
    except Exception as e:  # a broken torch install is worth saying, not a traceback
        lines.append(f"CUDA device: unknown (torch failed to import: {type(e).__name__}: {e})")
    return lines


def _version(value: bool) -> None:
    if value:
        for line in version_lines():
            typer.echo(line)
        raise typer.Exit()


class _OneLineErrors(RoseHelpGroup):
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
                  help="rose: fast LLM inference from the command line (generate, chat, serve, benchmark, profile).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", "-V", is_eager=True, callback=_version,
                                                help="Print the versions of rosecli, torch and triton and the "
                                                "CUDA device, then exit.")] = False) -> None:
    pass


app.command("generate", cls=RoseCommand)(generate)
app.command("chat", cls=RoseCommand)(chat)

bench_app = typer.Typer(cls=RoseHelpGroup, help="Benchmarks: streaming (TTFT/TPOT/ITL), scheduler throughput, "
                        "HTTP serving, and comparing saved results.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


app.command("serve-local", cls=RoseCommand)(serve_local)
app.command("profile", cls=RoseCommand)(profile)
bench_app.command("stream", cls=RoseCommand)(bench.stream)
bench_app.command("sched", cls=RoseCommand)(bench.sched)
bench_app.command("compare", cls=RoseCommand)(bench.compare)
bench_app.command("serve", cls=RoseCommand)(bench.serve)
sweep_app = typer.Typer(cls=RoseHelpGroup, help="Curves over load: one bench stream or bench serve workload at "
                        "several request rates, concurrencies, batch limits or lengths; --slo finds the highest "
                        "load meeting SLOs.", no_args_is_help=True)
bench_app.add_typer(sweep_app, name="sweep")
sweep_app.command("stream", cls=RoseCommand)(bench.sweep_stream)
sweep_app.command("serve", cls=RoseCommand)(bench.sweep_serve)
bench_app.command("plot", cls=RoseCommand)(bench.plot)
