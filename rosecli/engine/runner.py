"""The model runner: turns a scheduled batch into tensors, runs the model, samples.

Decode writes the batch metadata into pinned host buffers (numpy views, no tensor built per
step), copies them with ``non_blocking=True`` into static device buffers, and replays the CUDA
graph captured for the batch's padded size. Sampled ids come back with one device-to-host
copy per step. Prefill runs eagerly (variable shapes).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

import numpy as np
import torch

from rosecli.engine.attention import AttentionMetadata, with_decode_gather
from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.errors import ConfigError
from rosecli.engine.kv_cache import allocate_kv_cache, kv_bytes_per_block
from rosecli.engine.sampler import sample
from rosecli.engine.sequence import Sequence
from rosecli.engine.stages import Stages

CPU_DEFAULT_KV_TOKENS = 8192


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to ``max_batch_size`` (which is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 8))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


class _DecodeGraph:
    __slots__ = ("graph", "logits", "greedy")

    def __init__(self, graph, logits, greedy):
        self.graph, self.logits, self.greedy = graph, logits, greedy


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
        self.use_triton = bool(config.paged_attn if config.paged_attn is not None else self.is_cuda) and self.is_cuda
        self.use_graphs = bool(config.cuda_graph if config.cuda_graph is not None else self.is_cuda) and self.is_cuda
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(config.seed)
        self._seq_generators: dict[int, torch.Generator] = {}
        self.num_blocks = self._decide_num_blocks()
        self.kv_pool = allocate_kv_cache(model, self.num_blocks, self.block_size, dtype, device)
        self._alloc_decode_buffers()
        self.graphs: dict[int, _DecodeGraph] = {}
        self.graph_sizes: list[int] = graph_batch_sizes(self.max_batch_size) if self.use_graphs else []
        self.startup_times: dict[str, float] = {}

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

        def host(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self.h_input_ids = host(mb, torch.long)
        self.h_positions = host(mb, torch.long)
        self.h_slots = host(mb, torch.long)
        self.h_context_lens = host(mb, torch.int32)
        self.h_block_tables = host((mb, nb), torch.int32)
        self.h_sampled = host(max(mb, self.config.prefill_max_batch_size), torch.long)  # prefill samples too
        self.np_input_ids = self.h_input_ids.numpy()
        self.np_positions = self.h_positions.numpy()
        self.np_slots = self.h_slots.numpy()
        self.np_context_lens = self.h_context_lens.numpy()
        self.np_block_tables = self.h_block_tables.numpy()
        self.np_sampled = self.h_sampled.numpy()
        if self.is_cuda:
            dev = self.device
            self.d_input_ids = torch.zeros(mb, dtype=torch.long, device=dev)
            self.d_positions = torch.zeros(mb, dtype=torch.long, device=dev)
            self.d_slots = torch.zeros(mb, dtype=torch.long, device=dev)
            self.d_context_lens = torch.zeros(mb, dtype=torch.int32, device=dev)
            self.d_block_tables = torch.zeros((mb, nb), dtype=torch.int32, device=dev)
        else:
            self.d_input_ids, self.d_positions, self.d_slots = self.h_input_ids, self.h_positions, self.h_slots
            self.d_context_lens, self.d_block_tables = self.h_context_lens, self.h_block_tables
        self._decode_meta: dict[int, AttentionMetadata] = {}
        self._row_version = [-1] * mb  # table_version of the block table each staging row holds

    def _meta_for(self, batch: int, max_context_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False, slot_mapping=self.d_slots[:batch], block_tables=self.d_block_tables[:batch],
            context_lens=self.d_context_lens[:batch], max_context_len=max_context_len,
            use_triton=self.use_triton)

    # --- start-up ---------------------------------------------------------------------------
    def prepare(self, progress: Optional[Callable[[str, int, int], None]] = None) -> dict[str, float]:
        """Compile kernels and capture decode graphs now, so no request pays for them."""
        if not self.is_cuda:
            return self.startup_times
        t0 = time.perf_counter()
        self._warmup_kernels()
        torch.cuda.synchronize(self.device)
        self.startup_times["compile_s"] = time.perf_counter() - t0
        if self.use_graphs:
            t0 = time.perf_counter()
            self._capture_graphs(progress)
            torch.cuda.synchronize(self.device)
            self.startup_times["graph_capture_s"] = time.perf_counter() - t0
        return self.startup_times

    def _warmup_kernels(self) -> None:
        """Run prefill and eager decode over a few shapes so Triton compiles now (it specialises
        integer arguments on ==1 and divisibility by 16). Writes only blocks no request holds yet."""
        bs = self.block_size
        most = min(self.max_batch_size, self.config.prefill_max_batch_size)
        for lens in ([1], [3, 17], [16, 32], [5] * 4):
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
            self.execute(seqs, [len(s) for s in seqs], is_prefill=True)
            if not self.use_graphs:
                self.execute(seqs, [1] * len(seqs), is_prefill=False)

    def _capture_graphs(self, progress) -> None:
        pool = None
        sizes = sorted(self.graph_sizes, reverse=True)
        n = self.max_batch_size
        self.np_input_ids[:n] = 0
        self.np_positions[:n] = 0
        self.np_slots[:n] = -1
        self.np_context_lens[:n] = 1
        self.np_block_tables[:n] = 0
        self._copy_decode_inputs(n)
        for done, batch in enumerate(sizes):
            meta = self._meta_for(batch, self.max_model_len)
            self._decode_meta[batch] = meta
            with torch.inference_mode():
                self._decode_forward(batch, meta)  # warm up this shape outside the graph
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits, greedy = self._decode_forward(batch, meta)
            if pool is None:
                pool = graph.pool()
            self.graphs[batch] = _DecodeGraph(graph, logits, greedy)
            if progress:
                progress("capture", done + 1, len(sizes))

    # --- execution --------------------------------------------------------------------------
    def _decode_forward(self, batch: int, meta: AttentionMetadata):
        if not meta.use_triton:  # inside the captured graph: the block tables change every step
            meta = with_decode_gather(meta, self.block_size, self.dtype)
        hidden = self.model(self.d_input_ids[:batch], self.d_positions[:batch], meta)
        logits = self.model.compute_logits(hidden)
        return logits, logits.argmax(dim=-1)

    def _copy_decode_inputs(self, rows: int) -> None:
        if not self.is_cuda:
            return
        self.d_input_ids[:rows].copy_(self.h_input_ids[:rows], non_blocking=True)
        self.d_positions[:rows].copy_(self.h_positions[:rows], non_blocking=True)
        self.d_slots[:rows].copy_(self.h_slots[:rows], non_blocking=True)
        self.d_context_lens[:rows].copy_(self.h_context_lens[:rows], non_blocking=True)
        self.d_block_tables[:rows].copy_(self.h_block_tables[:rows], non_blocking=True)

    def padded_batch(self, batch: int) -> int:
        for size in self.graph_sizes:
            if size >= batch:
                return size
        return batch

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_new_tokens: list[int], is_prefill: bool) -> list[Optional[int]]:
        """Compute ``num_new_tokens[i]`` tokens of each sequence (all 1 for decode) and return the
        token sampled for every sequence whose computation reached its end (None otherwise)."""
        if is_prefill:
            return self._execute_prefill(seqs, num_new_tokens)
        return self._execute_decode(seqs)

    def _execute_decode(self, seqs: list[Sequence]) -> list[Optional[int]]:
        stages = self.stages
        batch = len(seqs)
        if batch > self.max_batch_size:
            raise ValueError(f"decode batch {batch} exceeds max_batch_size {self.max_batch_size}")
        graph = self.graphs.get(self.padded_batch(batch)) if self.graphs else None
        rows = self.padded_batch(batch) if graph is not None else batch
        bs = self.block_size
        with stages.range("prepare_inputs", batch):
            ids, pos, slots, ctx, bt = (self.np_input_ids, self.np_positions, self.np_slots,
                                        self.np_context_lens, self.np_block_tables)
            max_ctx = 1
            row_version = self._row_version
            for i, s in enumerate(seqs):
                n = len(s.token_ids)
                p = n - 1
                table = s.block_table
                ids[i] = s.token_ids[p]
                pos[i] = p
                slots[i] = table[p // bs] * bs + p % bs
                ctx[i] = n
                if row_version[i] != s.table_version:  # rows are rewritten only when a table changed
                    bt[i, :len(table)] = table
                    row_version[i] = s.table_version
                if n > max_ctx:
                    max_ctx = n
            if rows > batch:
                ids[batch:rows] = 0
                pos[batch:rows] = 0
                slots[batch:rows] = -1
                ctx[batch:rows] = 1
        with stages.range("h2d_copy", rows):
            self._copy_decode_inputs(rows)
        with stages.range("decode_forward", rows):
            if graph is not None:
                graph.graph.replay()
                logits, greedy = graph.logits[:batch], graph.greedy[:batch]
            else:
                logits, greedy = self._decode_forward(batch, self._meta_for(batch, max_ctx))
        return self._sample_and_fetch(seqs, logits, greedy)

    def _execute_prefill(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list[Optional[int]]:
        stages = self.stages
        bs = self.block_size
        with stages.range("prepare_inputs", sum(num_new_tokens)):
            input_ids: list[int] = []
            positions: list[int] = []
            slots: list[int] = []
            cu = [0]
            ctx_lens: list[int] = []
            last_rows: list[int] = []
            sample_idx: list[int] = []
            has_prefix = False
            for i, (s, n) in enumerate(zip(seqs, num_new_tokens)):
                start = s.num_computed_tokens
                end = start + n
                has_prefix |= start > 0
                input_ids.extend(s.token_ids[start:end])
                positions.extend(range(start, end))
                table = s.block_table
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                cu.append(cu[-1] + n)
                ctx_lens.append(end)
                if end == len(s.token_ids):
                    last_rows.append(cu[-1] - 1)
                    sample_idx.append(i)
            width = max(len(s.block_table) for s in seqs)
            tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
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
            out: list[Optional[int]] = [None] * len(seqs)
            if not sample_idx:
                return out
            rows = torch.tensor(last_rows, dtype=torch.long).to(dev, non_blocking=True)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        sampled = self._sample_and_fetch([seqs[i] for i in sample_idx], logits, None)
        for i, tok in zip(sample_idx, sampled):
            out[i] = tok
        return out

    def _sample_and_fetch(self, seqs: list[Sequence], logits: torch.Tensor,
                          greedy: Optional[torch.Tensor]) -> list[int]:
        batch = len(seqs)
        with self.stages.range("sampling", batch):
            if all(s.params.temperature == 0.0 or s.params.top_k == 1 for s in seqs):
                ids = greedy if greedy is not None else logits.argmax(dim=-1)
            else:
                ids = sample(logits, [s.params.temperature for s in seqs], [s.params.top_k for s in seqs],
                             [s.params.top_p for s in seqs], [self._generator_for(s) for s in seqs],
                             self.generator)
        with self.stages.range("d2h_copy", batch):
            if self.is_cuda:
                self.h_sampled[:batch].copy_(ids, non_blocking=True)
                torch.cuda.current_stream(self.device).synchronize()
                return self.np_sampled[:batch].tolist()
            return ids.tolist()

    def _generator_for(self, seq: Sequence) -> Optional[torch.Generator]:
        if seq.params.seed is None:
            return None
        g = self._seq_generators.get(seq.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seq.params.seed)
            self._seq_generators[seq.request_id] = g
        return g

    def release(self, seq: Sequence) -> None:
        """Forget per-request state (its seeded generator) once the request is done."""
        self._seq_generators.pop(seq.request_id, None)

    def close(self) -> None:
        self.graphs.clear()
        self._decode_meta.clear()
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = None
        self.kv_pool = None
        if self.is_cuda:
            torch.cuda.empty_cache()
