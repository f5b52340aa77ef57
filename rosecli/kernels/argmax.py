"""Greedy argmax of a decode step's logits: a two-stage split reduction over the vocabulary.

``torch.argmax(logits, -1)`` gives each row to one block that walks the whole vocabulary: on the
H100 13 us for GPT-2's 50,257 columns and 27-40 us for Llama 3's 128,256 (B=1 / B=64), a few SMs
busy and the rest idle. Here stage 1 gives each program a chunk of one row (grid: rows x
``ceil(n_cols / chunk)``) and writes the chunk's maximum and the index of its first occurrence;
stage 2, one program per row, reduces those partials. Both stages are captured in the decode graph.

Semantics, those of ``torch.argmax(x[:, :n_cols], dim=-1)`` (`argmax_ref`):

- ties go to the lowest index;
- NaN counts as larger than every number, as torch's max/argmax propagate it: a row holding a NaN
  gives the index of its first NaN;
- a row of -inf gives 0; +inf is an ordinary maximum;
- only the first ``n_cols`` columns are read: the tail of a padded logits row is never a result.

Rows may have any stride (columns must be contiguous); values are compared in float32, which
holds float16 and bfloat16 exactly, so the answer does not depend on the logits' dtype.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from rosecli.kernels.pdl import pdl_begin, use_pdl
from rosecli.kernels.stage_inputs import store_for_host

MIN_CHUNK, MAX_CHUNK = 512, 4096  # columns per stage-1 program
TARGET_PROGRAMS = 1024  # stage-1 programs worth having before chunks grow (several per SM of an H100)


def argmax_ref(x: torch.Tensor, n_cols: Optional[int] = None) -> torch.Tensor:
    """int64 [rows]: the first index of each row's maximum among its first ``n_cols`` columns."""
    return (x if n_cols is None else x[:, :n_cols]).argmax(dim=-1)


@triton.jit(do_not_specialize=["n_chunks"])  # (varies with the batch: no recompile per divisibility)
def _argmax_partial_kernel(x_ptr, val_ptr, idx_ptr, out_ptr, bits_ptr, bits_stride, n_cols, row_stride, n_chunks,
                           flag_ptr, CHUNK: tl.constexpr, STORE: tl.constexpr, STORE_IF: tl.constexpr,
                           MASKED: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < n_cols
    if (chunk + 1) * CHUNK <= n_cols:  # a whole chunk, read without the mask: 16-byte loads whatever n_cols is
        # (with it, a width not a multiple of 16, GPT-2's 50,257, made every load 2 bytes)
        x = tl.load(x_ptr + row * row_stride + cols).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
    if MASKED:  # a grammar's packed token bitmask: a token whose bit is 0 is -inf (NaN included)
        words = tl.load(bits_ptr + row * bits_stride + cols // 32, mask=mask, other=0)
        x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
    if STORE:  # the row's first n_cols values in float32, contiguous (`logits_argmax`)
        if STORE_IF:  # ... only while the device flag is set
            if tl.load(flag_ptr) != 0:
                tl.store(out_ptr + row * n_cols + cols, x, mask=mask)
        else:
            tl.store(out_ptr + row * n_cols + cols, x, mask=mask)
    nan = x != x
    first_nan = tl.min(tl.where(nan, cols, n_cols), 0)  # n_cols: none
    m = tl.max(tl.where(nan, float("-inf"), x), 0)
    first_max = tl.min(tl.where((x == m) & mask, cols, n_cols), 0)
    has_nan = first_nan < n_cols
    out = row * n_chunks + chunk
    tl.store(val_ptr + out, tl.where(has_nan, float("nan"), m))
    tl.store(idx_ptr + out, tl.where(has_nan, first_nan, first_max))


@triton.jit(do_not_specialize=["n_chunks"])
def _argmax_final_kernel(val_ptr, idx_ptr, out_ptr, copy_ptr, host0_ptr, host1_ptr, seq_ptr, n_chunks,
                         BLOCK: tl.constexpr, COPY: tl.constexpr, HOST: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < n_chunks
    none = 2147483647
    v = tl.load(val_ptr + row * n_chunks + c, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + row * n_chunks + c, mask=mask, other=none)
    nan = v != v
    first_nan = tl.min(tl.where(nan, i, none), 0)  # chunks are in column order: the lowest index wins
    m = tl.max(tl.where(nan, float("-inf"), v), 0)
    first_max = tl.min(tl.where((v == m) & mask, i, none), 0)
    ids = tl.where(first_nan < none, first_nan, first_max).to(tl.int64)
    tl.store(out_ptr + row, ids)
    if COPY:  # (a second home for the ids: the decode step's token pool, `logits_argmax`'s ``copy_to``)
        tl.store(copy_ptr + row, ids)
    if HOST:  # (and a third: pinned host memory, the buffer of the step's parity, `logits_argmax`'s ``to_host``)
        store_for_host(host0_ptr, host1_ptr, seq_ptr, row, ids)


def chunk_for(rows: int, n_cols: int) -> int:
    """Columns per stage-1 program: `MIN_CHUNK`, doubled (up to `MAX_CHUNK`) while the doubled
    chunk still leaves `TARGET_PROGRAMS` programs: small batches spread one row over many SMs,
    large ones keep the partials few."""
    chunk = MIN_CHUNK
    while chunk < MAX_CHUNK and rows * triton.cdiv(n_cols, 2 * chunk) >= TARGET_PROGRAMS:
        chunk *= 2
    return chunk


def _split_argmax(x: torch.Tensor, n_cols: Optional[int], chunk: Optional[int],
                  out: Optional[torch.Tensor], bitmask: Optional[torch.Tensor] = None,
                  ids: Optional[torch.Tensor] = None, store_flag: Optional[torch.Tensor] = None,
                  copy_to: Optional[torch.Tensor] = None,
                  to_host: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    rows, width = x.shape
    n_cols = width if n_cols is None else n_cols
    if not 0 < n_cols <= width:
        raise ValueError(f"argmax over {n_cols} columns of a tensor {width} wide")
    assert x.stride(1) == 1 or width == 1, "argmax reads contiguous columns"
    if ids is None:
        ids = torch.empty(rows, dtype=torch.long, device=x.device)
    if rows == 0:
        return ids
    chunk = chunk or chunk_for(rows, n_cols)
    n_chunks = triton.cdiv(n_cols, chunk)
    vals = torch.empty(rows * n_chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows * n_chunks, dtype=torch.int32, device=x.device)
    masked = bitmask is not None
    if masked:
        assert bitmask.dtype == torch.int32 and bitmask.stride(1) == 1 and bitmask.shape[0] >= rows
        assert bitmask.shape[1] * 32 >= n_cols, "the bitmask holds fewer columns than the argmax reads"
    # (`kernels.pdl`; not the masked argmax, whose stream may wait on the bitmask's copy beside it just before)
    pdl = not masked and use_pdl(x.device, "argmax")
    _argmax_partial_kernel[(rows, n_chunks)](x, vals, idx, vals if out is None else out,
                                             bitmask if masked else vals, bitmask.stride(0) if masked else 0,
                                             n_cols, x.stride(0), n_chunks, vals if store_flag is None else store_flag,
                                             CHUNK=chunk, STORE=out is not None, STORE_IF=store_flag is not None,
                                             MASKED=masked, PDL=pdl, num_warps=4 if chunk <= 2048 else 8,
                                             launch_pdl=pdl)
    pdl = use_pdl(x.device, "argmax")
    if copy_to is not None:
        assert copy_to.dtype == torch.int64 and copy_to.shape == (rows,) and copy_to.is_contiguous()
    if to_host is not None:
        assert all(t.dtype == torch.int64 for t in to_host) and min(t.numel() for t in to_host[:2]) >= rows
    host0, host1, seq = to_host if to_host is not None else (ids, ids, ids)
    _argmax_final_kernel[(rows,)](vals, idx, ids, copy_to if copy_to is not None else ids, host0, host1, seq, n_chunks,
                                  BLOCK=max(16, triton.next_power_of_2(n_chunks)), COPY=copy_to is not None,
                                  HOST=to_host is not None, PDL=pdl, num_warps=1 if n_chunks <= 128 else 2,
                                  launch_pdl=pdl)
    return ids


def argmax(x: torch.Tensor, n_cols: Optional[int] = None, chunk: Optional[int] = None) -> torch.Tensor:
    """Same contract as `argmax_ref`, two kernel launches. x: [rows, >= n_cols], columns contiguous;
    ``chunk``: columns per stage-1 program (a power of two; default `chunk_for`)."""
    return _split_argmax(x, n_cols, chunk, None)


def logits_argmax_ref(raw: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 ``raw[:, :n_cols]``, contiguous; its `argmax_ref`): what a model's ``compute_logits``
    and the greedy argmax make of the logits GEMM's raw (padded) output."""
    logits = raw[:, :n_cols].float().contiguous()
    return logits, logits.argmax(dim=-1)


def logits_argmax(raw: torch.Tensor, n_cols: int, chunk: Optional[int] = None,
                  store_flag: Optional[torch.Tensor] = None,
                  copy_to: Optional[torch.Tensor] = None,
                  to_host: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits_argmax_ref` in the same two launches as `argmax`: stage 1 also writes the float32
    logits, so the conversion of the GEMM's output (one kernel and a write) and the argmax (a
    second read of what it wrote) become one pass over the GEMM's output. Bit-equal to the
    reference: float16/bfloat16 -> float32 is exact. ``store_flag`` (int32 [1] on the device): the
    logits are written only while it is non-zero (a CUDA graph of a greedy step whose logits nobody
    reads skips the write, 4 bytes per vocabulary entry and row); otherwise the buffer is left as it was.
    ``copy_to`` (int64 [rows]): the ids are also written there, by the same kernel (a decode step's next inputs,
    without a copy after it). ``to_host`` (two int64 buffers of at least ``rows`` in pinned host memory, and an int64
    ``seq`` on the device): the ids are also written into the first buffer when ``seq`` (read when the kernel runs)
    is even, the second when it is odd (a decode step's ids for the host, without a copy after it:
    `stage_inputs`)."""
    logits = torch.empty((raw.shape[0], n_cols), dtype=torch.float32, device=raw.device)
    return logits, _split_argmax(raw, n_cols, chunk, logits, store_flag=store_flag, copy_to=copy_to, to_host=to_host)


MASKED_CHUNK = 2048  # one chunk size for every batch: the masked argmax runs outside the decode graphs,
# and a chunk per batch size would compile a variant per size in the middle of a run


def masked_argmax_ref(x: torch.Tensor, bitmask: torch.Tensor, n_cols: Optional[int] = None) -> torch.Tensor:
    """`argmax_ref` of ``x`` after a token bitmask set ``x[i, t]`` to -inf where bit ``t % 32`` of
    ``bitmask[i, t // 32]`` is 0 (the packed int32 layout of xgrammar; `structured.apply_bitmask`)."""
    from rosecli.engine.structured import apply_bitmask

    x = (x if n_cols is None else x[:, :n_cols]).float().clone()
    apply_bitmask(x, bitmask[:x.shape[0]])
    return x.argmax(dim=-1)


def masked_argmax(x: torch.Tensor, bitmask: torch.Tensor, n_cols: Optional[int] = None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`masked_argmax_ref` without writing the mask into ``x``: the bits are read in the argmax's
    first stage (two launches, ``x`` left as it is). ``out``: int64 [rows] to write the ids into."""
    return _split_argmax(x, n_cols, MASKED_CHUNK, None, bitmask, out)
