"""Bit-unshuffle helper (``@triton.jit``) fused into the LZ4 page decoder.

The decoder writes a shuffled page ``Y`` (``8E`` bit planes of ``G = P / (8E)`` bytes, see
``torch_pagecomp.format``) *transposed*: byte ``g`` of plane ``b`` lands at ``g * 8E + b``.
Each run of ``8E`` bytes then holds everything group ``g`` (elements ``8g .. 8g + 7``) needs,
so :func:`unshuffle_groups` finishes the inverse in place, group by group.

:func:`unshuffle_page` instead takes the page as a plain LZ4 decode leaves it (planes in order)
and inverts the shuffle in one whole-page tile (pages small enough to sit in registers).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bitshuffle import join16, transpose8x8, transpose_bits8, transpose_bytes4


@triton.jit
def unshuffle_groups(row, P: tl.constexpr, E: tl.constexpr, GT: tl.constexpr):
    """Rewrite ``row`` (``uint8 [P]`` pointer, transposed planes as written by the decoder) in
    place as the unshuffled page: element ``8g + t`` byte ``k`` bit ``j`` = bit ``t`` of byte
    ``8k + j`` of group ``g``. ``E`` (2 or 4) is the element size, ``GT`` groups per step.
    Callers place a barrier between the decoder's last store and this call."""
    G: tl.constexpr = P // (8 * E)
    g = tl.arange(0, GT)[:, None, None, None]
    t = tl.arange(0, 8)[None, :, None, None]
    k = tl.arange(0, E)[None, None, :, None]
    j = tl.arange(0, 8)[None, None, None, :]
    for g0 in range(0, G, GT):
        base = row + (g0 + g) * (8 * E)
        c = tl.load(base + k * 8 + j).to(tl.int32)  # [GT, 1, E, 8]: byte 8k + j of the group
        x = tl.sum(((c >> t) & 1) << j, axis=3, keep_dims=True)  # [GT, 8, E, 1]
        tl.debug_barrier()  # every thread has read the group before any overwrites it
        tl.store(base + t * E + k, x.to(tl.uint8))


@triton.jit
def unshuffle_page(row, P: tl.constexpr, E: tl.constexpr, JS: tl.constexpr):
    """Rewrite ``row`` (``uint8 [P]`` pointer holding the shuffled page ``Y``, planes in order,
    as a plain LZ4 decode leaves it) in place as the unshuffled page, in one tile: per byte lane
    ``k`` of the elements, the 8 planes ``8k .. 8k + 7`` of group ``g`` form a 64-bit word whose
    8x8 bit transpose holds byte ``k`` of elements ``8g .. 8g + 7``. The whole page is read (kept
    as ``P / 8`` int64 words) before a barrier and then written; the reads go ``JS`` planes per
    byte lane at a time (8: all at once; fewer: barriers in between keep the compiler from
    holding every loaded byte at once, fewer registers). Callers place a barrier between the
    decoder's last store and this call; ``P / 8`` words must fit in registers."""
    G: tl.constexpr = P // (8 * E)
    k = tl.arange(0, E)[:, None, None]
    j = tl.arange(0, JS)[None, :, None]
    g = tl.arange(0, G)[None, None, :]
    w = tl.zeros([E, G], tl.int64)
    for j0 in tl.static_range(0, 8, JS):
        c = tl.load(row + (8 * k + j0 + j) * G + g).to(tl.int64)  # [E, JS, G]: planes, byte g
        w |= tl.sum(c << (8 * (j0 + j)).to(tl.int64), axis=1)  # [E, G]
        if JS < 8:
            tl.debug_barrier()
    w = transpose8x8(w)  # byte t: byte k of element 8g + t
    kk = tl.arange(0, E)[:, None]
    gg = tl.arange(0, G)[None, :]
    tl.debug_barrier()  # every thread has read the page before any overwrites it
    for t in tl.static_range(8):
        tl.store(row + gg * (8 * E) + t * E + kk, ((w >> (8 * t)) & 255).to(tl.uint8))


@triton.jit
def unshuffle_groups64(row, P: tl.constexpr, E: tl.constexpr, GT: tl.constexpr):
    """:func:`unshuffle_groups` (same layout in, same bytes out) with ``GT`` groups per step
    (``GT * 8E`` contiguous bytes) and a 64-bit bit transpose per byte lane ``k``: bytes
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
    """:func:`unshuffle_page` (same bytes) on 32-bit words, every step elementwise over the
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
