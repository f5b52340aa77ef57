"""Fixed launch parameters for the Triton kernels, chosen per shape by plain lookups.

No `triton.autotune`: it cost 2.5% in a launch-dense path, and a captured CUDA graph needs the
same launch every replay anyway. Every value here must be (re-)measured on the H100 with
``python scripts/bench_kernels.py --sweep``, which prints rows in this file's form; each section
says what has been measured and what is still a guess.
"""

import math

# --- paged decode -------------------------------------------------------------------------------
# Measured on an H100 (torch 2.11, triton 3.6, fp16, head_dim 64, block 16) with the previous split
# rule (splits = ceil(528 / (batch*kv_heads)), at least 256 tokens each, from the host bound):
# tensor-core inner products won at every measured shape, MHA included (the group is padded to 16
# rows; the kernel is bound by memory, not math); with batch*kv_heads >= 256 programs, 64-token
# tiles and 2 warps won, with fewer, 128-token tiles and 4 warps. num_stages was Triton's default.
#
# Split count by batch*kv_heads: rows (largest batch*kv_heads the row covers, splits), first match
# wins; about 512 programs whatever the batch (the measured ~528), so one sequence with a long
# context still reads at full bandwidth, and a batch that fills the GPU alone is not split (no
# merge kernel). Each sequence's real length is divided among the splits on the device, whole
# multiples of DECODE_MIN_SPLIT_TOKENS, so a bound far above the real lengths (CUDA graphs pass
# the model's maximum) still spreads the real work. NOT YET MEASURED in this form: re-sweep.
# 2026-11-22 on the H100: with 128-token splits, B=1 ctx=1024 (GPT-2) took 59 us and SmolLM2 B=8 83 us,
# against 13 us and 14 us in the sweep with splits of at least 256 tokens; back to the sweep's values.
DECODE_SPLITS = ((4, 128), (8, 64), (16, 32), (32, 16), (64, 8), (256, 4), (512, 2), (math.inf, 1))
DECODE_MIN_SPLIT_TOKENS = 256  # a split never covers fewer tokens (caps the split count for short bounds)
# (tile tokens per inner iteration, num_warps, num_stages) by batch*kv_heads, first match wins.
DECODE_TILE = ((128, (128, 4, 3)), (math.inf, (64, 2, 3)))
DECODE_USE_DOT = True  # tensor-core inner products for MHA too (measured, see above)

# --- paged prefill ------------------------------------------------------------------------------
# (block_m, block_n, num_warps, num_stages) by the longest query run of the batch: rows (largest
# max_seqlen_q the row covers, params), first match wins. block_m counts rows = query tokens x the
# GQA group's heads. NOT YET MEASURED: re-sweep.
PREFILL = ((16, (16, 64, 4, 2)), (math.inf, (64, 64, 4, 2)))

# --- KV store -----------------------------------------------------------------------------------
# num_warps by kv_heads * head_dim (one program per token copies that many elements of K and V).
# NOT YET MEASURED: re-sweep.
STORE_WARPS = ((256, 1), (1024, 4), (math.inf, 8))


def lookup(rows, key):
    """The value of the first ``(bound, value)`` row with ``key <= bound``."""
    for bound, value in rows:
        if key <= bound:
            return value
    raise ValueError(f"no launch-table row covers {key}")


def decode_splits(batch: int, kv_heads: int, max_context_len: int) -> int:
    """Splits for a decode launch: the table's count, capped so no split is shorter than the minimum."""
    return max(1, min(lookup(DECODE_SPLITS, batch * kv_heads),
                      math.ceil(max_context_len / DECODE_MIN_SPLIT_TOKENS)))
