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
    (Writing the planes as 64-bit words too was no faster: H200,
    ``bench/results/h200_1a67841/wide2_probe_e44ec50.txt``.)"""
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


@triton.jit
def _swap(a, b, s: tl.constexpr, m: tl.constexpr):
    """Delta swap of two uint32 tensors: the bits of ``a`` at ``m << s`` trade places with the
    bits of ``b`` at ``m``."""
    t = ((a >> s) ^ b) & m
    return a ^ (t << s), b ^ t


@triton.jit
def transpose_bits8(a0, a1, a2, a3, a4, a5, a6, a7):
    """Per byte position ``q`` of eight uint32 tensors, transpose the 8x8 bit matrix whose row
    ``j`` is byte ``q`` of ``aj``: afterwards bit ``j`` of byte ``q`` of ``ar`` is the old bit
    ``r`` of byte ``q`` of ``aj``. Three rounds of block swaps (4x4, 2x2, 1x1), 60 operations
    for four matrices."""
    a0, a4 = _swap(a0, a4, 4, 0x0F0F0F0F)
    a1, a5 = _swap(a1, a5, 4, 0x0F0F0F0F)
    a2, a6 = _swap(a2, a6, 4, 0x0F0F0F0F)
    a3, a7 = _swap(a3, a7, 4, 0x0F0F0F0F)
    a0, a2 = _swap(a0, a2, 2, 0x33333333)
    a1, a3 = _swap(a1, a3, 2, 0x33333333)
    a4, a6 = _swap(a4, a6, 2, 0x33333333)
    a5, a7 = _swap(a5, a7, 2, 0x33333333)
    a0, a1 = _swap(a0, a1, 1, 0x55555555)
    a2, a3 = _swap(a2, a3, 1, 0x55555555)
    a4, a5 = _swap(a4, a5, 1, 0x55555555)
    a6, a7 = _swap(a6, a7, 1, 0x55555555)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def transpose_bytes4(w0, w1, w2, w3):
    """4x4 byte transpose of four uint32 tensors: byte ``s`` of the ``q``-th result is byte
    ``q`` of ``ws``."""
    w0, w2 = _swap(w0, w2, 16, 0xFFFF)
    w1, w3 = _swap(w1, w3, 16, 0xFFFF)
    w0, w1 = _swap(w0, w1, 8, 0x00FF00FF)
    w2, w3 = _swap(w2, w3, 8, 0x00FF00FF)
    return w0, w1, w2, w3


@triton.jit
def _store_planes(dst32, k: tl.constexpr, GW: tl.constexpr, i, a0, a1, a2, a3, a4, a5, a6, a7):
    """Bit-transpose ``a0 .. a7`` (byte ``q`` of ``ar``: byte ``k`` of element ``8(4i + q) + r``)
    and store result ``j`` as word ``i`` of plane ``8k + j``."""
    a0, a1, a2, a3, a4, a5, a6, a7 = transpose_bits8(a0, a1, a2, a3, a4, a5, a6, a7)
    tl.store(dst32 + (8 * k + 0) * GW + i, a0)
    tl.store(dst32 + (8 * k + 1) * GW + i, a1)
    tl.store(dst32 + (8 * k + 2) * GW + i, a2)
    tl.store(dst32 + (8 * k + 3) * GW + i, a3)
    tl.store(dst32 + (8 * k + 4) * GW + i, a4)
    tl.store(dst32 + (8 * k + 5) * GW + i, a5)
    tl.store(dst32 + (8 * k + 6) * GW + i, a6)
    tl.store(dst32 + (8 * k + 7) * GW + i, a7)


@triton.jit
def join16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
    """``[N]`` tensors ``v0 .. v15`` as one ``[N, 16]`` tensor (column ``f`` = ``vf``), so that
    ``N`` runs of 16 words go to memory in one store (the compiler coalesces it)."""
    a0 = tl.join(v0, v8)  # the last axis added first is the most significant bit of f
    a1 = tl.join(v1, v9)
    a2 = tl.join(v2, v10)
    a3 = tl.join(v3, v11)
    a4 = tl.join(v4, v12)
    a5 = tl.join(v5, v13)
    a6 = tl.join(v6, v14)
    a7 = tl.join(v7, v15)
    b0 = tl.join(a0, a4)
    b1 = tl.join(a1, a5)
    b2 = tl.join(a2, a6)
    b3 = tl.join(a3, a7)
    c0 = tl.join(b0, b2)
    c1 = tl.join(b1, b3)
    return tl.reshape(tl.join(c0, c1), [v0.shape[0], 16])


@triton.jit
def _split4(x):
    """``x [..., 2, 2]`` as 4 tensors, ``x[..., f // 2, f % 2]`` for ``f`` = 0..3."""
    a, b = tl.split(x)
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def split16(x):
    """``x [N, 16]`` as 16 ``[N]`` tensors (column ``f`` for ``f`` = 0..15): the inverse of
    :func:`join16`, so that one coalesced load feeds elementwise work."""
    y = tl.reshape(x, [x.shape[0], 2, 2, 2, 2])
    s0, s1, s2, s3 = _split4(y)  # low 2 bits of f
    v0, v4, v8, v12 = _split4(s0)
    v1, v5, v9, v13 = _split4(s1)
    v2, v6, v10, v14 = _split4(s2)
    v3, v7, v11, v15 = _split4(s3)
    return v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15


@triton.jit
def _load16(src32, o):
    """16 ``[N]`` tensors: the words at ``src32 + o + f`` (``o`` ``[N]``), in one coalesced
    load."""
    return split16(tl.load(src32 + o[:, None] + tl.arange(0, 16)[None, :]))


@triton.jit
def bitshuffle_page_words(src, dst, P: tl.constexpr, E: tl.constexpr, CW: tl.constexpr):
    """:func:`bitshuffle_page` (same bytes) on 32-bit words, elementwise over ``CW`` word
    positions ``i`` of a plane at a time (``GW = P / (32E)`` per plane): the ``8E`` words of
    groups ``4i .. 4i + 3`` (loaded in 16-word runs) are 4x4 byte-transposed into one word per
    byte lane ``k`` and element ``8g + r`` of the group (:func:`transpose_bytes4`), and the 8
    words of each byte lane are bit-transposed into word ``i`` of its 8 planes
    (:func:`transpose_bits8`): the inverse of ``bitunshuffle.unshuffle_page_words``. ``src`` and
    ``dst`` must be 4-byte aligned."""
    GW: tl.constexpr = P // (32 * E)
    src32 = src.to(tl.pointer_type(tl.uint32))
    dst32 = dst.to(tl.pointer_type(tl.uint32))
    for i0 in range(0, GW, CW):
        i = i0 + tl.arange(0, CW)
        if E == 2:  # word 16i + 4q + m: elements 8g + 2m, 8g + 2m + 1 of group g = 4i + q
            a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3 = _load16(src32, 16 * i)
            x0, y0, x1, y1 = transpose_bytes4(a0, a1, a2, a3)  # m = 0
            x2, y2, x3, y3 = transpose_bytes4(b0, b1, b2, b3)
            x4, y4, x5, y5 = transpose_bytes4(c0, c1, c2, c3)
            x6, y6, x7, y7 = transpose_bytes4(d0, d1, d2, d3)
            _store_planes(dst32, 0, GW, i, x0, x1, x2, x3, x4, x5, x6, x7)
            _store_planes(dst32, 1, GW, i, y0, y1, y2, y3, y4, y5, y6, y7)
        else:  # word 32i + 8q + r: element 8g + r of group g = 4i + q
            a0, b0, c0, d0, e0, f0, g0, h0, a1, b1, c1, d1, e1, f1, g1, h1 = _load16(src32, 32 * i)
            a2, b2, c2, d2, e2, f2, g2, h2, a3, b3, c3, d3, e3, f3, g3, h3 = _load16(
                src32, 32 * i + 16)
            x0, y0, u0, v0 = transpose_bytes4(a0, a1, a2, a3)  # r = 0
            x1, y1, u1, v1 = transpose_bytes4(b0, b1, b2, b3)
            x2, y2, u2, v2 = transpose_bytes4(c0, c1, c2, c3)
            x3, y3, u3, v3 = transpose_bytes4(d0, d1, d2, d3)
            x4, y4, u4, v4 = transpose_bytes4(e0, e1, e2, e3)
            x5, y5, u5, v5 = transpose_bytes4(f0, f1, f2, f3)
            x6, y6, u6, v6 = transpose_bytes4(g0, g1, g2, g3)
            x7, y7, u7, v7 = transpose_bytes4(h0, h1, h2, h3)
            _store_planes(dst32, 0, GW, i, x0, x1, x2, x3, x4, x5, x6, x7)
            _store_planes(dst32, 1, GW, i, y0, y1, y2, y3, y4, y5, y6, y7)
            _store_planes(dst32, 2, GW, i, u0, u1, u2, u3, u4, u5, u6, u7)
            _store_planes(dst32, 3, GW, i, v0, v1, v2, v3, v4, v5, v6, v7)
