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
                "reported on its own, never inside a run.")

SaveResult = Annotated[Optional[str], typer.Option("--save-result", metavar="FILE", help="Write configuration, environment, "
                                                   "per-run figures and raw timestamps to this JSON file "
                                                   "(schema rosecli.bench/1).")]
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


def _header(engine, spec, config) -> dict:
    return {"Model": engine.model_name, "Device": engine.device.type, "Dtype": str(engine.dtype).removeprefix("torch."),
            "Paged attention": engine.runner.use_triton, "CUDA Graph": bool(engine.runner.graphs),
            "NVTX": config.nvtx, "Prefix cache": config.enable_prefix_cache, "Requests": spec.num_requests,
            "Max new tokens": spec.max_new_tokens if spec.output_len is None else f"~{spec.output_len}"}


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
    against_direct: AgainstDirect = False, goodput: Goodput = None, *, warmup_runs: int, repeat_runs: int,
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
        header = _header(engine, spec, config)
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
                               goodput=slo or None)
        report.print_stream_summary(console, out["measured"], out["summary"])
        if against_direct and (line := report.against_direct_line(out["summary"])):
            console.print(line, highlight=False)
        if slo:
            report.print_goodput(console, out["summary"], slo)
        if save_result is not None:
            results.save_result(save_result, "stream", _config_dict(config, spec, params), engine.startup_times,
                                out["runs"], out["summary"], out["requests"])
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
        console.print("=== scheduler benchmark ===", highlight=False)
        for line in report.header_lines({**_header(engine, spec, config), "Mode": mode}):
            console.print(line, highlight=False)
        console.print(report.startup_line(engine.startup_times), highlight=False)
        with report.RunTable(console, "sched", f"scheduler benchmark ({mode})") as table:
            out = bench_sched(engine, spec, params, mode, warmup_runs, repeat_runs, table)
        report.print_sched_summary(console, mode, warmup_runs, out["pairs"], len(out["measured"]))
        if save_result is not None:
            results.save_result(save_result, "sched", _config_dict(config, spec, params, mode=mode),
                                engine.startup_times, out["runs"], out["summary"])
            console.print(f"saved {save_result}", highlight=False)
        report_failures(console, out["failures"], out["submitted"])
    finally:
        engine.close()


@o.user_errors
def compare(files: Annotated[list[str], typer.Argument(metavar="FILE", help="Result files from --save-result; the first is the "
                                                       "baseline.")]) -> None:
    """Compare saved results figure by figure; changes within the spread of repeat runs are marked noise."""
    from rosecli.bench import compare as cmp
    from rosecli.bench import report, results

    if len(files) < 2:
        raise ConfigError("give at least two result files: the baseline first")
    docs = [results.load_result(f) for f in files]
    kinds = {d["kind"] for d in docs}
    if not cmp.comparable(kinds):
        raise ConfigError(f"cannot compare results of different benchmarks ({', '.join(sorted(kinds))})")
    report.print_compare(Console(), files, cmp.compare_results(docs), cmp.config_differences(docs))


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
              "Sampling sent": ", ".join(f"{k} {v:g}" for k, v in sampling.items())}
    if slo:
        header["Goodput SLOs"] = ", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in slo.items())
    console.print("=== serving benchmark (HTTP) ===", highlight=False)
    for line in report.header_lines(header):
        console.print(line, highlight=False, markup=False)
    with report.RunTable(console, "serve", "serving benchmark (HTTP)") as table:
        out = bench_serve(target, requests, offsets, warmup_runs, repeat_runs, table, max_concurrency=max_concurrency,
                          percentiles=percentiles, goodput=slo or None, request_rate=request_rate)
    report.print_serve_summary(console, out["measured"], out["summary"],
                               {"max_concurrency": max_concurrency, "request_rate": request_rate})
    if save_result is not None:
        config = {"base_url": target.base_url, "endpoint": endpoint, "model": target.model, "dataset": dataset,
                  "dataset_path": dataset_path, "num_requests": num_prompts, "input_len": spec.input_len,
                  "output_len": spec.output_len, "range_ratio": range_ratio, "prefix_groups": prefix_groups,
                  "prefix_len": prefix_len, "request_rate": request_rate, "burstiness": burstiness,
                  "max_concurrency": max_concurrency, "seed": seed, "warmup_runs": warmup_runs,
                  "repeat_runs": repeat_runs, "temperature": target.extra_body["temperature"], **given,
                  "ignore_eos": target.ignore_eos, "metric_percentiles": list(percentiles),
                  "goodput_ms": {k: v * 1e3 for k, v in slo.items()}, "tokenizer": tokenizer}
        results.save_result(save_result, "serve", config, {}, out["runs"], out["summary"], out["requests"])
        console.print(f"saved {save_result}", highlight=False)
    report_failures(console, out["failures"], out["submitted"])


serve.__doc__ = f"{serve.__doc__}\n\n{SERVE_FIGURES_HELP}"
