"""``@triton.jit`` bit-shuffle helpers, fused into the compression kernel.

The transform is ``torch_pagecomp.format``'s (identical bytes to
``torch_pagecomp.shuffle.bitshuffle``): a page of ``n = P / E`` little-endian ``E``-byte elements
becomes ``8E`` bit planes of ``n / 8`` bytes, plane ``b`` first for ``b = 0``.

Per group of 8 elements and per byte lane ``j`` of the element, the 8 bytes ``x[8g + t]`` byte
``j`` form an 8x8 bit matrix (row ``t`` = element, column = bit); its transpose holds, in byte
``r``, bit ``r`` of the 8 elements, i.e. byte ``g`` of plane ``8j + r``. The transpose is three
delta swaps on one 64-bit word (Hacker's Delight, ``transpose8``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def transpose8x8(x):
    """Transpose 8x8 bit matrices held in int64 words (bit ``8 * row + col``), elementwise."""
    t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AA
    x = x ^ t ^ (t << 7)
    t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCC
    x = x ^ t ^ (t << 14)
    t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0
    x = x ^ t ^ (t << 28)
    return x


@triton.jit
def bitshuffle_page(src, dst, P: tl.constexpr, E: tl.constexpr, GCH: tl.constexpr):
    """Write the bit-shuffle of the ``P``-byte page at ``src`` (uint8 ptr) to ``dst`` (uint8 ptr).

    ``E`` is 2 or 4; ``GCH`` (a power of two <= P / (8E)) groups of 8 elements per step.
    """
    GROUPS: tl.constexpr = P // (8 * E)
    gi = tl.arange(0, GCH)[:, None]
    t = tl.arange(0, 8)[None, :]
    for j in tl.static_range(E):
        for g0 in range(0, GROUPS, GCH):
            g = g0 + gi
            b = tl.load(src + g * (8 * E) + t * E + j).to(tl.int64)
            x = transpose8x8(tl.sum(b << (8 * t).to(tl.int64), axis=1))
            y = (x[:, None] >> (8 * t).to(tl.int64)) & 255
            tl.store(dst + (8 * j + t) * GROUPS + g, y.to(tl.uint8))


@triton.jit
def _compact_bytes(x, E: tl.constexpr):
    """int64 ``x``: bytes ``0, E, 2E, ..`` moved to bytes ``0, 1, 2, ..`` (``8 / E`` bytes), the
    rest 0 (``E`` 2 or 4)."""
    if E == 2:
        x = x & 0x00FF00FF00FF00FF
        x = (x | (x >> 8)) & 0x0000FFFF0000FFFF
        x = (x | (x >> 16)) & 0x00000000FFFFFFFF
    else:
        x = x & 0x000000FF000000FF
        x = (x | (x >> 24)) & 0xFFFF
    return x


@triton.jit
def bitshuffle_page_wide(src, dst, P: tl.constexpr, E: tl.constexpr, GCH: tl.constexpr):
    """:func:`bitshuffle_page` (same bytes) reading 64-bit words instead of bytes: a group's
    ``8E`` bytes are ``E`` words (word ``m``: elements ``8g + (8/E)m ..``); byte lane ``k`` of
    its 8 elements is gathered by :func:`_compact_bytes`. ``src`` must be 8-byte aligned.
    The planes are still written as bytes: 64-bit stores are no faster."""
    GROUPS: tl.constexpr = P // (8 * E)
    M: tl.constexpr = 8 // E  # elements per word
    src64 = src.to(tl.pointer_type(tl.int64))
    gi = tl.arange(0, GCH)
    t = tl.arange(0, 8)[None, :]
    for g0 in range(0, GROUPS, GCH):
        g = g0 + gi
        a0 = tl.load(src64 + g * E)
        a1 = tl.load(src64 + g * E + 1)
        a2 = a0
        a3 = a0
        if E == 4:
            a2 = tl.load(src64 + g * E + 2)
            a3 = tl.load(src64 + g * E + 3)
        for k in tl.static_range(E):
            # byte t of w: byte k of element 8g + t, from word t // M
            w = _compact_bytes(a0 >> (8 * k), E) | (_compact_bytes(a1 >> (8 * k), E) << (8 * M))
            if E == 4:
                w |= _compact_bytes(a2 >> (8 * k), E) << (16 * M)
                w |= _compact_bytes(a3 >> (8 * k), E) << (24 * M)
            x = transpose8x8(w)
            y = (x[:, None] >> (8 * t).to(tl.int64)) & 255
            tl.store(dst + (8 * k + t) * GROUPS + g[:, None], y.to(tl.uint8))
