"""A decode step's first kernel: each row's input id picked from the token pool, and its embedding row gathered.

A decode graph used to begin with torch's ``tokens.index_select(0, src)`` (each row's id: the last step's sample or
the id the host wrote, `runner._Staging`) and then one ``index_select`` per embedding table (GPT-2 has two: tokens
and positions), each a kernel of a few hundred bytes behind the one before. `gather_embed` is all of that in one
launch (PDL, `kernels.pdl`): row ``i`` of the output is ``weight[tokens[src[i]]]`` and, given a position table, row
``i`` of the second output is ``pos_weight[positions[i]]``.

The ids are the engine's own (checked against the vocabulary when a request arrives, `inputs.InputProcessor`, or
sampled, never a padded row); positions are below the model's context length. Nothing here checks them again.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from rosecli.kernels.pdl import pdl_begin, use_pdl


@triton.jit
def _embed_kernel(tokens_ptr, src_ptr, w_ptr, out_ptr, pos_ptr, pw_ptr, res_ptr, D, w_stride, pw_stride,
                  BLOCK: tl.constexpr, POS: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    tok = tl.load(tokens_ptr + tl.load(src_ptr + row))
    tl.store(out_ptr + row * D + cols, tl.load(w_ptr + tok * w_stride + cols, mask=mask), mask=mask)
    if POS:
        pos = tl.load(pos_ptr + row)
        tl.store(res_ptr + row * D + cols, tl.load(pw_ptr + pos * pw_stride + cols, mask=mask), mask=mask)


def gather_embed_ref(tokens: torch.Tensor, src: torch.Tensor, weight: torch.Tensor,
                     positions: Optional[torch.Tensor] = None,
                     pos_weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(``weight[tokens[src]]``, ``pos_weight[positions]`` or None): what the model's embedding modules give."""
    x = weight.index_select(0, tokens.index_select(0, src))
    return x, (pos_weight.index_select(0, positions) if pos_weight is not None else None)


def gather_embed(tokens: torch.Tensor, src: torch.Tensor, weight: torch.Tensor,
                 positions: Optional[torch.Tensor] = None,
                 pos_weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`gather_embed_ref` in one launch. tokens, src, positions: int64 (src and positions [rows]); weight,
    pos_weight: [*, D] with contiguous rows, one dtype."""
    rows, D = src.shape[0], weight.shape[1]
    if weight.stride(1) != 1 or (pos_weight is not None and (pos_weight.stride(1) != 1 or pos_weight.shape[1] != D)):
        raise ValueError("gather_embed reads tables of contiguous rows of one width")
    if (pos_weight is None) != (positions is None):
        raise ValueError("gather_embed: a position table needs the positions, and the positions a table")
    out = torch.empty((rows, D), dtype=weight.dtype, device=weight.device)
    res = torch.empty_like(out) if pos_weight is not None else None
    if rows == 0:
        return out, res
    block = min(1024, triton.next_power_of_2(D))
    pdl = use_pdl(weight.device, "embed")
    _embed_kernel[(rows, triton.cdiv(D, block))](
        tokens, src, weight, out, positions if positions is not None else src,
        pos_weight if pos_weight is not None else weight, res if res is not None else out, D, weight.stride(0),
        pos_weight.stride(0) if pos_weight is not None else 0, BLOCK=block, POS=pos_weight is not None, PDL=pdl,
        num_warps=4, launch_pdl=pdl)
    return out, res
