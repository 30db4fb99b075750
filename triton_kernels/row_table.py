"""The row table of several outputs, written on the device from a few numbers per output.

The by-address decoders (``decompress_rows``, ``decompress_exp_rows``, ``row_checksums``) take
``rows``: the address of every page's output row. Where each output is a tensor of whole pages,
``rows`` is ``base_j + i * P`` for page ``i`` of output ``j``: this kernel writes it from
``(base_j, first page_j, pages_j)``, so the host sends three numbers per output instead of
building and uploading eight bytes per page (the activation hooks' batched restores did, about
a quarter of their host time: ``bench/results/h200_5b2a6fe_session30``). With stride 0 it
repeats each base over its rows (a group restore's per-slice shift of the page offsets).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import frozen_meta, known_args, launch, launch_known

ROW_BLOCK = 1024  # rows per program


@triton.jit
def row_table_kernel(desc_ptr, rows_ptr, outputs, STRIDE: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(j, b)``: rows ``b * BLOCK ..`` of output ``j``; ``desc`` is ``int64 [3,
    outputs]``: each output's base, first row in ``rows`` and row count."""
    j = tl.program_id(0)
    base = tl.load(desc_ptr + j)
    first = tl.load(desc_ptr + outputs + j)
    count = tl.load(desc_ptr + 2 * outputs + j)
    i = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(rows_ptr + first + i, base + i * STRIDE, mask=i < count)


def fill_row_table(desc: torch.Tensor, rows: torch.Tensor, stride: int, most_rows: int,
                   traced: bool = True) -> None:
    """Write ``rows`` (``int64 [total]``): ``rows[first_j + i] = base_j + i * stride`` for
    ``i < count_j``, from ``desc`` (``int64 [3, K]`` on the same device: per output ``base_j``,
    ``first_j`` and ``count_j``), on the current stream. ``stride``: the page size for a row
    table (``base_j`` an output's address); 0 repeats each base ``count_j`` times.
    ``most_rows``: the largest count (the grid's second axis; programs past an output's count
    write nothing). Outputs must not overlap in ``rows``."""
    if desc.dtype != torch.int64 or desc.dim() != 2 or desc.shape[0] != 3:
        raise ValueError(f"desc must be int64 [3, K], got {desc.dtype} {list(desc.shape)}")
    if rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous int64 [N], got {rows.dtype} "
                         f"{list(rows.shape)}")
    outputs = desc.shape[1]
    if outputs == 0 or most_rows <= 0:
        return
    grid = (outputs, triton.cdiv(most_rows, ROW_BLOCK))
    launch(row_table_kernel, grid, rows.device, (desc.contiguous(), rows, outputs),
           _meta(stride), traced)


def fill_row_table_known(desc: torch.Tensor, rows: torch.Tensor, stride: int,
                         most_rows: int) -> None:
    """:func:`fill_row_table` (``traced=False``) for the activation store's hot path: ``desc``
    ``int64 [3, K]`` (``K >= 1``) contiguous, on ``rows``' CUDA device (the current one) or in
    page-locked host memory, ``most_rows >= 1``; without the checks (``launch.launch_known``)."""
    args = (desc, rows, desc.shape[1])
    launch_known(row_table_kernel, (args[2], triton.cdiv(most_rows, ROW_BLOCK)),
                 rows.device.index, _meta(stride), *known_args(args), args)


@functools.cache
def _meta(stride: int):
    return frozen_meta((("STRIDE", stride), ("BLOCK", ROW_BLOCK), ("num_warps", 4)))
