"""`rose serve-local`: the OpenAI-compatible streaming HTTP server (rosecli/server) on uvicorn."""

from __future__ import annotations

import signal
from typing import Annotated, Optional

import typer
from rich.console import Console

from rosecli.commands import options as o
from rosecli.commands.progress import start_engine
from rosecli.engine.config import EngineConfig

SERVER = "Server"


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def serve_read_ceiling(engine, say):
    """The device's read ceiling for GET /roofline (rose bench serve's distance to the floor): measured
    once per device, then cached; None on CPU or when the measurement fails (the server serves without it)."""
    from rosecli.engine.config import cache_root
    from rosecli.engine.roofline import device_read_ceiling

    try:
        return device_read_ceiling(engine.device, cache_root(engine.config),
                                   lambda key: say(f"measuring the read ceiling of {key} (once)"))
    except Exception as e:  # noqa: BLE001 - bench serve then shows no distance to the floor
        say(f"note: the device's read ceiling was not measured ({type(e).__name__}: {e})")
        return None


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the value itself when it reads as a Jinja template."""
    import os

    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            o.fail(f"--chat-template {value}: cannot read it ({e})")
    if "{{" in value or "{%" in value:
        return value
    o.fail(f"--chat-template {value}: no such file, and not a Jinja template (no {{{{ ... }}}} or {{% ... %}})")


def use_chat_template(inputs, template: str) -> None:
    """Render the chat with ``template`` from now on; one that cannot render a one-message conversation is
    refused here, at start-up, not at the first request."""
    from rosecli.engine.errors import RequestError

    previous = inputs.tokenizer.chat_template
    inputs.tokenizer.chat_template = template
    try:
        inputs.chat([{"role": "user", "content": "Hello"}])
    except RequestError as e:
        inputs.tokenizer.chat_template = previous
        cause = e.__cause__
        o.fail(f"--chat-template: the template does not render a one-message conversation: "
               f"{f'{type(cause).__name__}: {cause}' if cause is not None else e}", code=1)


def _on_cuda(config: EngineConfig) -> bool:
    """Whether the engine will run on a CUDA device (``--device auto`` asks torch)."""
    if config.device != "auto":
        return config.device == "cuda"
    import torch

    return torch.cuda.is_available()


@o.user_errors
@o.with_options(o.engine_options())
def serve_local(
    config: EngineConfig,
    host: Annotated[str, typer.Option("--host", help="Address to bind.", rich_help_panel=SERVER)] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to bind.", rich_help_panel=SERVER)] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="ROSE_API_KEY", show_envvar=True,
                                                   help="Require 'Authorization: Bearer KEY' on every route "
                                                   "but /health.", rich_help_panel=SERVER)] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="The model name "
                                                             "clients send (default: --model).",
                                                             rich_help_panel=SERVER)] = None,
    overload: Annotated[str, typer.Option("--overload", metavar="reject|wait", help="Beyond --max-inflight-requests: reject (429) or "
                                          "wait for room.", rich_help_panel=SERVER)] = "reject",
    exit_on_engine_error: Annotated[bool, typer.Option("--exit-on-engine-error", help="Exit non-zero when the "
                                                       "engine worker dies (default: keep serving /health 503).",
                                                       rich_help_panel=SERVER)] = False,
    profile_dir: Annotated[Optional[str], typer.Option("--profile-dir", help="Enable POST /start_profile and "
                                                       "/stop_profile; torch profiler Chrome traces go here.",
                                                       rich_help_panel=SERVER)] = None,
    max_request_bytes: Annotated[int, typer.Option("--max-request-bytes", help="Largest request body "
                                                   "accepted (413 beyond).", rich_help_panel=SERVER)] = 4 * 1024 * 1024,
    read_timeout: Annotated[float, typer.Option("--read-timeout", help="Seconds a client may take to send a "
                                                "request's headers, and again its body (408 beyond).",
                                                rich_help_panel=SERVER)] = 30.0,
    engine_process: Annotated[Optional[bool], typer.Option("--engine-process/--no-engine-process",
                                                           help="Run the engine in a process of its own, so HTTP "
                                                           "work and engine work do not share the GIL (default: on "
                                                           "CUDA, unless --profile-dir).",
                                                           rich_help_panel=SERVER)] = None,
    shutdown_timeout: Annotated[float, typer.Option("--shutdown-timeout", help="On SIGTERM/SIGINT, seconds "
                                                    "running requests get to finish before they are ended.",
                                                    rich_help_panel=SERVER)] = 10.0,
    chat_template: Annotated[Optional[str], typer.Option("--chat-template", metavar="FILE|TEMPLATE",
                                                         help="A Jinja chat template (a file, or the template "
                                                         "itself) used instead of the model's, as vLLM's.",
                                                         rich_help_panel=SERVER)] = None,
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) with /health and /metrics."""
    try:
        from prometheus_client import disable_created_metrics

        from rosecli.engine.gc_pauses import GcPauses, freeze_startup
        from rosecli.server.app import OVERLOAD_MODES, create_app
        from rosecli.server.uvicorn_server import PortInUseError, bind_socket, make_server, set_gil_switch_interval
    except ImportError as e:
        o.fail(f"rose serve-local needs the server extras ({e.name} is missing): pip install 'rosecli[serve]'")

    if overload not in OVERLOAD_MODES:
        o.fail(f"--overload must be one of {', '.join(OVERLOAD_MODES)}, got {overload!r}")
    if not 0 < port < 65536:
        o.fail(f"--port must be between 1 and 65535, got {port}")
    if max_request_bytes < 1024:
        o.fail(f"--max-request-bytes must be at least 1024, got {max_request_bytes}")
    for flag, value in (("--read-timeout", read_timeout), ("--shutdown-timeout", shutdown_timeout)):
        if not 0 < value < float("inf"):
            o.fail(f"{flag} must be a positive number of seconds, got {value}")
    template = read_chat_template(chat_template) if chat_template is not None else None
    try:
        sock = bind_socket(host, port)  # before the model loads: a taken port fails in a moment
    except PortInUseError as e:
        o.fail(str(e), code=1)
    err = Console(stderr=True)
    if engine_process and profile_dir is not None:
        sock.close()
        o.fail("--profile-dir needs the engine in the server process (the torch profiler records the process "
               "that starts it): leave out --engine-process")
    try:
        if engine_process is None:
            engine_process = profile_dir is None and _on_cuda(config)
        if engine_process:
            from rosecli.server.engine_process import start_engine_process

            try:
                manager, engine = start_engine_process(config)
            except RuntimeError as e:
                o.fail(f"the engine did not start: {e}", code=1)
        else:
            # torch: seconds to import, after the port is ours; frozen below, once the app is made too
            engine = start_engine(config, err, freeze_gc=False)
            from rosecli.engine.streaming import StreamingManager

            manager = StreamingManager(engine)
        if template is not None:
            try:
                use_chat_template(engine.inputs, template)
            except BaseException:
                manager.close()
                raise
    except BaseException:
        sock.close()
        raise
    if engine_process:
        ceiling_gbs = engine.read_ceiling_gbs  # measured in the engine's process
    else:
        ceiling = serve_read_ceiling(engine, lambda msg: err.print(msg, highlight=False, markup=False))
        ceiling_gbs = ceiling.gbs if ceiling is not None else None
    disable_created_metrics()  # no *_created series: scrapers would store one per counter for nothing
    gc_watch = None
    try:
        died: list[bool] = []
        server = None

        def on_engine_dead() -> None:
            died.append(True)
            if exit_on_engine_error and server is not None:
                server.should_exit = True

        name = served_model_name or config.model
        app = create_app(manager, engine, api_key=api_key, served_model_name=name, overload=overload,
                         profile_dir=profile_dir, on_engine_dead=on_engine_dead,
                         max_request_bytes=max_request_bytes, read_timeout=read_timeout,
                         read_ceiling_gbs=ceiling_gbs)
        server = make_server(app, read_timeout=read_timeout, shutdown_timeout=shutdown_timeout)
        err.print(f"[bold]{name}[/bold] on {engine.device.type}, context {engine.max_model_len}: OpenAI API at "
                  f"http://{host}:{port}/v1" + (" (API key required)" if api_key else ""), highlight=False)
        # uvicorn re-raises the signal it shut down on; SIGTERM then ends the process with status 0
        signal.signal(signal.SIGTERM, _exit_cleanly)
        set_gil_switch_interval()
        freeze_startup()  # what start-up made is never walked by a collection again
        gc_metric = app.state.rose.metrics.gc_pause
        gc_watch = GcPauses(on_pause=lambda gen, s, _n: gc_metric.labels(str(gen)).observe(s))
        server.run(sockets=[sock])
        if died and exit_on_engine_error:
            o.fail(f"the engine worker died: {manager.error}", code=1)
    finally:
        if gc_watch is not None:
            gc_watch.close()
        sock.close()
        manager.close()
        engine.close()
