"""Page checksums: the optional ``checksums int32 [N]`` of ``torch_pagecomp.format``.

The checksum is the page's xxHash32 (seed 0), whose four lanes each run through the page's
16-byte stripes in order: a chain per lane, not a sum that threads could split. So each program
takes ``BLOCK`` pages and each page's four lanes are four elements of a ``[BLOCK, 4]`` tile
(one 16-byte load a page per stripe); the parallelism is across pages. Four stripes are
loaded before they are mixed in, so loads overlap the chains. The reference is
``torch_pagecomp.cpu_codec.page_checksums_cpu``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .constants import XXH_PRIME1, XXH_PRIME2, XXH_PRIME3
from .launch import config_meta, interpreting, launch


@dataclass(frozen=True)
class ChecksumConfig:
    """Settings of ``page_checksum_kernel``: its constexprs and ``num_warps``."""

    PAGE: int  # bytes per page
    ROWS: bool  # pages given by a table of addresses (``row_checksums``)
    BLOCK: int = 16  # pages per program (see :func:`checksum_config`)
    num_warps: int = 1


def checksum_config(page_size: int, rows: bool) -> ChecksumConfig:
    """The settings of a launch: on the GPU 16 pages a program (enough programs to fill it
    from a few thousand pages on); under the interpreter 256 (its cost is per operation, and a
    chain is as many operations as the page has stripes)."""
    return ChecksumConfig(page_size, rows, BLOCK=256 if interpreting() else 16)


_P1 = tl.constexpr(XXH_PRIME1)
_P2 = tl.constexpr(XXH_PRIME2)
_P3 = tl.constexpr(XXH_PRIME3)
_MINUS_P1 = tl.constexpr(-XXH_PRIME1 & 0xFFFFFFFF)
_P1_PLUS_P2 = tl.constexpr((XXH_PRIME1 + XXH_PRIME2) & 0xFFFFFFFF)


@triton.jit
def _rotl(x, r):
    return (x << r) | (x >> (32 - r))


@triton.jit
def _round(v, w):
    """One stripe into the lanes: ``v = rotl(v + w * P2, 13) * P1``."""
    return _rotl(v + w * _P2, 13) * _P1


@triton.jit
def page_checksum_kernel(
    pages_ptr,  # uint8 [N, P], rows contiguous, 4-byte aligned; or (ROWS) int64 [N] addresses
    out_ptr,  # int32 [N]
    n,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    page = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = page < n
    lane = tl.arange(0, 4)[None, :]
    if ROWS:  # pages of several tensors: the address of each in a table
        row = tl.load(pages_ptr + page, mask=live, other=0)
        words = row.to(tl.pointer_type(tl.uint32))[:, None] + lane
    else:
        words = (pages_ptr + page * PAGE).to(tl.pointer_type(tl.uint32))[:, None] + lane
    mask = live[:, None] & (lane < 4)
    # lanes start at seed + P1 + P2, seed + P2, seed, seed - P1 (seed 0)
    z = tl.zeros((BLOCK, 4), dtype=tl.uint32)
    v = tl.where(lane == 0, z + _P1_PLUS_P2,
                 tl.where(lane == 1, z + _P2, tl.where(lane == 2, z, z + _MINUS_P1)))
    for stripe in range(0, PAGE // 16, 4):
        # four stripes loaded before any is mixed in: the loads overlap the chains
        w0 = tl.load(words + stripe * 4, mask=mask, other=0)
        w1 = tl.load(words + (stripe + 1) * 4, mask=mask, other=0)
        w2 = tl.load(words + (stripe + 2) * 4, mask=mask, other=0)
        w3 = tl.load(words + (stripe + 3) * 4, mask=mask, other=0)
        v = _round(_round(_round(_round(v, w0), w1), w2), w3)
    r = tl.where(lane == 0, 1, tl.where(lane == 1, 7, tl.where(lane == 2, 12, 18))).to(tl.uint32)
    h = tl.sum(_rotl(v, r), axis=1) + PAGE
    h ^= h >> 15
    h *= _P2
    h ^= h >> 13
    h *= _P3
    h ^= h >> 16
    tl.store(out_ptr + page, h.to(tl.int32, bitcast=True), mask=live)


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
        cfg = checksum_config(page_size, False)
        launch(page_checksum_kernel, (triton.cdiv(n, cfg.BLOCK),), pages.device, (pages, out, n),
               config_meta(cfg), traced)
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
        cfg = checksum_config(page_size, True)
        launch(page_checksum_kernel, (triton.cdiv(rows.numel(), cfg.BLOCK),), rows.device,
               (rows, out, rows.numel()), config_meta(cfg), traced=False)
