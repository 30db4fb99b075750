"""Page checksums: the optional ``checksums int32 [N]`` of ``torch_pagecomp.format``.

One program per page reads it as ``uint32`` words, ``BLOCK`` at a time, offsets and mixes each
word (murmur3's finaliser: a bijection, so one changed word always changes the sum) and adds
them up modulo ``2^32``. The reference is ``torch_pagecomp.cpu_codec.page_checksums_cpu``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .constants import CHECKSUM_MUL1, CHECKSUM_MUL2, CHECKSUM_STEP
from .launch import config_meta, launch


@dataclass(frozen=True)
class ChecksumConfig:
    """Settings of ``page_checksum_kernel``: its constexprs and ``num_warps``."""

    PAGE: int  # bytes per page
    ROWS: bool  # pages given by a table of addresses (``row_checksums``)
    BLOCK: int = 1024  # words per step (divides every page size's P / 4)
    num_warps: int = 4


_STEP = tl.constexpr(CHECKSUM_STEP)
_MUL1 = tl.constexpr(CHECKSUM_MUL1)
_MUL2 = tl.constexpr(CHECKSUM_MUL2)


@triton.jit
def page_checksum_kernel(
    pages_ptr,  # uint8 [N, P], rows contiguous, 4-byte aligned; or (ROWS) int64 [N] addresses
    out_ptr,  # int32 [N]
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    page = tl.program_id(0).to(tl.int64)
    if ROWS:  # pages of several tensors: the address of each in a table
        words = tl.load(pages_ptr + page).to(tl.pointer_type(tl.uint32))
    else:
        words = (pages_ptr + page * PAGE).to(tl.pointer_type(tl.uint32))
    acc = tl.zeros((BLOCK,), dtype=tl.uint32)
    for start in range(0, PAGE // 4, BLOCK):
        j = start + tl.arange(0, BLOCK)
        h = tl.load(words + j) + (j + 1).to(tl.uint32) * _STEP
        h ^= h >> 16
        h *= _MUL1
        h ^= h >> 13
        h *= _MUL2
        h ^= h >> 16
        acc += h
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + page, total.to(tl.int32, bitcast=True))


def page_checksums(pages: torch.Tensor, traced: bool = True,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Checksums of uncompressed pages on their device and current stream.

    Args:
        pages: ``uint8 [N, P]``, rows contiguous, ``P`` a power of two from 4096 to 65536. A
            view that does not start 4-byte aligned is copied once.
        traced: ``False`` launches directly (see ``torch_pagecomp.kernels.launch``).
        out: ``int32 [N]`` (contiguous) to write into, or ``None``.
    Returns:
        ``int32 [N]`` (the format's page checksums), never synchronising with the host.
    """
    n, page_size = pages.shape
    if pages.storage_offset() % 4:
        pages = pages.clone()
    if out is None:
        out = torch.empty((n,), dtype=torch.int32, device=pages.device)
    if n:
        launch(page_checksum_kernel, (n,), pages.device, (pages, out),
               config_meta(ChecksumConfig(page_size, False)), traced)
    return out


def row_checksums(rows: torch.Tensor, page_size: int, out: torch.Tensor) -> None:
    """:func:`page_checksums` of pages given by address: ``rows`` ``int64 [N]`` on the device,
    each the 4-byte aligned address of ``page_size`` bytes inside a live tensor of that device
    (the decoder's row table, ``lz4_decompress.decompress_rows``); ``out`` ``int32 [N]``.
    Launches directly (addresses are not traceable)."""
    if rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous int64 [N] tensor, got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    if rows.numel():
        launch(page_checksum_kernel, (rows.numel(),), rows.device, (rows, out),
               config_meta(ChecksumConfig(page_size, True)), traced=False)
