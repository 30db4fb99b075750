"""The row table of several outputs, written on the device from a few numbers per output.

The by-address decoders (``decompress_rows``, ``decompress_exp_rows``, ``row_checksums``) take
``rows``: the address of every page's output row. Where each output is a tensor of whole pages,
``rows`` is ``base_j + i * P`` for page ``i`` of output ``j``: this kernel writes it from
``(base_j, first page_j, pages_j)``, so the host sends three numbers per output instead of
building and uploading eight bytes per page (the activation hooks' batched restores did, about
a quarter of their host time: ``bench/results/h200_5b2a6fe_session30``). With stride 0 it
repeats each base over its rows (a group restore's per-slice shift of the page offsets).

:func:`gather_slice_meta` does the same for a batch of stored slices in one launch: each page's
row, and its offset, size and kind read from its own slice's metadata, so a restore of several
tensors neither concatenates their metadata on the host side nor builds a row table apart.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import frozen_meta, int_class, launch, launch_known, ptr_class

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


def fill_row_table_at(index: int, outputs: int, stride: int, most_rows: int, addrs: tuple,
                      args) -> None:
    """:func:`fill_row_table` (``traced=False``) for the activation store's hot path, without
    its checks (``K = outputs >= 1``, ``most_rows >= 1``; ``launch.launch_known``), given the
    addresses ``addrs`` of ``(desc, rows)`` on CUDA device ``index`` (``desc``, ``int64 [3,
    K]``, read at its host address when in page-locked memory: no tensor is made for it);
    ``args`` (the tensors and ``outputs``, or a function that makes them) as for
    ``launch.launch_known``."""
    desc, rows = addrs
    classes = (ptr_class(torch.int64, desc), ptr_class(torch.int64, rows), int_class(outputs))
    launch_known(row_table_kernel, (outputs, triton.cdiv(most_rows, ROW_BLOCK)), index,
                 _meta(stride), classes, (desc, rows, outputs), args)


# rows of gather_slice_meta's desc: addresses of each slice's page offsets (int64, from the
# slice's first byte), sizes (int32) and kinds (uint8); where its bytes start in the payload;
# its first page in the outputs; its page count; the address of its first page's output row
SLICE_DESC_ROWS = 7


@triton.jit
def slice_meta_kernel(desc_ptr, offsets_ptr, sizes_ptr, kinds_ptr, rows_ptr, slices,
                      PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(j, b)``: pages ``b * BLOCK ..`` of slice ``j`` (``desc``: ``int64
    [SLICE_DESC_ROWS, slices]``)."""
    j = tl.program_id(0)
    rel = tl.load(desc_ptr + j).to(tl.pointer_type(tl.int64))
    size = tl.load(desc_ptr + slices + j).to(tl.pointer_type(tl.int32))
    kind = tl.load(desc_ptr + 2 * slices + j).to(tl.pointer_type(tl.uint8))
    shift = tl.load(desc_ptr + 3 * slices + j)
    first = tl.load(desc_ptr + 4 * slices + j)
    count = tl.load(desc_ptr + 5 * slices + j)
    row = tl.load(desc_ptr + 6 * slices + j)
    i = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < count
    tl.store(offsets_ptr + first + i, tl.load(rel + i, mask=m) + shift, mask=m)
    tl.store(sizes_ptr + first + i, tl.load(size + i, mask=m), mask=m)
    tl.store(kinds_ptr + first + i, tl.load(kind + i, mask=m), mask=m)
    tl.store(rows_ptr + first + i, row + i * PAGE, mask=m)


def gather_slice_meta(desc: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor,
                      kinds: torch.Tensor, rows: torch.Tensor, page_size: int, most_pages: int,
                      traced: bool = True) -> None:
    """For each slice ``j`` of ``desc`` (``int64 [SLICE_DESC_ROWS, K]``, see above) and page
    ``i < count_j``, at ``k = first_j + i``: ``offsets[k] = rel_j[i] + shift_j`` (``int64``),
    ``sizes[k] = sizes_j[i]`` (``int32``), ``kinds[k] = kinds_j[i]`` (``uint8``) and
    ``rows[k] = row_j + i * page_size`` (``int64``), on the current stream. The addresses in
    ``desc`` must hold ``count_j`` entries each, on the outputs' device; ``most_pages``: the
    largest count. Slices must not overlap in the outputs."""
    if desc.dtype != torch.int64 or desc.dim() != 2 or desc.shape[0] != SLICE_DESC_ROWS:
        raise ValueError(f"desc must be int64 [{SLICE_DESC_ROWS}, K], got {desc.dtype} "
                         f"{list(desc.shape)}")
    for name, t, dtype in (("offsets", offsets, torch.int64), ("sizes", sizes, torch.int32),
                           ("kinds", kinds, torch.uint8), ("rows", rows, torch.int64)):
        if t.dtype != dtype or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} [N], got {t.dtype} "
                             f"{list(t.shape)}")
    if desc.shape[1] == 0 or most_pages <= 0:
        return
    args = (desc.contiguous(), offsets, sizes, kinds, rows, desc.shape[1])
    launch(slice_meta_kernel, (args[5], triton.cdiv(most_pages, ROW_BLOCK)), rows.device,
           args, _slice_meta(page_size), traced)


def gather_slice_meta_at(index: int, slices: int, most_pages: int, page_size: int,
                         addrs: tuple, args) -> None:
    """:func:`gather_slice_meta` (``traced=False``) without its checks (``K = slices >= 1``,
    ``most_pages >= 1``; ``launch.launch_known``), given the addresses ``addrs`` of ``(desc,
    offsets, sizes, kinds, rows)`` on CUDA device ``index`` (``desc`` read at its host address
    when in page-locked memory); ``args`` (the tensors and ``slices``, or a
    function that makes them) as for ``launch.launch_known``."""
    desc, offsets, sizes, kinds, rows = addrs
    classes = (ptr_class(torch.int64, desc), ptr_class(torch.int64, offsets),
               ptr_class(torch.int32, sizes), ptr_class(torch.uint8, kinds),
               ptr_class(torch.int64, rows), int_class(slices))
    launch_known(slice_meta_kernel, (slices, triton.cdiv(most_pages, ROW_BLOCK)), index,
                 _slice_meta(page_size), classes, (*addrs, slices), args)


@functools.cache
def _slice_meta(page_size: int):
    return frozen_meta((("PAGE", page_size), ("BLOCK", ROW_BLOCK), ("num_warps", 4)))


@functools.cache
def _meta(stride: int):
    return frozen_meta((("STRIDE", stride), ("BLOCK", ROW_BLOCK), ("num_warps", 4)))
