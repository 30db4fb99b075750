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

from .bitshuffle import transpose8x8


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
