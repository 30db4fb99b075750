"""Bit-unshuffle helper (``@triton.jit``) fused into the LZ4 page decoder.

The decoder writes a shuffled page ``Y`` (``8E`` bit planes of ``G = P / (8E)`` bytes, see
``torch_pagecomp.format``) *transposed*: byte ``g`` of plane ``b`` lands at ``g * 8E + b``.
Each run of ``8E`` bytes then holds everything group ``g`` (elements ``8g .. 8g + 7``) needs,
so :func:`unshuffle_groups` finishes the inverse in place, group by group.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
