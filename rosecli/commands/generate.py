"""`rose generate`: stream completions to the terminal."""

from __future__ import annotations

import sys
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
    from rosecli.engine.detokenizer import IncrementalDetokenizer
    from rosecli.engine.llm import LLMEngine

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
        if use_chat and engine.tokenizer.chat_template is None:
            o.fail(f"--chat was given but {engine.model_name} has no chat template: use --no-chat")
        inputs = [engine.apply_chat_template(p) if use_chat else p for p in prompts]
        single = len(prompts) == 1
        # With stop strings, hold back text that could be the start of one until it is decided.
        holdback = max((len(x) for x in params.stop), default=1) - 1
        detoks: dict[int, IncrementalDetokenizer] = {}
        texts: dict[int, str] = {}
        shown = [0]
        t_first: list[float] = []
        out = sys.stdout

        def on_tokens(tokens: dict[int, int]) -> None:
            if not t_first:
                t_first.append(time.perf_counter())
            for rid, tok in tokens.items():
                detok = detoks.get(rid)
                if detok is None:
                    detok = detoks[rid] = IncrementalDetokenizer(engine.tokenizer)
                    texts[rid] = ""
                texts[rid] += detok.push(tok)
                if single and len(texts[rid]) - holdback > shown[0]:
                    out.write(texts[rid][shown[0]:len(texts[rid]) - holdback])
                    out.flush()
                    shown[0] = len(texts[rid]) - holdback

        t_submit = time.perf_counter()
        seqs = engine.generate(inputs, params, on_tokens)
        t_end = time.perf_counter()
        final = {s.request_id: s.final_text if s.final_text is not None
                 else texts.get(s.request_id, "") + (detoks[s.request_id].flush() if s.request_id in detoks else "")
                 for s in seqs}
        if single:
            out.write(final[seqs[0].request_id][shown[0]:] + "\n")
        else:
            for i, seq in enumerate(seqs):
                out.write(f"=== [{i}] {prompts[i]}\n{final[seq.request_id]}\n")
        out.flush()
        n_prompt = sum(s.num_prompt_tokens for s in seqs)
        n_gen = sum(s.num_output_tokens for s in seqs)
        ttft = (t_first[0] - t_submit) if t_first else float("nan")
        decode_tokens = n_gen - len(seqs)
        decode_s = t_end - t_first[0] if t_first else 0.0
        tps = decode_tokens / decode_s if decode_s > 0 and decode_tokens > 0 else float("nan")
        reasons = ",".join(sorted({s.finish_reason.value for s in seqs if s.finish_reason}))
        err.print(f"[dim]{engine.model_name} on {engine.device.type}: prompt tokens {n_prompt}, generated "
                  f"tokens {n_gen}, TTFT {ttft * 1e3:.1f} ms, decode {tps:.1f} tok/s, finish {reasons}, "
                  f"start to first token {(t_first[0] - t_start) if t_first else float('nan'):.2f} s[/dim]",
                  highlight=False)
    finally:
        engine.close()
