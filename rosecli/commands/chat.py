"""`rose chat`: talk to the model turn by turn, through its chat template.

One engine and one streaming manager for the session; each turn is one request through
`generate.stream_requests` (the same path as `rose generate`), its answer streamed to stdout. The
conversation is kept and sent whole each turn; when it no longer leaves room for an answer in
the context, the oldest exchanges are dropped (and the user told). Lines come from the terminal
(with line editing) or from a pipe: ``printf 'Hi\\n/exit\\n' | rose chat``.
"""

from __future__ import annotations

import sys
from typing import Optional

from rich.console import Console

from rosecli.commands import options as o
from rosecli.commands.generate import GENERATE_EXCLUDES, System, stream_requests
from rosecli.commands.progress import start_engine
from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.errors import RequestError

CHAT_DEFAULTS = {"max_new_tokens": 512}  # an answer, not a probe: longer than generate's 128
EXIT = ("/exit", "/quit", "/bye")
HELP = "/exit (or Ctrl-D) ends, /clear forgets the conversation, /help shows this"


@o.user_errors
@o.with_options(o.engine_options(exclude=GENERATE_EXCLUDES), o.sampling_options(), defaults=CHAT_DEFAULTS)
def chat(system: System = None, *, config: EngineConfig, params: SamplingParams) -> None:
    """Chat with the model: type a message, read the answer as it streams. /exit (or Ctrl-D) ends,
    /clear forgets the conversation. Needs a model with a chat template (smollm2-135m has one)."""
    if system is not None:
        o.check_text("--system", system)
    interactive = sys.stdin is not None and sys.stdin.isatty()
    err = Console(stderr=True)
    engine = start_engine(config.replace(max_batch_size=1, prefill_max_batch_size=1), err)
    try:
        if not engine.inputs.has_chat_template:
            o.fail(f"{engine.model_name} has no chat template, so it cannot chat: use rose generate "
                   "(or a model with one, such as smollm2-135m)")
        from rosecli.engine.streaming import StreamingManager

        manager = StreamingManager(engine, start=False)
        try:
            _session(engine, manager, system, params, interactive, err)
        finally:
            manager.close()
    finally:
        engine.close()


def _session(engine, manager, system: Optional[str], params: SamplingParams, interactive: bool,
             err: Console) -> None:
    head = [{"role": "system", "content": system}] if system is not None else []
    history: list[dict] = []
    if interactive:
        err.print(f"{engine.model_name} on {engine.device.type}, context {engine.max_model_len} tokens. {HELP}.",
                  highlight=False, markup=False)
    while True:
        line = _read_line(interactive)
        if line is None:  # end of input
            break
        text = line.strip()
        if not text:
            continue
        command = text.split()[0].lower() if text.startswith("/") else None
        if command in EXIT:
            break
        if command == "/clear":
            history.clear()
            err.print("(conversation cleared)", style="dim")
            continue
        if command in ("/help", "/?"):
            err.print(HELP, highlight=False, markup=False)
            continue
        if command is not None and " " not in text:
            err.print(f"unknown command {text}: {HELP} (anything else is sent as a message)", highlight=False,
                      markup=False)
            continue
        o.check_text("the message", line)
        history.append({"role": "user", "content": line.rstrip("\r\n")})
        try:
            ids = _fit(engine, head, history, params, err)
        except RequestError as e:
            history.pop()
            err.print(f"error: {e}", highlight=False, markup=False)
            continue
        (out,), _ = stream_requests(manager, [ids], params, sys.stdout)
        history.append({"role": "assistant", "content": out.text})
        if out.finish_reason == "length":
            err.print(f"(the answer stopped at {out.output_tokens} tokens: --max-new-tokens, or the context)",
                      style="dim", highlight=False)
        if interactive:
            sys.stdout.write("\n")
            sys.stdout.flush()


def _read_line(interactive: bool) -> Optional[str]:
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        try:
            return input(">>> ")
        except EOFError:
            sys.stdout.write("\n")
            return None
    line = sys.stdin.readline()
    return line if line else None


def _fit(engine, head: list[dict], history: list[dict], params: SamplingParams, err: Console) -> list[int]:
    """The conversation as prompt ids, dropping the oldest exchanges while it leaves less than
    room for an answer (--max-new-tokens, at most a quarter of the context)."""
    room = min(params.max_new_tokens, engine.max_model_len // 4)
    dropped = 0
    while True:
        ids = engine.inputs.chat(head + history)
        if len(ids) + room <= engine.max_model_len or len(history) <= 1:
            break
        del history[:2]  # the oldest user message and its answer
        dropped += 1
    if dropped:
        err.print(f"(the conversation outgrew the {engine.max_model_len}-token context: dropped the oldest "
                  f"{dropped} exchange{'s' if dropped != 1 else ''})", style="dim", highlight=False)
    engine.inputs.check_prompt(ids)
    return ids
