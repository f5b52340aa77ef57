"""`--help` that reads well at 80 columns.

Typer's own layout squeezes six columns into the terminal: option names are cut
(``--gpu-memory-utiliz…``), every option carries a type label (``<bool>``, ``<str>``) and arguments
show as ``{prompts}...``. Here every command and group renders its help itself, from the click
parameters Typer builds (their flags, help, default, panel), as panels of two columns:

- the names column holds ``-m, --model NAME``; a flag pair is ``--[no-]cuda-graph``; an option
  with choices shows them (``--device auto|cpu|cuda``); a value label only where neither a default
  nor choices say what to give. A name wider than the column gets a line of its own, its help
  below it: names are never cut.
- the help column ends with ``[default: X]`` and ``[env var: X]`` where they apply.

Panels come in the order they are first met, options of the command itself first and the "CUDA"
panel last (options that apply on a CUDA device only).
"""

from __future__ import annotations

import os
import textwrap
from typing import Any, Optional

from rich.console import Console, Group
from rich.panel import Panel
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

MAX_WIDTH = 100  # wider lines are harder to read, not easier
CUDA_PANEL = "CUDA"
_NAME_STYLE = "bold cyan"


def _console() -> Console:
    console = Console(highlight=False)
    width = console.width
    if os.environ.get("COLUMNS", "").isdigit():
        width = int(os.environ["COLUMNS"])
    return Console(width=max(40, min(width, MAX_WIDTH)), highlight=False, soft_wrap=False)


def _is_bool_flag(param) -> bool:
    return bool(getattr(param, "is_flag", False)) or bool(getattr(param, "secondary_opts", None))


def value_label(param) -> str:
    """What to type after the flag: the option's metavar (choices: ``auto|cpu|cuda``), else a
    plain label only when no default is shown."""
    if _is_bool_flag(param):
        return ""
    metavar = getattr(param, "metavar", None)
    if metavar:
        return metavar
    if _default_text(param) is not None:
        return ""
    kind = getattr(getattr(param, "type", None), "name", "") or ""
    return {"integer": "N", "integer range": "N", "float": "X", "float range": "X"}.get(kind, "TEXT")


def _flag_names(param) -> str:
    longs = [o for o in param.opts if o.startswith("--")]
    shorts = [o for o in param.opts if not o.startswith("--")]
    secondary = [o for o in getattr(param, "secondary_opts", []) if o.startswith("--")]
    if len(longs) == 1 and len(secondary) == 1 and secondary[0] == "--no-" + longs[0][2:]:
        longs = ["--[no-]" + longs[0][2:]]
    else:
        longs += secondary
    names = ", ".join(shorts + longs)
    label = value_label(param)
    return f"{names} {label}" if label else names


def _default_text(param) -> Optional[str]:
    if not getattr(param, "show_default", True) and getattr(param, "show_default", None) is not None:
        return None
    default = getattr(param, "default", None)
    if callable(default):
        return None
    if getattr(param, "secondary_opts", None):  # --x/--no-x: which one is on
        return None if default is None else ("on" if default else "off")
    if getattr(param, "is_flag", False) or default is None or default == [] or default == ():
        return None
    return str(default)


def _help_text(param) -> str:
    text = " ".join((getattr(param, "help", None) or "").split())
    extra = []
    default = _default_text(param)
    if default is not None and getattr(param, "param_type_name", "") == "option":
        extra.append(f"default: {default}")
    envvar = getattr(param, "envvar", None)
    if envvar and getattr(param, "show_envvar", True):
        extra.append(f"env var: {envvar if isinstance(envvar, str) else ', '.join(envvar)}")
    if getattr(param, "required", False) and getattr(param, "param_type_name", "") == "option":
        extra.append("required")
    return text + "".join(f" [{e}]" for e in extra)


def _argument_name(param) -> str:
    metavar = getattr(param, "metavar", None) or param.name.upper()
    many = getattr(param, "nargs", 1) != 1
    name = f"{metavar}..." if many and not metavar.endswith("...") else metavar
    return name if getattr(param, "required", False) else f"[{name}]"


def _rows_panel(title: str, rows: list[tuple[str, str]], width: int) -> Panel:
    """Two columns in ``width - 4`` characters (the panel's border and padding)."""
    inner = width - 4
    name_w = min(max(len(n) for n, _ in rows), max(16, inner * 2 // 5))
    help_w = max(20, inner - name_w - 2)
    lines: list[Text] = []
    for name, help_ in rows:
        wrapped = textwrap.wrap(help_, help_w, break_on_hyphens=False, break_long_words=False) or [""]
        if len(name) > name_w:  # a line of its own, never cut; its help below, indented
            lines.append(Text(name, style=_NAME_STYLE))
            first = 0
        else:
            line = Text(name.ljust(name_w), style=_NAME_STYLE)
            line.append("  " + wrapped[0])
            lines.append(line)
            first = 1
        for w in wrapped[first:]:
            lines.append(Text(" " * (name_w + 2) + w))
    return Panel(Group(*lines), title=title, title_align="left", border_style="dim", width=width)


def _usage(command, ctx) -> str:
    pieces = [ctx.command_path]
    if any(getattr(p, "param_type_name", "") == "option" for p in command.params):
        pieces.append("[OPTIONS]")
    for p in command.params:
        if getattr(p, "param_type_name", "") == "argument":
            pieces.append(_argument_name(p))
    if isinstance(command, TyperGroup):
        pieces.append("COMMAND [ARGS]...")
    return " ".join(pieces)


def _print_doc(console: Console, doc: Optional[str], width: int) -> None:
    if not doc:
        return
    for para in textwrap.dedent(doc).strip().split("\n\n"):
        console.print(textwrap.fill(" ".join(para.split()), width - 2, initial_indent=" ",
                                    subsequent_indent=" "), markup=False)
        console.print()


def render_help(command, ctx) -> None:
    console = _console()
    width = console.width
    console.print()
    console.print(Text(" Usage: ", style="bold") + Text(_usage(command, ctx)))
    console.print()
    _print_doc(console, command.help, width)
    panels: dict[str, list[tuple[str, str]]] = {}
    args = [(_argument_name(p), _help_text(p)) for p in command.get_params(ctx)
            if getattr(p, "param_type_name", "") == "argument" and not getattr(p, "hidden", False)]
    if args:
        panels["Arguments"] = args
    panels["Options"] = []
    for p in command.get_params(ctx):
        if getattr(p, "param_type_name", "") != "option" or getattr(p, "hidden", False):
            continue
        panel = getattr(p, "rich_help_panel", None) or "Options"
        panels.setdefault(panel, []).append((_flag_names(p), _help_text(p)))
    if CUDA_PANEL in panels:
        panels[CUDA_PANEL] = panels.pop(CUDA_PANEL)
    for title, rows in panels.items():
        if rows:
            console.print(_rows_panel(title, rows, width))
    if isinstance(command, TyperGroup):
        commands = [(name, " ".join((cmd.get_short_help_str(limit=200) or "").split()))
                    for name, cmd in command.commands.items() if not getattr(cmd, "hidden", False)]
        if commands:
            console.print(_rows_panel("Commands", commands, width))
    _print_doc(console, command.epilog, width)


class RoseCommand(TyperCommand):
    """A Typer command whose --help is `render_help`'s."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        render_help(self, ctx)


class RoseHelpGroup(TyperGroup):
    """A Typer group whose --help is `render_help`'s (the commands listed in a panel)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        render_help(self, ctx)
