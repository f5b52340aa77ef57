"""Engine, sampling and workload options are declared once (rosecli/commands/options.py): every
command's CLI default is the config dataclass's default, each command offers its option groups,
and "auto" execution paths are decided once per device, refusing what cannot run there."""

import dataclasses

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from rosecli.bench.workload import WorkloadSpec
from rosecli.commands import options as o
from rosecli.commands.main import app
from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.errors import ConfigError

DATACLASSES = (EngineConfig, SamplingParams, WorkloadSpec)
FIELD_OF_FLAG = {"prefix_cache": "enable_prefix_cache"}  # the one option named differently from its field
# CLI defaults that differ from a field's default on purpose, each with its reason
NOT_THE_FIELD_DEFAULT = {
    ("temperature", SamplingParams): None,  # None: 0, or 1.0 with --do-sample
    ("stop", SamplingParams): None,  # None: no stop strings (the field's [])
    ("seed", SamplingParams): 0,  # --seed seeds the engine (and the workload), never one request
}
# a command's own defaults: `rose profile` runs a short workload
COMMAND_DEFAULTS = {"profile": {"num_requests": 8, "max_new_tokens": 32}}


def _commands():
    root = get_command(app)
    out = {}
    for name, cmd in root.commands.items():
        if isinstance(cmd, typer.core.TyperGroup):
            out.update({f"{name} {sub}": c for sub, c in cmd.commands.items()})
        else:
            out[name] = cmd
    return out


COMMANDS = _commands()
ENGINE_COMMANDS = ("generate", "serve-local", "profile", "bench stream", "bench sched")


def _defaults(cls):
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_cli_default_is_the_dataclass_default(command):
    checked = 0
    for param in COMMANDS[command].params:
        field = FIELD_OF_FLAG.get(param.name, param.name)
        for cls in DATACLASSES:
            if field not in _defaults(cls):
                continue
            want = COMMAND_DEFAULTS.get(command.split()[-1], {}).get(param.name, _defaults(cls)[field])
            want = NOT_THE_FIELD_DEFAULT.get((param.name, cls), want)
            assert param.default == want, f"rose {command} --{param.name.replace('_', '-')}: {param.default!r} " \
                                          f"is not {cls.__name__}.{field} = {want!r}"
            checked += 1
    assert checked >= 10, checked


def _flags(command):
    return {flag for p in COMMANDS[command].params for flag in p.opts}


def _group_flags(table, exclude=()):
    return {flag for name, opt in table.items() if name not in exclude
            for flag in opt.flags.replace("/", " ").split()[:1]}


ENGINE = _group_flags(o.ENGINE_OPTIONS)
SAMPLING = _group_flags(o.SAMPLING_OPTIONS)
WORKLOAD = _group_flags(o.WORKLOAD_OPTIONS)


def test_each_command_offers_its_option_groups():
    assert len(ENGINE) == 26 and "--block-size" in ENGINE and "--prefix-cache" in ENGINE
    server_only = {"--host", "--port", "--overload"}
    assert _flags("serve-local") >= ENGINE | server_only and not _flags("serve-local") & (SAMPLING | WORKLOAD)
    assert _flags("bench stream") >= ENGINE | SAMPLING - {"--stop"} | WORKLOAD
    assert _flags("profile") >= ENGINE | SAMPLING - {"--stop"} | WORKLOAD - {"--repeat-runs"}
    sched = _flags("bench sched")
    assert sched >= {"--block-size", "--max-batch-size", "--num-requests", "--top-p", "--mode"}
    assert not sched & {"--stream-interval", "--tokenize-workers", "--max-inflight-requests",
                        "--submit-interval-ms", "--request-rate", "--stop"}
    gen = _flags("generate")
    assert gen >= SAMPLING | {"--model", "--device", "--block-size", "--paged-attn", "--chat"}
    for command in ("generate", "chat", "serve-local", "profile", "bench stream", "bench sched"):
        assert {"--tensor-parallel-size", "-tp"} <= _flags(command), command
    assert not gen & ({"--max-batch-size", "--prefix-cache", "--stream-interval"} | WORKLOAD)


def test_help_shows_each_option_in_its_panel():
    for command in ENGINE_COMMANDS:
        for p in COMMANDS[command].params:
            table = next((t for t in (o.ENGINE_OPTIONS, o.SAMPLING_OPTIONS, o.WORKLOAD_OPTIONS) if p.name in t), None)
            if table is not None:
                assert p.rich_help_panel == table[p.name].panel and p.help == table[p.name].full_help, (command, p.name)
                assert (p.rich_help_panel == o.CUDA) == p.help.startswith("(CUDA) "), (command, p.name)


def test_with_options_builds_the_configs_from_the_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("ROSE_CACHE_DIR", str(tmp_path))
    seen = {}
    probe = typer.Typer()

    @probe.command()
    @o.with_options(o.engine_options(), o.workload_options(), o.sampling_options(), defaults={"num_requests": 3})
    def run(config: EngineConfig, spec: WorkloadSpec, params: SamplingParams, *, warmup_runs: int):
        seen.update(config=config, spec=spec, params=params, warmup_runs=warmup_runs)

    r = CliRunner().invoke(probe, [])
    assert r.exit_code == 0, r.output
    assert seen["config"] == EngineConfig(cache_dir=str(tmp_path))
    assert seen["params"] == SamplingParams() and seen["spec"] == WorkloadSpec(num_requests=3)
    assert seen["warmup_runs"] == 0
    r = CliRunner().invoke(probe, ["--block-size", "8", "--no-prefix-cache", "--seed", "7", "--max-new-tokens", "5",
                                   "--do-sample", "--stop", "x", "--warmup-runs", "2"])
    assert r.exit_code == 0, r.output
    c, s, p = seen["config"], seen["spec"], seen["params"]
    assert (c.block_size, c.enable_prefix_cache, c.seed) == (8, False, 7)
    assert (s.seed, s.max_new_tokens, p.max_new_tokens, p.temperature, p.stop, p.seed) == (7, 5, 5, 1.0, ["x"], None)
    assert seen["warmup_runs"] == 2


def test_with_options_refuses_a_default_for_an_option_it_lacks():
    with pytest.raises(TypeError, match="block_size"):
        @o.with_options(o.engine_options(exclude=("block_size",)), defaults={"block_size": 8})
        def cmd(config: EngineConfig):
            pass


# ---- "auto" execution paths, decided once per device ---------------------------------------------


def test_auto_paths_are_on_for_cuda_and_off_for_cpu():
    cuda, cpu = EngineConfig().resolved("cuda"), EngineConfig().resolved("cpu")
    assert (cuda.device, cuda.paged_attn, cuda.cuda_graph, cuda.overlap_schedule) == ("cuda", True, True, True)
    assert (cpu.device, cpu.paged_attn, cpu.cuda_graph, cpu.overlap_schedule) == ("cpu", False, False, False)
    off = EngineConfig(paged_attn=False, cuda_graph=False, overlap_schedule=False).resolved("cuda")
    assert (off.paged_attn, off.cuda_graph, off.overlap_schedule) == (False, False, False)
    # overlap scheduling runs on CPU too: asked for, it is kept
    assert EngineConfig(overlap_schedule=True).resolved("cpu").overlap_schedule is True
    assert EngineConfig(paged_attn=False, cuda_graph=False).resolved("cpu").paged_attn is False


@pytest.mark.parametrize("field,flag", [("paged_attn", "--paged-attn"), ("cuda_graph", "--cuda-graph")])
def test_cuda_only_path_on_cpu_is_refused_naming_the_flag(field, flag):
    with pytest.raises(ConfigError, match=f"{flag} needs a CUDA GPU.*leave out {flag}"):
        EngineConfig(**{field: True}).resolved("cpu")


def test_options_without_effect_on_the_device_are_named():
    assert EngineConfig(cpu_weights="int8", threads=2).ignored_on("cpu") == []
    notes = EngineConfig(cpu_weights="int8", threads=2).ignored_on("cuda")
    assert len(notes) == 2 and "--cpu-weights int8 applies on CPU only" in notes[0] and "--threads 2" in notes[1]
    assert EngineConfig().ignored_on("cuda") == []


def test_the_engine_runs_on_the_resolved_config(tiny_engine_factory):
    engine = tiny_engine_factory()
    assert (engine.config.device, engine.config.paged_attn, engine.config.cuda_graph,
            engine.config.overlap_schedule) == ("cpu", False, False, False)
