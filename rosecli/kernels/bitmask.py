"""A grammar's token mask on the logits (structured output, rosecli.engine.structured): one kernel
for the whole batch instead of the torch reference's gather, shift, compare and masked fill."""

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _apply_bitmask_kernel(x_ptr, x_stride, m_ptr, m_stride, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    words = tl.load(m_ptr + row * m_stride + cols // 32, mask=inside, other=-1)
    off = ((words >> (cols % 32)) & 1) == 0
    tl.store(x_ptr + row * x_stride + cols, float("-inf"), mask=inside & off)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """``logits[i, t] = -inf`` where bit ``t % 32`` of ``bitmask[i, t // 32]`` is 0, in place:
    logits [B, V] (unit column stride), bitmask [>=B, >=ceil(V/32)] int32 (contiguous rows)."""
    B, V = logits.shape
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1 and bitmask.dtype == torch.int32
    if B:
        _apply_bitmask_kernel[(B, triton.cdiv(V, BLOCK))](logits, logits.stride(0), bitmask, bitmask.stride(0), V,
                                                          BLOCK=BLOCK)
