"""The engine: resolves device and dtype, loads the model, builds runner, scheduler and input
processor.

Every command drives this one object through the streaming manager (``bench sched`` drives its
scheduler directly).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

from rosecli.engine.config import EngineConfig, SamplingParams, default_threads
from rosecli.engine.errors import ConfigError
from rosecli.engine.inputs import InputProcessor
from rosecli.engine.runner import ModelRunner
from rosecli.engine.scheduler import Scheduler
from rosecli.engine.stages import Stages

if TYPE_CHECKING:
    from rosecli.engine.outputs import RequestOutput

Progress = Callable[[str, int, int], None]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was given but no CUDA GPU is visible to torch: "
                          "use --device cpu (or auto)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: Optional[str] = None) -> torch.dtype:
    """auto: float32 on CPU; on CUDA the checkpoint's own dtype (its config's ``torch_dtype``) when
    it is bfloat16 or float16, else float16: a float32 checkpoint (or one that states none, or a
    converted GGUF) runs in float16, as vLLM does, and bfloat16 falls back to float16 on a GPU
    without it."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        if checkpoint_dtype == "bfloat16" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float16
    dtype = getattr(torch, name)
    if device.type == "cpu" and dtype is torch.float16:
        raise ConfigError("--dtype float16 is too slow and imprecise on CPU: use float32 or bfloat16")
    return dtype


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: Optional[Progress] = None,
                 log: Callable[[str], None] = lambda msg: None, stages: Optional[Stages] = None):
        self.device = resolve_device(config.device)
        # the "auto" paths decided once for this device; a flag that cannot apply is refused here,
        # before the model loads, and one without effect is named on stderr
        self.config = config = config.resolved(self.device.type)
        for note in config.ignored_on(self.device.type):
            print(f"note: {note}", file=sys.stderr)
        from rosecli.engine.loader import checkpoint_dtype

        auto_cuda = config.dtype == "auto" and self.device.type == "cuda"
        self.dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype(config, progress) if auto_cuda else None)
        self.stages = stages or Stages(nvtx=config.nvtx)
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            torch.set_num_threads(config.threads or default_threads())
        t0 = time.perf_counter()
        if progress:
            progress("load", 0, 1)
        self.workers = None  # tensor parallelism: ranks 1..N-1 (rosecli/engine/distributed.py)
        if config.tensor_parallel_size > 1:
            from rosecli.engine import distributed
            from rosecli.engine.loader import resolve_hf_config

            distributed.check_tensor_parallel(config, self.device, resolve_hf_config(config, progress))
            self.workers = distributed.Workers(config, self.device, self.dtype, log)
        try:
            self._start(config, progress, log, t0)
        except BaseException:
            if self.workers is not None:
                self.workers.close()
            raise

    def _start(self, config: EngineConfig, progress, log, t0: float) -> None:
        from rosecli.engine.loader import load_model

        self.loaded = load_model(config, self.device, self.dtype, progress)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.startup_times: dict[str, float] = {"model_load_s": time.perf_counter() - t0}
        self.tokenizer = self.loaded.tokenizer
        from rosecli.engine import detokenizer

        detokenizer.prepare(self.tokenizer)  # its tables cost ~0.1 s: start-up pays, not the first request
        self.max_model_len = self.loaded.max_model_len
        if self.workers is None:
            self.runner = ModelRunner(config, self.loaded.model, self.max_model_len, self.device, self.dtype,
                                      self.stages, log)
        else:
            from rosecli.engine.distributed import DriverRunner

            self.runner = DriverRunner(config, self.loaded.model, self.max_model_len, self.device, self.dtype,
                                       self.stages, log, workers=self.workers)
        self.startup_times.update(self.runner.prepare(progress))
        self.scheduler = Scheduler(config, self.runner, self.loaded.eos_token_ids, self.max_model_len, self.stages)
        vocab_size = getattr(self.loaded.model, "vocab_size", None) or len(self.tokenizer)
        self.inputs = InputProcessor(self.tokenizer, self.max_model_len, vocab_size, self.scheduler.block_manager)
        from rosecli.engine.structured import StructuredOutput

        # grammars for structured output (the library loads on the first request that asks for one)
        self.structured = self.runner.structured = StructuredOutput(
            self.tokenizer, self.runner.sampler.vocab_size, self.loaded.eos_token_ids, self.device,
            self.runner.num_sampling_slots)

    @property
    def model_name(self) -> str:
        return self.loaded.name

    def generate(self, prompts: list[Union[str, list[int]]],
                 params: Union[SamplingParams, list[SamplingParams], None] = None) -> list["RequestOutput"]:
        """Offline: run the prompts (text or token ids) as one batch through the streaming manager;
        their outputs in order (text, output token ids, finish reason). A refused prompt raises."""
        from rosecli.engine.streaming import StreamingManager

        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        manager = StreamingManager(self, start=False)
        room = self.config.max_inflight_requests or len(prompts) or 1
        outputs: list = []
        try:  # the engine steps on this thread (see StreamingManager.run_until_idle); `room` at a time
            for start in range(0, len(prompts), room):
                ids = [manager.add_request(p, sp) for p, sp in zip(prompts[start:start + room],
                                                                    plist[start:start + room])]
                manager.run_until_idle()
                outputs.extend(manager.result(rid) for rid in ids)
            return outputs
        finally:
            manager.close()

    def add_fault_listener(self, fn: Callable[[BaseException], None]) -> None:
        """Call ``fn(error)`` (from another thread) if the engine dies outside a step: a
        tensor-parallel rank ended. A one-process engine has no such fault."""
        if self.workers is not None:
            self.workers.add_fault_listener(fn)

    def close(self) -> None:
        if hasattr(self, "runner"):
            self.runner.close()
        if self.workers is not None:
            self.workers.close()
