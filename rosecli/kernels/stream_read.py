"""A plain streaming read of device memory: what the device's read ceiling is measured with
(`rosecli.engine.roofline`), the same kernel as scripts/bench_kernels.py's read floor.

Each program reads one contiguous piece of a flat tensor, ``BLOCK`` elements a load, and writes
the sum of its piece (in float32) so the loads cannot be dropped.
"""

import torch
import triton
import triton.language as tl

BLOCK = 4096


def stream_read_sum_ref(x: torch.Tensor, programs: int) -> torch.Tensor:
    """x: flat, ``programs`` equal pieces -> [programs] float32 sums."""
    return x.view(programs, -1).float().sum(dim=1)


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, n_per, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * n_per
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, n_per, BLOCK):
        acc += tl.load(x_ptr + base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def stream_read_sum(x: torch.Tensor, out: torch.Tensor, block: int = BLOCK, num_warps: int = 4) -> torch.Tensor:
    """Sum ``out.numel()`` equal contiguous pieces of the flat, contiguous ``x`` into ``out``
    (float32). Each piece must be a whole number of ``block`` elements."""
    programs = out.numel()
    n_per = x.numel() // programs
    if x.numel() != programs * n_per or n_per % block:
        raise ValueError(f"stream_read_sum: {x.numel()} elements are not {programs} pieces of whole "
                         f"{block}-element blocks")
    _stream_read_kernel[(programs,)](x, out, n_per, BLOCK=block, num_warps=num_warps)
    return out
