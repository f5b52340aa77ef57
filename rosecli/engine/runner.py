"""The model runner: turns a scheduled batch into tensors, runs the model, samples.

Decode writes the batch metadata into one pinned host staging area (numpy views, no tensor
built per step) and replays the CUDA graph captured for the batch's padded size, whose first
kernel reads the area into a static device buffer (`kernels.stage_inputs`) and whose argmax
writes the greedy ids back into pinned memory: a greedy step is the graph alone, with no copy
queued before or after it, and a sampled one adds the sampler's graph, whose last kernel does the
same for its ids (`publish_ids`). The copies, ``non_blocking`` into the device buffer and back,
remain where the device cannot read pinned memory (and for a prefill's ids). Prefill runs eagerly
or as small graphs (`prefill_graphs`).

A decode step is launched (`launch_decode`) and its sampled ids read later (`collect`), so the
scheduler can prepare and launch step N+1 while the GPU still runs step N. A sequence whose last
token is still `PENDING` (sampled by the step in flight) takes its input id on the device from
that step's output row; the staging areas and the sampled-id buffers are double-buffered so the
host never rewrites memory a copy still in flight reads.

What the runner keeps per request lives here, keyed by request id (its seeded generator, its row
in the last decode launch); the scheduler's `Sequence` holds token and block state only.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from typing import Callable, Optional

import numpy as np
import torch

from rosecli.engine import prefill_graphs
from rosecli.engine.attention import AttentionMetadata, with_decode_gather
from rosecli.engine.block_manager import slots_of
from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.errors import ConfigError, RequestError
from rosecli.engine.kv_cache import allocate_kv_cache, kv_bytes_per_block
from rosecli.engine.logprobs import MAX_LOGPROBS, TokenLogprobs, pick, prompt_logprobs, row_logprobs, unpack
from rosecli.engine.sampling_state import SamplerState
from rosecli.engine.sequence import PENDING, Sequence
from rosecli.engine.stages import Stages
from rosecli.engine.step_plan import StepPlan
from rosecli.kernels.argmax import argmax as split_argmax, logits_argmax
from rosecli.kernels.embed import gather_embed
from rosecli.kernels.stage_inputs import HEADER_BYTES, publish_ids, stage_inputs

CPU_DEFAULT_KV_TOKENS = 8192


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to ``max_batch_size`` (which is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 8))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


class _DecodeGraph:
    """A captured decode step and its output buffers: the float32 logits (written while
    `ModelRunner._logits_wanted` says so), the greedy ids, and the logits GEMM's raw output (padded
    columns, the weights' dtype; None where the model has none), which a greedy grammar row reads."""

    __slots__ = ("graph", "logits", "greedy", "raw")

    def __init__(self, graph, logits, greedy, raw):
        self.graph, self.logits, self.greedy, self.raw = graph, logits, greedy, raw


class _Staging:
    """One host (pinned on CUDA) staging area for a decode step's inputs and its numpy views.

    Layout, bytes: a header of 8 int64 (`stage_inputs.HEADER_BYTES`: on the host the step's number,
    rows and block-table columns to copy; on the device what `stage_inputs` keeps), then int64
    [token pool: sampled (mb) | host ids (mb)] [src (mb)] [positions (mb)] [slots (mb)] [sampling slots
    (mb): each row's in the sampler, written while a row samples], then int32 [context_lens (mb)]
    [block_tables (mb x nb)]. Everything from the host ids on is copied in one
    piece; block-table rows come last so a step copies only the rows it uses. ``src[i]`` picks row
    i's input id from the token pool: a row of the previous step's samples, or ``mb + i`` for the id
    the host wrote.
    """

    __slots__ = ("buf", "header", "tokens", "host_ids", "src", "positions", "slots", "sample_slots", "context_lens",
                 "block_tables", "row_tables", "row_views")

    def __init__(self, buf: torch.Tensor, mb: int, nb: int):
        self.buf = buf
        h = HEADER_BYTES
        self.header = buf[:h].view(torch.int64)
        i64 = buf[h:h + self.INT64_FIELDS * 8 * mb].view(torch.int64)
        i32 = buf[h + self.INT64_FIELDS * 8 * mb:].view(torch.int32)
        self.tokens, self.src = i64[:2 * mb], i64[2 * mb:3 * mb]
        self.host_ids = i64[mb:2 * mb]
        self.positions, self.slots = i64[3 * mb:4 * mb], i64[4 * mb:5 * mb]
        self.sample_slots = i64[5 * mb:6 * mb]
        self.context_lens, self.block_tables = i32[:mb], i32[mb:].view(mb, nb)
        self.row_tables: list = [None] * mb  # the block table (list object) each row was written from

    def numpy(self) -> "_Staging":
        view = object.__new__(_Staging)
        for name in ("header", "tokens", "host_ids", "src", "positions", "slots", "sample_slots", "context_lens",
                     "block_tables"):
            setattr(view, name, getattr(self, name).numpy())
        view.buf, view.row_tables = self.buf, self.row_tables
        # memoryviews of the per-row fields: storing a Python int through one costs less than a
        # numpy item store, and a launch stores five per row
        view.row_views = tuple(memoryview(getattr(view, name))
                               for name in ("src", "host_ids", "positions", "slots", "context_lens"))
        return view

    INT64_FIELDS = 6  # sampled, host ids, src, positions, slots, sampling slots

    @classmethod
    def nbytes(cls, mb: int, nb: int) -> int:
        return cls.copied_span(mb, nb, mb)[1]

    @classmethod
    def copied_span(cls, mb: int, nb: int, rows: int) -> tuple[int, int]:
        """Bytes a step copies: from the host ids through block-table row ``rows - 1``."""
        return HEADER_BYTES + 8 * mb, HEADER_BYTES + cls.INT64_FIELDS * 8 * mb + 4 * mb + 4 * rows * nb


class DecodeLaunch:
    """A decode step launched on the device; `ModelRunner.collect` returns its sampled ids and
    fills ``logprobs`` {request id: `TokenLogprobs`} for the requests that asked."""

    __slots__ = ("seqs", "out", "event", "lp", "logprobs")

    def __init__(self, seqs, out, event, lp=None):
        self.seqs, self.out, self.event, self.lp = seqs, out, event, lp
        self.logprobs: Optional[dict[int, TokenLogprobs]] = None  # (no dict per step when nobody asks)


def _plain_greedy(p: SamplingParams, holds_back: bool) -> bool:
    """The model's argmax is the answer: greedy, nothing that changes the logits (``min_tokens``
    changes them only when there are stop ids to hold back: not with ``ignore_eos`` and no
    ``stop_token_ids``, which is how benchmarks fix output lengths)."""
    return (p.greedy and not p.logit_bias and not p.allowed_token_ids
            and not (p.min_tokens and holds_back)
            and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)


class _SamplerGraph:
    """The sampler's kernels for one decode batch, captured once and replayed: ``ids`` is its output."""

    __slots__ = ("graph", "ids")

    def __init__(self, graph, ids):
        self.graph, self.ids = graph, ids


MASK_COPY_ASIDE: Optional[bool] = None  # a grammar bitmask's copy on a side stream: None = when the driver does it
MAX_SAMPLER_GRAPHS = 256  # (batch, variant) pairs captured at most; beyond, the sampler runs eagerly
MAX_PREFILL_SAMPLER_GRAPHS = 64  # the same after prefill graphs, apart (their many sizes may not crowd decode's out)
GEMM_WARMUP_ROWS = 256  # start-up runs each prefill GEMM at every row count up to this (then every 64th)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, max_model_len: int,
                 device: torch.device, dtype: torch.dtype, stages: Optional[Stages] = None,
                 log: Callable[[str], None] = lambda msg: None):
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.is_cuda = device.type == "cuda"
        self.stages = stages or Stages()
        self.log = log
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / self.block_size)
        self.max_batch_size = config.max_batch_size
        assert config.device == device.type and None not in (config.paged_attn, config.cuda_graph), \
            "the runner reads a config resolved for its device: EngineConfig.resolved(device)"
        self.use_triton = config.paged_attn
        self.use_graphs = config.cuda_graph
        # one sampling slot per admitted request (at most max_active_requests are admitted, preempted
        # ones included: they wait at the head of the queue, before any new admission)
        self.num_sampling_slots = max(config.max_active_requests or config.max_batch_size, config.max_batch_size,
                                      config.prefill_max_batch_size)
        self.sampler = SamplerState(self.num_sampling_slots, model.vocab_size, device, seed=config.seed)
        self.eos_token_ids: list[int] = []  # set by the scheduler: what min_tokens holds back with stop ids
        self._slots: dict[int, int] = {}  # request id -> sampling slot, from its first sampled token
        self._special: set[int] = set()  # request ids whose sampling is not plain greedy
        self._masked_greedy: set[int] = set()  # plain greedy ones under a grammar (not in _special)
        self._logprob_ids: set[int] = set()  # request ids that asked for logprobs
        self._lp_step = None  # this step's logprobs on the device: (rows, ks, packed), for _fetch
        self._h_lp: list = [None, None]  # pinned host buffers for them (CUDA), made on first use
        # the last prefill's prompt logprobs: {request id: (first position, [TokenLogprobs ...])}
        self.prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = {}
        self.prefill_logprobs: dict[int, TokenLogprobs] = {}  # the last prefill's sampled tokens'
        self.structured = None  # rosecli.engine.structured.StructuredOutput, set by the engine when available
        self.num_blocks = self._decide_num_blocks()
        allocate_kv_cache(model, self.num_blocks, self.block_size, dtype, device)
        self._alloc_decode_buffers()
        self.graphs: dict[int, _DecodeGraph] = {}
        self._embed_tables = False  # the model's `decode_embeddings` (None: none), looked up at the first decode
        self.prefill_graphs: Optional[prefill_graphs.PrefillGraphs] = None  # small prefills as graphs (`prefill_graphs`)
        # decode sampling replays a graph per (logits buffer, batch, sampler variant), captured the
        # first time that key is met (after running it eagerly once, so its kernels are loaded)
        self._sampler_graphs: dict[tuple, Optional[_SamplerGraph]] = {}
        self._prefill_sampler_graphs: dict[tuple, Optional[_SamplerGraph]] = {}  # (the same after prefill graphs)
        # (batch, host bitmask index, copy aside, flip) -> a masked-argmax graph and its ids (`_masked_greedy_ids`)
        self._masked_replays: dict[tuple[int, int, bool, int], tuple] = {}
        self._ids_on_host = False  # the step's ids already queued for the host (`_fetch` skips its copy)
        self._stream: Optional[torch.cuda.Stream] = None  # the stream the steps run on (`_fetch`)
        self._sampler_pool = None
        self.graph_sizes: list[int] = graph_batch_sizes(self.max_batch_size) if self.use_graphs else []
        self.startup_times: dict[str, float] = {}
        # decode launches so far, the sequences they decoded and those sequences' context tokens
        # (summed): what the benchmarks count the bytes a decode step reads from (engine/roofline.py)
        self.decode_steps = self.decode_sequences = self.decode_context_tokens = 0

    # --- memory -----------------------------------------------------------------------------
    def _decide_num_blocks(self) -> int:
        per_block = kv_bytes_per_block(self.model, self.block_size, self.dtype)
        if self.config.num_gpu_blocks is not None:
            num = self.config.num_gpu_blocks
        elif not self.is_cuda:
            num = math.ceil(max(CPU_DEFAULT_KV_TOKENS, self.max_model_len) / self.block_size)
        else:
            num = self._profile_gpu_blocks(per_block)
        if num * self.block_size < self.max_model_len and self.config.num_gpu_blocks is None:
            raise ConfigError(
                f"only {num} KV blocks ({num * self.block_size} tokens) fit, fewer than one sequence of "
                f"--max-model-len {self.max_model_len}: lower --max-model-len or raise --gpu-memory-utilization")
        self.log(f"KV cache: {num} blocks x {self.block_size} tokens = {num * self.block_size} tokens "
                 f"({num * per_block / 2**30:.2f} GiB)")
        return num

    def _profile_gpu_blocks(self, per_block: int) -> int:
        """Give KV blocks whatever the weights and a peak prefill leave of the memory budget."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = max(1, min(self.config.prefill_max_tokens, self.max_model_len))
        nblk = math.ceil(n / self.block_size)
        allocate_kv_cache(self.model, nblk, self.block_size, self.dtype, self.device)
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=torch.arange(n, device=self.device),
            block_tables=torch.arange(nblk, dtype=torch.int32, device=self.device)[None],
            context_lens=torch.tensor([n], dtype=torch.int32, device=self.device), max_context_len=n,
            use_triton=self.use_triton, cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            max_seqlen_q=n)
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            hidden = self.model(ids, torch.arange(n, device=self.device) % self.max_model_len, meta)
            self.model.compute_logits(hidden[-self.max_batch_size:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.gpu_memory_utilization - others - peak
        num = int(budget // per_block)
        if num < 1:
            raise ConfigError(f"no GPU memory is left for the KV cache (budget {budget / 2**30:.2f} GiB): "
                              "raise --gpu-memory-utilization or use a smaller model")
        return num

    # --- buffers ----------------------------------------------------------------------------
    def _alloc_decode_buffers(self) -> None:
        mb, nb = self.max_batch_size, self.max_blocks_per_seq
        pin = self.is_cuda
        nbytes = _Staging.nbytes(mb, nb)
        # two host staging areas and two sampled-id buffers, alternating between steps (see module doc)
        self._host_staging = [_Staging(torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin), mb, nb)
                              for _ in range(2)]
        self._np_staging = [st.numpy() for st in self._host_staging]
        samples = max(mb, self.config.prefill_max_batch_size)  # prefill samples too
        self.h_sampled = [torch.zeros(samples, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.np_sampled = [t.numpy() for t in self.h_sampled]
        # each row's sampling slot, written like the staging areas (two, alternating) and copied once
        self._h_slot_rows = [torch.zeros(samples, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._np_slot_rows = [t.numpy() for t in self._h_slot_rows]
        self._d_slot_rows = torch.zeros(samples, dtype=torch.long, device=self.device)
        # whether a decode step writes its float32 logits (read at every replay: `_logits_wanted`)
        self._store_logits = torch.ones(1, dtype=torch.int32, device=self.device)
        self._storing_logits = True
        # whether every decode step keeps the logits GEMM's raw output (the decode graphs, once captured):
        # a greedy row under a grammar then reads it, and the float32 logits need not be written for it
        self._raw_for_grammar = False
        if self.is_cuda:
            self.dev_staging = _Staging(torch.zeros(nbytes, dtype=torch.uint8, device=self.device), mb, nb)
            self._events = [torch.cuda.Event() for _ in range(2)]
        else:  # the CPU reads the staging area in place
            self.dev_staging = self._host_staging[0]
            self._host_staging[1] = self._host_staging[0]
            self._np_staging[1] = self._np_staging[0]
            self._events = [None, None]
        # launches so far (prefill ones too): the staging area / sampled-id buffer a launch uses is its number's
        # parity, and a decode launch's number goes to the device in its area's header (`stage_inputs`)
        self._seq = 0
        # the device reads a decode step's inputs from the host areas in the step's first kernel and writes greedy
        # ids back the same way (`kernels.stage_inputs`), instead of copies before and after the step: on CUDA with
        # the Triton kernels, unless ROSE_STAGE_KERNEL=0 (the copies, for A/B measurements) or the check at
        # start-up fails (`_check_stage_kernel`)
        self._stage_kernel = self.is_cuda and self.use_triton and os.environ.get("ROSE_STAGE_KERNEL", "1") != "0"
        self._greedy_to_host = False  # the decode forward writes the greedy ids into `h_sampled` (`_decode_forward`)
        self._published = False  # the step's sampled ids were written into `h_sampled` (`_sampled`)
        self._publish_block = 1 << max(0, self.max_batch_size - 1).bit_length()  # (`publish_ids`: one variant)
        self._input_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (`_copy_decode_inputs`)
        self._rows_copy = None  # `aside_copy.RowsCopy` once made, False where the driver is not there
        self._ids_fetch = None  # `aside_copy.IdsFetch`, the same way (`_fetch`; both from `_make_driver_copies`)
        # request id -> its row in the last decode launch (a PENDING input is read from there), and
        # the dict the next launch fills (the two alternate: nothing is allocated per step)
        self._launch_rows: dict[int, int] = {}
        self._next_launch_rows: dict[int, int] = {}

    def _meta_for(self, batch: int, max_context_len: int) -> AttentionMetadata:
        d = self.dev_staging
        return AttentionMetadata(
            is_prefill=False, slot_mapping=d.slots[:batch], block_tables=d.block_tables[:batch],
            context_lens=d.context_lens[:batch], max_context_len=max_context_len,
            use_triton=self.use_triton, fused_ops=self.use_graphs)

    # --- start-up ---------------------------------------------------------------------------
    def prepare(self, progress: Optional[Callable[[str, int, int], None]] = None) -> dict[str, float]:
        """Compile kernels and capture decode graphs now, so no request pays for them."""
        if not self.is_cuda:
            return self.startup_times
        if progress:
            progress("compile", 0, 1)
        t0 = time.perf_counter()
        self._check_stage_kernel()
        self._warmup_kernels()
        self._warmup_sampler()
        torch.cuda.synchronize(self.device)
        self.startup_times["compile_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._warmup_gemms()
        torch.cuda.synchronize(self.device)
        self.startup_times["gemm_warmup_s"] = time.perf_counter() - t0
        if self.use_graphs:
            t0 = time.perf_counter()
            self._capture_graphs(progress)
            self._raw_for_grammar = all(g.raw is not None for g in self.graphs.values())
            torch.cuda.synchronize(self.device)
            self.startup_times["graph_capture_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            self._capture_prefill_graphs(progress)
            self.startup_times["prefill_graph_capture_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._warmup_grammar_kernels()  # (after the capture: the masked argmax's variant reads the graphs' buffer)
        torch.cuda.synchronize(self.device)
        self.startup_times["compile_s"] += time.perf_counter() - t0
        return self.startup_times

    def _warmup_kernels(self) -> None:
        """Run prefill and eager decode over a few shapes so Triton compiles now (it specialises
        integer arguments on ==1 and divisibility by 16), and a burst of short prompts (the most
        sequences one prefill takes) so the first burst's shapes (its GEMMs' cuBLAS kernels, the
        logits and argmax of that many rows) are loaded before a request waits for them. Writes
        only blocks no request holds yet."""
        bs = self.block_size
        most = min(self.max_batch_size, self.config.prefill_max_batch_size)
        for lens in ([1], [3, 17], [16, 32], [5] * 4, [2] * most):
            lens = [min(n, self.max_model_len) for n in lens[:most]]
            if sum(math.ceil(n / bs) for n in lens) > self.num_blocks:
                continue
            seqs, next_block = [], 0
            for i, n in enumerate(lens):
                s = Sequence(-1 - i, [0] * n, SamplingParams())
                nb = math.ceil(n / bs)
                s.block_table = list(range(next_block, next_block + nb))
                next_block += nb
                seqs.append(s)
            self.execute(StepPlan.prefill(seqs, [len(s) for s in seqs]))
            if not self.use_graphs:
                self.execute(StepPlan.decode(seqs))
            for s in seqs:  # their sampling slots back: every slot is a real request's
                self.release(s)

    @torch.inference_mode()
    def _warmup_gemms(self) -> None:
        """Run every prefill GEMM now at each row count a prefill can have (all up to
        `GEMM_WARMUP_ROWS`, then every 64th up to the prefill budget), and the logits GEMM at each
        count of sampled rows. cuBLAS picks its kernel by the row count, and CUDA loads a kernel's
        module the first time it runs: on the H100, a prefill of a token count not seen before took
        1-9 ms longer than the next one of that count (GPT-2) and up to 50 ms (Llama-3.2-1B), paid
        by the first requests. Each distinct linear layer (weight shape, bias) runs with its bias
        and without (the fused paths add it in a later kernel); the outputs are discarded."""
        budget = max(1, self.config.prefill_max_tokens)
        rows = [*range(1, min(GEMM_WARMUP_ROWS, budget) + 1), *range(GEMM_WARMUP_ROWS + 64, budget + 1, 64)]
        layers = {}
        for mod in self.model.modules():
            if isinstance(mod, torch.nn.Linear):
                layers.setdefault((tuple(mod.weight.shape), mod.weight.dtype, mod.bias is not None), mod)
        for mod in layers.values():
            x = torch.zeros(rows[-1], mod.in_features, dtype=mod.weight.dtype, device=self.device)
            for m in rows:
                torch.nn.functional.linear(x[:m], mod.weight)
                if mod.bias is not None:
                    torch.nn.functional.linear(x[:m], mod.weight, mod.bias)
        most = min(self.max_batch_size, self.config.prefill_max_batch_size)
        h = torch.zeros(most, self.model.output_embedding().shape[1], dtype=self.dtype, device=self.device)
        for m in range(1, most + 1):
            self.model.compute_logits(h[:m])

    def _warmup_sampler(self) -> None:
        """Compile the sampler's Triton kernels now: the first sampled request of a run waited
        about 15 s for them (measured on the H100), and a batch of a size not seen before compiled
        again (a grammar run on the H100 spent 6 s of each run's TTFT so). One batch of each size
        bucket (`sampling.batch_classes`) for sampling alone, with penalties and min_p, and top-p
        alone; the slots are given back."""
        from rosecli.kernels.sampling import batch_classes

        st = self.sampler
        kinds = (SamplingParams(temperature=0.8, top_p=0.95, top_k=50),
                 SamplingParams(temperature=0.8, top_p=0.95, top_k=50, min_p=0.05, repetition_penalty=1.1,
                                presence_penalty=0.5, frequency_penalty=0.5),
                 SamplingParams(temperature=0.8, top_p=0.95))
        most = min(self.num_sampling_slots, max(self.config.max_batch_size, self.config.prefill_max_batch_size))
        sizes = batch_classes(most) if st.use_triton else [1]
        for params in kinds:
            slots = [st.acquire(params, prompt_ids=[0]) for _ in range(max(sizes))]
            try:
                st.flush()
                for B in sizes:
                    logits = torch.randn(B, st.vocab_size, device=self.device)
                    st.sample(logits, torch.tensor(slots[:B], device=self.device))
            except Exception as e:  # a request that samples this way will meet it again, with its own error
                self.log(f"sampler warm-up failed ({type(e).__name__}: {e}); sampled requests compile on first use")
            finally:
                for slot in slots:
                    st.release(slot)
        st.flush()

    def _warmup_grammar_kernels(self) -> None:
        """Compile the kernels of requests under a grammar: the masked argmax of greedy ones (`_masked_greedy_ids`),
        on what it will read (the decode graphs' raw logits GEMM output, or float32 logits), and the bitmask's
        kernel on the float32 logits of sampled ones (`structured.StructuredOutput.apply_filled`)."""
        if not (self.sampler.use_triton and importlib.util.find_spec("xgrammar") is not None):
            return
        from rosecli.kernels.argmax import masked_argmax
        from rosecli.kernels.bitmask import apply_bitmask

        V = self.sampler.vocab_size
        bits = torch.full((2, (V + 31) // 32), -1, dtype=torch.int32, device=self.device)
        logits = torch.randn(2, V, device=self.device)
        if self._raw_for_grammar:
            masked_argmax(self.graphs[max(self.graphs)].raw[:2], bits, n_cols=V)
        else:
            masked_argmax(logits, bits)
        apply_bitmask(logits, bits)

    def _capture_graphs(self, progress) -> None:
        pool = None
        sizes = sorted(self.graph_sizes, reverse=True)
        n = self.max_batch_size
        for st in self._np_staging:
            self._pad_rows(st, 0, n)
            st.block_tables[:n] = 0
        self._copy_decode_inputs(self._host_staging[0], n)
        for done, batch in enumerate(sizes):
            meta = self._meta_for(batch, self.max_model_len)
            with torch.inference_mode():
                self._decode_forward(batch, meta)  # warm up this shape outside the graph
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits, greedy, raw = self._decode_forward(batch, meta)
            if pool is None:
                pool = graph.pool()
            self.graphs[batch] = _DecodeGraph(graph, logits, greedy, raw)
            if progress:
                progress("capture", done + 1, len(sizes))

    def _capture_prefill_graphs(self, progress) -> None:
        """Graphs of small prefills (`prefill_graphs`), with the Triton kernels, on one rank; a capture that fails
        leaves every prefill eager (logged)."""
        if not self.use_triton or self.config.tensor_parallel_size != 1:
            return
        cfg = self.config
        rows = max(cfg.prefill_max_batch_size, cfg.max_batch_size)  # (the scheduler's most sampled rows a prefill)
        pg = prefill_graphs.build(self.model, self.device, self.block_size, cfg.prefill_max_batch_size, rows,
                                  min(cfg.prefill_max_tokens, self.max_model_len))
        if pg is None:
            return
        try:
            pg.capture(progress)
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - eager prefill is always correct
            self.log(f"prefill graph capture failed ({type(e).__name__}: {e}); prefills run eagerly")
            return
        self.prefill_graphs = pg

    # --- execution --------------------------------------------------------------------------
    def _decode_forward(self, batch: int, meta: AttentionMetadata):
        # inside the captured graph: the block tables change every step (a model with its own CPU
        # decode kernel reads the block tables itself)
        if not meta.use_triton and getattr(self.model, "native_decode", lambda: None)() is None:
            meta = with_decode_gather(meta, self.block_size, self.model.num_kv_heads, self.dtype)
        d = self.dev_staging
        if self._stage_kernel:  # (the padded batch's rows: a graph's, or the eager step's)
            self._stage(batch)
        if self._embed_tables is False:  # (once: the tables are the loaded model's for good)
            self._embed_tables = getattr(self.model, "decode_embeddings", lambda: None)() if self.use_triton else None
        tables = self._embed_tables
        if tables is not None:  # one kernel: each row's id (last step's sample or the host's) and its embeddings
            pos = d.positions[:batch]
            embedded = gather_embed(d.tokens, d.src[:batch], tables[0], pos if tables[1] is not None else None,
                                    tables[1])
            hidden = self.model(None, pos, meta, embedded=embedded)
        else:
            input_ids = d.tokens.index_select(0, d.src[:batch])  # last step's samples or the host's ids
            hidden = self.model(input_ids, d.positions[:batch], meta)
        gemm = getattr(self.model, "logits_gemm", None) if self.use_graphs else None
        raw = gemm(hidden, meta.fused_ops) if gemm is not None else None
        self._greedy_to_host = raw is not None and self._stage_kernel
        if raw is not None:  # in the decode graph: one pass makes the float32 logits and the greedy argmax, which
            # its last kernel also writes into the next step's inputs (if every row is greedy), and for the host
            to_host = (self.h_sampled[0], self.h_sampled[1], d.header) if self._greedy_to_host else None
            logits, greedy = logits_argmax(raw, self.model.vocab_size, store_flag=self._store_logits,
                                           copy_to=d.tokens[:batch], to_host=to_host)
        else:
            logits = self.model.compute_logits(hidden)
            greedy = split_argmax(logits) if self.use_graphs else logits.argmax(dim=-1)
            d.tokens[:batch].copy_(greedy)  # the next step's inputs, if every row is greedy
        return logits, greedy, raw

    def _next_buffers(self) -> int:
        """Which staging area / sampled-id buffer this launch uses (the parity of its number, `_seq`); the next
        launch takes the other."""
        self._seq += 1
        return self._seq & 1

    def _stage(self, rows: int) -> None:
        """The decode step's first kernel: its inputs from the host area the device has not staged yet."""
        start, tables = _Staging.copied_span(self.max_batch_size, self.max_blocks_per_seq, 0)
        stage_inputs((self._host_staging[0].buf, self._host_staging[1].buf), self.dev_staging.buf, start, tables,
                     self.max_blocks_per_seq, rows)

    def _check_stage_kernel(self) -> None:
        """Run `stage_inputs` and `publish_ids` once on patterns (compiling them) and keep them only if the device read
        the pinned area and wrote the pinned buffer right (a platform where pinned memory is not mapped into the
        device's address space then copies the inputs and the ids)."""
        if not self._stage_kernel:
            return
        host, dev = self._host_staging[0], self.dev_staging
        start, end = _Staging.copied_span(self.max_batch_size, self.max_blocks_per_seq, 1)
        saved = host.buf.clone()
        host.buf[start:end] = torch.arange(end - start, dtype=torch.int64).remainder(251).to(torch.uint8)
        host.header[:3] = torch.tensor([0, 1, self.max_blocks_per_seq])  # (both areas' seq 0: the first is read)
        try:
            self._stage(1)
            ok = torch.equal(dev.buf[start:end].cpu(), host.buf[start:end])
            why = "the device read other bytes than the host wrote"
            ids = torch.arange(3, 3 + self.max_batch_size, device=self.device)  # (and the sampler's way back, compiled)
            publish_ids(ids, dev.tokens, (self.h_sampled[0], self.h_sampled[1]), dev.header, self._publish_block)
            torch.cuda.synchronize(self.device)
            if ok and not torch.equal(self.h_sampled[0][:len(ids)], ids.cpu()):
                ok, why = False, "the device's writes did not reach the host's buffer"
        except Exception as e:  # noqa: BLE001 - the copies are always correct
            ok, why = False, f"{type(e).__name__}: {e}"
        torch.cuda.synchronize(self.device)
        host.buf.copy_(saved)
        dev.buf.zero_()
        if not ok:
            self._stage_kernel = False
            self.log(f"decode inputs: the device cannot read pinned host memory here ({why}); they are copied")

    def _copy_decode_inputs(self, staging: _Staging, rows: int, blocks: Optional[int] = None) -> None:
        """Host to device: host ids through the first ``rows`` block-table rows, of which only the first
        ``blocks`` columns when given (the step's contexts span no more: the kernels read no further).
        Through the driver (`aside_copy.RowsCopy`) when it loads, else one torch copy of whole rows."""
        if not self.is_cuda:
            return
        if blocks is not None and self._rows_copy is not False:
            if self._rows_copy is None:
                self._make_driver_copies()
            if self._rows_copy and self._rows_copy(staging.buf, rows, 4 * min(blocks, self.max_blocks_per_seq)):
                return
            self._rows_copy = False  # (torch's copy from now on)
        key = (id(staging), rows)
        views = self._input_views.get(key)
        if views is None:  # (two slices per step cost the host more than this lookup)
            start, end = _Staging.copied_span(self.max_batch_size, self.max_blocks_per_seq, rows)
            views = self._input_views[key] = (self.dev_staging.buf[start:end], staging.buf[start:end])
        views[0].copy_(views[1], non_blocking=True)

    def _make_driver_copies(self) -> None:
        """`aside_copy.RowsCopy` and `aside_copy.IdsFetch` on the step's stream, for whichever of `_rows_copy` /
        `_ids_fetch` is not decided yet; False where the driver is not there (torch's copies)."""
        from rosecli.engine import aside_copy

        lib = aside_copy.driver()
        stream = self._step_stream()
        if self._rows_copy is None:
            mb, nb = self.max_batch_size, self.max_blocks_per_seq
            start, end = _Staging.copied_span(mb, nb, 0)  # (no block-table row: where the tables start)
            self._rows_copy = lib is not None and aside_copy.RowsCopy(lib, self.dev_staging.buf, start, end, 4 * nb,
                                                                      stream.cuda_stream)
        if self._ids_fetch is None:
            if lib is not None:
                for event in self._events:  # (torch makes an event on its first record)
                    event.record(stream)
            self._ids_fetch = lib is not None and aside_copy.IdsFetch(lib, self.h_sampled, self._events,
                                                                      stream.cuda_stream)

    def _step_stream(self) -> torch.cuda.Stream:
        if self._stream is None:  # (`record()` looks the current stream up: ~30 us of a step's host time)
            self._stream = torch.cuda.current_stream(self.device)
        return self._stream

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks ``src -> dst`` in every layer (the choices of an ``n`` > 1 request each
        get their own copy of the prompt's last, partly filled block)."""
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long).to(self.device)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long).to(self.device)
        for attn in self.model.attention_layers():
            for cache in (attn.k_cache, attn.v_cache):
                cache.index_copy_(0, dst, cache.index_select(0, src))

    def _pad_rows(self, st: _Staging, start: int, end: int) -> None:
        """Padding rows of a graph's batch: a dummy token, no KV store, a one-token context."""
        mb = self.max_batch_size
        st.src[start:end] = np.arange(mb + start, mb + end)
        st.host_ids[start:end] = 0
        st.positions[start:end] = 0
        st.slots[start:end] = -1
        st.context_lens[start:end] = 1

    def padded_batch(self, batch: int) -> int:
        for size in self.graph_sizes:
            if size >= batch:
                return size
        return batch

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[Optional[int]]:
        """Run a step and return the token sampled for every sequence whose computation reached
        its end (None for a chunk of a longer prompt)."""
        if plan.is_prefill:
            return self._execute_prefill(plan)
        return self.collect(self.launch_decode(plan))

    @torch.inference_mode()
    def launch_decode(self, plan: StepPlan) -> DecodeLaunch:
        """Launch a decode step without waiting for it.

        A sequence whose last token is `PENDING` must have been in the previous launch; its input
        id is that launch's sample, read on the device."""
        stages = self.stages
        seqs = plan.seqs
        batch = len(seqs)
        if batch > self.max_batch_size:
            raise ValueError(f"decode batch {batch} exceeds max_batch_size {self.max_batch_size}")
        graph = self.graphs.get(self.padded_batch(batch)) if self.graphs else None
        rows = self.padded_batch(batch) if graph is not None else batch
        flip = self._next_buffers()
        host = self._host_staging[flip]
        bs = self.block_size
        mb = self.max_batch_size
        last_rows, launch_rows = self._launch_rows, self._next_launch_rows
        launch_rows.clear()
        with stages.range("prepare_inputs", batch):
            slots_of = self._slots
            st = self._np_staging[flip]
            src, ids, pos, slots, ctx = st.row_views
            bt = st.block_tables
            max_ctx = 1
            ctx_total = 0
            row_tables = st.row_tables
            for i, s in enumerate(seqs):
                tokens = s.token_ids
                n = len(tokens)
                p = n - 1
                tok = tokens[p]
                rid = s.request_id
                if rid not in slots_of:  # (before the forward: its sampling decides `_logits_wanted`)
                    self._acquire(s)
                if tok == PENDING:
                    row = last_rows.get(rid)
                    if row is None:
                        raise RuntimeError(f"request {rid}: its pending token is not from the last step")
                    src[i] = row
                else:
                    src[i] = mb + i
                    ids[i] = tok
                launch_rows[rid] = i
                table = s.block_table
                pos[i] = p
                slots[i] = table[p // bs] * bs + p % bs  # (`slot_of`, inline)
                ctx[i] = n
                ctx_total += n
                if row_tables[i] is not table:  # a row is rewritten only when its table was replaced
                    bt[i, :len(table)] = table
                    row_tables[i] = table
                if n > max_ctx:
                    max_ctx = n
            if self._special:  # a row samples: each row's sampling slot goes with the inputs (`_sample_ids`)
                samp = st.sample_slots
                for i, s in enumerate(seqs):
                    samp[i] = slots_of[s.request_id]
            if rows > batch:
                self._pad_rows(st, batch, rows)
        self.decode_steps += 1
        self.decode_sequences += batch
        self.decode_context_tokens += ctx_total
        self._launch_rows, self._next_launch_rows = launch_rows, last_rows
        with stages.range("h2d_copy", rows):
            blocks = -(-max_ctx // bs)
            if self._stage_kernel:  # the step's first kernel reads them: the header says what, its number last
                header = st.header
                header[1] = rows
                header[2] = min(blocks, self.max_blocks_per_seq)
                header[0] = self._seq
            else:
                self._copy_decode_inputs(host, rows, blocks)
            self._logits_wanted()
        with stages.range("decode_forward", rows):
            if graph is not None:
                graph.graph.replay()
                logits, greedy, raw = graph.logits[:batch], graph.greedy[:batch], graph.raw
            else:
                logits, greedy, raw = self._decode_forward(batch, self._meta_for(batch, max_ctx))
        with stages.range("sampling", batch):
            ids_dev = self._sample(seqs, logits, greedy, flip, static=graph is not None, last_rows=last_rows,
                                   raw=raw, staged=True)
            if ids_dev is greedy:
                self._ids_on_host = self._greedy_to_host  # (the forward's argmax wrote them into `h_sampled`)
            elif self._published:  # (so did the sampler's last kernel, and into the token pool)
                self._ids_on_host = True
            elif ids_dev.data_ptr() != self.dev_staging.tokens.data_ptr():
                self.dev_staging.tokens[:batch].copy_(ids_dev)
        return DecodeLaunch(seqs, *self._fetch(ids_dev, batch, flip))

    def _logits_wanted(self) -> None:
        """Set the device flag that makes the decode step write its float32 logits: while any admitted request
        samples or asked for logprobs. While every one is plain greedy, the model's argmax is all a step needs,
        and the logits' write (4 bytes per vocabulary entry and row: 13 MB for GPT-2 at 64 rows, 33 MB for
        Llama 3) is skipped; a greedy one under a grammar needs them only where the decode graphs keep no raw
        logits GEMM output for its masked argmax to read (`_raw_for_grammar`). The flag changes only when that
        set does, by a one-element fill on the step's stream before the step."""
        want = bool(self._special or self._logprob_ids or (self._masked_greedy and not self._raw_for_grammar))
        if want != self._storing_logits:
            self._store_logits.fill_(int(want))
            self._storing_logits = want

    def decode_counts(self) -> tuple[int, int, int]:
        """(decode steps launched, sequences they decoded, those sequences' context tokens), summed
        since start-up: two snapshots' difference is what the steps between them read."""
        return self.decode_steps, self.decode_sequences, self.decode_context_tokens

    def collect(self, launch: DecodeLaunch) -> list[int]:
        """Wait for a launched decode step and return its sampled ids, one per sequence."""
        with self.stages.range("d2h_copy", len(launch.seqs)):
            if launch.event is not None:
                launch.event.synchronize()
            ids = launch.out[:len(launch.seqs)].tolist()
            if launch.lp is not None:
                rows, ks, host = launch.lp
                entries = unpack(host, [ids[i] for i in rows], ks)
                launch.logprobs = {launch.seqs[i].request_id: e for i, e in zip(rows, entries)}
            return ids

    @torch.inference_mode()
    def rerun_decode(self, batch: int, max_context_len: int, eager: bool = False) -> bool:
        """Run the model forward of the last decode launch (``batch`` sequences, the longest of
        ``max_context_len`` tokens) again on the inputs staged for it, without sampling or copying
        anything back: to measure a decode step's device time and see its kernels (``rose profile
        --decode-step``). Replays the launch's CUDA graph unless ``eager`` or none was captured;
        returns whether it replayed one. The same inputs write the same KV and the same greedy ids,
        so greedy requests go on unchanged; sampled ones must be discarded afterwards."""
        graph = None if eager else self.graphs.get(self.padded_batch(batch))
        if graph is not None:
            graph.graph.replay()
        else:
            self._decode_forward(batch, self._meta_for(batch, max_context_len))
        return graph is not None

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, greedy: Optional[torch.Tensor],
                flip: int, static: bool = False, last_rows: Optional[dict] = None,
                raw: Optional[torch.Tensor] = None, staged: bool = False) -> torch.Tensor:
        """The batch's next ids on the device (every request holds its sampling slot: the callers
        `_acquire` it before its first sampled token); while every admitted request is plain greedy, the
        model's argmax (computed inside the decode graph) is the answer and the sampler is not called.
        ``static``: ``logits`` is a graph's output buffer (a decode graph's, or with ``staged`` false a prefill
        graph's), so the sampler's kernels can be a graph of their own. ``raw``: the decode step's logits GEMM output
        (`_DecodeGraph`), where it kept one. ``staged``: a decode step, whose rows' sampling slots went to the device
        with its inputs."""
        lp = self._raw_logprobs(seqs, logits) if self._logprob_ids else None
        ids = self._sample_ids(seqs, logits, greedy, flip, static, last_rows, raw, staged)
        if lp is not None:
            rows, ks, rows_t, lp = lp
            self._lp_step = (rows, ks, pick(lp, ids if rows_t is None else ids.index_select(0, rows_t), max(ks)))
        return ids

    def _raw_logprobs(self, seqs: list[Sequence], logits: torch.Tensor):
        """log_softmax of the raw logits of the rows whose request asked for logprobs (taken before
        the sampler changes the logits in place): (rows, their k, rows on the device or None for
        all, [R, V]); None when no row asked."""
        asked = self._logprob_ids
        rows = [i for i, s in enumerate(seqs) if s.request_id in asked]
        if not rows:
            return None
        ks = [seqs[i].params.logprobs for i in rows]
        if len(rows) == len(seqs):
            return rows, ks, None, row_logprobs(logits)
        rows_t = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=self.is_cuda)
        return rows, ks, rows_t, row_logprobs(logits.index_select(0, rows_t))

    def _sample_ids(self, seqs: list[Sequence], logits: torch.Tensor, greedy: Optional[torch.Tensor],
                    flip: int, static: bool, last_rows: Optional[dict] = None,
                    raw: Optional[torch.Tensor] = None, staged: bool = False) -> torch.Tensor:
        self._published = False
        if not self._special:
            # greedy rows under a grammar: their masked logits' argmax; the other rows' masks are
            # all ones, so their argmax is the model's (no sampler kernels for anyone)
            if self._masked_greedy and self.structured.fill(
                    seqs, self._pending_reader(last_rows, flip ^ 1), PENDING) is not None:
                # (its graphs replay on the decode graphs' buffers: a decode step's only)
                return self._masked_greedy_ids(logits, static and staged, flip, raw if self._raw_for_grammar else None)
            return greedy if greedy is not None else logits.argmax(dim=-1)
        slots = self._slots
        st = self.sampler
        batch = len(seqs)
        if staged:  # (`launch_decode` wrote them beside the step's inputs)
            d = self.dev_staging.sample_slots[:batch]
        else:
            h = self._np_slot_rows[flip]
            for i, s in enumerate(seqs):
                h[i] = slots[s.request_id]
            d = self._d_slot_rows[:batch]
            d.copy_(self._h_slot_rows[flip][:batch], non_blocking=self.is_cuda)
        if self.structured is not None and self.structured.active:  # grammar rows: masked in place, eagerly
            self.structured.mask_logits(seqs, logits, self._pending_reader(last_rows, flip ^ 1), PENDING)
        st.flush()
        # a decode step's ids go to the next step's token pool and the host from the sampler's last kernel
        publish = staged and self._stage_kernel
        if not (static and self.use_graphs):
            return self._sampled(st.sample(logits, d).token_ids, publish)
        graphs, cap = ((self._sampler_graphs, MAX_SAMPLER_GRAPHS) if staged
                       else (self._prefill_sampler_graphs, MAX_PREFILL_SAMPLER_GRAPHS))
        key = (logits.data_ptr(), batch, st.variant())
        g = graphs.get(key, False)
        if g:
            g.graph.replay()
            self._published = publish
            return g.ids
        ids = self._sampled(st.sample(logits, d).token_ids, publish)  # also loads the kernels for the capture
        if g is False and len(graphs) < cap:
            graphs[key] = self._capture_sampler(logits, d, publish)
        return ids

    def _sampled(self, ids: torch.Tensor, publish: bool) -> torch.Tensor:
        """The sampler's ids, and with ``publish`` also in the token pool and the step's host buffer (`publish_ids`)."""
        if publish:
            publish_ids(ids, self.dev_staging.tokens, (self.h_sampled[0], self.h_sampled[1]), self.dev_staging.header,
                        self._publish_block)
            self._published = True
        return ids

    def _masked_greedy_ids(self, logits: torch.Tensor, static: bool, flip: int,
                           raw: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The argmax of ``logits`` under the bitmask the structured output's last fill wrote. On
        CUDA one masked argmax (`kernels.argmax.masked_argmax`: the logits are not rewritten), which reads
        ``raw`` (the logits GEMM's output: the same values in the weights' dtype) where given;
        from a decode graph's logits, the bitmask's copy to the device, the argmax and the ids' copy
        back to the host (``flip``'s buffer, for `_fetch`) are a graph of their own (one launch: the
        host's time per step is what a grammar step costs), which writes the ids straight into the
        token pool the next decode step reads."""
        so = self.structured
        B = logits.shape[0]
        n_cols = None if raw is None else self.sampler.vocab_size
        if not (self.is_cuda and self.use_triton):
            x = logits if raw is None else raw[:B, :n_cols].float()
            so.apply_filled(x)
            return x.argmax(dim=-1)
        from rosecli.kernels.argmax import masked_argmax

        if not (static and self.use_graphs):
            return masked_argmax(logits if raw is None else raw[:B], so.stage_bitmask(B), n_cols)
        # the bitmask's copy: on a side stream beside the forward (~16 us of the device's time for 64
        # rows of GPT-2's vocabulary) when the driver's API makes it cheap for the host, else inside the graph
        aside = so.aside_is_cheap if MASK_COPY_ASIDE is None else MASK_COPY_ASIDE
        key = (B, so.filled_index(), aside, flip)
        hit = self._masked_replays.get(key)
        if hit is not None:  # (the usual step: one lookup and one replay)
            graph, ids, rows = hit
            if aside:
                so.stage_bitmask(rows, aside=True)
            graph.replay()
            self._ids_on_host = True
            return ids
        rows = self.padded_batch(B)  # the graph's whole logits buffer: one capture per graph size
        full = self.graphs[rows].logits if raw is None else self.graphs[rows].raw
        out = self.dev_staging.tokens[:rows]
        bits = so.stage_bitmask(rows, aside=aside)
        masked_argmax(full, bits, n_cols, out=out)  # this step's answer; loads the kernels
        if len(self._masked_replays) < MAX_SAMPLER_GRAPHS:
            def step() -> torch.Tensor:
                masked_argmax(full, bits if aside else so.stage_bitmask(rows), n_cols, out=out)
                return self.h_sampled[flip][:rows].copy_(out, non_blocking=True)  # (`_fetch` need not)

            g = self._capture(step)
            if g is not None:
                self._masked_replays[key] = (g.graph, out[:B], rows)
        return out[:B]

    def _pending_reader(self, last_rows: Optional[dict], prev_flip: int) -> Callable[[int], int]:
        """request id -> the token the previous decode launch sampled for it (overlap: not read back
        by the scheduler yet); the first call waits for that launch, whose copy was queued before
        this step's forward (once a step, not once a row)."""
        event = self._events[prev_flip]
        sampled = self.np_sampled[prev_flip]
        values: Optional[list] = None

        def read(request_id: int) -> int:
            nonlocal values
            if values is None:
                if event is not None:
                    event.synchronize()
                values = sampled.tolist()  # (one conversion: a numpy scalar per row costs more)
            return values[last_rows[request_id]]

        return read

    def _capture_sampler(self, logits: torch.Tensor, slots: torch.Tensor, publish: bool) -> Optional[_SamplerGraph]:
        """Record `SamplerState.sample` (and `publish_ids`) on these (static) buffers; recording runs nothing,
        so the sampler's state (counts, steps) is not touched."""
        return self._capture(lambda: self._sampled(self.sampler.sample(logits, slots).token_ids, publish))

    def _capture(self, fn: Callable[[], torch.Tensor]) -> Optional[_SamplerGraph]:
        """A graph of ``fn`` (sampling kernels on static buffers) and the ids tensor it returns.
        None if the capture fails (that key then samples eagerly; the failure is logged once)."""
        try:
            if self._sampler_pool is None:
                self._sampler_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self._sampler_pool):
                ids = fn()
            return _SamplerGraph(graph, ids)
        except Exception as e:  # noqa: BLE001 - eager sampling is always correct
            if not any(v is None for v in (*self._sampler_graphs.values(), *self._prefill_sampler_graphs.values())):
                self.log(f"sampler graph capture failed ({type(e).__name__}: {e}); sampling runs eagerly")
            return None

    def _acquire(self, seq: Sequence) -> None:
        p = seq.params
        vocab = self.sampler.vocab_size  # a stop id past the vocabulary can never be sampled: nothing to hold back
        stop_ids = [t for t in (list(self.eos_token_ids) if p.stop_on_eos else []) + list(p.stop_token_ids)
                    if t < vocab]
        out = [t for t in seq.output_token_ids if t != PENDING]
        self._slots[seq.request_id] = self.sampler.acquire(p, prompt_ids=seq.token_ids[:seq.num_prompt_tokens],
                                                           output_ids=out, stop_ids=stop_ids)
        if not _plain_greedy(p, bool(stop_ids)):
            self._special.add(seq.request_id)
        elif getattr(p, "structured", None) is not None:  # greedy under a grammar: the masked logits' argmax
            self._masked_greedy.add(seq.request_id)
        if p.logprobs is not None:
            self._logprob_ids.add(seq.request_id)

    def _fetch(self, ids: torch.Tensor, batch: int, flip: int):
        """Start the device-to-host copy of sampled ids (and of the step's logprobs, if a row
        asked); returns (numpy view, event or None, logprobs (rows, ks, host tensor) or None)."""
        lp, self._lp_step = self._lp_step, None
        if not self.is_cuda:
            out = self.np_sampled[flip]
            out[:batch] = ids.numpy()
            return out, None, lp
        if lp is not None:
            rows, ks, packed = lp
            if self._h_lp[flip] is None:
                self._h_lp[flip] = torch.empty(len(self.h_sampled[flip]) * (1 + 2 * MAX_LOGPROBS),
                                               dtype=torch.float32, pin_memory=True)
            host = self._h_lp[flip][:packed.numel()].view(packed.shape)
            host.copy_(packed, non_blocking=True)
            lp = (rows, ks, host)
        copied = self._ids_on_host  # (the masked-argmax graph copied them)
        self._ids_on_host = False
        if self._ids_fetch is None:
            self._make_driver_copies()
        fetch = self._ids_fetch
        event = self._events[flip]
        # the ids' copy and the event through the driver: two calls in place of torch's copy_ and record
        if not (fetch and ids.dtype == torch.long and ids.is_contiguous()
                and fetch(None if copied else ids, batch, flip)):
            if not copied:
                self.h_sampled[flip][:batch].copy_(ids, non_blocking=True)
            event.record(self._step_stream())
        return self.np_sampled[flip], event, lp

    def _execute_prefill(self, plan: StepPlan) -> list[Optional[int]]:
        stages = self.stages
        bs = self.block_size
        seqs, num_new_tokens = plan.seqs, plan.num_new_tokens
        forks = plan.forks or {}
        picked: list[Sequence] = []
        out_at: list[int] = []  # where each sampled token goes: seqs' places, then the forks' in order
        n_forks = 0
        with stages.range("prepare_inputs", sum(num_new_tokens)):
            input_ids: list[int] = []
            positions: list[int] = []
            slots: list[int] = []
            cu = [0]
            ctx_lens: list[int] = []
            last_rows: list[int] = []
            has_prefix = False
            for i, (s, n) in enumerate(zip(seqs, num_new_tokens)):
                start = s.num_computed_tokens
                end = start + n
                has_prefix |= start > 0
                input_ids.extend(s.token_ids[start:end])
                positions.extend(range(start, end))
                slots += slots_of(s.block_table, start, end, bs)
                cu.append(cu[-1] + n)
                ctx_lens.append(end)
                if end == len(s.token_ids):
                    last_rows.append(cu[-1] - 1)
                    picked.append(s)
                    out_at.append(i)
                    for f in forks.get(i, ()):  # the request's other choices sample from the same logits
                        last_rows.append(cu[-1] - 1)
                        picked.append(f)
                        n_forks += 1
                        out_at.append(len(seqs) + n_forks - 1)
            width = max(len(s.block_table) for s in seqs)
            tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
            wants_plp = any(s.params.prompt_logprobs is not None and not s.num_output_tokens for s in seqs)
        pg = self.prefill_graphs
        size = None if pg is None or wants_plp else pg.pick(len(input_ids), len(seqs), len(last_rows), width)
        self.prompt_logprobs, self.prefill_logprobs = {}, {}
        out: list[Optional[int]] = [None] * (len(seqs) + n_forks)
        if size is not None:  # a small prefill: its graph (the input copy counts as the forward's)
            with stages.range("prefill_forward", len(input_ids)):
                logits = pg.run(size, input_ids, positions, slots, cu, ctx_lens, tables, last_rows)
            if not picked:
                return out
        else:
            with stages.range("h2d_copy", len(input_ids)):
                dev = self.device
                meta = AttentionMetadata(
                    is_prefill=True,
                    slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
                    block_tables=torch.tensor(tables, dtype=torch.int32).to(dev, non_blocking=True),
                    context_lens=torch.tensor(ctx_lens, dtype=torch.int32).to(dev, non_blocking=True),
                    max_context_len=max(ctx_lens), use_triton=self.use_triton,
                    cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(dev, non_blocking=True),
                    max_seqlen_q=max(num_new_tokens), has_prefix=has_prefix)
                ids_t = torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True)
                pos_t = torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True)
            with stages.range("prefill_forward", len(input_ids)):
                hidden = self.model(ids_t, pos_t, meta)
                for i, (s, n) in enumerate(zip(seqs, num_new_tokens)):
                    if s.params.prompt_logprobs is not None and not s.num_output_tokens:  # (not when recomputed)
                        self._prompt_logprobs(s, s.num_computed_tokens, n, cu[i], hidden)
                if not picked:
                    return out
                rows = torch.tensor(last_rows, dtype=torch.long).to(dev, non_blocking=True)
                logits = self.model.compute_logits(hidden.index_select(0, rows))
        flip = self._next_buffers()
        with self.stages.range("sampling", len(picked)):
            for s in picked:
                if s.request_id not in self._slots:
                    self._acquire(s)
            # a prefill graph's logits are its own buffer: the sampler's kernels replay as a graph of their own
            ids = self._sample(picked, logits, None, flip, static=size is not None)
        launch = DecodeLaunch(picked, *self._fetch(ids, len(picked), flip))
        sampled = self.collect(launch)
        self.prefill_logprobs = launch.logprobs or {}
        for at, tok in zip(out_at, sampled):
            out[at] = tok
        return out

    def _prompt_logprobs(self, seq: Sequence, start: int, n: int, first_row: int, hidden: torch.Tensor) -> None:
        """The logprobs of the prompt tokens this chunk's logits predict (positions ``start + 1`` up
        to the prompt's last), into ``prompt_logprobs``."""
        first, last = start + 1, min(start + n, seq.num_prompt_tokens - 1)
        if first > last:
            return
        rows = [first_row + t - 1 - start for t in range(first, last + 1)]
        entries = prompt_logprobs(hidden, self.model.compute_logits, rows, seq.token_ids[first:last + 1],
                                  seq.params.prompt_logprobs)
        self.prompt_logprobs[seq.request_id] = (first, entries)

    def add_request(self, seq: Sequence) -> None:
        """Check what the sampler will be given when the request is added, so that a bad value
        fails that request alone, not a batched step (its slot is taken at its first token)."""
        vocab = self.sampler.vocab_size
        p = seq.params
        for name in ("logit_bias", "allowed_token_ids"):
            bad = [t for t in getattr(p, name, None) or () if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})", name)
        if p.allowed_token_ids and p.min_tokens:  # (else its first tokens would have no token left to take)
            held = set(p.stop_token_ids) | (set(self.eos_token_ids) if p.stop_on_eos else set())
            if held.issuperset(p.allowed_token_ids):
                raise RequestError("allowed_token_ids holds only end-of-sequence and stop tokens, which min_tokens "
                                   "holds back: no token could be generated", "allowed_token_ids")
        spec = getattr(seq.params, "structured", None)
        if spec is not None:
            if self.structured is None:
                from rosecli.engine.structured import INSTALL_HINT

                raise RequestError(INSTALL_HINT, spec.param)
            self.structured.add(seq.request_id, spec)  # compiled (or cached) here: a bad grammar fails alone

    def release(self, seq: Sequence) -> None:
        """Forget per-request state (its sampling slot) once the request is done."""
        slot = self._slots.pop(seq.request_id, None)
        if slot is not None:
            self.sampler.release(slot)
        self._special.discard(seq.request_id)
        self._masked_greedy.discard(seq.request_id)
        self._logprob_ids.discard(seq.request_id)
        if self.structured is not None:
            self.structured.release(seq.request_id)

    def close(self) -> None:
        self.graphs.clear()
        self.prefill_graphs = None
        self._sampler_graphs.clear()
        self._prefill_sampler_graphs.clear()
        self._masked_replays.clear()
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = None
        if self.is_cuda:
            torch.cuda.empty_cache()
