"""`rose bench stream | sched | compare`: Typer wiring over rosecli.bench."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Optional

import typer
from rich.console import Console

from rosecli.bench.workload import WorkloadSpec
from rosecli.commands import options as o
from rosecli.commands.progress import start_engine
from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.errors import ConfigError

# bench sched drives the scheduler directly: no streaming manager options, every request at once
SCHED_EXCLUDES = ("stream_interval", "tokenize_workers", "max_inflight_requests")
SCHED_WORKLOAD_EXCLUDES = ("submit_interval_ms", "submit_schedule", "request_rate")

FIGURES_HELP = ("Figures (per run, p50/p95/p99): TTFT = first token received - submit; TPOT = (finish - first "
                "token) / (tokens - 1), one-token outputs left out; ITL = every gap between consecutive pieces a "
                "client receives; latency = finish - submit; queue wait = admitted - tokenized; submit lag = submit "
                "- scheduled time. Throughput = tokens / (last finish - first submit). Percentiles interpolate "
                "linearly between closest ranks. The summary is the median over measured runs; start-up is "
                "reported on its own, never inside a run. On a GPU: decode bytes per step (weights + the KV of the "
                "batch's context lengths), decode step time, GB/s read and its share of the device's read ceiling "
                "(measured once per device, cached; docs/bench-metrics.md).")

SaveResult = Annotated[Optional[str], typer.Option("--save-result", metavar="FILE", help="Write configuration, environment, "
                                                   "per-run figures and raw timestamps to this JSON file "
                                                   "(schema rosecli.bench/1).")]
Timeline = Annotated[bool, typer.Option("--timeline", help="Record every scheduler step of the measured runs "
                                        "(batch size, tokens in flight, step time, KV blocks used, preemptions) "
                                        "into the result file; nothing is recorded without it.")]
AgainstDirect = Annotated[bool, typer.Option("--against-direct", help="After each run, drive the same workload "
                                              "through the scheduler directly (as bench sched --mode offline, in "
                                              "this process) and report the streaming manager's throughput "
                                              "overhead against it. Needs every request at once.")]
Mode = Annotated[str, typer.Option("--mode", metavar="offline|online", help="offline: run all requests to "
                                   "completion; online: also timestamp each request's submit, first token and "
                                   "finish.")]
SERVE = "Server"
BaseUrl = Annotated[str, typer.Option("--base-url", help="The server, e.g. http://127.0.0.1:8000 (rose serve-local, "
                                      "vllm serve, sglang, llama-server, ...).", rich_help_panel=SERVE)]
Endpoint = Annotated[str, typer.Option("--endpoint", help="/v1/completions or /v1/chat/completions.",
                                       rich_help_panel=SERVE)]
ServeModel = Annotated[Optional[str], typer.Option("--model", help="The model name to send (default: the first "
                                                   "the server lists at /v1/models).", rich_help_panel=SERVE)]
ApiKey = Annotated[Optional[str], typer.Option("--api-key", envvar="OPENAI_API_KEY", show_envvar=True,
                                               help="Sent as 'Authorization: Bearer KEY'.", rich_help_panel=SERVE)]
RequestTimeout = Annotated[float, typer.Option("--request-timeout", help="Seconds without a byte from the server "
                                               "before a request counts as timed out.", rich_help_panel=SERVE)]
Tokenizer = Annotated[Optional[str], typer.Option("--tokenizer", help="Tokenizer (local directory or hub id) that "
                                                  "counts ShareGPT tokens and turns random ids into chat text "
                                                  "(default: SmolLM2's, bundled).", rich_help_panel=o.WORKLOAD)]
Dataset = Annotated[str, typer.Option("--dataset", metavar="random|sharegpt|prefix", help="random | sharegpt (--dataset-path FILE.json) | prefix "
                                      "(--prefix-groups groups sharing a --prefix-len token prefix).",
                                      rich_help_panel=o.WORKLOAD)]
DatasetPath = Annotated[Optional[str], typer.Option("--dataset-path", help="A ShareGPT-format JSON file (read "
                                                    "locally).", rich_help_panel=o.WORKLOAD)]
PrefixGroups = Annotated[int, typer.Option("--prefix-groups", help="prefix dataset: groups, each sharing one "
                                           "prefix.", max=o.MAX_REQUESTS, rich_help_panel=o.WORKLOAD)]
PrefixLen = Annotated[int, typer.Option("--prefix-len", help="prefix dataset: tokens of each shared prefix.",
                                        max=2**31 - 1,
                                        rich_help_panel=o.WORKLOAD)]
NumPrompts = Annotated[int, typer.Option("--num-prompts", "--num-requests", help="Requests per run.",
                                         max=o.MAX_REQUESTS, rich_help_panel=o.WORKLOAD)]
Burstiness = Annotated[float, typer.Option("--burstiness", help="With --request-rate: gamma-distributed gaps of "
                                           "this shape (1: Poisson; < 1 burstier; > 1 more even).",
                                           rich_help_panel=o.WORKLOAD)]
MaxConcurrency = Annotated[Optional[int], typer.Option("--max-concurrency", help="Most requests in flight at once "
                                                       "(client side); the wait is reported as client queue.",
                                                       max=o.MAX_REQUESTS, rich_help_panel=o.WORKLOAD)]
ClientProcesses = Annotated[str, typer.Option(
    "--client-processes", help="Client processes sending the requests (split round-robin; each its own asyncio "
    "client, all on one start time; started once per benchmark), or 'auto' = min(4, CPUs - 1, ceil(concurrency / "
    "16)). With more than one, --max-concurrency is split across them in shares summing to it (never more "
    "processes than the cap). Use it when the summary says 'Client busy'.", rich_help_panel=SERVE)]
ServeSeed = Annotated[int, typer.Option("--seed", help="Seed of the dataset's sampling and the arrival times.",
                                        rich_help_panel=o.WORKLOAD)]
MetricPercentiles = Annotated[str, typer.Option("--metric-percentiles", help="Comma-separated percentiles to "
                                                "report (mean, median and std are always shown).",
                                                rich_help_panel=o.WORKLOAD)]
Goodput = Annotated[Optional[list[str]], typer.Option("--goodput", help="SLOs in ms, e.g. --goodput 'ttft:500 "
                                                      "tpot:50 e2el:2000' (any subset): goodput = requests meeting "
                                                      "every one, per second (as vLLM).", rich_help_panel=o.WORKLOAD)]
# The shared options bench serve also takes (their flags, help and bounds from the one table)
InputLen = o.WORKLOAD_OPTIONS["input_len"].annotation()
OutputLen = o.WORKLOAD_OPTIONS["output_len"].annotation()
RangeRatio = o.WORKLOAD_OPTIONS["range_ratio"].annotation()
RequestRate = o.WORKLOAD_OPTIONS["request_rate"].annotation()
WarmupRuns = o.WORKLOAD_OPTIONS["warmup_runs"].annotation()
RepeatRuns = o.WORKLOAD_OPTIONS["repeat_runs"].annotation()
Temperature = o.SAMPLING_OPTIONS["temperature"].annotation()
TopP = o.SAMPLING_OPTIONS["top_p"].annotation()
TopK = o.SAMPLING_OPTIONS["top_k"].annotation()
MinP = o.SAMPLING_OPTIONS["min_p"].annotation()
PresencePenalty = o.SAMPLING_OPTIONS["presence_penalty"].annotation()
FrequencyPenalty = o.SAMPLING_OPTIONS["frequency_penalty"].annotation()
RepetitionPenalty = o.SAMPLING_OPTIONS["repetition_penalty"].annotation()
StopOnEos = o.SAMPLING_OPTIONS["stop_on_eos"].annotation()



def _start(config, console_err: Console):
    return start_engine(config, console_err)


def _roofline(engine, console_err: Console):
    """The engine's `bench.roofline.EngineProbe` on a GPU (its read ceiling measured once per device,
    then cached), None on CPU: no figures, no cost."""
    from rosecli.bench.roofline import engine_probe

    return engine_probe(engine, lambda msg: console_err.print(msg, highlight=False, markup=False))


def _roofline_env(probe) -> Optional[dict]:
    """The result file's environment, with the read ceiling and what a decode step reads when measured."""
    if probe is None:
        return None
    from rosecli.bench import results

    return {**results.environment(), "read_ceiling_gbs": probe.ceiling_gbs, **probe.weights}


def _print_attached_summary(console: Console, out: dict, probe) -> None:
    """The summary's distance to the floor (a GPU engine: medians over the measured runs), then the garbage
    collector's pauses in all the measured runs together (the result file keeps each run's and their medians)."""
    from rosecli.bench.roofline import line
    from rosecli.engine.gc_pauses import GcInterval, gc_line

    if probe is not None and (text := line(out["summary"], probe.ceiling_gbs)):
        console.print(text.replace("Decode roofline:", "Decode roofline (median):", 1), highlight=False,
                      markup=False, soft_wrap=True)
    if gcs := [m.gc for m in out["measured"] if m.gc is not None]:
        n = len(out["measured"])
        what = f"GC pauses ({'the measured run' if n == 1 else f'the {n} measured runs together'})"
        console.print(gc_line(GcInterval.together(gcs).figures(), what),
                      highlight=False, markup=False, soft_wrap=True)


def _header(engine, spec, config, params) -> dict:
    from rosecli.bench.report import sampling_line

    return {"Model": engine.model_name, "Device": engine.device.type, "Dtype": str(engine.dtype).removeprefix("torch."),
            "Paged attention": engine.runner.use_triton, "CUDA Graph": bool(engine.runner.graphs),
            "NVTX": config.nvtx, "Prefix cache": config.enable_prefix_cache, "Requests": spec.num_requests,
            "Max new tokens": spec.max_new_tokens if spec.output_len is None else f"~{spec.output_len}",
            "Sampling": sampling_line(params, config.load_format == "dummy")}


def report_failures(console: Console, failures: list, submitted: int, runs: str = "measured runs") -> None:
    """Say how many requests failed and why; every one failing is an error (exit code 1).
    ``failures``: (kind, message) pairs as the bench drivers record them."""
    from rosecli.bench import report

    if not failures:
        return
    kinds = report.failure_kinds(failures)
    if len(failures) >= submitted:
        o.fail(f"all {submitted} requests of the {runs} failed, nothing was measured: {kinds}", code=1)
    console.print(f"Failed requests: {len(failures)} of {submitted} in the {runs}: {kinds}", highlight=False,
                  markup=False, soft_wrap=True)


def _config_dict(config, spec, params, **extra) -> dict:
    return {**dataclasses.asdict(config), **dataclasses.asdict(spec), **dataclasses.asdict(params), **extra}


@o.user_errors
@o.with_options(o.engine_options(), o.workload_options(), o.sampling_options(exclude=("stop",)))
def stream(
    config: EngineConfig, spec: WorkloadSpec, params: SamplingParams, save_result: SaveResult = None,
    against_direct: AgainstDirect = False, goodput: Goodput = None, timeline: Timeline = False, *,
    warmup_runs: int, repeat_runs: int,
) -> None:
    """Streaming benchmark through the streaming manager: TTFT / TPOT / ITL per run."""
    from rosecli.bench import report, results

    if save_result is not None:
        results.check_result_path(save_result)
    if against_direct and (spec.request_rate is not None or spec.submit_interval_ms > 0):
        raise ConfigError("--against-direct compares runs that submit every request at once: leave out "
                          "--request-rate and --submit-interval-ms")
    from rosecli.bench.metrics import parse_goodput

    slo = parse_goodput(goodput)
    from rosecli.bench.run import bench_stream  # the engine's modules: after the cheap checks

    console, err = Console(), Console(stderr=True)
    engine = _start(config, err)
    try:
        probe = _roofline(engine, err)
        header = _header(engine, spec, config, params)
        header.update({"Pretok": spec.pretok, "Tokenize workers": config.tokenize_workers,
                       "Stream interval": config.stream_interval})
        if spec.request_rate is not None:
            header["Arrivals"] = f"Poisson {spec.request_rate} req/s (seed {spec.seed})"
        else:
            header["Submit interval/schedule"] = f"{spec.submit_interval_ms:.3f} ms / {spec.submit_schedule}"
        console.print("=== streaming benchmark ===", highlight=False)
        for line in report.header_lines(header):
            console.print(line, highlight=False)
        console.print(report.startup_line(engine.startup_times), highlight=False)
        with report.RunTable(console, "stream", "streaming benchmark") as table:
            out = bench_stream(engine, spec, params, warmup_runs, repeat_runs, table, against_direct,
                               goodput=slo or None, timeline=timeline, roofline=probe)
        report.print_stream_summary(console, out["measured"], out["summary"])
        _print_attached_summary(console, out, probe)
        if against_direct and (line := report.against_direct_line(out["summary"])):
            console.print(line, highlight=False)
        if slo:
            report.print_goodput(console, out["summary"], slo)
        if timeline:
            from rosecli.bench.timeline import summary_line

            for i, tl in enumerate(out["timelines"]):
                console.print(f"run {i + 1}: {summary_line(tl)}", highlight=False, markup=False, soft_wrap=True)
        if save_result is not None:
            doc = results.build_result("stream", _config_dict(config, spec, params), engine.startup_times,
                                       out["runs"], out["summary"], out["requests"], env=_roofline_env(probe))
            if timeline:  # one column set per measured run (rosecli.bench.timeline)
                doc["timelines"] = results._finite(out["timelines"])
            results.write_document(save_result, doc)
            console.print(f"saved {save_result}", highlight=False)
        report_failures(console, out["failures"], out["submitted"])
    finally:
        engine.close()


@o.user_errors
@o.with_options(o.engine_options(exclude=SCHED_EXCLUDES), o.workload_options(exclude=SCHED_WORKLOAD_EXCLUDES),
                o.sampling_options(exclude=("stop",)))
def sched(
    config: EngineConfig, mode: Mode = "online", *, spec: WorkloadSpec, params: SamplingParams,
    save_result: SaveResult = None, warmup_runs: int, repeat_runs: int,
) -> None:
    """Scheduler benchmark, driving the scheduler directly: decode and total time, throughput."""
    from rosecli.bench import report, results

    if save_result is not None:
        results.check_result_path(save_result)
    if mode not in ("offline", "online"):
        raise ConfigError(f"--mode must be offline or online, got {mode!r}")
    from rosecli.bench.run import bench_sched  # the engine's modules: after the cheap checks

    console, err = Console(), Console(stderr=True)
    engine = _start(config, err)
    try:
        probe = _roofline(engine, err)
        console.print("=== scheduler benchmark ===", highlight=False)
        for line in report.header_lines({**_header(engine, spec, config, params), "Mode": mode}):
            console.print(line, highlight=False)
        console.print(report.startup_line(engine.startup_times), highlight=False)
        with report.RunTable(console, "sched", f"scheduler benchmark ({mode})") as table:
            out = bench_sched(engine, spec, params, mode, warmup_runs, repeat_runs, table, roofline=probe)
        report.print_sched_summary(console, mode, warmup_runs, out["pairs"], len(out["measured"]))
        _print_attached_summary(console, out, probe)
        if save_result is not None:
            results.save_result(save_result, "sched", _config_dict(config, spec, params, mode=mode),
                                engine.startup_times, out["runs"], out["summary"], env=_roofline_env(probe))
            console.print(f"saved {save_result}", highlight=False)
        report_failures(console, out["failures"], out["submitted"])
    finally:
        engine.close()


@o.user_errors
def compare(files: Annotated[list[str], typer.Argument(metavar="FILE", help="Result files from --save-result; the first is the "
                                                       "baseline.")],
            percentiles: Annotated[Optional[str], typer.Option("--percentiles", help="Comma-separated percentiles "
                                                               "of each per-request figure to compare (from the raw "
                                                               "samples), e.g. 50,90,99.")] = None,
            confidence: Annotated[float, typer.Option("--confidence", help="Confidence of the intervals.")] = 0.95,
            ) -> None:
    """Compare saved results figure by figure, with a bootstrap confidence interval of each change: noise when the
    interval contains zero, else better or worse. Environment and option differences are listed first."""
    from rosecli.bench import compare as cmp
    from rosecli.bench import report, results

    if len(files) < 2:
        raise ConfigError("give at least two result files: the baseline first")
    pcts = None
    if percentiles is not None:
        from rosecli.bench.metrics import parse_percentiles

        with o.flag_names():
            pcts = parse_percentiles(percentiles)
    docs = [results.load_result(f) for f in files]
    kinds = {d["kind"] for d in docs}
    if not cmp.comparable(kinds):
        raise ConfigError(f"cannot compare results of different benchmarks ({', '.join(sorted(kinds))})")
    console = Console()
    if kinds == {"sweep"}:  # point by point, the points every file has
        differences = cmp.config_differences(docs)
        for label, point_docs in cmp.sweep_point_docs(docs):
            console.print(f"=== point {label} ===", highlight=False, markup=False)
            report.print_compare(console, files, cmp.compare_results(point_docs, pcts, confidence), differences,
                                 confidence=confidence)
            differences = {}  # listed once, before the first point
        return
    report.print_compare(console, files, cmp.compare_results(docs, pcts, confidence), cmp.config_differences(docs),
                         confidence=confidence)


stream.__doc__ = f"{stream.__doc__}\n\n{FIGURES_HELP}"


# --- `rose bench serve`: the same benchmark over HTTP against any OpenAI-compatible server -------
# (declared in the current option style; kept apart so a later change of style moves it as one block)

SERVE_FIGURES_HELP = (
    "Figures (as vllm bench serve): TTFT = first SSE event carrying a choice - just before the request was sent "
    "(after any --max-concurrency wait, reported as client queue); E2EL = last choice event - sent; TPOT = (E2EL - "
    "TTFT) / (output tokens - 1), output tokens from the server's usage; ITL = gaps between consecutive choice "
    "events; throughputs over the run's duration (first request due -> last ended). docs/bench-metrics.md says "
    "where these differ from bench stream's.")
def _serve_tokenizer(name: Optional[str], needed: bool, console: Console):
    """The client-side tokenizer, or None when the workload does not need one."""
    if name is None and not needed:
        return None
    try:
        if name is None:
            import types

            from rosecli.engine.loader import dummy_tokenizer

            console.print("Tokenizer: SmolLM2's (bundled; pass --tokenizer for the server model's)", highlight=False)
            return dummy_tokenizer(types.SimpleNamespace(cache_dir=None))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except ConfigError:
        raise
    except Exception as e:  # a missing or broken tokenizer is a user error, in one line
        raise ConfigError(f"--tokenizer {name}: cannot load it ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]})") from None


@o.user_errors
def serve(
    base_url: BaseUrl = "http://127.0.0.1:8000", endpoint: Endpoint = "/v1/completions", model: ServeModel = None,
    api_key: ApiKey = None, request_timeout: RequestTimeout = 600.0, tokenizer: Tokenizer = None,
    dataset: Dataset = "random", dataset_path: DatasetPath = None, num_prompts: NumPrompts = 16,
    input_len: InputLen = None, output_len: OutputLen = None, range_ratio: RangeRatio = 0.0,
    prefix_groups: PrefixGroups = 4, prefix_len: PrefixLen = 256,
    request_rate: RequestRate = None, burstiness: Burstiness = 1.0, max_concurrency: MaxConcurrency = None,
    seed: ServeSeed = 0, warmup_runs: WarmupRuns = 0, repeat_runs: RepeatRuns = 1,
    temperature: Temperature = None, top_p: TopP = 1.0, top_k: TopK = 0, min_p: MinP = 0.0,
    presence_penalty: PresencePenalty = 0.0, frequency_penalty: FrequencyPenalty = 0.0,
    repetition_penalty: RepetitionPenalty = 1.0, stop_on_eos: StopOnEos = False,
    metric_percentiles: MetricPercentiles = "50,95,99", goodput: Goodput = None, save_result: SaveResult = None,
    client_processes: ClientProcesses = "1",
) -> None:
    """Serving benchmark over HTTP/SSE against any OpenAI-compatible server: TTFT / TPOT / ITL / E2EL, goodput."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        o.fail("rose bench serve needs httpx: pip install 'rosecli[serve]'")
    from rosecli.bench import datasets, http_client, metrics, report, results
    from rosecli.bench.serve import bench_serve

    o.check_runs(warmup_runs, repeat_runs)
    if save_result is not None:
        results.check_result_path(save_result)
    if max_concurrency is not None and max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    processes = http_client.resolve_client_processes(http_client.parse_client_processes(client_processes),
                                                     num_prompts, max_concurrency)
    if not 0 < request_timeout < float("inf"):
        raise ConfigError(f"--request-timeout must be a positive number of seconds, got {request_timeout}")
    if not endpoint.startswith("/"):
        raise ConfigError(f"--endpoint must be a path such as /v1/completions, got {endpoint!r}")
    percentiles = metrics.parse_percentiles(metric_percentiles)
    slo = metrics.parse_goodput(goodput)
    spec = datasets.ServeDataset(dataset, dataset_path, num_prompts, input_len if input_len is not None else 128,
                                 output_len if output_len is not None or dataset == "sharegpt" else 128,
                                 range_ratio, prefix_groups, prefix_len, seed)
    offsets = datasets.arrival_offsets(num_prompts, request_rate, burstiness, seed)
    given = {"top_p": top_p, "top_k": top_k, "min_p": min_p, "presence_penalty": presence_penalty,
             "frequency_penalty": frequency_penalty, "repetition_penalty": repetition_penalty}
    with o.flag_names():  # the server checks them too; a bad one is refused here, naming its flag
        SamplingParams(**given)
    sampling = {"temperature": 0.0 if temperature is None else temperature}
    sampling.update((k, v) for k, v in given.items() if v != o.option_default(o.SAMPLING_OPTIONS, k))
    target = http_client.Target(http_client.normalize_base_url(base_url), endpoint, model, api_key, request_timeout,
                                ignore_eos=not stop_on_eos, extra_body=sampling)
    console = Console()
    http_client.check_server(target)  # a server that is not there: one line, before anything else
    tok = _serve_tokenizer(tokenizer, target.chat or dataset == "sharegpt", console)
    requests = datasets.build_requests(spec, tok, target.chat)
    header = {"Base URL": target.base_url, "Endpoint": endpoint, "Model": target.model, "Dataset": dataset,
              "Requests": num_prompts, "Input tokens (mean)": f"{sum(r.prompt_len for r in requests) / num_prompts:.1f}",
              "Output tokens (mean)": f"{sum(r.output_len for r in requests) / num_prompts:.1f}",
              "Arrivals": ("all at once" if request_rate is None or request_rate == float("inf") else
                           f"{request_rate} req/s, burstiness {burstiness} (seed {seed})"),
              "Max concurrency": max_concurrency, "ignore_eos/min_tokens sent": target.ignore_eos,
              "Client processes": processes,
              "Sampling sent": ", ".join(f"{k} {v:g}" for k, v in sampling.items())}
    if slo:
        header["Goodput SLOs"] = ", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in slo.items())
    console.print("=== serving benchmark (HTTP) ===", highlight=False)
    for line in report.header_lines(header):
        console.print(line, highlight=False, markup=False)
    with report.RunTable(console, "serve", "serving benchmark (HTTP)") as table:
        out = bench_serve(target, requests, offsets, warmup_runs, repeat_runs, table, max_concurrency=max_concurrency,
                          percentiles=percentiles, goodput=slo or None, request_rate=request_rate,
                          client_processes=processes)
    report.print_serve_summary(console, out["measured"], out["summary"],
                               {"max_concurrency": max_concurrency, "request_rate": request_rate})
    server_roof = out["roofline"]  # a rose server on a GPU: its read ceiling and what a decode step reads
    if server_roof is not None:
        from rosecli.bench.roofline import line

        if text := line(out["summary"], server_roof["read_ceiling_gbs"]):
            console.print(text.replace("Decode roofline:", "Decode roofline (median, server):", 1), highlight=False,
                          markup=False, soft_wrap=True)
    if save_result is not None:
        config = {"base_url": target.base_url, "endpoint": endpoint, "model": target.model, "dataset": dataset,
                  "dataset_path": dataset_path, "num_requests": num_prompts, "input_len": spec.input_len,
                  "output_len": spec.output_len, "range_ratio": range_ratio, "prefix_groups": prefix_groups,
                  "prefix_len": prefix_len, "request_rate": request_rate, "burstiness": burstiness,
                  "max_concurrency": max_concurrency, "seed": seed, "warmup_runs": warmup_runs,
                  "repeat_runs": repeat_runs, "temperature": target.extra_body["temperature"], **given,
                  "client_processes": processes,
                  "ignore_eos": target.ignore_eos, "metric_percentiles": list(percentiles),
                  "goodput_ms": {k: v * 1e3 for k, v in slo.items()}, "tokenizer": tokenizer}
        env = None
        if server_roof is not None:  # the server's device, not this client's
            env = {**results.environment(), "read_ceiling_gbs": server_roof["read_ceiling_gbs"],
                   **{k: server_roof[k] for k in ("weight_bytes_per_step", "embedding_row_bytes",
                                                  "kv_bytes_per_token")}}
        results.save_result(save_result, "serve", config, {}, out["runs"], out["summary"], out["requests"], env=env)
        console.print(f"saved {save_result}", highlight=False)
    report_failures(console, out["failures"], out["submitted"])


serve.__doc__ = f"{serve.__doc__}\n\n{SERVE_FIGURES_HELP}"


# --- `rose bench sweep stream|serve`, `rose bench plot`: curves over load, the SLO search, charts --

SWEEP = "Sweep"
RequestRates = Annotated[Optional[str], typer.Option("--request-rates", "--request-rate", help="Comma-separated "
                                                     "request rates, one point each, e.g. 1,2,4,8,inf (inf: all at "
                                                     "once; Poisson arrivals).", rich_help_panel=SWEEP)]
ConcurrencyGrid = Annotated[Optional[str], typer.Option("--max-concurrency", help="Comma-separated client-side "
                                                        "limits of requests in flight, one point each, e.g. "
                                                        "1,8,32,64.", rich_help_panel=SWEEP)]
BatchGrid = Annotated[Optional[str], typer.Option("--max-batch-size", help="Comma-separated decode batch limits, "
                                                  "one point each (the engine is rebuilt for each).",
                                                  rich_help_panel=SWEEP)]
InputLenGrid = Annotated[Optional[str], typer.Option("--input-len", help="Comma-separated prompt lengths (random "
                                                     "tokens), one point each.", rich_help_panel=SWEEP)]
OutputLenGrid = Annotated[Optional[str], typer.Option("--output-len", help="Comma-separated output lengths, one "
                                                      "point each.", rich_help_panel=SWEEP)]
Slo = Annotated[Optional[list[str]], typer.Option("--slo", help="Search for the highest load meeting these SLOs in "
                                                  "ms, e.g. --slo 'ttft:200 tpot:20' (any of ttft, tpot, e2el): "
                                                  "bisection over --request-rates (or --max-concurrency), starting "
                                                  "from the values given.", rich_help_panel=SWEEP)]
GoodputTarget = Annotated[float, typer.Option("--goodput-target", help="With --slo: the share of requests that "
                                              "must meet every SLO.", rich_help_panel=SWEEP)]
SloSteps = Annotated[int, typer.Option("--slo-steps", help="With --slo: most bisection steps after the first "
                                       "miss.", max=20, rich_help_panel=SWEEP)]
PlotPng = Annotated[Optional[str], typer.Option("--plot", help="Also draw the curves to this PNG (matplotlib: "
                                                "pip install 'rosecli\\[plot]').", rich_help_panel=SWEEP)]


def _sweep_axes(mode: str, **grids) -> dict:
    from rosecli.bench import sweep

    return {name: sweep.parse_axis(name, text) for name, text in grids.items()}


def _search_plan(axes: dict, slo: dict, goodput_target: float, slo_steps: int):
    """(axis, start values, fixed params) of the SLO search, or None without --slo."""
    if not slo:
        return None
    if not 0 < goodput_target <= 1:
        raise ConfigError(f"--goodput-target must be in (0, 1], e.g. 0.99, got {goodput_target}")
    if slo_steps < 0:
        raise ConfigError(f"--slo-steps must be >= 0, got {slo_steps}")
    rates, conc = axes.get("request_rate") or [], axes.get("max_concurrency") or []
    if len(rates) > 1 and len(conc) > 1:
        raise ConfigError("--slo searches one axis: give several --request-rates or several --max-concurrency "
                          "values, not both")
    axis = "max_concurrency" if len(conc) > 1 or (conc and not rates) else "request_rate"
    if not axes.get(axis):
        raise ConfigError("--slo needs the loads to start from: pass --request-rates (e.g. 1,4,16) or "
                          "--max-concurrency (e.g. 1,8,32)")
    others = [n for n, v in axes.items() if n != axis and len(v) > 1]
    if others:
        raise ConfigError(f"--slo searches {axis.replace('_', ' ')} with everything else fixed: give "
                          f"{', '.join(sorted(others))} one value")
    fixed = {n: v[0] for n, v in axes.items() if n != axis and v}
    return axis, axes[axis], fixed


def _check_plot_libs(plot: Optional[str], console: Console) -> None:
    """Before a sweep runs: --plot needs matplotlib (refused now, not after the sweep)."""
    from rosecli.bench import plot as plots

    if plot is not None:
        plots._check_png_path(plot)
        plots.require("matplotlib")


def _finish_sweep(console: Console, doc: dict, points, search, slo, save_result, plot, paths_name: str) -> None:
    from rosecli.bench import plot as plots
    from rosecli.bench import sweep

    if search is not None:
        console.print(sweep.search_line(search, slo, points), highlight=False, markup=False, soft_wrap=True)
    for p in points:
        for i, tl in enumerate(p.timelines or []):
            from rosecli.bench.timeline import summary_line

            console.print(f"{p.label} run {i + 1}: {summary_line(tl)}", highlight=False, markup=False, soft_wrap=True)
    if save_result is not None:
        sweep.save_sweep_result(save_result, doc)
        console.print(f"saved {save_result}", highlight=False)
    series = [plots.series_of(doc, paths_name)]
    if plot is not None:
        plots.write_png(series, plot)
        console.print(f"wrote {plot}", highlight=False)
    if console.is_terminal and len(points) > 1:  # in a pipe: the plain lines above, no chart
        try:
            console.print(plots.terminal_chart(series, width=min(console.width, 120), color=False),
                          highlight=False, markup=False)
        except ConfigError:
            console.print("(charts: pip install 'rosecli[plot]')", style="dim", markup=False)


@o.user_errors
@o.with_options(o.engine_options(exclude=("max_batch_size",)),
                o.workload_options(exclude=("request_rate", "input_len", "output_len")),
                o.sampling_options(exclude=("stop",)))
def sweep_stream(
    config: EngineConfig, spec: WorkloadSpec, params: SamplingParams, request_rates: RequestRates = None,
    max_batch_size: BatchGrid = None, input_len: InputLenGrid = None, output_len: OutputLenGrid = None,
    slo: Slo = None, goodput_target: GoodputTarget = 0.99, slo_steps: SloSteps = 4, plot: PlotPng = None,
    save_result: SaveResult = None, timeline: Timeline = False, *, warmup_runs: int, repeat_runs: int,
) -> None:
    """Sweep a bench stream workload (in process) over request rates, batch limits or lengths; --slo finds the
    highest rate meeting SLOs."""
    from rosecli.bench import metrics, results, sweep
    from rosecli.bench.run import bench_stream
    from rosecli.bench.sweep_table import SweepTable

    o.check_runs(warmup_runs, repeat_runs)
    if save_result is not None:
        results.check_result_path(save_result)
    # the batch limit outermost: the engine is rebuilt only when it changes
    axes = _sweep_axes("stream", max_batch_size=max_batch_size, request_rate=request_rates, input_len=input_len,
                       output_len=output_len)
    slo_s = metrics.parse_goodput(slo, flag="--slo")
    plan = _search_plan(axes, slo_s, goodput_target, slo_steps)
    grid = sweep.grid(axes, "stream") if plan is None else None
    console, err = Console(), Console(stderr=True)
    _check_plot_libs(plot, console)
    engines: dict = {}
    startup: dict = {}

    def engine_for(batch):
        if batch not in engines:
            for e in engines.values():
                e.close()
            engines.clear()
            cfg = config if batch is None else dataclasses.replace(config, max_batch_size=batch)
            engines[batch] = _start(cfg, err)
            startup.update(engines[batch].startup_times)
        return engines[batch]

    def run_point(p: dict) -> sweep.Point:
        engine = engine_for(p.get("max_batch_size"))
        pspec = dataclasses.replace(spec, **{k: v for k, v in p.items() if k in ("request_rate", "input_len",
                                                                                 "output_len")})
        out = bench_stream(engine, pspec, params, warmup_runs, repeat_runs, table, goodput=slo_s or None,
                           timeline=timeline)
        # requests/s, as bench serve reports it: the load axis of a sweep (completed requests / wall)
        measured_runs = [r for r in out["runs"] if not r["warmup"]]
        for r, m in zip(measured_runs, out["measured"]):
            r["figures"]["throughput_requests"] = m.requests / m.wall_s if m.wall_s > 0 else float("nan")
        out["summary"]["throughput_requests"] = metrics.median_figures(
            [r["figures"] for r in measured_runs])["throughput_requests"]
        return sweep.Point(p, out["runs"], out["summary"], out["requests"], out["timelines"], out["measured"],
                           out["failures"], out["submitted"])

    console.print("=== sweep: streaming benchmark ===", highlight=False)
    search = None
    try:
        with SweepTable(console, "sweep (bench stream)") as table:
            if plan is None:
                points = sweep.run_grid(grid, run_point, table)
            else:
                points, search = sweep.run_search(plan[0], plan[2], plan[1], run_point, table, goodput_target,
                                                  slo_steps)
    finally:
        for e in engines.values():
            e.close()
    cfg = _config_dict(config, spec, params, warmup_runs=warmup_runs, repeat_runs=repeat_runs)
    doc = sweep.build_sweep_result("stream", cfg, startup, axes, points, slo_s or None,
                                   goodput_target if slo_s else None, search)
    _finish_sweep(console, doc, points, search, slo_s, save_result, plot, "stream")
    report_failures(console, [f for p in points for f in p.failures], sum(p.submitted for p in points),
                    runs="measured runs of the sweep")


@o.user_errors
def sweep_serve(
    base_url: BaseUrl = "http://127.0.0.1:8000", endpoint: Endpoint = "/v1/completions", model: ServeModel = None,
    api_key: ApiKey = None, request_timeout: RequestTimeout = 600.0, tokenizer: Tokenizer = None,
    dataset: Dataset = "random", dataset_path: DatasetPath = None, num_prompts: NumPrompts = 16,
    input_len: InputLenGrid = None, output_len: OutputLenGrid = None, range_ratio: RangeRatio = 0.0,
    prefix_groups: PrefixGroups = 4, prefix_len: PrefixLen = 256, request_rates: RequestRates = None,
    burstiness: Burstiness = 1.0, max_concurrency: ConcurrencyGrid = None, seed: ServeSeed = 0,
    warmup_runs: WarmupRuns = 0, repeat_runs: RepeatRuns = 1, temperature: Temperature = None,
    stop_on_eos: StopOnEos = False, metric_percentiles: MetricPercentiles = "50,95,99", slo: Slo = None,
    goodput_target: GoodputTarget = 0.99, slo_steps: SloSteps = 4, plot: PlotPng = None,
    save_result: SaveResult = None, client_processes: ClientProcesses = "1",
) -> None:
    """Sweep a bench serve workload (HTTP, any OpenAI-compatible server) over request rates, concurrency or
    lengths; --slo finds the highest load meeting SLOs."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        o.fail("rose bench sweep serve needs httpx: pip install 'rosecli[serve]'")
    from rosecli.bench import datasets, http_client, metrics, results, sweep
    from rosecli.bench.serve import bench_serve
    from rosecli.bench.sweep_table import SweepTable

    o.check_runs(warmup_runs, repeat_runs)
    if save_result is not None:
        results.check_result_path(save_result)
    if not 0 < request_timeout < float("inf"):
        raise ConfigError(f"--request-timeout must be a positive number of seconds, got {request_timeout}")
    if not endpoint.startswith("/"):
        raise ConfigError(f"--endpoint must be a path such as /v1/completions, got {endpoint!r}")
    processes = http_client.parse_client_processes(client_processes)  # "auto": per point, from its concurrency
    axes = _sweep_axes("serve", request_rate=request_rates, max_concurrency=max_concurrency, input_len=input_len,
                       output_len=output_len)
    percentiles = metrics.parse_percentiles(metric_percentiles)
    if 99.0 not in percentiles:  # the charts and the search line read p99
        percentiles = (*percentiles, 99.0)
    slo_s = metrics.parse_goodput(slo, flag="--slo")
    plan = _search_plan(axes, slo_s, goodput_target, slo_steps)
    grid = sweep.grid(axes, "serve") if plan is None else None
    console = Console()
    _check_plot_libs(plot, console)
    sampling = {"temperature": 0.0 if temperature is None else temperature}
    target = http_client.Target(http_client.normalize_base_url(base_url), endpoint, model, api_key, request_timeout,
                                ignore_eos=not stop_on_eos, extra_body=sampling)
    http_client.check_server(target)
    tok = _serve_tokenizer(tokenizer, target.chat or dataset == "sharegpt", console)
    cache: dict = {}

    def run_point(p: dict) -> sweep.Point:
        ilen = p.get("input_len", 128)
        olen = p.get("output_len", 128 if dataset != "sharegpt" else None)
        if (ilen, olen) not in cache:
            spec = datasets.ServeDataset(dataset, dataset_path, num_prompts, ilen, olen, range_ratio, prefix_groups,
                                         prefix_len, seed)
            cache[(ilen, olen)] = datasets.build_requests(spec, tok, target.chat)
        rate = p.get("request_rate")
        offsets = datasets.arrival_offsets(num_prompts, rate, burstiness, seed)
        conc = p.get("max_concurrency")
        out = bench_serve(target, cache[(ilen, olen)], offsets, warmup_runs, repeat_runs, table, max_concurrency=conc,
                          percentiles=percentiles, goodput=slo_s or None, request_rate=rate,
                          client_processes=processes)
        return sweep.Point(p, out["runs"], out["summary"], out["requests"], None, out["measured"], out["failures"],
                           out["submitted"])

    console.print("=== sweep: serving benchmark (HTTP) ===", highlight=False)
    console.print(f"Base URL: {target.base_url}\nEndpoint: {endpoint}\nModel: {target.model}\nRequests per run: "
                  f"{num_prompts}", highlight=False, markup=False)
    search = None
    with SweepTable(console, "sweep (bench serve)") as table:
        if plan is None:
            points = sweep.run_grid(grid, run_point, table)
        else:
            points, search = sweep.run_search(plan[0], plan[2], plan[1], run_point, table, goodput_target, slo_steps)
    cfg = {"base_url": target.base_url, "endpoint": endpoint, "model": target.model, "dataset": dataset,
           "dataset_path": dataset_path, "num_requests": num_prompts, "range_ratio": range_ratio,
           "prefix_groups": prefix_groups, "prefix_len": prefix_len, "burstiness": burstiness, "seed": seed,
           "warmup_runs": warmup_runs, "repeat_runs": repeat_runs, "temperature": sampling["temperature"],
           "ignore_eos": target.ignore_eos, "metric_percentiles": list(percentiles), "tokenizer": tokenizer,
           "client_processes": processes}
    doc = sweep.build_sweep_result("serve", cfg, {}, axes, points, slo_s or None, goodput_target if slo_s else None,
                                   search)
    _finish_sweep(console, doc, points, search, slo_s, save_result, plot, "serve")
    report_failures(console, [f for p in points for f in p.failures], sum(p.submitted for p in points),
                    runs="measured runs of the sweep")


@o.user_errors
def plot(
    files: Annotated[list[str], typer.Argument(help="Result files (sweeps or single runs); each is one series.")],
    png: Annotated[Optional[str], typer.Option("--plot", help="Also write the chart to this PNG (matplotlib).")] = None,
    timeline: Annotated[bool, typer.Option("--timeline", help="Chart the step timelines recorded with --timeline "
                                           "instead of latency against throughput.")] = False,
    width: Annotated[Optional[int], typer.Option("--width", help="Columns of the terminal chart (default: the "
                                                 "terminal's, at most 120).", min=40, max=1000)] = None,
) -> None:
    """Charts of result files: latency against throughput, or a run's step timeline.

    TTFT and TPOT p50/p99 against output throughput, one series per file (or, with --timeline, a run's batch
    size, tokens in flight, step time, KV blocks and preemptions over time). Needs pip install
    'rosecli\\[plot]'."""
    from rosecli.bench import plot as plots
    from rosecli.bench import results

    docs = [results.load_result(f) for f in files]
    plots.require("plotext")
    console = Console()
    cols = width or min(console.width, 120)
    if timeline:
        tls = [(f"{n} {name}", tl) for n, d in zip(plots.series_names(files), docs) for name, tl in plots.timelines_of(d)]
        if not tls:
            raise ConfigError("no timeline in these files: record one with rose bench stream --timeline (or bench "
                              "sweep stream --timeline)")
        for name, tl in tls:
            console.print(f"=== timeline: {name} ===", highlight=False, markup=False)
            console.print(plots.timeline_chart(tl, width=cols, color=console.is_terminal), highlight=False,
                          markup=False)
        if png is not None:
            plots.write_timeline_png(tls, png)
            console.print(f"wrote {png}", highlight=False)
        return
    series = [plots.series_of(d, n) for d, n in zip(docs, plots.series_names(files))]
    if not any(s.x for s in series):
        raise ConfigError("no figures to plot in these files (they hold no throughput): pass bench stream, serve "
                          "or sweep results")
    console.print(plots.terminal_chart(series, width=cols, color=console.is_terminal), highlight=False,
                  markup=False)
    if png is not None:
        plots.write_png(series, png)
        console.print(f"wrote {png}", highlight=False)
