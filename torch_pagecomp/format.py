"""The compressed page format: constants, the container, and input validation.

A batch of ``N`` pages is a contiguous ``uint8`` tensor of shape ``[N, P]``; ``P`` (the page
size) is a power of two from 4096 to 65536. Each page is stored on its own as one of three kinds:

* ``RAW``  (0): the page's ``P`` bytes as they are (LZ4 would not save enough).
* ``LZ4``  (1): one standard LZ4 *block* (no frame, no size prefix) that decodes to exactly ``P``
  bytes; ``lz4.block.decompress(block, uncompressed_size=P)`` reads it. The block may encode the
  page after a bit-shuffle (see below).
* ``FILL`` (2): every byte of the page is equal; the one byte value is stored (size 1).

Metadata, on the same device as the payload:

* ``sizes``: ``int32 [N]``, stored bytes of each page (``P`` for RAW, ``1`` for FILL,
  ``1..P-1`` for LZ4).
* ``kinds``: ``uint8 [N]``. Low nibble: the kind above. High nibble: ``log2(element_size)`` of
  the bit-shuffle applied before LZ4 (0: none, 1: 2-byte elements, 2: 4-byte elements); it is
  non-zero only for LZ4 pages (RAW pages hold the original, unshuffled bytes).

Two containers hold the payload:

* **fixed-stride** (what a kernel writes with no host synchronisation): ``payload`` is
  ``uint8 [N, P]``; page ``i``'s stored bytes are ``payload[i, :sizes[i]]``; the rest of the row
  is zero (so the op is deterministic). ``offsets`` is ``None`` (page ``i`` starts at ``i * P``).
* **packed** (for storage and transfer, nothing wasted): ``payload`` is ``uint8 [T]`` with
  ``T = sum(sizes)``; ``offsets`` is ``int64 [N + 1]``, ``offsets[0] = 0``,
  ``offsets[i + 1] = offsets[i] + sizes[i]``; page ``i`` is ``payload[offsets[i]:offsets[i+1]]``.

Bit-shuffle with element size ``E`` (2 or 4): the page is read as ``n = P / E`` little-endian
unsigned integers ``x[0..n)``. The shuffled page ``Y`` (``P`` bytes) is ``8E`` bit planes of
``n / 8`` bytes each, plane ``b`` (bit ``b`` of every element, ``b = 0`` the least significant)
first for ``b = 0``: ``Y[b * (n/8) + g] = sum_{t<8} ((x[8g + t] >> b) & 1) << t``. The LZ4 block
holds ``Y``; decompression inverts it.

An LZ4 page is kept only when its block saves at least ``P / 32`` bytes (``size <= P - P/32``);
otherwise the page is stored RAW, so a stored page never exceeds ``P`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .kernels.constants import (  # noqa: F401 - re-exported: the format's constants
    ELEMENT_SIZES,
    KIND_FILL,
    KIND_LZ4,
    KIND_RAW,
    MAX_PAGE_SIZE,
    MIN_PAGE_SIZE,
    STATUS_BAD_KIND,
    STATUS_BAD_OFFSET,
    STATUS_BAD_SIZE,
    STATUS_OK,
    STATUS_OVERFLOW,
    STATUS_SHORT,
    STATUS_TRUNCATED,
    element_shift,
    valid_page_size,
)

DEFAULT_PAGE_SIZE = 4096
KIND_NAMES = {KIND_RAW: "raw", KIND_LZ4: "lz4", KIND_FILL: "fill"}

STATUS_NAMES = {
    STATUS_OK: "ok",
    STATUS_BAD_KIND: "bad kind",
    STATUS_BAD_SIZE: "bad size",
    STATUS_TRUNCATED: "truncated block",
    STATUS_BAD_OFFSET: "bad match offset",
    STATUS_OVERFLOW: "output overflow",
    STATUS_SHORT: "decodes short of the page size",
}


def lz4_keep_limit(page_size: int) -> int:
    """Largest LZ4 block size (bytes) stored as LZ4 rather than RAW for this page size."""
    return page_size - page_size // 32


def lz4_bound(page_size: int) -> int:
    """Worst-case LZ4 block size for ``page_size`` input bytes (LZ4_compressBound)."""
    return page_size + page_size // 255 + 16


class PageCompError(ValueError):
    """Bad input to a pagecomp function: the message names the problem."""


class CorruptPageError(RuntimeError):
    """Some pages failed to decode. ``pages`` lists their indices, ``reasons`` what failed."""

    def __init__(self, pages: list[int], reasons: list[str], message: str | None = None):
        self.pages = pages
        self.reasons = reasons
        if message is None:
            shown = ", ".join(f"{p} ({r})" for p, r in zip(pages[:16], reasons[:16]))
            more = f" and {len(pages) - 16} more" if len(pages) > 16 else ""
            message = f"{len(pages)} corrupt page(s): {shown}{more}"
        super().__init__(message)


@dataclass(frozen=True)
class CompressedPages:
    """A batch of compressed pages (see the module docstring for the exact layout).

    Attributes:
        payload: ``uint8 [N, P]`` (fixed-stride) or ``uint8 [T]`` (packed).
        sizes: ``int32 [N]`` stored bytes per page.
        kinds: ``uint8 [N]`` kind (low nibble) and log2 shuffle element size (high nibble).
        page_size: ``P``.
        offsets: ``None`` (fixed-stride) or ``int64 [N + 1]`` (packed).
    """

    payload: torch.Tensor
    sizes: torch.Tensor
    kinds: torch.Tensor
    page_size: int
    offsets: torch.Tensor | None = None

    @property
    def num_pages(self) -> int:
        return self.sizes.shape[0]

    @property
    def is_packed(self) -> bool:
        return self.offsets is not None

    @property
    def device(self) -> torch.device:
        return self.payload.device

    @property
    def uncompressed_nbytes(self) -> int:
        return self.num_pages * self.page_size

    def compressed_nbytes(self) -> int:
        """Sum of stored page sizes (synchronises when on a GPU)."""
        if self.offsets is not None:
            return int(self.offsets[-1])
        return int(self.sizes.sum(dtype=torch.int64))

    def ratio(self) -> float:
        """Uncompressed bytes over stored payload bytes (synchronises when on a GPU)."""
        return self.uncompressed_nbytes / max(1, self.compressed_nbytes())

    def page_offsets(self) -> torch.Tensor:
        """``int64 [N]``: where each page starts in ``payload.view(-1)``."""
        if self.offsets is not None:
            return self.offsets[:-1]
        n, p = self.num_pages, self.page_size
        return torch.arange(0, n * p, p, device=self.sizes.device, dtype=torch.int64)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> CompressedPages:
        """Move every tensor to ``device``."""

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            payload=mv(self.payload),
            sizes=mv(self.sizes),
            kinds=mv(self.kinds),
            offsets=mv(self.offsets),
        )


def check_page_size(page_size: int) -> None:
    """Raise ``PageCompError`` unless ``page_size`` is a power of two in [4096, 65536]."""
    if not valid_page_size(page_size):
        raise PageCompError(
            f"page size must be a power of two from {MIN_PAGE_SIZE} to {MAX_PAGE_SIZE}, "
            f"got {page_size!r}"
        )


def check_element_size(element_size: int) -> None:
    if element_size not in ELEMENT_SIZES:
        raise PageCompError(f"element_size must be one of {ELEMENT_SIZES}, got {element_size!r}")


def as_pages(data: torch.Tensor, page_size: int | None = None) -> torch.Tensor:
    """Validate ``data`` and view it as ``uint8 [N, P]``.

    ``data`` is ``uint8 [N, P]`` (then ``page_size``, if given, must equal ``P``) or a 1-D
    ``uint8`` tensor whose length is a whole number of pages (``page_size`` defaults to 4096).
    """
    if not isinstance(data, torch.Tensor):
        raise PageCompError(f"pages must be a torch.Tensor, got {type(data).__name__}")
    if data.dtype != torch.uint8:
        raise PageCompError(
            f"pages must have dtype torch.uint8, got {data.dtype} "
            "(view other dtypes as bytes with tensor.view(torch.uint8))"
        )
    if data.dim() == 2:
        if page_size is not None and data.shape[1] != page_size:
            raise PageCompError(
                f"pages have {data.shape[1]} bytes per row but page_size={page_size}"
            )
        page_size = data.shape[1]
    elif data.dim() == 1:
        page_size = DEFAULT_PAGE_SIZE if page_size is None else page_size
    else:
        raise PageCompError(
            f"pages must be 2-D [num_pages, page_size] or 1-D bytes, got shape {tuple(data.shape)}"
        )
    check_page_size(page_size)
    if not data.is_contiguous():
        raise PageCompError(
            f"pages must be contiguous (got strides {data.stride()}); call .contiguous() first"
        )
    if data.dim() == 1:
        if data.numel() % page_size:
            raise PageCompError(
                f"{data.numel()} bytes is not a whole number of {page_size}-byte pages"
            )
        data = data.view(-1, page_size)
    return data


def check_compressed(c: CompressedPages) -> None:
    """Validate the container's tensors (dtype, shape, device); not the bytes inside."""
    check_page_size(c.page_size)
    n = c.sizes.shape[0] if c.sizes.dim() == 1 else -1
    problems = []
    if c.payload.dtype != torch.uint8:
        problems.append(f"payload dtype must be uint8, got {c.payload.dtype}")
    if c.sizes.dtype != torch.int32 or c.sizes.dim() != 1:
        problems.append(f"sizes must be int32 [N], got {c.sizes.dtype} {tuple(c.sizes.shape)}")
    if c.kinds.dtype != torch.uint8 or tuple(c.kinds.shape) != (n,):
        problems.append(f"kinds must be uint8 [{n}], got {c.kinds.dtype} {tuple(c.kinds.shape)}")
    if c.offsets is None:
        if c.payload.dim() != 2 or tuple(c.payload.shape) != (n, c.page_size):
            problems.append(
                f"fixed-stride payload must be [{n}, {c.page_size}], got {tuple(c.payload.shape)}"
            )
    else:
        if c.payload.dim() != 1:
            problems.append(f"packed payload must be 1-D, got shape {tuple(c.payload.shape)}")
        if c.offsets.dtype != torch.int64 or tuple(c.offsets.shape) != (n + 1,):
            problems.append(
                f"offsets must be int64 [{n + 1}], got {c.offsets.dtype} {tuple(c.offsets.shape)}"
            )
    tensors = [c.payload, c.sizes, c.kinds] + ([] if c.offsets is None else [c.offsets])
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        problems.append(f"tensors are on different devices: {sorted(map(str, devices))}")
    if not all(t.is_contiguous() for t in tensors):
        problems.append("all tensors must be contiguous")
    if problems:
        raise PageCompError("invalid compressed pages: " + "; ".join(problems))
