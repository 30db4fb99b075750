"""Bit-unshuffle helpers (``@triton.jit``) fused into the LZ4 page decoder.

The shuffled page ``Y`` has ``8E`` bit planes of ``G = P / (8E)`` bytes (``torch_pagecomp.format``).

:func:`unshuffle_page_words` takes the page as a plain LZ4 decode leaves it (planes in order)
and inverts the shuffle in one whole-page tile of 32-bit words (pages small enough to sit in
registers): every step is elementwise over the word positions of a plane (bit transposes by
delta swaps, 4x4 byte transposes), and the result goes out in 16-word runs.

For larger pages (or rows not 4-byte aligned) the decoder writes ``Y`` *transposed*: byte ``g``
of plane ``b`` lands at ``g * 8E + b``. Each run of ``8E`` bytes then holds everything group
``g`` (elements ``8g .. 8g + 7``) needs, so :func:`unshuffle_groups64` finishes the inverse in
place, a few groups per step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bitshuffle import transpose8x8


@triton.jit
def unshuffle_groups64(row, P: tl.constexpr, E: tl.constexpr, GT: tl.constexpr):
    """Rewrite ``row`` (``uint8 [P]`` pointer, transposed planes as written by the decoder) in
    place as the unshuffled page (element size ``E``, 2 or 4), ``GT`` groups per step
    (``GT * 8E`` contiguous bytes), with a 64-bit bit transpose per byte lane ``k``: bytes
    ``8k .. 8k + 7`` of a group are one little-endian word whose 8x8 transpose holds byte ``k``
    of its 8 elements. Callers place a barrier between the decoder's last store and this call."""
    G: tl.constexpr = P // (8 * E)
    g = tl.arange(0, GT)[:, None, None]
    k = tl.arange(0, E)[None, :, None]
    j = tl.arange(0, 8)[None, None, :]
    gg = tl.arange(0, GT)[:, None]
    kk = tl.arange(0, E)[None, :]
    for g0 in range(0, G, GT):
        base = row + g0 * (8 * E)
        c = tl.load(base + g * (8 * E) + k * 8 + j).to(tl.int64)  # [GT, E, 8]
        w = transpose8x8(tl.sum(c << (8 * j).to(tl.int64), axis=2))  # [GT, E]
        tl.debug_barrier()  # every thread has read the step's groups before any overwrites them
        for t in tl.static_range(8):  # byte t of w: byte k of element 8g + t
            tl.store(base + gg * (8 * E) + t * E + kk, ((w >> (8 * t)) & 255).to(tl.uint8))


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
def _lane_words(row32, k: tl.constexpr, GW: tl.constexpr, i):
    """Word ``i`` of planes ``8k .. 8k + 7`` (``GW`` words per plane), bit-transposed: byte
    ``q`` of the ``r``-th result is byte ``k`` of element ``8(4i + q) + r``."""
    a0 = tl.load(row32 + (8 * k + 0) * GW + i)
    a1 = tl.load(row32 + (8 * k + 1) * GW + i)
    a2 = tl.load(row32 + (8 * k + 2) * GW + i)
    a3 = tl.load(row32 + (8 * k + 3) * GW + i)
    a4 = tl.load(row32 + (8 * k + 4) * GW + i)
    a5 = tl.load(row32 + (8 * k + 5) * GW + i)
    a6 = tl.load(row32 + (8 * k + 6) * GW + i)
    a7 = tl.load(row32 + (8 * k + 7) * GW + i)
    return transpose_bits8(a0, a1, a2, a3, a4, a5, a6, a7)


@triton.jit
def _store16(row32, o, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
    """Words ``v0 .. v15`` (``[N]`` each) at ``row32 + o + f`` for ``f`` = 0..15 (``o`` ``[N]``),
    in one coalesced store."""
    x = join16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15)
    tl.store(row32 + o[:, None] + tl.arange(0, 16)[None, :], x)


@triton.jit
def unshuffle_page_words(row, P: tl.constexpr, E: tl.constexpr):
    """Rewrite ``row`` (``uint8 [P]`` pointer holding the shuffled page, planes in order, as a
    plain LZ4 decode leaves it) in place as the unshuffled page, on 32-bit words, every step
    elementwise over the
    ``GW = P / (32E)`` word positions ``i`` of a plane: word ``i`` of the 8 planes of byte lane
    ``k`` is bit-transposed (:func:`transpose_bits8`; byte ``q`` of result ``r``: byte ``k`` of
    element ``8(4i + q) + r``), and 4x4 byte transposes across the byte lanes assemble whole
    elements, the ``8E`` words of groups ``4i .. 4i + 3`` stored in 16-word runs. ``row`` must
    be 4-byte aligned. Callers place a barrier between the decoder's last store and this
    call."""
    GW: tl.constexpr = P // (32 * E)
    row32 = row.to(tl.pointer_type(tl.uint32))
    i = tl.arange(0, GW)
    x0, x1, x2, x3, x4, x5, x6, x7 = _lane_words(row32, 0, GW, i)
    y0, y1, y2, y3, y4, y5, y6, y7 = _lane_words(row32, 1, GW, i)
    if E == 2:
        # word 16i + 4q + m: elements 8g + 2m, 8g + 2m + 1 of group g = 4i + q
        a0, a1, a2, a3 = transpose_bytes4(x0, y0, x1, y1)  # m = 0, by q
        b0, b1, b2, b3 = transpose_bytes4(x2, y2, x3, y3)
        c0, c1, c2, c3 = transpose_bytes4(x4, y4, x5, y5)
        d0, d1, d2, d3 = transpose_bytes4(x6, y6, x7, y7)
        tl.debug_barrier()  # every thread has read the page before any overwrites it
        _store16(row32, 16 * i, a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3)
    else:
        u0, u1, u2, u3, u4, u5, u6, u7 = _lane_words(row32, 2, GW, i)
        v0, v1, v2, v3, v4, v5, v6, v7 = _lane_words(row32, 3, GW, i)
        # word 32i + 8q + r: element 8g + r of group g = 4i + q
        a0, a1, a2, a3 = transpose_bytes4(x0, y0, u0, v0)  # r = 0, by q
        b0, b1, b2, b3 = transpose_bytes4(x1, y1, u1, v1)
        c0, c1, c2, c3 = transpose_bytes4(x2, y2, u2, v2)
        d0, d1, d2, d3 = transpose_bytes4(x3, y3, u3, v3)
        e0, e1, e2, e3 = transpose_bytes4(x4, y4, u4, v4)
        f0, f1, f2, f3 = transpose_bytes4(x5, y5, u5, v5)
        g0, g1, g2, g3 = transpose_bytes4(x6, y6, u6, v6)
        h0, h1, h2, h3 = transpose_bytes4(x7, y7, u7, v7)
        tl.debug_barrier()  # every thread has read the page before any overwrites it
        _store16(row32, 32 * i, a0, b0, c0, d0, e0, f0, g0, h0, a1, b1, c1, d1, e1, f1, g1, h1)
        _store16(row32, 32 * i + 16, a2, b2, c2, d2, e2, f2, g2, h2,
                 a3, b3, c3, d3, e3, f3, g3, h3)
