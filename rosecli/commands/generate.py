"""`rose generate`: stream completions to the terminal."""

from __future__ import annotations

import sys
import threading
import time
from typing import Annotated, Optional

import typer
from rich.console import Console

from rosecli.commands import options as o
from rosecli.commands.progress import startup_progress
from rosecli.engine.config import EngineConfig, SamplingParams

# Engine options generate does not offer: its batch is its prompts; the rest serve long-running
# or benchmark engines.
GENERATE_EXCLUDES = ("prefix_cache", "max_batch_size", "prefill_max_batch_size", "prefill_max_tokens",
                     "max_active_requests", "nvtx", "stream_interval", "tokenize_workers", "max_inflight_requests")


@o.user_errors
@o.with_options(o.engine_options(exclude=GENERATE_EXCLUDES), o.sampling_options())
def generate(
    prompts: Annotated[list[str], typer.Argument(help="One or more prompts; several run as one batch.")],
    chat: Annotated[Optional[bool], typer.Option("--chat/--no-chat", help="Apply the model's chat template. "
                                                 "Default: on for instruct models (those with a chat "
                                                 "template, such as smollm2-135m), off otherwise.")] = None,
    *, config: EngineConfig, params: SamplingParams,
) -> None:
    """Generate text; one prompt streams token by token to stdout, a one-line summary goes to stderr."""
    from rosecli.engine.llm import LLMEngine
    from rosecli.engine.streaming import StreamingManager

    t_start = time.perf_counter()
    for i, p in enumerate(prompts):
        o.check_text(f"prompt argument {i + 1}" if len(prompts) > 1 else "the prompt argument", p)
    batch = max(1, len(prompts))  # the prompts run as one batch
    config = config.replace(max_batch_size=batch, prefill_max_batch_size=batch)
    err = Console(stderr=True)
    with startup_progress(err) as progress:
        engine = LLMEngine(config, progress=progress)
    try:
        use_chat = engine.loaded.is_instruct if chat is None else chat
        if use_chat and not engine.inputs.has_chat_template:
            o.fail(f"--chat was given but {engine.model_name} has no chat template: use --no-chat")
        inputs = [engine.inputs.chat(p) if use_chat else p for p in prompts]
        manager = StreamingManager(engine, start=False)
        try:
            ids = [manager.add_request(x, params) for x in inputs]
            streams = [manager.stream(rid) for rid in ids]
            failed: list[BaseException] = []
            printer = threading.Thread(target=_print, args=(streams, prompts, sys.stdout, failed), daemon=True)
            printer.start()
            # the engine steps on this thread, the main one: on CPU torch's threads serve it only
            manager.run_until_idle()
            printer.join()
            if failed:
                raise failed[0]
            outputs = [s.output for s in streams]
        finally:
            manager.close()
        err.print(f"[dim]{engine.model_name} on {engine.device.type}: {summary(outputs, t_start)}[/dim]",
                  highlight=False)
    finally:
        engine.close()


def _print(streams, prompts: list[str], out, failed: list) -> None:
    """One prompt: its text as it streams; several: each one's block once it ends (in order)."""
    try:
        if len(streams) == 1:
            for piece in streams[0]:
                out.write(piece)
                out.flush()
            out.write("\n")
        else:
            for i, stream in enumerate(streams):
                text = "".join(stream)
                out.write(f"=== [{i}] {prompts[i]}\n{text}\n")
        out.flush()
    except BaseException as e:  # handed to the main thread
        failed.append(e)


def summary(outputs, t_start: float) -> str:
    """Counts, TTFT (submit to first token), decode tok/s (tokens after each request's first, over
    first token to last finish), finish reasons and start-up to first token."""
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
    return (f"prompt tokens {n_prompt}, generated tokens {n_gen}, TTFT {ttft * 1e3:.1f} ms, decode {tps:.1f} "
            f"tok/s, finish {reasons}, start to first token {(first - t_start) if first is not None else nan:.2f} s")
