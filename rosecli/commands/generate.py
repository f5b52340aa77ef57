"""`rose generate`: stream completions to the terminal.

Prompts come from the arguments, from files (``-p FILE``) and from stdin (``-``); several run as
one batch and are printed in order, each streamed as it is generated: the first one live, each
later one from what it has generated so far once the one before it ends (nothing interleaves).
The engine steps on the main thread (`StreamingManager.run_until_idle`); a printer thread writes.
`rose chat` uses the same path (`stream_requests`) turn by turn.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Annotated, Optional

import typer
from rich.console import Console

from rosecli.commands import options as o
from rosecli.commands.progress import start_engine
from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.errors import ConfigError

# Engine options generate does not offer: its batch is its prompts; the rest serve long-running
# or benchmark engines.
GENERATE_EXCLUDES = ("prefix_cache", "max_batch_size", "prefill_max_batch_size", "prefill_max_tokens",
                     "max_active_requests", "nvtx", "stream_interval", "tokenize_workers", "max_inflight_requests")

System = Annotated[Optional[str], typer.Option("--system", metavar="TEXT", help="System prompt, through the model's "
                                               "chat template.")]


def launch_time() -> float:
    """When this process started, on the `time.perf_counter` clock (Linux: from /proc; elsewhere
    when rosecli's commands were imported): the first-byte figure counts Python's and torch's
    imports, as the user waits for them."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
        if age >= 0:
            return time.perf_counter() - age
    except (OSError, ValueError, IndexError):
        pass
    return _IMPORTED


_IMPORTED = time.perf_counter()


def _read_prompt(source: str, data: bytes) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source} is not valid UTF-8 (byte 0x{data[e.start]:02x} at byte {e.start}): pass UTF-8 "
                          "text") from None
    text = text.rstrip("\r\n")
    if not text.strip():
        raise ConfigError(f"{source} is empty: it holds no prompt")
    return text


def _stdin_prompt() -> str:
    if sys.stdin is None:
        raise ConfigError("- reads the prompt from stdin, but there is no stdin")
    if sys.stdin.isatty():
        print("reading the prompt from stdin; end it with Ctrl-D", file=sys.stderr)
    stream = getattr(sys.stdin, "buffer", None)
    data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
    return _read_prompt("stdin", data)


def collect_prompts(prompts: Optional[list[str]], prompt_files: Optional[list[str]]) -> tuple[list[str], list[str]]:
    """The prompts in order (arguments, then files) and a short label for each; ``-`` (an argument
    or a file name) reads stdin, once."""
    out, labels = [], []
    stdin_used = False
    args = [(None, p) for p in prompts or []] + [(f, None) for f in prompt_files or []]
    for i, (path, text) in enumerate(args):
        if text == "-" or path == "-":
            if stdin_used:
                raise ConfigError("- (stdin) was given twice: stdin holds one prompt")
            stdin_used = True
            text, label = _stdin_prompt(), "stdin"
        elif path is not None:
            if not path.strip():
                raise ConfigError("--prompt-file needs a file name, got an empty one")
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                raise ConfigError(f"--prompt-file {path}: no such file") from None
            except IsADirectoryError:
                raise ConfigError(f"--prompt-file {path} is a directory: pass a text file") from None
            except OSError as e:
                raise ConfigError(f"--prompt-file {path} cannot be read: {e.strerror}") from None
            text, label = _read_prompt(f"--prompt-file {path}", data), path
        else:
            o.check_text(f"prompt argument {i + 1}" if len(args) > 1 else "the prompt argument", text)
            label = text
        out.append(text)
        first = label.splitlines()[0] if label.strip() else label
        labels.append(first if len(first) <= 60 else first[:59] + "…")
    if not out:
        raise ConfigError('give a prompt: rose generate "Hello", -p FILE, or - to read stdin (rose chat to talk '
                          "turn by turn)")
    return out, labels


@o.user_errors
@o.with_options(o.engine_options(exclude=GENERATE_EXCLUDES), o.sampling_options())
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(metavar="PROMPT", show_default=False, help="One or "
                                                           "more prompts; several run as one batch. - reads "
                                                           "one from stdin.")] = None,
    prompt_file: Annotated[Optional[list[str]], typer.Option("--prompt-file", "-p", metavar="FILE",
                                                             show_default=False, help="A prompt from a file (the "
                                                             "whole file; - is stdin); repeatable, after the PROMPT "
                                                             "arguments.")] = None,
    system: System = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--no-chat", help="Apply the model's chat template. "
                                                 "Default: on for instruct models (those with a chat "
                                                 "template, such as smollm2-135m), off otherwise.")] = None,
    *, config: EngineConfig, params: SamplingParams,
) -> None:
    """Generate text: each prompt's text streams to stdout as it is generated; a summary goes to stderr."""
    launched = launch_time()
    if system is not None:
        o.check_text("--system", system)
        if chat is False:
            raise ConfigError("--system goes through the chat template: leave out --no-chat")
    texts, labels = collect_prompts(prompts, prompt_file)
    batch = len(texts)  # the prompts run as one batch
    config = config.replace(max_batch_size=batch, prefill_max_batch_size=batch)
    err = Console(stderr=True)
    engine = start_engine(config, err, freeze_gc=False)  # one batch, then exit: the freeze would only delay it
    try:
        use_chat = engine.loaded.is_instruct if chat is None else chat
        use_chat = use_chat or system is not None
        if use_chat and not engine.inputs.has_chat_template:
            flag = "--system" if system is not None else "--chat"
            o.fail(f"{flag} was given but {engine.model_name} has no chat template: "
                   f"{'leave out --system' if system is not None else 'use --no-chat'}")
        head = [{"role": "system", "content": system}] if system is not None else []
        inputs = [engine.inputs.chat([*head, {"role": "user", "content": t}]) if use_chat else t for t in texts]
        from rosecli.engine.streaming import StreamingManager

        manager = StreamingManager(engine, start=False)
        try:
            outputs, first_byte = stream_requests(manager, inputs, params, sys.stdout,
                                                  labels if len(texts) > 1 else None)
        finally:
            manager.close()
        for line in summary_lines(f"{engine.model_name} on {engine.device.type}", outputs,
                                  first_byte - launched if first_byte is not None else None):
            err.print(line, highlight=False, markup=False, soft_wrap=True, style="dim")
    finally:
        engine.close()


def stream_requests(manager, inputs: list, params: SamplingParams, out, labels: Optional[list[str]] = None):
    """Submit ``inputs`` (text or token ids) as one batch, step the engine on this thread until all
    have ended, and print each one's text to ``out`` as it streams, in order (``labels``: a
    ``=== [i] label`` header before each). Returns (outputs, perf_counter time of the first byte
    of text written, or None)."""
    ids = [manager.add_request(x, params) for x in inputs]
    printer = _Printer([manager.stream(rid) for rid in ids], labels, out)
    printer.start()
    # the engine steps on this thread, the main one: on CPU torch's threads serve it only
    manager.run_until_idle()
    printer.join()
    if printer.failed:
        raise printer.failed[0]
    return [s.output for s in printer.streams], printer.first_byte


class _Printer(threading.Thread):
    def __init__(self, streams, labels: Optional[list[str]], out):
        super().__init__(name="rose-print", daemon=True)
        self.streams, self.labels, self.out = streams, labels, out
        self.first_byte: Optional[float] = None
        self.failed: list[BaseException] = []

    def run(self) -> None:
        out = self.out
        try:
            for i, stream in enumerate(self.streams):
                if self.labels is not None:
                    out.write(f"=== [{i}] {self.labels[i]}\n")
                    out.flush()
                for piece in stream:
                    if self.first_byte is None and piece:
                        self.first_byte = time.perf_counter()
                    out.write(piece)
                    out.flush()
                out.write("\n")
                out.flush()
        except BaseException as e:  # handed to the main thread
            self.failed.append(e)


def summary_lines(where: str, outputs, first_byte_s: Optional[float]) -> list[str]:
    """Counts, then each figure with what it measures: launch to first byte (process start to the
    first text on stdout: imports, model load and prefill included), TTFT (request submitted to
    its first token), decode rate (tokens after each request's first, over first token to last
    finish)."""
    nan = float("nan")
    firsts = [r.timestamps.first_token for r in outputs if r.timestamps.first_token is not None]
    first = min(firsts, default=None)
    submit = min(r.timestamps.submit for r in outputs)
    end = max((r.timestamps.finish for r in outputs if r.timestamps.finish is not None), default=None)
    n_prompt = sum(r.prompt_tokens for r in outputs)
    n_gen = sum(r.output_tokens for r in outputs)
    decode_tokens = n_gen - len(firsts)
    decode_s = end - first if first is not None and end is not None else 0.0
    tps = decode_tokens / decode_s if decode_s > 0 and decode_tokens > 0 else nan
    reasons = ",".join(sorted({r.finish_reason for r in outputs if r.finish_reason}))
    ttft = first - submit if first is not None else nan
    n = len(outputs)
    lines = [where, f"  {n} prompt{'s' if n != 1 else ''}: prompt tokens {n_prompt}, generated tokens {n_gen}, "
                    f"finish {reasons or '-'}"]
    if first_byte_s is not None:
        lines.append(f"  first byte {first_byte_s:9.2f} s      process start to first text on stdout")
    lines.append(f"  TTFT       {ttft * 1e3:9.1f} ms     request submitted to its first token")
    lines.append(f"  decode     {tps:9.1f} tok/s  tokens after the first, first token to last finish")
    return lines
