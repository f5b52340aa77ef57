"""Small prefills replayed as CUDA graphs (CUDA, with decode graphs on).

An eager prefill is bound by the host's launches when it is small: W1's burst of 64 prompts of 2-3 tokens
took 3.8-5.8 ms of the H100 machine's host time against 1.35 ms of device time (docs/performance.md, "A
prefill is bound by the host's launches"), and every request's TTFT pays a prefill. So start-up also
captures the model's prefill forward, logits included, for a few token counts (`TOKENS`); a prefill of at
most that many new tokens (every chunk of every sequence in the step, prefix-cache hits included, with
contexts of at most `CONTEXT_TOKENS`) copies its inputs into the graph's buffers, padded, and replays the
smallest graph that holds it.

Padding: tokens past the step's are stored nowhere (slot -1) and belong to no sequence; sequences past the
step's have no tokens (their query range is empty, their context 0); the logits rows past the step's
sampled rows read token 0. The prefill kernel reads each sequence's range and context on the device, so the
graph's launch (its grid sized by the bucket's token count and the most sequences a prefill holds) serves
any batch within the bucket. A prefill that asks for prompt logprobs, or does not fit, runs eagerly.

The inputs travel in one int64 host buffer (pinned) and one copy; the graph converts the int32 ones.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Optional

import torch

from rosecli.engine.attention import AttentionMetadata

TOKENS = (16, 32, 64, 128, 256)  # the new-token counts captured (those within the prefill budget)
CONTEXT_TOKENS = 1024  # the block-table width captured: a context (prefix hit + chunk) of at most this
ENABLED = os.environ.get("ROSE_PREFILL_GRAPHS", "1") != "0"  # (0: every prefill eager, for A/B runs)


def bucket(n: int, sizes) -> Optional[int]:
    """The smallest of ``sizes`` (ascending) that holds ``n``; None when none does."""
    for size in sizes:
        if n <= size:
            return size
    return None


class PrefillGraphs:
    """Graphs of ``model``'s prefill forward and logits at each of ``tokens`` new tokens, for at most
    ``seqs`` sequences and ``rows`` sampled rows a step, over blocks of ``block_size`` tokens."""

    def __init__(self, model, device: torch.device, block_size: int, seqs: int, rows: int, tokens: list[int]):
        self.model, self.block_size = model, block_size
        self.sizes = sorted(tokens)
        T, S, R = self.sizes[-1], seqs, rows
        W = math.ceil(max(CONTEXT_TOKENS, T) / block_size)
        self.max_tokens, self.seqs, self.rows, self.width = T, S, R, W
        # offsets of the packed inputs: ids, positions, slots [T]; cu_seqlens [S + 1]; context lens [S];
        # block tables [S, W]; logits rows [R]
        self.o_pos, self.o_slot, self.o_cu = T, 2 * T, 3 * T
        self.o_ctx = self.o_cu + S + 1
        self.o_tab = self.o_ctx + S
        self.o_last = self.o_tab + S * W
        n = self.o_last + R
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
        self.np = self.host.numpy()
        self.dev = torch.zeros(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # (tests: how many prefills ran as graphs)

    def capture(self, progress: Optional[Callable[[str, int, int], None]] = None) -> None:
        """One graph per size, largest first (its memory pool then serves the others). The capture's dummy step
        stores nothing in the cache (every slot -1) and reads block 0."""
        pool = None
        for done, T in enumerate(reversed(self.sizes)):
            self._stage([0] * T, [0] * T, [-1] * T, [0, T], [T], [[0]], [T - 1], T)
            self.dev.copy_(self.host)
            with torch.inference_mode():
                self._forward(T)  # kernels and cuBLAS handles for this shape, outside the graph
                torch.cuda.synchronize(self.dev.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(T)
            if pool is None:
                pool = graph.pool()
            self.graphs[T] = (graph, logits)
            if progress:
                progress("capture_prefill", done + 1, len(self.sizes))

    def _forward(self, T: int) -> torch.Tensor:
        d, S, W = self.dev, self.seqs, self.width
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=d[self.o_slot:self.o_slot + T],
            block_tables=d[self.o_tab:self.o_tab + S * W].view(S, W).to(torch.int32),
            context_lens=d[self.o_ctx:self.o_ctx + S].to(torch.int32), max_context_len=W * self.block_size,
            use_triton=True, cu_seqlens_q=d[self.o_cu:self.o_cu + S + 1].to(torch.int32), max_seqlen_q=T)
        hidden = self.model(d[:T], d[self.o_pos:self.o_pos + T], meta)
        return self.model.compute_logits(hidden.index_select(0, d[self.o_last:self.o_last + self.rows]))

    def pick(self, tokens: int, seqs: int, rows: int, width: int) -> Optional[int]:
        """The size whose graph runs a prefill of ``tokens`` new tokens of ``seqs`` sequences sampling
        ``rows`` rows, whose block tables are ``width`` wide; None: it runs eagerly."""
        if seqs > self.seqs or rows > self.rows or width > self.width:
            return None
        return bucket(tokens, self.sizes)

    def run(self, size: int, input_ids: list[int], positions: list[int], slots: list[int], cu: list[int],
            ctx_lens: list[int], tables: list[list[int]], last_rows: list[int]) -> torch.Tensor:
        """Copy a prefill's inputs into the buffers and replay the graph of ``size``; the sampled rows' logits
        ([len(last_rows), vocab], the graph's own buffer: read before the next prefill)."""
        self._stage(input_ids, positions, slots, cu, ctx_lens, tables, last_rows, size)
        self.dev.copy_(self.host, non_blocking=True)  # (the host buffer is rewritten only after this step's read)
        graph, logits = self.graphs[size]
        graph.replay()
        self.replays += 1
        return logits[:len(last_rows)]

    def _stage(self, input_ids, positions, slots, cu, ctx_lens, tables, last_rows, size: int) -> None:
        h = self.np
        n, b, r = len(input_ids), len(ctx_lens), len(last_rows)
        h[:n] = input_ids
        h[n:size] = 0
        p = self.o_pos
        h[p:p + n] = positions
        h[p + n:p + size] = 0
        s = self.o_slot
        h[s:s + n] = slots
        h[s + n:s + size] = -1  # padding tokens: stored nowhere
        c = self.o_cu
        h[c:c + b + 1] = cu
        h[c + b + 1:c + self.seqs + 1] = n  # padding sequences: no tokens
        x = self.o_ctx
        h[x:x + b] = ctx_lens
        h[x + b:x + self.seqs] = 0
        if tables and tables[0]:  # (rows of equal width: the caller pads them; columns past them are not read)
            t = h[self.o_tab:self.o_tab + self.seqs * self.width].reshape(self.seqs, self.width)
            t[:b, :len(tables[0])] = tables
        q = self.o_last
        h[q:q + r] = last_rows
        h[q + r:q + self.rows] = 0


def build(model, device: torch.device, block_size: int, seqs: int, rows: int, budget: int) -> Optional[PrefillGraphs]:
    """The prefill graphs for a budget of ``budget`` tokens a step (None: none fits, or ROSE_PREFILL_GRAPHS=0)."""
    sizes = [t for t in TOKENS if t <= budget]
    if not ENABLED or not sizes:
        return None
    return PrefillGraphs(model, device, block_size, seqs, rows, sizes)
