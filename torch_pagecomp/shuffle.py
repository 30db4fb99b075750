"""Bit-shuffle of whole batches: the transform the kernels fuse, for the CPU path and tests.

See ``torch_pagecomp.format`` for the exact definition. :func:`bitshuffle` and
:func:`bitunshuffle` take and return ``uint8 [N, P]`` tensors (``element_size`` 1 is the
identity); CPU tensors go through :func:`bitshuffle_np` / :func:`bitunshuffle_np`: the C
extension's SSE2 loops where it is built on x86-64 (``_native.bitshuffle``: per block of 64
elements, an 8x8 byte transpose and an 8x8 bit transpose of each 64-bit lane, with the GIL
released), else numpy over the whole batch at once (the reference, below); tensors on other
devices through the same transform in torch element ops.

How the numpy version works (element size ``E``, ``G = P / 8E`` groups of 8 elements a page):
the elements are transposed so that element ``t`` of every group of every page lies in row
``t`` of an ``[8, N * G]`` array (one numpy copy). Byte lane ``(g, j)`` of row ``t`` is then
byte ``j`` of element ``8g + t``, and bit ``i`` of that lane has to go to bit ``t`` of lane
``(g, j)`` of row ``i``: an 8x8 bit transpose across the rows, done for 8 lanes per ``uint64``
by three butterfly stages (row pairs ``t, t + d`` swap their ``d``-bit blocks, ``d`` = 1, 2, 4:
six whole-array operations each). Row ``i`` then holds, at lane ``(g, j)``, byte ``g`` of bit
plane ``8j + i``; splitting the lanes by ``j`` writes the planes in place. The unshuffle runs
the same steps backwards (the bit transpose is its own inverse). Every step is a numpy call over
a chunk of about 1 MiB (cache-sized), which releases the GIL.
"""

from __future__ import annotations

import numpy as np
import torch

from .format import PageCompError, _desc, check_element_size

try:  # the C loops (setup.py builds them where a C compiler is found; the shuffle on x86-64)
    from . import _native

    if not hasattr(_native, "bitshuffle"):
        _native = None
except ImportError:
    _native = None
# Whether the C extension bit-shuffles (then its page loops do it page by page themselves).
C_SHUFFLE = _native is not None

_U64 = np.uint64
# (d, mask): bits i with i & d == 0 of every byte lane
_STAGES = (
    (1, _U64(0x5555555555555555)),
    (2, _U64(0x3333333333333333)),
    (4, _U64(0x0F0F0F0F0F0F0F0F)),
)
_ELEMENT = {2: np.uint16, 4: np.uint32}
CHUNK_BYTES = 1 << 20  # bytes of pages per step: cache-sized, yet few numpy calls per batch


def _transpose_rows(w: np.ndarray, tmp: np.ndarray) -> None:
    """In place: bit ``i`` of byte lane ``k`` of row ``t`` <-> bit ``t`` of lane ``k`` of row
    ``i`` for ``w`` ``uint64 [8, L]`` (a transpose of the 8x8 bit matrix of every byte lane).
    ``tmp`` is ``uint64 [4 * L]`` scratch."""
    length = w.shape[1]
    for d, mask in _STAGES:
        pairs = w.reshape(8 // (2 * d), 2, d, length)
        lo, hi = pairs[:, 0], pairs[:, 1]  # rows t and t + d, t & d == 0
        t = tmp.reshape(8 // (2 * d), d, length)
        np.right_shift(lo, _U64(d), out=t)
        np.bitwise_xor(t, hi, out=t)
        np.bitwise_and(t, mask, out=t)
        np.bitwise_xor(hi, t, out=hi)
        np.left_shift(t, _U64(d), out=t)
        np.bitwise_xor(lo, t, out=lo)


def _check_np(pages: np.ndarray, element_size: int) -> tuple[np.ndarray, int]:
    """``(pages as a C-contiguous array, element_size as an int)``, or ValueError."""
    element_size = check_element_size(element_size)
    if pages.ndim != 2 or pages.dtype != np.uint8:
        raise ValueError(f"expected uint8 [N, P] pages, got {pages.dtype} {pages.shape}")
    if pages.shape[1] % (8 * element_size):
        raise ValueError(f"page size {pages.shape[1]} is not a multiple of {8 * element_size}")
    return np.ascontiguousarray(pages), element_size


def _check_torch(pages: torch.Tensor, element_size: int) -> int:
    """``element_size`` as an int, or ``PageCompError`` unless ``pages`` is ``uint8 [N, P]``
    with ``P`` a multiple of ``8 * element_size``: the torch transform of another dtype took
    each element for one byte (an ``int32`` page lost all but its low bytes, silently)."""
    element_size = check_element_size(element_size)
    if not isinstance(pages, torch.Tensor) or pages.dtype != torch.uint8 or pages.dim() != 2:
        raise PageCompError(f"expected uint8 [N, P] pages (view other dtypes as bytes with "
                            f"tensor.view(torch.uint8)), got {_desc(pages)}")
    if pages.shape[1] % (8 * element_size):
        raise PageCompError(f"page size {pages.shape[1]} is not a multiple of "
                            f"{8 * element_size}")
    return element_size


def _native_shuffle(pages: np.ndarray, out: np.ndarray, element_size: int,
                    inverse: bool) -> bool:
    """The transform through the C extension (``_native.bitshuffle``: SSE2, the GIL released)
    where it is built and takes these arrays; False where numpy has to do it."""
    if (_native is None or element_size == 1 or pages.shape[1] % (64 * element_size)
            or not out.flags.c_contiguous or out.shape != pages.shape or out.dtype != np.uint8):
        return False
    _native.bitshuffle(pages.reshape(-1), out.reshape(-1), pages.shape[1], element_size, inverse)
    return True


def bitshuffle_np(
    pages: np.ndarray, element_size: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Bit planes of each page: ``uint8 [N, P]`` -> ``uint8 [N, P]`` (``out`` if given,
    which must not overlap ``pages``). In C where the extension is built (x86-64), else numpy
    (:func:`_bitshuffle_numpy`): the same bytes."""
    pages, element_size = _check_np(pages, element_size)
    out = np.empty_like(pages) if out is None else out
    if _native_shuffle(pages, out, element_size, inverse=False):
        return out
    return _bitshuffle_numpy(pages, element_size, out)


def _bitshuffle_numpy(pages: np.ndarray, element_size: int, out: np.ndarray) -> np.ndarray:
    if element_size == 1:
        np.copyto(out, pages)
        return out
    n, page_size = pages.shape
    e, dt = element_size, _ELEMENT[element_size]
    groups = page_size // (8 * e)
    rows = max(1, CHUNK_BYTES // page_size)
    elems = np.empty((8, min(rows, n), groups), dt)
    tmp = np.empty(elems.size * e // 2, _U64)
    for s in range(0, n, rows):
        r = min(rows, n - s)
        el = elems[:, :r] if r == elems.shape[1] else np.empty((8, r, groups), dt)
        np.copyto(el, pages[s : s + r].view(dt).reshape(r, groups, 8).transpose(2, 0, 1))
        w = el.reshape(8, -1).view(_U64)
        _transpose_rows(w, tmp[: 4 * w.shape[1]])
        planes = out[s : s + r].reshape(r, e, 8, groups)
        for j in range(e):  # lane byte j of row i -> plane 8j + i
            src = el if j == 0 else el >> dt(8 * j)
            np.copyto(planes[:, j].transpose(1, 0, 2), src, casting="unsafe")
    return out


def bitunshuffle_np(
    shuffled: np.ndarray, element_size: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Inverse of :func:`bitshuffle_np` (``out`` may be ``shuffled`` itself); in C where the
    extension is built, else numpy (:func:`_bitunshuffle_numpy`)."""
    shuffled, element_size = _check_np(shuffled, element_size)
    out = np.empty_like(shuffled) if out is None else out
    if _native_shuffle(shuffled, out, element_size, inverse=True):
        return out
    return _bitunshuffle_numpy(shuffled, element_size, out)


def _bitunshuffle_numpy(shuffled: np.ndarray, element_size: int, out: np.ndarray) -> np.ndarray:
    if element_size == 1:
        if out is not shuffled:
            np.copyto(out, shuffled)
        return out
    n, page_size = shuffled.shape
    e, dt = element_size, _ELEMENT[element_size]
    groups = page_size // (8 * e)
    rows = max(1, CHUNK_BYTES // page_size)
    elems = np.empty((8, min(rows, n), groups), dt)
    high = np.empty_like(elems)
    tmp = np.empty(elems.size * e // 2, _U64)
    for s in range(0, n, rows):
        r = min(rows, n - s)
        full = r == elems.shape[1]
        el = elems[:, :r] if full else np.empty((8, r, groups), dt)
        hi = high[:, :r] if full else np.empty((8, r, groups), dt)
        planes = shuffled[s : s + r].reshape(r, e, 8, groups)
        np.copyto(el, planes[:, 0].transpose(1, 0, 2))
        for j in range(1, e):
            np.copyto(hi, planes[:, j].transpose(1, 0, 2))
            np.left_shift(hi, dt(8 * j), out=hi)
            np.bitwise_or(el, hi, out=el)
        w = el.reshape(8, -1).view(_U64)
        _transpose_rows(w, tmp[: 4 * w.shape[1]])
        np.copyto(out[s : s + r].view(dt).reshape(r, groups, 8).transpose(2, 0, 1), el)
    return out


def _bitshuffle_torch(pages: torch.Tensor, element_size: int) -> torch.Tensor:
    n_pages, page_size = pages.shape
    nbits = 8 * element_size
    groups = page_size // nbits  # n / 8 bytes per plane, n = P / E elements
    # bytes [N, groups, 8 elements, E bytes] -> bits [N, groups, 8, 8E] (bit b of element)
    b = pages.reshape(n_pages, groups, 8, element_size)
    shifts = torch.arange(8, device=pages.device, dtype=torch.uint8)
    bits = (b.unsqueeze(-1) >> shifts) & 1  # [N, groups, 8, E, 8]
    bits = bits.reshape(n_pages, groups, 8, nbits)  # bit index b = byte * 8 + bit
    weights = (1 << shifts).to(torch.int32)  # element t within the group -> bit t
    planes = (bits.to(torch.int32) * weights.view(1, 1, 8, 1)).sum(dim=2)  # [N, groups, 8E]
    return planes.transpose(1, 2).reshape(n_pages, page_size).to(torch.uint8)


def _bitunshuffle_torch(shuffled: torch.Tensor, element_size: int) -> torch.Tensor:
    n_pages, page_size = shuffled.shape
    nbits = 8 * element_size
    groups = page_size // nbits
    planes = shuffled.reshape(n_pages, nbits, groups).transpose(1, 2)  # [N, groups, 8E]
    shifts = torch.arange(8, device=shuffled.device, dtype=torch.uint8)
    bits = (planes.unsqueeze(2) >> shifts.view(1, 1, 8, 1)) & 1  # [N, groups, 8 elems, 8E]
    bits = bits.reshape(n_pages, groups, 8, element_size, 8).to(torch.int32)
    data = (bits * (1 << shifts).to(torch.int32)).sum(dim=-1)  # [N, groups, 8, E]
    return data.reshape(n_pages, page_size).to(torch.uint8)


def bitshuffle(pages: torch.Tensor, element_size: int) -> torch.Tensor:
    """Bit planes of each page: ``uint8 [N, P]`` -> ``uint8 [N, P]`` (a new tensor)."""
    element_size = _check_torch(pages, element_size)
    if element_size == 1:
        return pages.clone()
    if pages.device.type == "cpu":
        return torch.from_numpy(bitshuffle_np(pages.detach().numpy(), element_size))
    return _bitshuffle_torch(pages, element_size)


def bitunshuffle(shuffled: torch.Tensor, element_size: int) -> torch.Tensor:
    """Inverse of :func:`bitshuffle`: ``uint8 [N, P]`` -> ``uint8 [N, P]`` (a new tensor)."""
    element_size = _check_torch(shuffled, element_size)
    if element_size == 1:
        return shuffled.clone()
    if shuffled.device.type == "cpu":
        return torch.from_numpy(bitunshuffle_np(shuffled.detach().numpy(), element_size))
    return _bitunshuffle_torch(shuffled, element_size)
