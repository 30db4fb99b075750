"""Fixed-stride -> packed payloads: copy each page's stored bytes back to back.

One program per (page, chunk of ``BLOCK`` bytes): program ``(i, j)`` copies bytes
``[j * BLOCK, min((j + 1) * BLOCK, size_i))`` of row ``i`` to ``packed[offsets[i] + ...]``.
Offsets come from a device-side cumulative sum, so nothing synchronises with the host: up to
``ONE_PROGRAM_PAGES`` pages one program of :func:`page_offsets_kernel`, where five small
PyTorch kernels (zeros, clamp, cast, and a scan of two) took as many launches. The ring
pipeline packs every batch from a worker thread that shares the GIL, and there each launch
cost the host about 50 us: with the exponent codec (89 us of encoding a 64 MiB batch on an
H200) the host's launches, not the GPU, set the pace of its batches. One program took 17-24 us
of GPU and 18-20 of host time for 4096-16384 pages against PyTorch's 51-58 (host-bound), but
its GPU time grows with the pages (88 us at 65536, 354 at 262144), where PyTorch's scan stays
at 57: past the bound, PyTorch's way (H200, ``bench/dev_pipeline_profile.py --offsets``,
``bench/results/h200_session68``).
Bytes of ``packed`` past ``offsets[N]`` are zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch

PACK_BLOCK = 1024  # bytes per program (divides every page size)
PACK_WARPS = 1  # 32 bytes per lane: two 16-byte loads, 32 byte stores


OFFSETS_BLOCK = 2048  # sizes a step of the offsets' one program
ONE_PROGRAM_PAGES = 1 << 15  # pages whose offsets one program sums (more: PyTorch's scan)


@triton.jit
def page_offsets_kernel(sizes_ptr, offsets_ptr, n, PAGE_SIZE: tl.constexpr,
                        BLOCK: tl.constexpr):
    """``offsets[0] = 0`` and ``offsets[i + 1] = offsets[i] + size_i`` (each size clamped to
    ``[0, PAGE_SIZE]``, as :func:`pack_pages_kernel` reads it) for the ``n`` sizes; one program,
    ``BLOCK`` sizes a step (a batch's 16384 pages are 16 steps)."""
    total = tl.zeros([], tl.int64)
    tl.store(offsets_ptr, total)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        size = tl.load(sizes_ptr + idx, mask=idx < n, other=0)
        size = tl.minimum(tl.maximum(size, 0), PAGE_SIZE).to(tl.int64)
        tl.store(offsets_ptr + 1 + idx, total + tl.cumsum(size, axis=0), mask=idx < n)
        total += tl.sum(size, axis=0)


@triton.jit
def pack_pages_kernel(
    payload_ptr,  # uint8 [N, P]
    sizes_ptr,  # int32 [N]
    offsets_ptr,  # int64 [N + 1]
    packed_ptr,  # uint8 [N * P]
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    page = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    size = tl.load(sizes_ptr + page)
    size = tl.minimum(tl.maximum(size, 0), PAGE_SIZE)  # garbage sizes never read past the row
    if start < size:  # chunks past the stored bytes have nothing to copy
        dst = tl.load(offsets_ptr + page)
        idx = start + tl.arange(0, BLOCK)
        # the whole chunk lies in the row: unmasked, aligned, so 16-byte loads; the stores
        # land at any byte offset and stop at the page's size
        data = tl.load(payload_ptr + page * PAGE_SIZE + idx)
        tl.store(packed_ptr + dst + idx, data, mask=idx < size)


def pack_pages(payload: torch.Tensor, sizes: torch.Tensor, traced: bool = True,
               zero_tail: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack a fixed-stride payload.

    Args:
        payload: ``uint8 [N, P]`` fixed-stride payload.
        sizes: ``int32 [N]`` stored bytes per page (clamped to ``[0, P]``).
        traced: ``False`` launches directly (see ``torch_pagecomp.kernels.launch``).
        zero_tail: ``False`` leaves the bytes past ``offsets[N]`` unwritten (a caller that
            reads only ``packed[:offsets[N]]`` saves a memset of ``N * P`` bytes).
    Returns:
        ``(packed uint8 [N * P], offsets int64 [N + 1])``; page ``i`` is
        ``packed[offsets[i]:offsets[i + 1]]`` and bytes past ``offsets[N]`` are zero.
    """
    n, page_size = payload.shape
    offsets = page_offsets(sizes, page_size, traced)
    alloc = torch.zeros if zero_tail else torch.empty
    packed = alloc(n * page_size, dtype=torch.uint8, device=payload.device)
    if n:
        grid = (n, triton.cdiv(page_size, PACK_BLOCK))
        launch(pack_pages_kernel, grid, payload.device, (payload, sizes, offsets, packed),
               dict(PAGE_SIZE=page_size, BLOCK=PACK_BLOCK, num_warps=PACK_WARPS), traced)
    return packed, offsets


def page_offsets(sizes: torch.Tensor, page_size: int, traced: bool = True) -> torch.Tensor:
    """``int64 [N + 1]`` on ``sizes``' device: where each of ``N`` pages of ``sizes`` (``int32
    [N]``, each clamped to ``[0, page_size]``) starts when packed back to back, then their
    total: :func:`page_offsets_kernel`, one launch, up to ``ONE_PROGRAM_PAGES`` pages, else
    PyTorch's scan (see the module docstring). ``traced`` as :func:`pack_pages`."""
    n = sizes.numel()
    if n > ONE_PROGRAM_PAGES:
        offsets = torch.zeros(n + 1, dtype=torch.int64, device=sizes.device)
        torch.cumsum(sizes.clamp(0, page_size).to(torch.int64), dim=0, out=offsets[1:])
        return offsets
    offsets = torch.empty(n + 1, dtype=torch.int64, device=sizes.device)
    launch(page_offsets_kernel, (1,), sizes.device, (sizes, offsets, n),
           dict(PAGE_SIZE=page_size, BLOCK=OFFSETS_BLOCK, num_warps=4), traced)
    return offsets


@triton.jit
def publish_kernel(src_ptr, dst_ptr):
    """``dst[0] = src[0]`` (int64), one program: ``dst`` may be page-locked host memory."""
    tl.store(dst_ptr, tl.load(src_ptr))


def publish_to_host(src: torch.Tensor, dst: torch.Tensor, traced: bool = True) -> None:
    """Write one ``int64`` from the GPU into host memory with a kernel, not a copy.

    Args:
        src: ``int64 [1]`` on the GPU (e.g. ``offsets[N:]``, a batch's packed size).
        dst: ``int64 [1]`` in page-locked host memory from ``cudaHostAlloc`` (torch's
            ``pin_memory=True``), which a kernel can store to directly (unified addressing).
        traced: as :func:`pack_pages`.

    The value is on the host once an event recorded after this launch completed. A copy to
    the host would queue on the copy engine behind earlier downloads (served in order), so a
    pipeline that sizes each download from this value would wait for the previous download
    before queueing the next one, and the link would idle while the host reacts.
    """
    if src.dtype != torch.int64 or dst.dtype != torch.int64 or src.numel() < 1 or dst.numel() < 1:
        raise ValueError(f"publish_to_host takes int64 tensors, got {src.dtype} -> {dst.dtype}")
    launch(publish_kernel, (1,), src.device, (src, dst), dict(num_warps=1), traced)
