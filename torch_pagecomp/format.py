"""The compressed page format: constants, the container, and input validation.

A batch of ``N`` pages is a contiguous ``uint8`` tensor of shape ``[N, P]``; ``P`` (the page
size) is a power of two from 4096 to 65536. Each page is stored on its own as one of four kinds:

* ``RAW``  (0): the page's ``P`` bytes as they are (LZ4 would not save enough).
* ``LZ4``  (1): one standard LZ4 *block* (no frame, no size prefix) that decodes to exactly ``P``
  bytes; ``lz4.block.decompress(block, uncompressed_size=P)`` reads it. The block may encode the
  page after a bit-shuffle (see below).
* ``FILL`` (2): every byte of the page is equal; the one byte value is stored (size 1).
* ``EXP``  (3): an exponent-coded page of 16-bit floats (bf16 or fp16; see below), written only
  by ``compress(..., codec="exp-bf16" | "exp-fp16")`` and read only by the exponent decoder.

Metadata, on the same device as the payload:

* ``sizes``: ``int32 [N]``, stored bytes of each page (``P`` for RAW, ``1`` for FILL,
  ``1..lz4_bound(P)`` for LZ4, ``LZ4_compressBound(P)``: any LZ4 block of a page, though the
  compressors here write at most ``P-P/32``, see ``lz4_keep_limit``; for EXP exactly its fixed
  part plus its escapes, at most ``P-P/32``). A decoder gives any other size
  ``STATUS_BAD_SIZE``, as it does a page whose ``[offset, offset + size)`` is not inside the
  payload.
* ``kinds``: ``uint8 [N]``. Low nibble: the kind above. High nibble: for LZ4 pages
  ``log2(element_size)`` of the bit-shuffle applied before LZ4 (0: none, 1: 2-byte elements,
  2: 4-byte elements); for EXP pages the layout (1: bf16, 2: fp16; kinds ``0x13`` / ``0x23``);
  0 for RAW and FILL pages (RAW pages hold the original, unshuffled bytes). Any other
  combination is ``STATUS_BAD_KIND``.

Two containers hold the payload:

* **fixed-stride** (what a kernel writes with no host synchronisation): ``payload`` is
  ``uint8 [N, P]``; page ``i``'s stored bytes are ``payload[i, :sizes[i]]``; the rest of the row
  is zero (so the op is deterministic). ``offsets`` is ``None`` (page ``i`` starts at ``i * P``).
* **packed** (for storage and transfer, nothing wasted): ``payload`` is ``uint8 [T]`` with
  ``T = sum(sizes)``; ``offsets`` is ``int64 [N + 1]``, ``offsets[0] = 0``,
  ``offsets[i + 1] = offsets[i] + sizes[i]``; page ``i`` is ``payload[offsets[i]:offsets[i+1]]``.
  ``api.decompress`` gives a page whose offsets disagree with its size ``STATUS_BAD_SIZE``.

Bit-shuffle with element size ``E`` (2 or 4): the page is read as ``n = P / E`` little-endian
unsigned integers ``x[0..n)``. The shuffled page ``Y`` (``P`` bytes) is ``8E`` bit planes of
``n / 8`` bytes each, plane ``b`` (bit ``b`` of every element, ``b = 0`` the least significant)
first for ``b = 0``: ``Y[b * (n/8) + g] = sum_{t<8} ((x[8g + t] >> b) & 1) << t``. The LZ4 block
holds ``Y``; decompression inverts it.

An LZ4 page is kept only when its block saves at least ``P / 32`` bytes (``size <= P - P/32``);
otherwise the page is stored RAW, so a page these compressors store never exceeds ``P`` bytes.
The decoders read any LZ4 block of a page, up to ``lz4_bound(P)`` bytes (what ``lz4.block`` or
nvCOMP write for a page they cannot compress): blocks from other LZ4 encoders need no
re-encoding.

EXP pages (``torch_pagecomp.exp_codec`` is the reference). The page is ``n = P / 2``
little-endian 16-bit values ``v[0..n)``, each split into an exponent ``e``, a rest byte ``r``
and (fp16 only) three high bits ``h``:

* bf16 (layout 1): ``e = (v >> 7) & 255``; ``r = ((v >> 8) & 0x80) | (v & 0x7F)`` (sign, then
  the 7 mantissa bits); ``v = ((r & 0x80) << 8) | (e << 7) | (r & 0x7F)``.
* fp16 (layout 2): ``e = (v >> 10) & 31``; ``r = v & 0xFF`` (the mantissa's low 8 bits);
  ``h = ((v >> 13) & 4) | ((v >> 8) & 3)`` (sign, mantissa bits 9 and 8);
  ``v = ((h & 4) << 13) | (e << 10) | ((h & 3) << 8) | r``.

The stored bytes, in order (a "3-bit stream" packs ``n`` fields of 3 bits, 8 to a 3-byte
group: group ``g`` is the little-endian 24-bit word ``sum_{t<8} x[8g + t] << 3t``):

1. ``table``, 7 bytes: the exponent values ordered by how many of the page's *sampled*
   values have them (descending), ties by value (ascending); when fewer than 7 occur there,
   absent values (count 0) fill the table in the same order. The sample is one row of 8
   values in ``EXP_SAMPLE`` (4): values ``32j .. 32j + 7``, a quarter of the page. Any table
   of 7 distinct exponents decodes: the sample is the encoders' rule (counting a quarter of
   the values made the GPU encoder 1.40x faster on 4 KiB bf16 pages for 0.06-0.13% of the
   ratio on six bf16 corpora), and a decoder does not check the table's order or how it was
   chosen.
2. ``codes``, ``3n/8`` bytes: a 3-bit stream of ``c[i] = k`` where ``e[i] == table[k]``
   (``k < 7``), ``c[i] = 7`` (escape) where ``e[i]`` is not in the table.
3. fp16 only: ``3n/8`` bytes, the 3-bit stream of ``h[i]``.
4. ``n`` bytes: ``r[i]``.
5. ``escapes``: one byte per escaped value (``c[i] == 7``), in increasing ``i``: ``e[i]``.

The fixed part (1-4) is ``F = 7 + 3n/8 + n`` bytes (bf16) or ``F = 7 + 6n/8 + n`` (fp16)
(``exp_fixed_bytes``); the stored size is ``F`` plus the number of escapes, and must equal it.
fp16 table and escape bytes hold values below 32 (a decoder reads their low 5 bits). An
all-equal page is stored FILL; a page whose EXP size would exceed ``P - P/32`` is stored RAW.
The exponent decoder decodes RAW, FILL and EXP pages and gives LZ4 pages ``STATUS_BAD_KIND``;
the LZ4 decoder gives EXP pages ``STATUS_BAD_KIND`` (``api.decompress`` picks the decoder by
the container's ``codec``, or runs both with ``codec="any"``). Per EXP page, in order:
``STATUS_BAD_KIND`` for a layout other than 1 or 2; ``STATUS_BAD_SIZE`` for
``[offset, offset + size)`` outside the payload, ``size < F`` or ``size > P - P/32`` (checked
before any byte of the page is read), then for a size other than ``F`` plus the escapes that
its codes count.

Checksums (optional: ``compress(..., checksum=True)``): ``checksums`` is ``int32 [N]``, the
checksum of each *uncompressed* page, so a decoder can tell a page that decoded to other bytes
(a flipped bit in a stored payload, host memory or a transfer) from a correct one: the page's
standard xxHash32 with seed 0 (the hash the LZ4 frame format uses for its checksums; any
xxHash library gives the same value, e.g. ``xxhash.xxh32_intdigest(page)``), stored as the
int32 of the same 32 bits. Pages are whole 16-byte stripes, so the hash is its four lanes over
the stripes, their merge, the length and the final avalanche. A page whose decode status is OK
but whose checksum differs gets ``STATUS_CHECKSUM``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

import torch

from .kernels.constants import (  # noqa: F401 - re-exported: the format's constants
    ELEMENT_SIZES,
    EXP_BF16,
    EXP_FP16,
    EXP_SAMPLE,
    EXP_TABLE,
    KIND_EXP,
    KIND_EXP_BF16,
    KIND_EXP_FP16,
    KIND_FILL,
    KIND_LZ4,
    KIND_LZ4_SHUFFLED_2,
    KIND_LZ4_SHUFFLED_4,
    KIND_RAW,
    MAX_PAGE_SIZE,
    MIN_PAGE_SIZE,
    STATUS_BAD_KIND,
    STATUS_BAD_OFFSET,
    STATUS_BAD_SIZE,
    STATUS_CHECKSUM,
    STATUS_OK,
    STATUS_OVERFLOW,
    STATUS_SHORT,
    STATUS_TRUNCATED,
    XXH_PRIME1,
    XXH_PRIME2,
    XXH_PRIME3,
    element_shift,
    exp_fixed_bytes,
    valid_page_size,
)

DEFAULT_PAGE_SIZE = 4096
# What ``CompressedPages.codec`` may say: the decoder that reads its pages.
CONTAINER_CODECS = ("lz4", "exp")
KIND_NAMES = {KIND_RAW: "raw", KIND_LZ4: "lz4", KIND_FILL: "fill", KIND_EXP: "exp"}

STATUS_NAMES = {
    STATUS_OK: "ok",
    STATUS_BAD_KIND: "bad kind",
    STATUS_BAD_SIZE: "bad size",
    STATUS_TRUNCATED: "truncated block",
    STATUS_BAD_OFFSET: "bad match offset",
    STATUS_OVERFLOW: "output overflow",
    STATUS_SHORT: "decodes short of the page size",
    STATUS_CHECKSUM: "checksum mismatch (decoded to other bytes than were compressed)",
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

    def __reduce__(self):
        # pickle and copy rebuild an exception from ``args`` (the message alone), which this
        # ``__init__`` does not take: a worker process that raised it broke its whole
        # ProcessPoolExecutor (BrokenProcessPool) instead of naming the pages. (The state: any
        # other attribute, such as notes added to it.)
        return (type(self), (self.pages, self.reasons, self.args[0] if self.args else None),
                self.__dict__)


@dataclass(frozen=True)
class CompressedPages:
    """A batch of compressed pages (see the module docstring for the exact layout).

    Attributes:
        payload: ``uint8 [N, P]`` (fixed-stride) or ``uint8 [T]`` (packed).
        sizes: ``int32 [N]`` stored bytes per page.
        kinds: ``uint8 [N]`` kind (low nibble) and log2 shuffle element size (high nibble).
        page_size: ``P``.
        offsets: ``None`` (fixed-stride) or ``int64 [N + 1]`` (packed).
        checksums: ``None`` or ``int32 [N]``, the checksum of each uncompressed page (see the
            module docstring); decompression checks them when present.
        codec: which decoder reads the pages: ``"lz4"`` (RAW, FILL, LZ4 pages) or ``"exp"``
            (RAW, FILL, EXP pages: ``compress(..., codec="exp-bf16" | "exp-fp16")``).
    """

    payload: torch.Tensor
    sizes: torch.Tensor
    kinds: torch.Tensor
    page_size: int
    offsets: torch.Tensor | None = None
    checksums: torch.Tensor | None = None
    codec: str = "lz4"

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
        """Sum of stored page sizes (synchronises when on a GPU). Taken from ``sizes`` (negative
        sizes count as 0) for both containers: a packed container's ``offsets[-1]`` equals it
        only when the offsets are consistent, which nothing here has checked."""
        return int(self.sizes.clamp(min=0).sum(dtype=torch.int64))

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
            checksums=mv(self.checksums),
        )


def packed_pages(payloads: list[torch.Tensor], sizes: list[torch.Tensor],
                 kinds: list[torch.Tensor], page_size: int, codec: str) -> CompressedPages:
    """One packed CPU :class:`CompressedPages` of parts given in page order: ``payloads``
    (``uint8``, each part's stored bytes back to back), ``sizes`` (``int32``) and ``kinds``
    (``uint8``); the offsets follow from the sizes."""
    payload = torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8)
    sizes_t = torch.cat(sizes) if sizes else torch.empty(0, dtype=torch.int32)
    kinds_t = torch.cat(kinds) if kinds else torch.empty(0, dtype=torch.uint8)
    offsets = torch.zeros(sizes_t.numel() + 1, dtype=torch.int64)
    torch.cumsum(sizes_t.to(torch.int64), 0, out=offsets[1:])
    return CompressedPages(payload, sizes_t, kinds_t, page_size, offsets, codec=codec)


def dtype_element_size(dtype: torch.dtype) -> int:
    """Bit-shuffle width for ``dtype``, the one rule every path uses: its element width for
    2- and 4-byte types (bf16/fp16 -> 2, fp32/int32 -> 4), 4 for 8-byte types (each element as
    two 32-bit halves), 1 (no shuffle) for 1-byte and other types."""
    if not isinstance(dtype, torch.dtype):
        raise PageCompError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    return {2: 2, 4: 4, 8: 4}.get(dtype.itemsize, 1)


def check_page_size(page_size: int) -> None:
    """Raise ``PageCompError`` unless ``page_size`` is a power of two in [4096, 65536]."""
    if not valid_page_size(page_size):
        raise PageCompError(
            f"page size must be a power of two from {MIN_PAGE_SIZE} to {MAX_PAGE_SIZE}, "
            f"got {page_size!r}"
        )


def check_element_size(element_size: int) -> int:
    """Raise ``PageCompError`` unless ``element_size`` is an integer 1, 2 or 4; returns it as
    a Python ``int``, for the code that computes with it: a numpy ``uint8(2)`` passes the check
    but overflowed there (``4096 % (64 * element_size)``)."""
    # an int, not a float that equals one (2.0 failed later, deep in the CPU loops)
    if (isinstance(element_size, bool) or not isinstance(element_size, numbers.Integral)
            or element_size not in ELEMENT_SIZES):
        raise PageCompError(f"element_size must be one of {ELEMENT_SIZES}, got {element_size!r}")
    return int(element_size)


def as_pages(data: torch.Tensor, page_size: int | None = None) -> torch.Tensor:
    """Validate ``data`` and view it as ``uint8 [N, P]``.

    ``data`` is ``uint8 [N, P]`` (then ``page_size``, if given, must equal ``P``) or a 1-D
    ``uint8`` tensor whose length is a whole number of pages (``page_size`` defaults to 4096).
    """
    if not isinstance(data, torch.Tensor):
        raise PageCompError(f"pages must be a torch.Tensor, got {type(data).__name__}")
    if data.device.type == "meta":
        raise PageCompError("pages are on the meta device: a meta tensor holds no bytes")
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
    if data.shape[0] > MAX_PAGES:
        raise PageCompError(f"at most {MAX_PAGES} pages per call, got {data.shape[0]}")
    return data


def check_compressed(c: CompressedPages) -> None:
    """Validate the container's tensors (dtype, shape, device, contiguity); not the bytes
    inside (the offsets of a packed container are checked against the sizes by
    ``api.decompress``, on the device)."""
    if not plainly_valid(c):  # the usual case in a few comparisons (every small call pays)
        _check_fully(c)


def _check_fully(c: object) -> None:
    """:func:`check_compressed` item by item, naming every problem."""
    if not isinstance(c, CompressedPages):
        raise PageCompError(f"expected CompressedPages, got {type(c).__name__}")
    fields = {"payload": c.payload, "sizes": c.sizes, "kinds": c.kinds, "offsets": c.offsets,
              "checksums": c.checksums}
    for name, t in fields.items():
        if not isinstance(t, torch.Tensor) and not (t is None and name in ("offsets",
                                                                           "checksums")):
            raise PageCompError(f"CompressedPages.{name} must be a torch.Tensor, got "
                                f"{type(t).__name__}")
        if t is not None and t.device.type == "meta":
            raise PageCompError(f"CompressedPages.{name} is on the meta device: it holds no "
                                "bytes")
    check_page_size(c.page_size)
    n = c.sizes.shape[0] if c.sizes.dim() == 1 else -1
    problems = []
    if c.codec not in CONTAINER_CODECS:
        problems.append(f"codec must be one of {CONTAINER_CODECS}, got {c.codec!r}")
    if c.payload.dtype != torch.uint8:
        problems.append(f"payload dtype must be uint8, got {c.payload.dtype}")
    if c.sizes.dtype != torch.int32 or c.sizes.dim() != 1:
        problems.append(f"sizes must be int32 [N], got {_desc(c.sizes)}")
    if c.kinds.dtype != torch.uint8 or tuple(c.kinds.shape) != (n,):
        problems.append(f"kinds must be uint8 [{n}], got {_desc(c.kinds)}")
    if c.offsets is None:
        if c.payload.dim() != 2 or tuple(c.payload.shape) != (n, c.page_size):
            problems.append(
                f"fixed-stride payload must be [{n}, {c.page_size}], got {tuple(c.payload.shape)}"
            )
    else:
        if c.payload.dim() != 1:
            problems.append(f"packed payload must be 1-D, got shape {tuple(c.payload.shape)}")
        if c.offsets.dtype != torch.int64 or tuple(c.offsets.shape) != (n + 1,):
            problems.append(f"offsets must be int64 [{n + 1}], got {_desc(c.offsets)}")
    if c.checksums is not None and (c.checksums.dtype != torch.int32
                                    or tuple(c.checksums.shape) != (n,)):
        problems.append(f"checksums must be int32 [{n}], got {_desc(c.checksums)}")
    named = {"payload": c.payload, "sizes": c.sizes, "kinds": c.kinds}
    if c.offsets is not None:
        named["offsets"] = c.offsets
    if c.checksums is not None:
        named["checksums"] = c.checksums
    _check_devices(problems, named)
    _check_contiguous(problems, named)
    if problems:
        raise PageCompError("invalid compressed pages: " + "; ".join(problems))


# ------------------------------------------------------------------ op argument validation
# One place for the checks of the ``torch.ops.pagecomp`` operators and their eager entry points
# (``torch_pagecomp._ops``): shapes, dtypes, strides, devices and page sizes only, never a
# tensor's values, so they cost a few attribute reads, never synchronise, and trace under
# ``torch.compile`` / ``make_fx`` / fake tensors. What the values may be (sizes, offsets, kinds,
# the blocks) is the decoders' business: every page gets a status.

# Pages per call: one program per page on grid axis 0, at most 2**31 - 1 on CUDA.
MAX_PAGES = 2**31 - 1


def _desc(t: object) -> str:
    """A tensor's dtype and shape for a message (anything else: its type and value)."""
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)}"
    return f"{type(t).__name__} {t!r:.60}"


def plainly_valid(c: object) -> bool:
    """Whether ``c`` passes :func:`check_compressed`, decided without building its messages:
    plain tensors only (a subclass, or anything unusual, goes through the full check)."""
    if type(c) is not CompressedPages or c.codec not in CONTAINER_CODECS:
        return False
    p, s, k, o, sums = c.payload, c.sizes, c.kinds, c.offsets, c.checksums
    if not (type(p) is torch.Tensor and type(s) is torch.Tensor and type(k) is torch.Tensor
            and valid_page_size(c.page_size)):
        return False
    dev = p.device
    if (dev.type == "meta" or s.device != dev or k.device != dev or p.dtype != torch.uint8
            or s.dtype != torch.int32 or k.dtype != torch.uint8 or s.dim() != 1):
        return False
    n = s.shape[0]
    if k.shape != (n,) or not (p.is_contiguous() and s.is_contiguous() and k.is_contiguous()):
        return False
    if o is None:
        if p.shape != (n, c.page_size):
            return False
    elif not (type(o) is torch.Tensor and p.dim() == 1 and o.dtype == torch.int64
              and o.shape == (n + 1,) and o.device == dev and o.is_contiguous()):
        return False
    return sums is None or (type(sums) is torch.Tensor and sums.dtype == torch.int32
                            and sums.shape == (n,) and sums.device == dev
                            and sums.is_contiguous())


def _check_devices(problems: list[str], named: dict[str, torch.Tensor]) -> None:
    devices = [t.device for t in named.values()]
    if devices and devices.count(devices[0]) != len(devices):  # (no set: devices hash slowly)
        where = ", ".join(f"{k} on {t.device}" for k, t in named.items())
        names = sorted(set(map(str, devices)))
        problems.append(f"tensors are on different devices: {names} ({where})")


def _check_contiguous(problems: list[str], named: dict[str, torch.Tensor]) -> None:
    for k, t in named.items():
        if not t.is_contiguous():
            problems.append(
                f"{k} must be contiguous, got shape {list(t.shape)} with strides {list(t.stride())}"
                " (an expanded or sliced view; call .contiguous() first)"
            )


def _check_tensor(problems: list[str], name: str, t: object, dtype: torch.dtype,
                  shape: tuple) -> bool:
    """Append what is wrong with ``t`` (a tensor of ``dtype`` and ``shape``; ``None`` in
    ``shape``: any length). Returns whether ``t`` is a tensor at all."""
    if not isinstance(t, torch.Tensor):
        problems.append(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        return False
    # (on every call of every op: the message is built only when something is wrong)
    got = t.shape
    bad = t.dtype != dtype or len(got) != len(shape)
    if not bad:  # (a loop: a generator costs more than these checks)
        for g, d in zip(got, shape):
            if d is not None and g != d:
                bad = True
                break
    if bad:
        want = "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
        problems.append(f"{name} must be {dtype} {want}, got {_desc(t)}")
    return True


def _raise(op: str, problems: list[str]) -> None:
    if problems:
        raise PageCompError(f"pagecomp.{op}: " + "; ".join(problems))


def _page_size_problem(page_size: object, what: str = "page_size") -> str | None:
    if isinstance(page_size, torch.SymInt):  # traced with dynamic shapes: specialise (the
        page_size = int(page_size)  # kernels compile P in, so a graph is per page size anyway)
    if isinstance(page_size, bool) or not valid_page_size(page_size):
        return (f"{what} must be a power of two from {MIN_PAGE_SIZE} to {MAX_PAGE_SIZE}, "
                f"got {page_size!r}")
    return None


def _check_pages_count(problems: list[str], n: int) -> None:
    if n > MAX_PAGES:
        problems.append(f"at most {MAX_PAGES} pages per call, got {n}")


def _check_pages(problems: list[str], pages: torch.Tensor) -> None:
    if _check_tensor(problems, "pages", pages, torch.uint8, (None, None)):
        if pages.dim() == 2:
            bad = _page_size_problem(pages.shape[1], "pages.shape[1] (the page size)")
            if bad:
                problems.append(bad)
            _check_pages_count(problems, pages.shape[0])
        _check_contiguous(problems, {"pages": pages})


def check_compress_args(pages: torch.Tensor, element_size: object) -> None:
    """Arguments of ``pagecomp::compress``: ``pages`` contiguous ``uint8 [N, P]`` (``P`` a
    power of two from 4096 to 65536), ``element_size`` 1, 2 or 4."""
    problems: list[str] = []
    _check_pages(problems, pages)
    if isinstance(element_size, bool) or element_size not in ELEMENT_SIZES:
        problems.append(f"element_size must be one of {ELEMENT_SIZES}, got {element_size!r}")
    _raise("compress", problems)


FLOAT_FORMATS = ("bf16", "fp16")  # the exponent codec's layouts, by name
# the exponent codec's layout of each dtype it codes (what ``codec="auto"`` sends to it)
DTYPE_FLOAT_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_compress_exp_args(pages: torch.Tensor, float_format: object) -> None:
    """Arguments of ``pagecomp::compress_exp``: ``pages`` as for ``pagecomp::compress``,
    ``float_format`` ``"bf16"`` or ``"fp16"`` (the layout of the values in the pages)."""
    problems: list[str] = []
    _check_pages(problems, pages)
    if float_format not in FLOAT_FORMATS:
        problems.append(f"float_format must be one of {FLOAT_FORMATS}, got {float_format!r}")
    _raise("compress_exp", problems)


def check_checksum_args(pages: torch.Tensor) -> None:
    """Arguments of ``pagecomp::checksum``: ``pages`` as for ``pagecomp::compress``."""
    problems: list[str] = []
    _check_pages(problems, pages)
    _raise("checksum", problems)


def check_decompress_args(payload: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor,
                          kinds: torch.Tensor, page_size: object,
                          pages: torch.Tensor | None = None,
                          status: torch.Tensor | None = None, op: str | None = None) -> None:
    """Arguments of ``pagecomp::decompress`` (and ``decompress_exp``: ``op`` names the op in
    the error): ``payload`` contiguous ``uint8 [T]``, ``offsets`` ``int64 [N]`` (start of each
    page), ``sizes`` ``int32 [N]``, ``kinds`` ``uint8 [N]``, all contiguous and on one device,
    ``page_size`` a power of two from 4096 to 65536. With ``pages`` / ``status`` (the outputs
    of ``decompress_into``): contiguous ``uint8 [N, P]`` and ``int32 [N]`` on the same
    device."""
    problems: list[str] = []
    op = op or ("decompress" if pages is None and status is None else "decompress_into")
    named: dict[str, torch.Tensor] = {}
    if _check_tensor(problems, "sizes", sizes, torch.int32, (None,)):
        named["sizes"] = sizes
    n = sizes.shape[0] if "sizes" in named and sizes.dim() == 1 else None
    if _check_tensor(problems, "payload", payload, torch.uint8, (None,)):
        named["payload"] = payload
    for name, t, dtype in (("offsets", offsets, torch.int64), ("kinds", kinds, torch.uint8)):
        if _check_tensor(problems, name, t, dtype, (n,)):
            named[name] = t
    bad = _page_size_problem(page_size)
    if bad:
        problems.append(bad)
    if pages is not None and _check_tensor(problems, "pages", pages, torch.uint8,
                                           (n, None if bad else page_size)):
        named["pages"] = pages
    if status is not None and _check_tensor(problems, "status", status, torch.int32, (n,)):
        named["status"] = status
    if n is not None:
        _check_pages_count(problems, n)
    _check_devices(problems, named)
    _check_contiguous(problems, named)
    _raise(op, problems)


def check_pack_args(payload: torch.Tensor, sizes: torch.Tensor) -> None:
    """Arguments of ``pagecomp::pack``: a fixed-stride ``payload`` contiguous ``uint8 [N, P]``
    and ``sizes`` contiguous ``int32 [N]`` on the same device."""
    problems: list[str] = []
    named: dict[str, torch.Tensor] = {}
    n = None
    if _check_tensor(problems, "payload", payload, torch.uint8, (None, None)):
        named["payload"] = payload
        if payload.dim() == 2:
            n = payload.shape[0]
            bad = _page_size_problem(payload.shape[1], "payload.shape[1] (the page size)")
            if bad:
                problems.append(bad)
            _check_pages_count(problems, n)
    if _check_tensor(problems, "sizes", sizes, torch.int32, (n,)):
        named["sizes"] = sizes
    _check_devices(problems, named)
    _check_contiguous(problems, named)
    _raise("pack", problems)
