"""Public Python API: ``compress``, ``decompress``, ``pack``, ``page_checksums``.

These validate inputs (errors name the problem), ask ``backend.route`` where the call runs and
call the ``torch.ops.pagecomp`` operators (eager calls on plain CUDA tensors launch the same
kernels directly, without the operator dispatch: ``backend.direct_launch_ok``). Only
``decompress`` (to raise on corrupt pages, unless asked for the statuses) and ``pack`` (to trim
to the exact size, unless ``exact=False``) synchronise.
"""

from __future__ import annotations

import torch

from . import format as fmt
from ._ops import checksum_eager, compress_eager, decompress_eager
from .backend import BACKENDS, CPU, INTERPRET, KERNELS, route  # noqa: F401 (BACKENDS)
from .format import CompressedPages, PageCompError


def compress(
    data: torch.Tensor,
    page_size: int | None = None,
    element_size: int = 1,
    backend: str = "auto",
    checksum: bool = False,
) -> CompressedPages:
    """Compress a batch of pages, each on its own.

    Args:
        data: ``uint8 [N, P]``, or 1-D ``uint8`` of ``N * page_size`` bytes; CPU or CUDA.
        page_size: ``P``, a power of two from 4096 to 65536 (default: ``data.shape[1]``, or 4096
            for 1-D input).
        element_size: 1 (bytes), 2 (bf16/fp16) or 4 (fp32/int32): bit-shuffle each page by this
            element width before LZ4.
        backend: ``"auto"`` (see ``select_backend``), ``"cpu"`` (lz4) or ``"triton"``.
        checksum: also store each page's checksum (``checksums int32 [N]``, one more read of
            the pages): :func:`decompress` then flags a page that decodes to other bytes than
            were compressed (``STATUS_CHECKSUM``) instead of returning it.

    Returns:
        A fixed-stride :class:`CompressedPages` on ``data``'s device: ``payload uint8 [N, P]``,
        ``sizes int32 [N]``, ``kinds uint8 [N]`` (and ``checksums``). No host synchronisation
        on the GPU path.
    """
    pages = fmt.as_pages(data, page_size)
    fmt.check_element_size(element_size)
    page_size = pages.shape[1]
    where = route(backend, pages.shape[0], pages.device, (pages,))
    if where == CPU:
        payload, sizes, kinds = torch.ops.pagecomp.compress(pages.cpu(), element_size)
        payload, sizes, kinds = (t.to(pages.device) for t in (payload, sizes, kinds))
    elif where == KERNELS:
        payload, sizes, kinds = compress_eager(pages, element_size)
    elif pages.device.type == "cuda":  # OP, or CPU_SERVED: the op serves it on the host
        payload, sizes, kinds = torch.ops.pagecomp.compress(pages, element_size)
    elif where == INTERPRET:
        from .kernels.lz4_compress import compress_pages

        payload, sizes, kinds = compress_pages(pages, element_size)
    else:  # UPLOAD: a host batch sent through the GPU
        gpu = pages.to("cuda", non_blocking=pages.is_pinned())
        payload, sizes, kinds = (t.cpu() for t in torch.ops.pagecomp.compress(gpu, element_size))
    sums = page_checksums(pages, backend) if checksum else None
    return CompressedPages(payload, sizes, kinds, page_size, checksums=sums)


def page_checksums(data: torch.Tensor, backend: str = "auto",
                   page_size: int | None = None) -> torch.Tensor:
    """The format's checksum of each page (``torch_pagecomp.format``): its xxHash32, seed 0,
    as ``int32`` (``& 0xFFFFFFFF`` gives what any xxHash library returns for the page).

    Args:
        data: ``uint8 [N, P]``, or 1-D ``uint8`` of ``N * page_size`` bytes; CPU or CUDA.
        backend, page_size: as for :func:`compress`.
    Returns:
        ``int32 [N]`` on ``data``'s device; no host synchronisation.
    """
    pages = fmt.as_pages(data, page_size)
    where = route(backend, pages.shape[0], pages.device, (pages,))
    if where == CPU:
        return torch.ops.pagecomp.checksum(pages.cpu()).to(pages.device)
    if where == KERNELS:
        return checksum_eager(pages)
    if pages.device.type == "cuda":  # OP, or CPU_SERVED
        return torch.ops.pagecomp.checksum(pages)
    if where == INTERPRET:
        from .kernels.checksum import page_checksums as kernel

        return kernel(pages)
    return torch.ops.pagecomp.checksum(pages.to("cuda")).cpu()  # UPLOAD


def decompress(
    c: CompressedPages,
    return_status: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decompress every page of ``c`` (fixed-stride or packed) bit-exactly.

    Returns:
        ``pages uint8 [N, P]`` on ``c``'s device. Corrupt pages raise :class:`CorruptPageError`
        naming them (this reads the statuses: a synchronisation). With ``return_status=True``
        returns ``(pages, status int32 [N])`` instead and never synchronises; failed pages have a
        non-zero status (``format.STATUS_*``) and unspecified bytes; every other page is correct.

    With ``c.checksums`` (``compress(..., checksum=True)``) each decoded page's checksum is
    compared on the device (one more read of the pages): a page that decoded without error to
    other bytes than were compressed fails with ``STATUS_CHECKSUM``.

    A packed container's page ``i`` whose offsets disagree with its size
    (``offsets[i + 1] - offsets[i] != sizes[i]``, or ``offsets[0] != 0`` for page 0) fails with
    ``STATUS_BAD_SIZE`` (worked out on the device, no synchronisation); the error names it.
    """
    if not isinstance(c, CompressedPages):
        raise PageCompError(f"decompress takes CompressedPages, got {type(c).__name__}")
    fmt.check_compressed(c)
    mismatch = offsets_mismatch(c)
    sizes = c.sizes if mismatch is None else torch.where(mismatch, 0, c.sizes)  # 0: BAD_SIZE
    args = (c.payload.view(-1), c.page_offsets(), sizes, c.kinds, c.page_size)
    where = route(backend, c.num_pages, c.device, args[:4])
    if where == CPU:
        pages, status = torch.ops.pagecomp.decompress(*(a.cpu() for a in args[:4]), c.page_size)
        pages, status = pages.to(c.device), status.to(c.device)
    elif where == KERNELS:
        pages, status = decompress_eager(*args)
    elif c.device.type == "cuda":  # OP, or CPU_SERVED: the op serves it on the host
        pages, status = torch.ops.pagecomp.decompress(*args)
    elif where == INTERPRET:
        from .kernels.lz4_decompress import decompress_pages

        pages, status = decompress_pages(*args)
    else:  # UPLOAD
        gpu = [a.to("cuda") for a in args[:4]]
        pages, status = (t.cpu() for t in torch.ops.pagecomp.decompress(*gpu, c.page_size))
    if c.checksums is not None:  # decoded, but to the bytes that were compressed?
        status = checksum_status(status, page_checksums(pages, backend), c.checksums)
    if return_status:
        return pages, status
    raise_for_status(status, mismatch)
    return pages


def checksum_status(status: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``status`` with ``STATUS_CHECKSUM`` where a page decoded without error (status OK) to
    bytes whose checksum ``got`` is not the stored ``want`` (all ``int32 [N]``; device work,
    no synchronisation)."""
    wrong = got != want.to(got.device, non_blocking=True)
    return torch.where((status == fmt.STATUS_OK) & wrong, fmt.STATUS_CHECKSUM, status)


OFFSETS_MISMATCH = "bad size (offsets[i + 1] - offsets[i] != sizes[i] in the packed container)"


def offsets_mismatch(c: CompressedPages) -> torch.Tensor | None:
    """``bool [N]`` on ``c``'s device: pages of a packed container whose offsets disagree with
    their sizes (``offsets[i + 1] - offsets[i] != sizes[i]``; page 0 also when
    ``offsets[0] != 0``); ``None`` for a fixed-stride container. Device work on ``N`` numbers,
    no synchronisation. (Whether each page lies inside the payload the decoders check.)"""
    if c.offsets is None:
        return None
    o = c.offsets
    bad = (o[1:] - o[:-1]) != c.sizes
    bad[:1] |= o[:1] != 0
    return bad


def raise_for_status(status: torch.Tensor, mismatch: torch.Tensor | None = None) -> None:
    """Raise :class:`CorruptPageError` naming every page whose status is not OK (synchronises).
    ``mismatch`` (from :func:`offsets_mismatch`) marks pages failed for their offsets."""
    bad = torch.nonzero(status).flatten().tolist()
    if bad:
        codes = status[bad].tolist()
        reasons = [fmt.STATUS_NAMES.get(s, f"status {s}") for s in codes]
        if mismatch is not None:
            flags = mismatch.to(status.device)[bad].tolist()
            reasons = [OFFSETS_MISMATCH if f else r for f, r in zip(flags, reasons)]
        raise fmt.CorruptPageError(bad, reasons)


def pack(c: CompressedPages, exact: bool = True) -> CompressedPages:
    """Fixed-stride -> packed form (payloads back to back, ``offsets int64 [N + 1]``).

    With ``exact=True`` the payload is trimmed to ``sum(sizes)`` bytes (reads one number: a
    synchronisation on the GPU). With ``exact=False`` it keeps the upper bound ``N * P`` bytes and
    never synchronises. A packed input is returned as it is.
    """
    fmt.check_compressed(c)
    if c.is_packed:
        return c
    packed, offsets = torch.ops.pagecomp.pack(c.payload, c.sizes)
    if exact:
        packed = packed[: int(offsets[-1])].clone()
    return CompressedPages(packed, c.sizes, c.kinds, c.page_size, offsets, c.checksums)
