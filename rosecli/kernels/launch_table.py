"""Fixed launch parameters for the Triton kernels, chosen per shape by plain lookups.

No `triton.autotune`: it cost 2.5% in a launch-dense path, and a captured CUDA graph needs the
same launch every replay anyway. Every value here must be (re-)measured on the H100 with
``python scripts/bench_kernels.py --quick-sweep`` (decode) or ``--sweep`` (decode and prefill), which
print rows in this file's form; each section says what has been measured and what is still a guess.
"""

import math
import os
from typing import NamedTuple

# --- paged decode -------------------------------------------------------------------------------
# One row per batch x kv heads (the programs a launch has before splitting): rows (largest
# batch*kv_heads the row covers, DecodeLaunch), first match wins. The fields:
#   splits            programs per (sequence, kv head), capped so no split covers less than
#   min_split_tokens  (nor one tile) of the host bound; one split means no merge kernel. Each
#                     sequence's *real* length is dealt out to the splits on the device a tile at a
#                     time, so a bound far above the real lengths (CUDA graphs pass the model's
#                     maximum) still spreads the real work
#   tile              context tokens per inner iteration (whole blocks: one block-table read per block)
#   num_warps, num_stages
#   head_major        launch order: the kv heads of one sequence side by side (they read neighbouring
#                     runs of the same cache blocks) instead of one kv head of every sequence
#   use_dot           tensor-core inner products (the GQA group padded to 16 rows) or vector ones
# Measured on an H100 (torch 2.11, triton 3.6, fp16, head_dim 64, block 16) before this form, with
# `triton.testing.do_bench`: tensor cores won at every shape, MHA included (the kernel is bound by
# memory, not math); with batch*kv_heads >= 256 programs 64-token tiles and 2 warps won, with fewer
# 128-token tiles and 4 warps; about 512 programs in all; splits of at least 256 tokens. A later try
# with 128-token splits (B=1 ctx 1024 GPT-2: 59 us against 13 us) compared a table run with a sweep
# run, not two configs in one run, and do_bench at these sizes can time host launch work (Python
# falling behind the GPU); `bench_kernels.py` now times CUDA-graph replay too, and the sweep compares
# configs in one process. Re-measure with
# `python scripts/bench_kernels.py --quick-sweep`, which prints the rows below in this form.
class DecodeLaunch(NamedTuple):
    splits: int
    min_split_tokens: int
    tile: int
    num_warps: int
    num_stages: int
    head_major: bool
    use_dot: bool


# Swept 2026-11-23 on an H100 (torch 2.11, triton 3.6) with `--quick-sweep` (CUDA-graph timing, scored
# against SDPA over contexts 128/1024/4096), on the [blocks, kv_heads, block_size, head_dim] cache and with the
# merge launched by PDL: small batches split down to 64-token pieces; from 768 programs up, one split in
# head-major order. With these rows ours is 0.42-0.92x the time of SDPA held to FlashAttention-2 at every point;
# against SDPA's default (cuDNN) 0.75-0.98x at 18 of 24 points and 1.00-1.10x at 6: GPT-2 B=8 ctx 1024,
# GPT-2 B=256 ctx >= 1024 and SmolLM2 B=64. GPT-2 B=64 ctx 1024 reads 96.4% of the 2,975 GB/s copy ceiling.
# docs/kernels.md has the table and what was tried.
#           batch*kv_heads   splits, min_split_tokens, tile, num_warps, num_stages, head_major, use_dot
DECODE = ((3, DecodeLaunch(32, 64, 128, 4, 2, False, True)),  # smollm2 B=1
          (12, DecodeLaunch(32, 64, 128, 4, 2, False, True)),  # gpt2 B=1
          (24, DecodeLaunch(16, 64, 128, 4, 2, False, True)),  # smollm2 B=8
          (96, DecodeLaunch(4, 256, 128, 4, 2, True, True)),  # gpt2 B=8
          (192, DecodeLaunch(4, 256, 64, 2, 3, False, True)),  # smollm2 B=64
          (768, DecodeLaunch(1, 256, 64, 2, 2, True, True)),  # gpt2 B=64, smollm2 B=256
          (math.inf, DecodeLaunch(1, 256, 32, 2, 3, True, True)))  # gpt2 B=256


# num_warps for GQA groups of 4 heads or more (the group's padded rows of q against each tile are more work), by the
# same batch x kv heads key as DECODE; None: the row's own. Measured on an H200 inside whole steps (`rose profile
# --decode-step --load-format dummy --decode-batch-sizes 16,32,64`, 128 tokens, 2 -> 4 warps by a temporary switch,
# alternating twice, us per step): Llama-3.2-1B 1,025.1 / 1,023.3 -> 1,016.3 / 1,016.9 at 32 rows, 1,133.2 / 1,134.0
# -> 1,127.8 / 1,128.6 at 64, but 941.5 / 941.6 -> 950.0 / 950.3 at 16 (key 128); Llama-3.1-8B 4,913.2 / 4,910.2 ->
# 4,887.3 / 4,894.6 at 64. GPT-2 (MHA) at 64 rows lost (441 -> 453); SmolLM2's group of 3 is unmeasured.
DECODE_GQA_WARPS = ((192, None), (768, 4), (math.inf, None))


def decode_row(batch: int, heads: int, kv_heads: int) -> DecodeLaunch:
    """`DECODE`'s row for a decode launch, by batch x kv heads, with `DECODE_GQA_WARPS`'s warps for GQA groups of 4+."""
    key = batch * kv_heads
    row = lookup(DECODE, key)
    warps = lookup(DECODE_GQA_WARPS, key) if heads >= 4 * kv_heads else None
    return row if warps is None else row._replace(num_warps=warps)


# --- paged prefill ------------------------------------------------------------------------------
# (block_m, block_n, num_warps, num_stages) by the longest query run of the batch: rows (largest
# max_seqlen_q the row covers, params), first match wins. block_m counts rows = query tokens x the
# GQA group's heads. NOT YET MEASURED: re-sweep.
PREFILL = ((16, (16, 64, 4, 2)), (math.inf, (64, 64, 4, 2)))

# --- KV store -----------------------------------------------------------------------------------
# num_warps by kv_heads * head_dim (one program per token copies that many elements of K and V).
# NOT YET MEASURED: re-sweep.
STORE_WARPS = ((256, 1), (1024, 4), (math.inf, 8))

# --- rotary + KV store (`rotary.rotary_kv`) -------------------------------------------------------
def rotary_launch(tokens: int, head_dim: int) -> tuple[int, int]:
    """(heads per program, num_warps) of `rotary.rotary_kv` for ``tokens`` rows (q and k heads of ``head_dim``).

    Measured on the H100 (`python scripts/bench_rotary.py`, CUDA graphs of 16 calls, bf16, us per call) for the
    SmolLM2-135M, Llama-3.2-1B, Qwen2.5-1.5B and Llama-3-8B heads: one program per head (the form before) took
    1.3-1.5 at 1-16 tokens but 3.5-3.6 at 64 (Llama) and 4.1-13.1 at 256; 8 heads per program 1.4-1.7 at 64 and
    1.5-2.1 at 256 (Llama-3-8B 4.0), best with 4 warps at head_dim 64 and 8 at 128 (16 heads and 8 warps for
    Llama-3.2-1B at 256: 1.91 against 2.05). At 1-16 tokens 1-2 heads per program were best (1.28-1.36), 8 about
    0.1-0.2 us slower."""
    if tokens <= 16:
        return 2, 2 if head_dim <= 64 else 4
    return 8, 4 if head_dim <= 64 else 8


def lookup(rows, key):
    """The value of the first ``(bound, value)`` row with ``key <= bound``."""
    for bound, value in rows:
        if key <= bound:
            return value
    raise ValueError(f"no launch-table row covers {key}")


def row_launch(row: DecodeLaunch, max_context_len: int, block_size: int) -> dict:
    """The kernel launch ``row`` gives at a context bound: its fields, with the split count capped (`capped_splits`)
    in place of ``splits`` and ``min_split_tokens``."""
    launch = row._asdict()
    del launch["min_split_tokens"]
    launch["splits"] = capped_splits(row, max_context_len, block_size)
    return launch


def capped_splits(row: DecodeLaunch, max_context_len: int, block_size: int = 1) -> int:
    """``row``'s split count, capped so no split covers less than its minimum, nor one tile, of the bound.
    A tile covers whole KV blocks (the kernel widens a tile below ``block_size`` to one block)."""
    return max(1, min(row.splits, math.ceil(max_context_len / max(row.min_split_tokens, row.tile, block_size))))


# --- skinny linear layers (decode's 1-64 rows; `kernels.skinny_gemm`) --------------------------
class SkinnyLaunch(NamedTuple):
    block_n: int      # output columns per program
    block_k: int      # K per inner iteration
    split_k: int      # programs sharing one tile's K (1: none; >1 adds the partials in one kernel)
    num_warps: int
    num_stages: int
    tma: bool = False  # 2-64 rows: x's and W's tiles loaded by the TMA unit, W the product's wide side


# Measured on the H100 (torch 2.11, triton 3.6) with `python scripts/bench_skinny.py --sweep`: each layer
# shape of GPT-2, SmolLM2-135M (fp16), Llama-3.2-1B, Qwen2.5-1.5B and Llama-3-8B (bf16) at 1 and 64 rows, a
# CUDA graph of one call per weight copy (past the L2 cache). One row: vector products won every shape,
# 1.04-1.98x cuBLAS (its epilogue kernel counted), best with 4 columns per program and 512-wide K steps
# (256 below K=1024 or for the 16k-28k-row gate/up projections). 64 rows: tensor-core tiles won for the
# small models' layers (1.07-1.27x). Alone, the 1B-8B shapes' fused gate/up + SiLU also won (1.07-1.13x),
# but inside whole decode steps at 64 rows it measured 2% faster for Llama-3.2-1B, 1% slower for
# Qwen2.5-1.5B and 3% slower for Llama-3-8B: they kept cuBLAS at 2-64 rows, as did their other layers
# (-3..+6% of cuBLAS alone), until the TMA-loaded tiles (`tma_launch`) beat it inside whole steps for every one of them.
SMALL_LAYER = 4 << 20  # weight elements up to which the tensor-core tiles beat cuBLAS at 2-64 rows (x2 gate/up)
# ... and only for the small models' widths: layers of at least this many inputs and outputs (Qwen2.5-1.5B's q/k/v
# [2048, 1536] and o [1536, 1536], Llama-3.2-1B's o [2048, 2048], all within SMALL_LAYER) went back to cuBLAS.
# `rose profile --decode-step` on the H100, one call: Qwen2.5-1.5B 2,276 -> 2,201 us at B=64 and 2,042 -> 2,031
# at B=16, Llama-3.2-1B 1,540 -> 1,527 and 1,397 -> 1,381 (per layer 7.3 -> 6.1 + 5.3 us for Qwen's two, 9.2 ->
# 6.8 us for the 1B's o; the small models' widest layers have one side at most 768).
SMALL_LAYER_SIDE = 1536


def skinny_launch(rows: int, n: int, k: int, swiglu: bool = False) -> "SkinnyLaunch | None":
    """The launch of `skinny_gemm.skinny_linear` for ``rows`` x [n outputs, k] (``swiglu``: n outputs of a
    [2n, k] gate/up weight), or None where cuBLAS measured as fast or faster."""
    size = n * k * (2 if swiglu else 1)
    if rows == 1:
        if size > (16 << 20):
            return SkinnyLaunch(4, 256, 1, 4, 3)
        return SkinnyLaunch(4, 512 if k >= 1024 or k % 512 == 0 else 256, 1, 2, 4)
    if size > SMALL_LAYER or min(n, k) >= SMALL_LAYER_SIDE:
        return tma_launch(rows, n, k, swiglu)
    if swiglu:
        return SkinnyLaunch(16, 128, 1, 2, 3)
    if k >= 3072:
        return SkinnyLaunch(32, 256, 4, 4, 3)
    if k >= 1536 and n <= 1024:
        return SkinnyLaunch(16, 256, 1, 4, 4)
    return SkinnyLaunch(32, 256, 1, 4, 3) if n >= 2048 else SkinnyLaunch(16, 128, 1, 4, 4)


TMA_GEMM = os.environ.get("ROSE_TMA_GEMM", "1") != "0"  # (0: cuBLAS for every 1B-8B layer at 2-64 rows, as before)


def tma_launch(rows: int, n: int, k: int, swiglu: bool) -> "SkinnyLaunch | None":
    """The launch at 2-64 rows of a layer past the plain tensor-core tiles' sizes (`skinny_launch`): the tiles loaded
    by the TMA unit (`SkinnyLaunch.tma`), or None (cuBLAS) with ``ROSE_TMA_GEMM=0``.

    Measured on an H200 (torch 2.11, triton 3.6). The gate/up + SiLU in 64-column, 64-wide K tiles, 4 stages, each
    layer alone (`python scripts/bench_skinny.py --rows 4 16 64`, us, cuBLAS with its SiLU kernel -> the TMA tiles):
    Qwen2.5-1.5B 18.5 -> 16.0 (4 rows), 18.8 -> 16.4 (16), 20.8 -> 18.4 (64); Llama-3.2-1B 20.2 -> 19.2, 20.5 -> 19.4,
    22.1 -> 21.5; Llama-3-8B 58.0 -> 58.2, 58.6 -> 59.0, 64.3 -> 61.4 (at 4-16 rows the SiLU kernel it saves is the
    gain in the step); whole steps (`rose profile --decode-step --decode-batch-sizes 4,16,64`, ``ROSE_TMA_GEMM=0``
    against 1, one call, us): Qwen2.5-1.5B 1,632.9 -> 1,537.0, 1,630.7 -> 1,529.4, 1,797.0 -> 1,708.0; Llama-3.1-8B
    4,376.4 -> 4,230.3, 4,630.2 -> 4,435.7, 5,111.1 -> 4,935.1; Llama-3.2-1B 1,027.3 -> 991.6, 1,086.3 -> 1,043.5,
    1,198.3 -> 1,171.9.
    The other layers (q/k/v, o, down) in 128-wide K steps: a sweep of the TMA launches at 16, 32 and 64 rows (each
    layer alone, against cuBLAS: 1.01-1.21x, except Qwen's down at 64 rows, 0.97x) found 64 columns and 4 warps with
    6 stages best for every q/k/v and o, split in two at 16 rows (and at 32 for the 1B's and 8B's o, `TMA_SPLITS`)
    where that leaves at most 64 column tiles; the down projections (K at least 3x the outputs) split so about 128
    programs run (4 for the 1B's and Qwen's, 2 for the 8B's), 4 stages with 8 warps at 33-64 rows where split in 4.
    Whole steps with them (`rose profile --decode-step --decode-batch-sizes 4,16,32,64`, the engine before against
    these launches, one call, us): Qwen2.5-1.5B 1,572.1 -> 1,396.5, 1,547.6 -> 1,434.3, 1,612.6 -> 1,491.1, 1,722.9
    -> 1,643.5; Llama-3.2-1B 1,004.5 -> 929.1, 1,057.3 -> 978.5, 1,111.1 -> 1,041.9, 1,183.8 -> 1,146.0; Llama-3.1-8B
    4,339.7 -> 4,208.3, 4,539.5 -> 4,355.9, 4,726.1 -> 4,517.3, 5,076.3 -> 4,984.0 (the 1B and Qwen twice,
    alternating, within 7 us).
    A down projection split in fewer than 128 programs (Qwen2.5-1.5B's, 24 column tiles x 4) keeps more tiles in flight
    a program: 6 stages, and 5 in 8 warps at 33-64 rows (where 6 measured 0.7% slower in the whole step, the down
    kernel alone the same). Whole steps against 4 stages (`rose profile --decode-step`, alternating twice in one call,
    H200, us): Qwen2.5-1.5B at 4 / 16 / 32 / 64 rows 1,345.8 / 1,363.5 / 1,429.1 / 1,592.2 -> 1,322.1 / 1,341.4 /
    1,404.1 / 1,568.6 (-1.4 to -1.8%; the down 13.1 -> 12.4 us at 64 rows). The 1B's down in 128 programs went slower
    with 6 (1,003.2 -> 1,010.5 at 32 rows, 1,117.6 -> 1,122.5 at 64) and 7 stages; more programs (5-6 splits, or
    128-column tiles in 8-10) or 8 warps at 16-32 rows were slower for Qwen's."""
    if not TMA_GEMM:
        return None
    if swiglu:
        return SkinnyLaunch(64, 64, 1, 4, 4, True)
    tiles = -(-n // 64)
    if k >= 3 * n:  # a down projection: split K so about 128 programs run
        split = max(1, min(4, 1 << ((128 // tiles).bit_length() - 1)))
        wide = split >= 4 and rows > 32  # 8 warps
        stages = 4 if split >= 4 and tiles * split >= 128 else 5 if wide else 6  # fewer programs: more in flight each
        return SkinnyLaunch(64, 128, split, 8 if wide else 4, stages, True)
    bucket = 0 if rows <= 16 else 1 if rows <= 32 else 2
    measured = TMA_SPLITS.get((n, k))
    split = measured[bucket] if measured is not None else 2 if bucket == 0 and tiles <= 64 else 1
    return SkinnyLaunch(64, 128, split, 4, 6, True)


# The K splits of the q/k/v and o layers the sweep measured, at 2-16, 17-32 and 33-64 rows; other shapes take
# `tma_launch`'s rule (two at 2-16 rows for at most 64 column tiles, else one).
TMA_SPLITS = {(2048, 1536): (2, 1, 1), (1536, 1536): (2, 1, 1),  # Qwen2.5-1.5B q/k/v, o
              (3072, 2048): (1, 1, 1), (2048, 2048): (2, 2, 1),  # Llama-3.2-1B
              (6144, 4096): (1, 1, 1), (4096, 4096): (2, 2, 1)}  # Llama-3-8B


def prefetch_lines(rows: int, rest: int, line: int) -> int:
    """How many L2 lines (of ``line`` weight elements) in each row of its weights a skinny GEMM program of ``rows``
    rows asks for while it waits on the kernel before (`pdl.l2_prefetch`), ``rest`` being what it reads past its
    first K tile (which it loads into registers then): a power of two covering ``rest``, or 0 (none).

    Measured on the H100 (`rose profile --decode-step`, ``ROSE_PREFETCH_OFF=all`` against on, one call, twice each,
    us per step): at 16 and 64 rows GPT-2 388 -> 375 and 522 -> 506, SmolLM2-135M 714 -> 659 and 853 -> 808; at one
    row GPT-2 and SmolLM2-135M unchanged (290, 524) but Llama-3.2-1B 1,073 -> 1,205 and Qwen2.5-1.5B 1,488 -> 1,660
    (their one-row programs stream large weights at near the read rate; the prefetches double the requests). So
    one row asks for none. (The decode kernel asking for its first K/V tile the same way measured -0.7..+0.2%: not
    kept.)"""
    return 1 << (-(-rest // line) - 1).bit_length() if rows > 1 and rest > 0 else 0


SKINNY_LOGITS = os.environ.get("ROSE_SKINNY_LOGITS", "1") != "0"  # (0: the logits GEMM on cuBLAS at one row too)


def logits_launch(rows: int) -> "SkinnyLaunch | None":
    """The skinny kernel's launch for the logits GEMM of a decode step of ``rows`` rows, or None: cuBLAS. One row takes
    the kernel (2-64 rows are past the size `skinny_launch` gives it), in 512-wide K steps with 2 warps.

    Measured on the H100, the kernel against cuBLAS at one row (`rose profile --decode-step --decode-batch-sizes 1`,
    ``ROSE_SKINNY_LOGITS=0`` -> 1, one call, us per step, then with `skinny_launch`'s launch for layers past 16 M
    weights: 4 columns, 256-wide K steps, 4 warps): GPT-2 289.6 -> 285.9, Llama-3.2-1B 1,072.8 -> 1,056.4, Qwen2.5-1.5B
    1,487.5 -> 1,476.1, Llama-3.1-8B 5,379.8 -> 5,345.5; SmolLM2-135M 522.4 -> 526.2 (inside the 522-526 it measured in
    every call that day).
    The launch swept inside whole steps on an H200 (the same command, a temporary switch, one call, us per step, the
    launch before run first and last; columns, K step, warps, stages): with 2 warps every K step tried (256-1024) beat
    it, except on the 8B (unchanged); 4 warps in 512-wide steps gained less, and lost on GPT-2. Llama-3.2-1B 787.1 /
    788.1 -> 774.8 (4, 512, 2, 3), 775.9 (4, 1024, 2, 3), 776.5 (4, 256, 2, 3), 776.0 (8, 512, 2, 3), 780.1 (4, 512, 4,
    3); Qwen2.5-1.5B 1,147.6 / 1,146.2 -> 1,131.9 (4, 512, 2, 3), 1,133.3 (4, 1024, 2, 3), 1,130.9 (4, 256, 2, 3),
    1,138.6 (4, 512, 4, 3); GPT-2 247.0 / 247.4 -> 241.6, 244.5, 241.7, 251.6 (the same four); Llama-3.1-8B 3,872.1 /
    3,872.9 -> 3,872.9 (4, 512, 2, 3), 3,865.8 (4, 1024, 2, 3)."""
    return SkinnyLaunch(4, 512, 1, 2, 3) if rows == 1 and SKINNY_LOGITS else None


def fold_norm(rows: int, n: int, k: int) -> "SkinnyLaunch | None":
    """The launch of `skinny_gemm.skinny_norm_linear` (the `norm.add_norm` before a skinny GEMM of ``rows`` x
    [n, k] run in its prologue), or None: keep the add_norm kernel.

    Measured on the H100 (`rose profile --decode-step`, ROSE_NORM_FOLD=0 -> 1, one call): at one row with
    the whole K in one tile per program (the rows read once, for the statistics and the product), GPT-2's
    step 354 -> 312 us, SmolLM2-135M's 654 -> 561, Llama-3.2-1B's 1203 -> 1189, Qwen2.5-1.5B's 1767 -> 1658;
    Llama-3-8B's (K = 4096, a [4, 4096] weight tile per program) 5857 -> 6941 us, so K stays at most 2048.
    With K in steps (statistics in a loop before the product) GPT-2's step was 354 -> 382 us at one row and
    593 -> 1368 us at 64 rows (every program re-reads its 64 rows from L2): more rows keep add_norm."""
    if rows == 1 and k <= 2048:
        return SkinnyLaunch(4, max(16, 1 << (k - 1).bit_length()), 1, 2 if k <= 1024 else 4, 1)
    return None


def stats_fold(rows: int, n: int, k: int, swiglu: bool = False, before: bool = False) -> "SkinnyLaunch | None":
    """The launch, at 2-64 rows, of the skinny GEMM before a residual add and a norm that also adds the residual
    and writes each row's statistics of the sum (`skinny_gemm.skinny_linear_add`), and of the one after the
    norm, which reads the raw sum with the norm folded into its weights (`skinny_gemm.skinny_stats_norm_linear`),
    in place of the add_norm kernel between them; None: keep add_norm (a shape the table leaves to cuBLAS).
    At one row, for the widths `stats_pair` gives it (elsewhere `fold_norm`), a one-row launch with 3 stages: the GEMM
    after the norm in 512-wide K steps with 2 warps (4 for a gate/up + SiLU of K <= 1536, Qwen2.5-1.5B's), the one
    ``before`` it in 1024-wide steps with 4 warps at 4096 outputs (Llama-3-8B's width) and 2 below.

    Measured on the H100. A sweep of each GPT-2 / SmolLM2-135M pair at 64 rows (weights in L2) found 32-column,
    128-wide K tiles with 4 stages best or within 0.3 us of it for all eight kernels; the plain table's 2-warp
    gate/up launch took 9.5 us against 4.8 as the folded consumer (split-K 4 kept for K >= 3072).
    `scripts/bench_skinny.py --pairs` (weights past L2), GEMM + add_norm + GEMM -> the pair, us at 16 / 64 rows:
    GPT-2 attn_proj+c_fc 9.0 -> 9.3 / 12.8 -> 10.6, mlp_proj+c_attn 11.7 -> 10.9 / 13.5 -> 12.3; SmolLM2 o+gate_up
    8.8 -> 7.2 / 10.1 -> 8.8, down+qkv 8.4 -> 8.1 / 10.0 -> 9.3. Whole decode steps (`rose profile --decode-step`):
    GPT-2 447 -> 402 us (B=16), 594 -> 542 (B=64); SmolLM2 850 -> 747, 1013 -> 892.
    One row, `scripts/bench_skinny.py --pairs --rows 1 --sweep` (columns per program, K step, warps, stages), the
    plain one-row table's launches -> the best found, us per pair: Llama-3-8B o+gate_up 93.7 -> 91.1 (4 warps
    before, 2 after), down+qkv 63.8 -> 59.0 (the same); Qwen2.5-1.5B o+gate_up 25.3 -> 23.5, down+qkv 15.3 -> 15.3;
    Llama-3.2-1B o+gate_up 30.2 -> 28.8, down+qkv 19.0 -> 19.0. Every best had 4 columns and 512-wide K steps,
    most 3 stages.
    On the H200 the same sweep, with 1024-wide K steps and 5 stages added, found the 1B's pairs best with the GEMM
    before the norm in 1024-wide K steps and 2 warps (o+gate_up 21.2 -> 20.9 us, down+qkv 17.9 -> 14.9: the 4 warps
    the rule then gave every K >= 4096 had put its down projection 3 us behind the plain kernel). Inside the step
    (`rose profile --decode-step --decode-batch-sizes 1`, the engine before against this rule, alternating, one call,
    us): Llama-3.2-1B 868.8 / 868.4 -> 818.0 / 817.6, Qwen2.5-1.5B 1,330.6 / 1,330.5 -> 1,203.0 / 1,202.3,
    Llama-3.1-8B 3,918.4 -> 3,851.5; 4 warps wherever K >= 4096 with the wider steps measured 831.0 (1B) and 1,225.7
    (Qwen), and 2 warps in 512-wide steps 859 (1B) and 1,356 (Qwen, slower than before).
    Later, on an H200, each of the one-row launches varied inside whole steps (`rose profile --decode-step
    --decode-batch-sizes 1`, one call, the table's launches run first and last, us): Llama-3.2-1B 786.6 / 786.7,
    Qwen2.5-1.5B 1,161.2 / 1,161.5 with the table's; the gate/up + SiLU with 4 warps 828.8 and 1,147.7 (Qwen's three
    512-wide K steps), in 8 columns with 4 warps 832.8 and 1,190.0, in 8 columns of 256-wide steps 831.2 and
    1,242.5; the q/k/v in 8 columns with 4 warps 808.2 and 1,183.2, in 256-wide steps with 4 stages 825.0 and
    1,176.9; the GEMM before the norm in 8 columns of 512-wide steps with 4 warps 854.5 and 1,314.8. So only Qwen's
    gate/up (K = 1536) takes 4 warps: in the next call, the engine before against this rule, alternating, 1,160.7 /
    1,160.2 -> 1,150.3 / 1,149.4 us (-0.9%; 59.8% -> 60.4% of the floor)."""
    if rows == 1:  # (whether one row takes the pair at all is `stats_pair`'s to say)
        if before:  # 1024-wide K steps; 4 warps at Llama-3-8B's width (4096 outputs), 2 below it
            return SkinnyLaunch(4, 1024, 1, 4 if n >= 4096 else 2, 3)
        return SkinnyLaunch(4, 512, 1, 4 if swiglu and k <= 1536 else 2, 3)
    plain = skinny_launch(rows, n, k, swiglu) if 1 < rows <= 64 else None
    if plain is None or plain.tma:  # (the TMA tiles keep the add_norm kernel: the statistics in their epilogues
        # measured slower at 2-64 rows, docs/performance.md)
        return None
    return SkinnyLaunch(32, 128, 4 if k >= 3072 else 1, 4, 4)


# The residual stream widths (lo, hi) at which one row takes the pair rather than `fold_norm`'s whole-row prologue (or,
# past K = 2048, the add_norm kernel); None: none does. At one row no weights are copied (`fold_copy`). `rose profile
# --decode-step` at B=1 on the H100, without -> with the pair, one call, twice each: Qwen2.5-1.5B (1536) 1,707 ->
# 1,557 us (59.9% -> 65.7% of the floor), Llama-3.1-8B (4096) 5,951 -> 5,779 us (83.5% -> 86.0%); Llama-3.2-1B (2048)
# 1,184 -> 1,125 us in another call. GPT-2 (768) and SmolLM2-135M (576) keep the fold (`scripts/bench_skinny.py
# --pairs --rows 1`: their pairs 0.54-0.90x of it, the larger models' 1.02-1.18x).
STATS_ONE_ROW_WIDTHS: "tuple[int, int] | None" = (1536, 4096)


def stats_pair(rows: int, width: int) -> bool:
    """Whether the add_norm on a residual stream of ``width`` at ``rows`` is split between the GEMMs around it
    (`stats_fold`'s launches, where it gives both layers one)."""
    one_row = STATS_ONE_ROW_WIDTHS
    return 1 < rows <= 64 or (rows == 1 and one_row is not None and one_row[0] <= width <= one_row[1])


def fold_copy(rows: int) -> bool:
    """Whether the layer after the statistics pair reads a norm-folded copy of its weights (`skinny_gemm.NormFold`)
    rather than its own, the layer before writing the stream times the norm's scale beside the stream. Measured on
    the H100 (`rose profile --decode-step`, one call, twice): without copies at 2-64 rows GPT-2's step was 398 -> 408
    us (B=16) and 540 -> 548 (B=64), SmolLM2-135M's 750 -> 770 and 893 -> 922, so those rows keep the copies (100-140
    MB); at one row (the 1.5B-8B widths) the copies would be 1.3-9 GB, and the pair without them is 0.2-2.4 us
    slower than with them (`scripts/bench_skinny.py --pairs --rows 1`)."""
    return rows > 1


KV_IN_DECODE = os.environ.get("ROSE_KV_IN_DECODE", "1") != "0"  # (0: the store kernel before decode attention)


def kv_in_decode() -> bool:
    """Whether a Triton decode step's K and V, where nothing before stored them (GPT-2's at 2-64 rows: not its q/k/v
    GEMM, `kv_in_gemm`, nor the Llama family's rotary kernel), are stored into the cache by the decode-attention kernel
    itself (`paged_decode_attention`'s ``store``) rather than by `store_kv.store_kv_cache` before it. Measured on the
    H100 (`rose profile --decode-step --model gpt2 --input-len 200`, ``ROSE_KV_IN_DECODE=0`` against 1, alternating
    twice in one call, us per step): B=16 388.7 / 388.4 -> 380.0 / 380.6, B=64 569.6 / 570.5 -> 564.9 / 566.3 (12
    kernels fewer; the decode kernel 0.1-0.4 us slower at 16 rows). With the decode kernel then not launched early
    (``ROSE_PDL_OFF=decode``) B=64 gained 1.5 us more and B=16 lost 5-6 us: it stays early."""
    return KV_IN_DECODE


ROPE_IN_DECODE = os.environ.get("ROSE_ROPE_IN_DECODE", "1") != "0"  # (0: the rotary kernel before decode attention)


def rope_in_decode() -> bool:
    """Whether a Llama-family decode step whose q/k/v GEMM did not rotate q and k (`kv_in_gemm`; not Qwen3's q/k norms)
    leaves the rotation and the K/V store to the decode-attention kernel (`paged_decode_attention`'s ``rope``) in
    place of the `rotary.rotary_kv` kernel before it: one kernel a layer fewer at 2-64 rows. Measured on an H200
    (`rose profile --decode-step --decode-batch-sizes 16,64`, ``ROSE_ROPE_IN_DECODE=0`` against 1 in one call, us per
    step, the 1-1.5B shapes alternating twice): Llama-3.2-1B B=16 1,135.2 / 1,137.7 -> 1,086.2 / 1,087.0, B=64
    1,230.5 / 1,232.4 -> 1,207.4 / 1,208.4; Qwen2.5-1.5B 1,718.2 / 1,718.2 -> 1,647.6 / 1,647.8 and 1,860.5 / 1,862.1
    -> 1,823.4 / 1,823.6; SmolLM2-135M 652.9 -> 618.8 and 798.7 -> 786.3; Llama-3.1-8B 4,726.0 -> 4,684.7 and
    5,126.4 -> 5,101.3. The decode kernel stays launched early (``ROSE_PDL_OFF=decode``: SmolLM2 B=16 634.0, B=64
    781.5; the 1B 1,088.5 and 1,202.6)."""
    return ROPE_IN_DECODE


def kv_in_gemm(rows: int) -> bool:
    """Whether GPT-2's q/k/v GEMM stores K and V into the cache in its epilogue (`skinny_gemm.KVOut`) instead
    of the store kernel after it. Measured on the H100 (`rose profile --decode-step`, one call): at one row
    with the norm folded, GPT-2's step 312 -> 295 us; at 64 rows 592 -> 611 us (the tensor-core tile's
    scattered stores cost its GEMM more than the store kernel's 1.6 us), so more rows keep the store kernel.
    The Llama family's q/k/v GEMM at one row also rotates q and k there (`skinny_gemm.KVOut.rope`) in place of the
    rotary + KV-store kernel (`ROSE_ROPE_IN_GEMM=0` -> 1 in one call, us per B=1 step): SmolLM2-135M 529.2 -> 522.9,
    Llama-3.2-1B 1,090.2 -> 1,073.1, Qwen2.5-1.5B 1,522.5 -> 1,488.2, Llama-3.1-8B 5,407.4 -> 5,379.8."""
    return rows == 1
