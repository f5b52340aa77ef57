"""Fixed launch parameters for the Triton kernels, chosen per shape by plain lookups.

No `triton.autotune`: it cost 2.5% in a launch-dense path, and a captured CUDA graph needs the
same launch every replay anyway. THE VALUES BELOW ARE FIRST GUESSES FROM REASONING, NOT
MEASUREMENTS: re-measure them on the H100 with ``python scripts/bench_kernels.py --sweep`` and
paste the rows it prints (docs/kernels.md says how).
"""

import math

# --- paged decode -------------------------------------------------------------------------------
# Split count by (batch * kv_heads): rows (largest batch*kv_heads the row covers, splits), first
# match wins. Aim: about 512 programs (~4 per SM on 132 SMs) whatever the batch, so one sequence
# with a long context still reads at full bandwidth; a batch that fills the GPU alone is not split
# (no merge kernel). The context is divided among the splits on the device, from each sequence's
# real length, so a bound far above the real lengths (CUDA graphs pass the model's maximum) still
# spreads the real work over all splits.
DECODE_SPLITS = ((4, 128), (8, 64), (16, 32), (32, 16), (64, 8), (128, 4), (256, 2), (math.inf, 1))
DECODE_MIN_SPLIT_TOKENS = 64  # a split never covers fewer tokens (bounds the splits for short contexts)
# (tile tokens per inner iteration, num_warps, num_stages) for one query head per kv head (MHA,
# vector inner products) and for GQA groups (padded to 16 rows, tensor cores).
DECODE_MHA = (64, 4, 2)
DECODE_GQA = (64, 4, 2)

# --- paged prefill ------------------------------------------------------------------------------
# (block_m, block_n, num_warps, num_stages) by the longest query run of the batch: rows (largest
# max_seqlen_q the row covers, params), first match wins.
PREFILL = ((16, (16, 64, 4, 2)), (math.inf, (64, 64, 4, 2)))

# --- KV store -----------------------------------------------------------------------------------
# num_warps by kv_heads * head_dim (one program per token copies that many elements of K and V).
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
