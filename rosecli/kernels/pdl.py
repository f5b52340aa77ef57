"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A kernel launched with ``launch_pdl=True`` may be scheduled while the kernel before it in the stream
still runs (once every program of that one has called ``gdc_launch_dependents``, or ended): its
programs become resident and wait on the device (``gdc_wait``) until the kernel before has ended and
its writes are visible. Inside a CUDA graph that hides the launch gap between two kernels. Each of
our kernels calls ``gdc_launch_dependents`` as it starts, so the next one can be scheduled early; a
kernel that is not launched this way (cuBLAS, torch's) is ordered as usual.

The rule every kernel here keeps: with PDL on, nothing that a kernel before it writes is read, and nothing that a
kernel before it reads is written, before ``gdc_wait`` returns. `pdl_begin` waits first. What no kernel writes may
be read before it: the skinny GEMM fetches its first weight tile and its epilogue's bias and rows' positions and
cache slots (not the rotary tables' entries nor the next norm's scale: both measured slower, `_skinny_kernel`),
`add_norm` its weight and biases, and decode attention each sequence's length, position and slot and the rotary
tables; a kernel launched early then has them when the kernel before ends. The sequences' inputs are written by the
step's first kernel (`stage_inputs`, launched without PDL), which ends before the second kernel's ``gdc_wait``
returns, and that one lets the third launch only after it: every kernel from the third on is launched after the
inputs are written.

``ROSE_PDL=0`` turns it off for every kernel, ``ROSE_PDL_OFF=decode,argmax`` for the kernels named (the
``kernel`` argument of `use_pdl`: skinny, decode, merge, norm, rotary, activation, store, argmax, embed,
sampler), for A/B measurements; ``ROSE_SKINNY_PDL=0`` (older) is ``ROSE_PDL_OFF=skinny``.

While it waits, a kernel launched early can also ask for what it will read into the L2 cache (`l2_prefetch`):
the skinny GEMM at 2-64 rows asks for the rest of its weights. Such a step is bound by latency, not by the read
rate, so those reads then overlap the kernel before instead of following it. A prefetch is a hint: it changes no
result, and since the L2 is where the device's writes meet, a line fetched before a kernel before writes it is
not stale. ``ROSE_PREFETCH_OFF=skinny`` (or ``all``) turns it off.
"""

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = os.environ.get("ROSE_PDL", "1") != "0"
OFF = frozenset([k for k in os.environ.get("ROSE_PDL_OFF", "").split(",") if k]
                + (["skinny"] if os.environ.get("ROSE_SKINNY_PDL", "1") == "0" else []))
PREFETCH_OFF = frozenset(k for k in os.environ.get("ROSE_PREFETCH_OFF", "").split(",") if k)
LINE_BYTES = 128  # the L2's line: what one prefetch brings


@functools.lru_cache(maxsize=None)
def use_pdl(device: torch.device, kernel: str = "") -> bool:
    """Whether ``kernel`` (a name for ``ROSE_PDL_OFF``) is launched with PDL on ``device``: a CUDA device of compute
    capability 9 or later."""
    return ENABLED and kernel not in OFF and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def use_prefetch(device: torch.device, kernel: str) -> bool:
    """Whether ``kernel`` (skinny), launched early (`use_pdl`), prefetches its reads into L2 while it waits."""
    return "all" not in PREFETCH_OFF and kernel not in PREFETCH_OFF and use_pdl(device, kernel)


@triton.jit
def l2_prefetch(ptrs):
    """Asks for the L2 lines holding ``ptrs`` (a tensor of pointers, each line once is enough), not waiting for them
    nor keeping anything in registers: PTX ``prefetch.global.L2``, one per element. Not in the interpreter."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """A PDL-launched kernel's first step: wait for the kernel before to end, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
