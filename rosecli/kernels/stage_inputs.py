"""A decode step's inputs read from host memory by the step's first kernel, instead of copied before the step.

A decode step's inputs (each row's id source, position, KV slot and context length, and the first columns of its
block table) are written by the host into a pinned staging area (`runner._Staging`; two of them, alternate steps
taking turns). They used to reach the device through two host-to-device copies queued before the step's CUDA graph,
and its ids came back through a copy queued after it. Each of those operations outside the graph cost the H200 10-14
us of a step in which the device did nothing (GPT-2 at one row: 262 us a step against 242 us for the graph alone).
`stage_inputs` is a kernel at the start of the graph that reads the staging area itself (pinned memory is mapped into
the device's address space) and writes the device's copy of it; the greedy argmax at the end of the graph writes
the ids into pinned memory the same way (`argmax.logits_argmax`'s ``to_host``), and a sampled step's graph ends with
`publish_ids`, which writes the sampler's ids into the next step's token pool and pinned memory.

Which of the two areas: a graph's arguments are fixed when it is captured, so the kernel reads both areas' headers
(``seq``: the step's number, growing by one or more a step; ``rows``; ``width``: block-table columns to copy) and
takes the area of the oldest step the device has not staged yet: the smaller ``seq`` above the one staged last
(kept in the device area's header). With the steps overlapped, the host may already be writing the next step into
the other area; it writes a step's header last, and only into an area whose step the device has finished, so the
area taken is never one being written. When neither is newer (a replay of the same step, `ModelRunner.rerun_decode`)
it takes the one staged last again. The programs that copy agree on the area by reading the staged ``seq`` before
any of them moves it: the last program to finish records the new one.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

HEADER_BYTES = 64  # each area (host and device) begins with a header of 8 int64 words:
# host: [seq, rows, block-table columns], written by the host; device: [seq staged, programs done]
CHUNK = 1024  # int32 words a program copies at a time
MAX_PROGRAMS = 64


@triton.jit
def _stage_kernel(h0_ptr, h1_ptr, dev_ptr, fields_w, n_fields, tables_w, pitch, CHUNK: tl.constexpr):
    s0 = tl.load(h0_ptr, cache_modifier=".cv")  # (".cv": host memory, read again every time)
    s1 = tl.load(h1_ptr, cache_modifier=".cv")
    r0 = tl.load(h0_ptr + 1, cache_modifier=".cv")
    r1 = tl.load(h1_ptr + 1, cache_modifier=".cv")
    w0 = tl.load(h0_ptr + 2, cache_modifier=".cv")
    w1 = tl.load(h1_ptr + 2, cache_modifier=".cv")
    prev = tl.load(dev_ptr)
    new0 = s0 > prev
    new1 = s1 > prev
    take1 = tl.where(new0 & new1, s1 < s0, tl.where(new0 | new1, new1, s1 > s0))
    seq = tl.where(take1, s1, s0)
    rows = tl.where(take1, r1, r0)
    width = tl.maximum(tl.where(take1, w1, w0), 1)
    src = tl.where(take1, h1_ptr, h0_ptr).to(tl.pointer_type(tl.int32), bitcast=True)
    dst = dev_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    total = n_fields + rows * width
    pid = tl.program_id(0)
    step = tl.num_programs(0) * CHUNK
    for base in range(pid * CHUNK, total, step):
        j = base + tl.arange(0, CHUNK)
        t = j - n_fields  # (a block-table entry's index among the ``rows x width`` copied)
        at = tl.where(t < 0, fields_w + j, tables_w + (t // width) * pitch + t % width)
        keep = j < total
        tl.store(dst + at, tl.load(src + at, mask=keep, cache_modifier=".cv"), mask=keep)
    done = tl.atomic_add(dev_ptr + 1, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:  # every program has read the staged seq: move it
        tl.store(dev_ptr + 1, 0)
        tl.store(dev_ptr, seq)


def _headers(host: tuple[torch.Tensor, torch.Tensor], dev: torch.Tensor):
    for t in (*host, dev):
        if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != dev.numel():
            raise ValueError("stage_inputs: the areas are flat uint8 buffers of one size")
    return [t[:HEADER_BYTES].view(torch.int64) for t in (*host, dev)]


def pick_ref(host: tuple[torch.Tensor, torch.Tensor], dev: torch.Tensor) -> int:
    """Which host area the step's kernel reads (0 or 1): see the module's doc."""
    s0, s1, prev = (int(t[:HEADER_BYTES].view(torch.int64)[0]) for t in (*host, dev))
    new0, new1 = s0 > prev, s1 > prev
    if new0 and new1:
        return int(s1 < s0)
    if new0 or new1:
        return int(new1)
    return int(s1 > s0)


def stage_inputs_ref(host: tuple[torch.Tensor, torch.Tensor], dev: torch.Tensor, start: int, tables: int,
                     pitch: int) -> None:
    """`stage_inputs` in torch: bytes ``[start, tables)`` of the area picked, then the first ``width`` int32 columns of
    its first ``rows`` block-table rows (``pitch`` columns a row, from byte ``tables`` on), into ``dev``; the
    device header's seq becomes the area's."""
    *_, d = _headers(host, dev)
    src = host[pick_ref(host, dev)]
    seq, rows, width = (int(v) for v in src[:HEADER_BYTES].view(torch.int64)[:3])
    dev[start:tables] = src[start:tables].to(dev.device)
    t_src = src[tables:].view(torch.int32).view(-1, pitch)
    t_dev = dev[tables:].view(torch.int32).view(-1, pitch)
    t_dev[:rows, :width] = t_src[:rows, :width].to(dev.device)
    d[0] = seq


def stage_inputs(host: tuple[torch.Tensor, torch.Tensor], dev: torch.Tensor, start: int, tables: int, pitch: int,
                 rows: int, programs: Optional[int] = None) -> None:
    """`stage_inputs_ref` in one launch (no host sync: it can be captured in a CUDA graph). ``host``: the two pinned
    areas (on CUDA; CPU tensors in the interpreter), ``dev``: the device's, all laid out alike; ``rows``: the most
    block-table rows a step of this launch copies (sizes the grid); ``programs``: at most that many (tests)."""
    h0, h1, d = _headers(host, dev)
    if start % 4 or tables % 4 or not HEADER_BYTES <= start <= tables:
        raise ValueError("stage_inputs copies whole int32 words after the header")
    n_fields = (tables - start) // 4
    grid = min(programs or MAX_PROGRAMS, triton.cdiv(n_fields + rows * pitch, CHUNK))
    _stage_kernel[(max(1, grid),)](h0, h1, d, start // 4, n_fields, tables // 4, pitch, CHUNK=CHUNK, num_warps=4)


@triton.jit
def store_for_host(host0_ptr, host1_ptr, seq_ptr, rows, ids, mask=None):
    """``ids`` into rows ``rows`` of the pinned host buffer of the staged step's parity (``seq_ptr``: the device
    area's header): the way a decode step's ids go back to the host (the argmax's, `publish_ids`')."""
    tl.store(tl.where(tl.load(seq_ptr) % 2 == 1, host1_ptr, host0_ptr) + rows, ids, mask=mask)


@triton.jit(do_not_specialize=["n"])
def _publish_kernel(ids_ptr, tokens_ptr, host0_ptr, host1_ptr, seq_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    keep = i < n
    ids = tl.load(ids_ptr + i, mask=keep)
    tl.store(tokens_ptr + i, ids, mask=keep)
    store_for_host(host0_ptr, host1_ptr, seq_ptr, i, ids, keep)


def publish_ids(ids: torch.Tensor, tokens: torch.Tensor, host: tuple[torch.Tensor, torch.Tensor], seq: torch.Tensor,
                block: int) -> None:
    """A sampled step's ids (int64 [n]) into the next step's token pool (``tokens``, on the device) and into the host
    buffer of the step's parity (``host``: pinned, read when ``seq``, the staged step's number on the device, is even /
    odd), in one launch after the sampler's (the greedy ids get both from the argmax: `logits_argmax`). ``block``: a
    power of two at least ``n``, one for every ``n`` (one compiled variant)."""
    n = ids.numel()
    if ids.dtype != torch.int64 or not n <= block or any(t.dtype != torch.int64 or t.numel() < n
                                                          for t in (tokens, *host)):
        raise ValueError(f"publish_ids: {n} int64 ids into int64 buffers of as many, in a block of {block}")
    _publish_kernel[(1,)](ids, tokens, host[0], host[1], seq, n, BLOCK=block, num_warps=4)
