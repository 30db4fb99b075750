"""Triton LZ4 page compression: :func:`compress_pages`, the launcher behind
``torch.ops.pagecomp.compress``; the reference is ``torch_pagecomp.cpu_codec.compress_cpu`` (same
kind rules), the tests ``tests/test_triton_compress.py`` (whose ``_model`` states the parse).

Output: the fixed-stride container of ``torch_pagecomp.format`` (``payload uint8 [N, P]`` with a
zero tail, ``sizes int32 [N]``, ``kinds uint8 [N]``); every LZ4 page is a standard LZ4 block.

Design: one warp owns one page at a time (``num_warps=1``: warp-wide reductions are single
``redux.sync`` instructions and 32 programs fit an SM); a persistent grid of
``programs_per_sm x SMs`` programs loops over the pages.

1. Same-filled check: one pass over the page as 32-bit words. Filled pages skip to step 5.
2. ``element_size`` 2/4: the program bit-shuffles its page (8x8 bit transposes on 64-bit words,
   ``bitshuffle.py``; read as 64-bit words where the pages are 8-byte aligned) into a private
   P-byte scratch row that stays in cache; all LZ4 work reads that row.
3. Match candidates for a window of ``WINDOW`` positions at once: the 4-byte word at every
   position (a row of 4 positions from 2 aligned loads).
   Plain bytes: a per-program hash table in global scratch, int32 entries
   ``tag << log2(P) | position`` (tagged by a page counter, so it is cleared once per launch,
   never per page), read with ``.cg`` loads and updated with ``atomic_max`` per sub-chunk of 32
   positions (:func:`_table_candidates`); the sub-chunk's own earlier positions are invisible
   to it, so distances 1, 2, 4, 8 (``NEAR``) are checked directly on 4 aligned words per row.
   Bit-shuffled pages: no hash table. Their matches are runs and repeated planes (exponent
   bits that rarely change), so the candidates are distances 1, 2, 4, 8, 16 and one and two
   planes back, read from the row in L1 (:func:`_plane_candidates`). A window is searched only
   if one of its aligned words repeats at 4, 8, 16 bytes or one or two planes back (the gate);
   planes none of whose words repeat (the noisy mantissa planes) are found once per page and
   passed over whole.
   A candidate must hold the same word (hash collisions lose matches, never correctness), and
   the next ``KNOWN_WORDS`` words of every candidate are compared at once, so most match
   lengths are known before the walk.
4. Greedy parse, one short step per sequence (:func:`_parse_window`): a warp min over packed
   keys ``(position, known length, candidate)`` finds the next match at or after the current
   position; only matches longer than the known part are extended, ``MATCH_STEP`` bytes per
   step. Each sequence is written at once: token and offset as scalar stores, literals as
   32-bit word stores (bytes at the ends), length extensions as vectors of 255s. The LZ4 end
   rules hold by construction: matches start at most at ``P - 12`` and end at most at
   ``P - 5``; offsets are ``1..P - 12`` (so at most 65524 for 64 KiB pages).
   ``LAZY`` (plain bytes): when the match found is short, the next position's candidate wins
   if it is known to be longer. Matches shorter than ``MIN_MATCH`` stay literals: fewer
   sequences, faster decoding. A window that the last match ran past is not searched: the next
   window starts at the match's end (4-aligned), as LZ4 skips the positions inside a match.
   ``ACCEL`` (bit-shuffled pages): after windows without a sequence, windows of the same plane
   are skipped. ``BACK`` (plain bytes): a chosen match grows backwards into its literals (up to
   32 bytes; LZ4's "catch up"), which the hash candidates miss where a position's entry was
   older or overwritten.
5. The last literals are written only if the block fits ``lz4_keep_limit(P)``; otherwise (or as
   soon as the output passes the limit) the page goes RAW. A final pass over the row (32-bit
   words) writes the RAW copy, the FILL byte or the zero tail.

Barriers (``tl.debug_barrier``) separate table writes from other threads' reads, and the encoded
bytes from a RAW overwrite. Table reads are ``.cg`` loads: the atomics are performed in L2.
Scratch: ``G x 2**HASH_BITS`` int32 (plain bytes) and ``G x P`` bytes (bit-shuffled pages).
The settings of each page kind, and why, are in :func:`compress_config`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import constants as fmt
from .bitshuffle import bitshuffle_page, bitshuffle_page_wide
from .launch import (
    config_meta,
    int_class,
    interpreting,
    launch,
    launch_known,
    ptr_class,
)
from .lz4_decompress import _row, check_rows

_NOKEY = tl.constexpr(0x7FFFFFFF)  # no match (a parse key larger than every real one)


@triton.jit
def _word_at(ptr32, i, mask):
    """uint32 little-endian word of the 4 bytes at byte offset ``i`` (needs ``i + 8 <= PAGE``)."""
    k = i >> 2
    lo = tl.load(ptr32 + k, mask=mask, other=0)
    hi = tl.load(ptr32 + k + 1, mask=mask, other=0)
    sh = ((i & 3) * 8).to(tl.uint32)
    return (lo >> sh) | ((hi << 1) << (31 - sh))  # two shifts: 0 when sh == 0


@triton.jit
def _fill_i32(ptr, N: tl.constexpr, value, WORD_STEP: tl.constexpr):
    """``ptr[0:N] = value`` (int32)."""
    for q in range(0, N, WORD_STEP):
        k = q + tl.arange(0, WORD_STEP)
        tl.store(ptr + k, tl.full([WORD_STEP], value, tl.int32), mask=k < N)


@triton.jit
def _ext_len(n):
    """Extension bytes after a 4-bit length field holding ``n``."""
    return tl.where(n >= 15, (n - 15) // 255 + 1, 0)


@triton.jit
def _row_words(ptr32, k, sh, PAGE: tl.constexpr):
    """Words at bytes ``4k + sh / 8`` (``k`` [R, 1] word indices, ``sh`` [1, 4] shifts): [R, 4].

    Rows whose second word lies past the page read 0 (callers mask those positions)."""
    lo = tl.load(ptr32 + k, mask=k + 1 < PAGE // 4, other=0)
    hi = tl.load(ptr32 + k + 1, mask=k + 1 < PAGE // 4, other=0)
    return (lo >> sh) | ((hi << 1) << (31 - sh))


@triton.jit
def _equal_bytes(x):
    """Leading (little-endian) zero bytes of ``x = a ^ b``: bytes of ``a`` equal to ``b``, 0..4."""
    nb = tl.where((x & 0xFFFF) == 0, 2, ((x & 0xFF) == 0).to(tl.int32))
    nb = tl.where((x & 0xFFFFFF) == 0, 3, nb)
    return tl.where(x == 0, 4, nb)


@triton.jit
def _match_len(data, p, c, known, PAGE: tl.constexpr, MATCH_STEP: tl.constexpr):
    """Length of the match at ``p`` against ``c < p`` (``known`` bytes known equal), ending at
    most at ``PAGE - 5``: ``MATCH_STEP / 4`` words compared per step (``data`` 4-byte aligned)."""
    data32 = data.to(tl.pointer_type(tl.uint32))
    k = tl.arange(0, MATCH_STEP // 4)
    n = p + known
    go = n < PAGE - 5
    while go:
        i = n + 4 * k
        m = i < PAGE - 5
        x = _word_at(data32, i, m) ^ _word_at(data32, i - (p - c), m)
        nb = tl.where(m, tl.minimum(_equal_bytes(x), PAGE - 5 - i), 0)
        # the first word not wholly equal and its equal bytes, in one reduction
        f = tl.min(tl.where(nb < 4, 8 * k + nb, 8 * (MATCH_STEP // 4)))
        d = 4 * (f >> 3) + (f & 7)
        n += d
        go = d == MATCH_STEP
    return n - p


@triton.jit
def _back_len(data, p, c, lit):
    """Bytes before ``p`` equal to those before ``c < p`` (at most ``min(lit, c, 32)``)."""
    k = tl.arange(0, 32)
    lim = tl.minimum(lit, c)
    a = tl.load(data + (p - 1 - k), mask=k < lim, other=0)
    b = tl.load(data + (c - 1 - k), mask=k < lim, other=0)
    return tl.min(tl.where((a != b) | (k >= lim), k, 32))


@triton.jit
def _put_len_ext(dst, o, n, PAGE: tl.constexpr, LEN_STEP: tl.constexpr):
    """Write the extension bytes of a length field holding ``n >= 15`` at ``dst + o``."""
    cnt = (n - 15) // 255 + 1
    rem = (n - 15) % 255
    for q in range(0, cnt, LEN_STEP):
        k = q + tl.arange(0, LEN_STEP)
        v = tl.where(k < cnt - 1, 255, rem)
        tl.store(dst + o + k, v.to(tl.uint8), mask=(k < cnt) & (o + k < PAGE))
    return o + cnt


@triton.jit
def _copy_bytes(dst, o, src, a, n, PAGE: tl.constexpr, LEN_STEP: tl.constexpr):
    """``dst[o:o + n] = src[a:a + n]`` (``dst``, ``src``: 4-byte aligned rows of ``PAGE`` bytes;
    bytes at or past ``PAGE`` are dropped): the whole 32-bit words of ``dst`` as word stores,
    ``LEN_STEP``
    per step, each from two aligned loads of ``src``; the up to 3 bytes before and after them
    as byte stores."""
    src32 = src.to(tl.pointer_type(tl.uint32))
    dst32 = dst.to(tl.pointer_type(tl.uint32))
    b = tl.arange(0, 4)
    head = tl.minimum((4 - (o & 3)) & 3, n)
    v = tl.load(src + a + b, mask=b < head, other=0)
    tl.store(dst + o + b, v, mask=(b < head) & (o + b < PAGE))
    q0 = (o + head) >> 2  # the first whole word of dst
    nw = (n - head) >> 2
    s0 = a + head  # its source byte
    sh = ((s0 & 3) * 8).to(tl.uint32)
    for q in range(0, nw, LEN_STEP):
        j = q + tl.arange(0, LEN_STEP)
        k = (s0 >> 2) + j
        lo = tl.load(src32 + k, mask=j < nw, other=0)
        hi = tl.load(src32 + k + 1, mask=(j < nw) & (k + 1 < PAGE // 4), other=0)
        w = (lo >> sh) | ((hi << 1) << (31 - sh))
        tl.store(dst32 + q0 + j, w, mask=(j < nw) & (q0 + j < PAGE // 4))
    t = head + 4 * nw
    v = tl.load(src + a + t + b, mask=b < n - t, other=0)
    tl.store(dst + o + t + b, v, mask=(b < n - t) & (o + t + b < PAGE))


@triton.jit
def _emit(
    dst, data, out, anchor, lit, off, ml, HAS_MATCH: tl.constexpr, PAGE: tl.constexpr,
    LEN_STEP: tl.constexpr,
):
    """Write one sequence at ``dst + out`` (stores past the row end are dropped); returns the new
    output position. ``lit`` literals from ``data + anchor``; then, if ``HAS_MATCH``, offset
    ``off`` and match length ``ml + 4``.
    """
    if HAS_MATCH:
        token = (tl.minimum(lit, 15) << 4) | tl.minimum(ml, 15)
    else:
        token = tl.minimum(lit, 15) << 4
    tl.store(dst + out, token.to(tl.uint8), mask=out < PAGE)
    o = out + 1
    if lit >= 15:
        o = _put_len_ext(dst, o, lit, PAGE, LEN_STEP)
    if lit > 0:  # (matches right after matches: none)
        _copy_bytes(dst, o, data, anchor, lit, PAGE, 32)  # a word per lane and step
    o += lit
    if HAS_MATCH:
        tl.store(dst + o, (off & 255).to(tl.uint8), mask=o < PAGE)
        tl.store(dst + o + 1, (off >> 8).to(tl.uint8), mask=o + 1 < PAGE)
        o += 2
        if ml >= 15:
            o = _put_len_ext(dst, o, ml, PAGE, LEN_STEP)
    return o


@triton.jit
def _near_word(m2, m1, l0, l1, lane, D: tl.constexpr):
    """Word at ``idx - D`` (``D`` 1, 2, 4 or 8) of positions ``idx = 4k + lane``, from the
    aligned words ``m2, m1, l0, l1`` at ``k - 2 .. k + 1``."""
    if D % 4 == 0:  # the same byte shift, D / 4 words back
        sh = (lane * 8).to(tl.uint32)
        a = m1 if D == 4 else m2
        b = l0 if D == 4 else m1
    else:  # lanes >= D start in word k, the others in word k - 1
        up = lane >= D
        sh = (((lane - D) & 3) * 8).to(tl.uint32)
        a = tl.where(up, l0, m1)
        b = tl.where(up, l1, l0)
    return (a >> sh) | ((b << 1) << (31 - sh))


@triton.jit
def _near_step(c, m2, m1, l0, l1, lane, word, valid, idx, D: tl.constexpr):
    """Positions of ``c`` still -1 whose word repeats ``D`` bytes back take ``idx - D``."""
    ok = valid & (c < 0) & (idx >= D) & (_near_word(m2, m1, l0, l1, lane, D) == word)
    return tl.where(ok, idx - D, c)


@triton.jit
def _word_back(data32, k0, sh, D4: tl.constexpr, PAGE: tl.constexpr):
    """Words ``4 * D4`` bytes before positions ``4 * k0 + lane`` (``k0`` [R, 1], ``sh`` [1, 4]
    lane shifts): [R, 4]. Rows before the page start or past its end read 0 (callers check the
    distance against the position)."""
    k = k0 - D4
    m = (k >= 0) & (k + 1 < PAGE // 4)
    lo = tl.load(data32 + k, mask=m, other=0)
    hi = tl.load(data32 + k + 1, mask=m, other=0)
    return (lo >> sh) | ((hi << 1) << (31 - sh))


@triton.jit
def _near_candidates(data32, c, idx, k0, lane, word, valid, PAGE: tl.constexpr, NEAR: tl.constexpr):
    """Positions of ``c`` that are -1 take the nearest of distances 1, 2, 4, 8, 16 (``NEAR`` of
    them) that holds the same ``word`` (positions ``idx = 4 * k0 + lane`` [R, 4])."""
    if NEAR > 0:
        # rows past the page end (a window that starts late, after a skip) read nothing
        m2 = tl.load(data32 + k0 - 2, mask=(k0 >= 2) & (k0 - 2 < PAGE // 4), other=0)
        m1 = tl.load(data32 + k0 - 1, mask=(k0 >= 1) & (k0 - 1 < PAGE // 4), other=0)
        l0 = tl.load(data32 + k0, mask=k0 + 1 < PAGE // 4, other=0)
        l1 = tl.load(data32 + k0 + 1, mask=k0 + 1 < PAGE // 4, other=0)
        # literal distances: constexpr on every triton (a shifted loop index is not on 3.6)
        c = _near_step(c, m2, m1, l0, l1, lane, word, valid, idx, 1)
        if NEAR > 1:
            c = _near_step(c, m2, m1, l0, l1, lane, word, valid, idx, 2)
        if NEAR > 2:
            c = _near_step(c, m2, m1, l0, l1, lane, word, valid, idx, 4)
        if NEAR > 3:
            c = _near_step(c, m2, m1, l0, l1, lane, word, valid, idx, 8)
        if NEAR > 4:
            sh = (lane * 8).to(tl.uint32)
            okd = valid & (c < 0) & (idx >= 16) & (_word_back(data32, k0, sh, 4, PAGE) == word)
            c = tl.where(okd, idx - 16, c)
    return c


@triton.jit
def _plane_candidates(
    data32, idx, k0, lane, word, valid, PAGE: tl.constexpr, PLANE: tl.constexpr, NEAR: tl.constexpr,
):
    """Candidates of a bit-shuffled page without a hash table (-1: none) for positions
    ``idx = 4 * k0 + lane`` [R, 4]: the nearest of distances 1, 2, 4, 8, 16 (``NEAR`` of them),
    then one and two bit planes back (``PLANE`` bytes per plane), that holds the same ``word``.
    A plane equal to the one before it (exponent bits that rarely change) is one match."""
    c = _near_candidates(data32, tl.zeros_like(idx) - 1, idx, k0, lane, word, valid, PAGE, NEAR)
    sh = (lane * 8).to(tl.uint32)
    for j in tl.static_range(1, 3):
        okd = valid & (c < 0) & (idx >= j * PLANE)
        okd = okd & (_word_back(data32, k0, sh, j * PLANE // 4, PAGE) == word)
        c = tl.where(okd, idx - j * PLANE, c)
    return c


@triton.jit
def _same_word_back(data32, k, w, D: tl.constexpr, m):
    """``data32[k - D] == w`` where ``m`` and ``k >= D`` (else False)."""
    m = m & (k >= D)
    return m & (tl.load(data32 + k - D, mask=m, other=0) == w)


@triton.jit
def _repeats(data32, k, m, PLANE: tl.constexpr):
    """Whether each aligned word ``k`` (where ``m``) equals the word 4, 8 or 16 bytes, or one or
    two bit planes (``PLANE`` bytes), before it."""
    w = tl.load(data32 + k, mask=m, other=0)
    h = _same_word_back(data32, k, w, 1, m) | _same_word_back(data32, k, w, 2, m)
    h = h | _same_word_back(data32, k, w, 4, m) | _same_word_back(data32, k, w, PLANE // 4, m)
    return h | _same_word_back(data32, k, w, PLANE // 2, m)


@triton.jit
def _window_has_repeats(data32, w0, WINDOW: tl.constexpr, PAGE: tl.constexpr, PLANE: tl.constexpr):
    """1 if one of the aligned words of the window at ``w0`` (those that start at most at
    ``PAGE - 12``) :func:`_repeats`, else 0: the window gate of ``"planes"``."""
    k = (w0 >> 2) + tl.arange(0, WINDOW // 4)
    return tl.max(_repeats(data32, k, 4 * k <= PAGE - 12, PLANE).to(tl.int32))


@triton.jit
def _repeats_pairs(data64, j, PAGE: tl.constexpr, PLANE: tl.constexpr):
    """:func:`_repeats` of the two aligned 32-bit words of each 64-bit word ``j`` (words ``2j``,
    ``2j + 1``), ORed: the same test with 5 loads per two words instead of 12 (each 64-bit
    load brings two words, and the words one, two and four back come from the loads one and
    two 64-bit words back). Words past ``PAGE - 12`` count as not repeating, as there."""
    LO: tl.constexpr = 0xFFFFFFFF
    m = j < PAGE // 8
    cur = tl.load(data64 + j, mask=m, other=0)
    b1 = tl.load(data64 + j - 1, mask=m & (j >= 1), other=0)  # words 2j - 2, 2j - 1
    b2 = tl.load(data64 + j - 2, mask=m & (j >= 2), other=0)  # words 2j - 4, 2j - 3
    p1 = tl.load(data64 + j - PLANE // 8, mask=m & (j >= PLANE // 8), other=0)  # one plane back
    p2 = tl.load(data64 + j - PLANE // 4, mask=m & (j >= PLANE // 4), other=0)  # two planes back
    x1, x2, x3, x4 = cur ^ b1, cur ^ b2, cur ^ p1, cur ^ p2
    lo = ((cur ^ (b1 >> 32)) & LO) == 0  # word 2j against 4, 8, 16 bytes, 1, 2 planes back
    lo = (lo | ((x1 & LO) == 0)) & (j >= 1)
    lo = lo | (((x2 & LO) == 0) & (j >= 2))
    lo = lo | (((x3 & LO) == 0) & (j >= PLANE // 8)) | (((x4 & LO) == 0) & (j >= PLANE // 4))
    hi = (((cur >> 32) ^ cur) & LO) == 0  # word 2j + 1
    hi = hi | (((x1 >> 32) == 0) & (j >= 1)) | (((x2 >> 32) == 0) & (j >= 2))
    hi = hi | (((x3 >> 32) == 0) & (j >= PLANE // 8)) | (((x4 >> 32) == 0) & (j >= PLANE // 4))
    return (lo & (8 * j <= PAGE - 12)) | (hi & (8 * j + 4 <= PAGE - 12))


@triton.jit
def _live_planes(data32, PAGE: tl.constexpr, PLANE: tl.constexpr):
    """int64 with bit ``p`` set for every bit plane ``p`` (``PLANE`` bytes each) that holds an
    aligned word (one that starts at most at ``PAGE - 12``) equal to the word 4, 8 or 16 bytes, or
    one or two planes, before it (:func:`_repeats`). Every window of the other, still, planes
    fails the window gate. Read as 64-bit words (:func:`_repeats_pairs`; ``data32`` 8-byte
    aligned), 128 32-bit words per step: whole planes, or one plane's part."""
    U: tl.constexpr = 8  # bytes per element read
    EPP: tl.constexpr = PLANE // U  # elements per plane
    STEP: tl.constexpr = 512 // U  # elements per step: 128 words
    R: tl.constexpr = EPP if EPP < STEP else STEP
    NR: tl.constexpr = STEP // R
    data64 = data32.to(tl.pointer_type(tl.uint64))
    bits = tl.sum(tl.zeros([NR], tl.int64))
    for s in range(0, PAGE // U, STEP):
        j = s + tl.arange(0, NR)[:, None] * R + tl.arange(0, R)[None, :]
        rep = _repeats_pairs(data64, j, PAGE, PLANE)
        row = tl.max(rep.to(tl.int64), axis=1)
        plane = ((s + tl.arange(0, NR) * R) // EPP).to(tl.int64)
        bits = bits | tl.sum(row << plane)
    return bits


@triton.jit
def _skip_still_planes(w0, live, PAGE: tl.constexpr, PLANE: tl.constexpr, PLANE_LOG2: tl.constexpr):
    """From a bit plane's start ``w0``, pass over the still planes (bits of ``live`` clear);
    returns the next position to search. The blocks are the same as gating each window."""
    go = ((w0 & (PLANE - 1)) == 0) & (w0 <= PAGE - 12)
    while go:
        still = ((live >> (w0 >> PLANE_LOG2)) & 1) == 0
        if still:
            w0 += PLANE
        go = still & (w0 <= PAGE - 12)
    return w0


@triton.jit
def _table_candidates(
    table, data32, h, idx, widx, k0, lane, word, valid, pc, PAGE_LOG2: tl.constexpr,
    PAGE: tl.constexpr, WINDOW: tl.constexpr, NEAR: tl.constexpr,
):
    """Verified candidates (-1: none) of a window's positions ``idx = 4 * k0 + lane``
    ``[WINDOW / 4, 4]`` (``h`` hashes, ``word`` words, ``widx`` offsets in the window) from the
    hash table, entries ``pc << PAGE_LOG2 | position`` (``pc`` the page's tag), updated in
    sub-chunks of 32 positions: ``.cg`` load, barrier, ``atomic_max`` (the latest position
    wins: deterministic, and half the L2 operations of a second, per-window table), barrier.
    The sub-chunk's own earlier positions are invisible to it, so positions whose table entry
    fails fall back to the nearest of distances 1, 2, 4, 8, 16 (``NEAR`` of them) that holds
    the same word."""
    PMASK: tl.constexpr = (1 << PAGE_LOG2) - 1
    sub = widx >> 5
    ent = tl.zeros_like(idx)
    for s in tl.static_range(WINDOW // 32):
        m = valid & (sub == s)
        e = tl.load(table + h, mask=m, other=0, cache_modifier=".cg")
        ent = tl.where(sub == s, e, ent)
        tl.debug_barrier()
        tl.atomic_max(table + h, (pc << PAGE_LOG2) | idx, mask=m, sem="relaxed")
        tl.debug_barrier()
    ct = tl.where((ent >> PAGE_LOG2) == pc, ent & PMASK, -1)
    ok = valid & (ct >= 0) & (ct < idx)
    ok = ok & (_word_at(data32, ct, ok) == word)
    c = tl.where(ok, ct, -1)
    return _near_candidates(data32, c, idx, k0, lane, word, valid, PAGE, NEAR)


@triton.jit
def _parse_window(dst, data, key, idx, w0, wend, pos, anchor, out, PAGE: tl.constexpr,
                  KNOWN_WORDS: tl.constexpr, MATCH_STEP: tl.constexpr, LEN_STEP: tl.constexpr,
                  LAZY: tl.constexpr, BACK: tl.constexpr):
    """Greedy parse of one window: from ``pos`` to ``wend``, the next match (the least
    ``key``: position, known length, candidate) is written as a sequence after the literals
    since ``anchor``; returns the new ``(pos, anchor, out)``. ``LAZY``: a short match loses to
    one a byte later that is known to be longer. ``BACK``: a match grows backwards into its
    literals (up to 32 bytes). Lengths past the ``4 + 4 * KNOWN_WORDS`` known bytes are extended
    here."""
    while pos < wend:
        k = tl.min(tl.where(idx >= pos, key, _NOKEY))
        if LAZY:
            if (k != _NOKEY) & (((k >> 16) & 31) < 4 * KNOWN_WORDS):
                k1 = tl.min(tl.where(idx > w0 + (k >> 21), key, _NOKEY))
                better = (k1 >> 21) == (k >> 21) + 1
                better = better & (((k1 >> 16) & 31) > ((k >> 16) & 31))
                if (k1 != _NOKEY) & better:
                    k = k1
        if k != _NOKEY:
            p = w0 + (k >> 21)
            src_pos = k & 0xFFFF
            mx = (k >> 16) & 31
            mlen = tl.minimum(4 + mx, PAGE - 5 - p)
            if (mx == 4 * KNOWN_WORDS) & (mlen == 4 + mx):
                mlen = _match_len(data, p, src_pos, mlen, PAGE, MATCH_STEP)
            if BACK:
                if p > anchor:
                    back_n = _back_len(data, p, src_pos, p - anchor)
                    p -= back_n
                    src_pos -= back_n
                    mlen += back_n
            off = p - src_pos
            out = _emit(dst, data, out, anchor, p - anchor, off, mlen - 4, True, PAGE, LEN_STEP)
            pos = p + mlen
            anchor = pos
        else:
            pos = wend
    return pos, anchor, out


@triton.jit
def _lz4_compress_kernel(
    pages_ptr, payload_ptr, sizes_ptr, kinds_ptr, tab_ptr, shuf_ptr, n_pages,
    PAGE: tl.constexpr, PAGE_LOG2: tl.constexpr, ELEMENT_SIZE: tl.constexpr,
    KIND_LZ4: tl.constexpr, HASH_BITS: tl.constexpr, WINDOW: tl.constexpr,
    KNOWN_WORDS: tl.constexpr, MIN_MATCH: tl.constexpr, NEAR: tl.constexpr, LAZY: tl.constexpr,
    BACK: tl.constexpr, ACCEL: tl.constexpr, MATCH_STEP: tl.constexpr, LEN_STEP: tl.constexpr,
    WORD_STEP: tl.constexpr, WIDE_SHUFFLE: tl.constexpr, ROWS: tl.constexpr = False,
):
    """Grid ``(G,)``; program ``pid`` compresses pages ``pid, pid + G, ...``.

    pages/payload ``uint8 [N, PAGE]`` (with ``ROWS``, pages is an ``int64 [N]`` table of the
    pages' addresses, each 8-byte aligned), sizes ``int32 [N]``, kinds ``uint8 [N]``, tab
    ``int32 [G, 2**HASH_BITS]`` (plain bytes; uninitialised), shuf ``uint8 [G, PAGE]``
    (ELEMENT_SIZE > 1).
    """
    tl.static_assert((ACCEL == 0) | (ELEMENT_SIZE > 1))  # window skipping is for bit planes only
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    TABLE: tl.constexpr = 1 << HASH_BITS
    TAG_MAX: tl.constexpr = 0x7FFFFFFF >> PAGE_LOG2  # the largest page tag
    LIMIT: tl.constexpr = PAGE - PAGE // 32
    LAST_START: tl.constexpr = PAGE - 12  # the last position where a match may start
    PLANE: tl.constexpr = PAGE // (8 * ELEMENT_SIZE)  # bytes per bit plane (bit-shuffled pages)
    # log2(PLANE): ELEMENT_SIZE // 2 is log2(ELEMENT_SIZE) for the sizes 1, 2, 4
    PLANE_LOG2: tl.constexpr = PAGE_LOG2 - 3 - (ELEMENT_SIZE // 2)
    table = tab_ptr + pid.to(tl.int64) * TABLE
    if ELEMENT_SIZE == 1:
        _fill_i32(table, TABLE, 0, WORD_STEP)
        tl.debug_barrier()
    pc = 0
    for it in range(0, tl.cdiv(n_pages - pid, nprog)):
        page = pid + it * nprog
        src = _row(pages_ptr, page, PAGE, ROWS)
        dst = payload_ptr + page.to(tl.int64) * PAGE
        src32 = src.to(tl.pointer_type(tl.uint32))
        dst32 = dst.to(tl.pointer_type(tl.uint32))
        first = tl.load(src)
        first4 = first.to(tl.uint32) * 0x01010101
        differs = tl.zeros([WORD_STEP], tl.int32)
        for q in range(0, PAGE // 4, WORD_STEP):
            w = tl.load(src32 + q + tl.arange(0, WORD_STEP))
            differs = differs | (w != first4).to(tl.int32)
        diff = tl.max(differs)
        size = page * 0 + 1
        kind = page * 0 + 2
        keep = page * 0
        if diff != 0:
            if ELEMENT_SIZE > 1:
                data = shuf_ptr + pid.to(tl.int64) * PAGE
                if WIDE_SHUFFLE:
                    bitshuffle_page_wide(src, data, PAGE, ELEMENT_SIZE, 64)
                else:
                    bitshuffle_page(src, data, PAGE, ELEMENT_SIZE, 64)
                tl.debug_barrier()
            else:
                data = src
            data32 = data.to(tl.pointer_type(tl.uint32))
            if ELEMENT_SIZE == 1:  # the hash table's tag: entries of earlier pages never match
                pc += 1
                if pc > TAG_MAX:
                    _fill_i32(table, TABLE, 0, WORD_STEP)
                    tl.debug_barrier()
                    pc = 1
            pos = 0
            anchor = 0
            out = 0
            w0 = 0
            misses = 0
            if ELEMENT_SIZE > 1:  # still planes (every window of one fails the gate) passed over
                live_planes = _live_planes(data32, PAGE, PLANE)
                w0 = _skip_still_planes(w0, live_planes, PAGE, PLANE, PLANE_LOG2)
            while w0 <= LAST_START:
                out0 = out
                wprev = w0
                wend = tl.minimum(w0 + WINDOW, LAST_START + 1)
                live = 1
                if ELEMENT_SIZE > 1:  # a window without a repeated aligned word is not searched
                    live = _window_has_repeats(data32, w0, WINDOW, PAGE, PLANE)
                if live == 0:
                    pos = tl.maximum(pos, wend)
                else:
                    # positions as [WINDOW / 4, 4]: a row's 4 words come from 2 aligned loads
                    row = tl.arange(0, WINDOW // 4)[:, None]
                    lane = tl.arange(0, 4)[None, :]
                    widx = row * 4 + lane
                    idx = w0 + widx
                    valid = idx <= LAST_START
                    k0 = (w0 >> 2) + row
                    sh = (lane * 8).to(tl.uint32)
                    word = _row_words(data32, k0, sh, PAGE)
                    if ELEMENT_SIZE > 1:
                        c = _plane_candidates(data32, idx, k0, lane, word, valid, PAGE, PLANE, NEAR)
                    else:
                        h = ((word * 2654435761) >> (32 - HASH_BITS)).to(tl.int32)
                        c = _table_candidates(table, data32, h, idx, widx, k0, lane, word, valid,
                                              pc, PAGE_LOG2, PAGE, WINDOW, NEAR)
                    ok = c >= 0
                    if tl.max(ok.to(tl.int32)) == 0:  # no candidate (a noisy plane): no walk
                        pos = tl.maximum(pos, wend)
                    else:
                        m = tl.zeros([WINDOW // 4, 4], tl.int32)
                        alive = ok
                        for j in tl.static_range(1, 1 + KNOWN_WORDS):  # the next words of each
                            mj = alive & (idx + 4 * j < PAGE - 4)
                            x = _row_words(data32, k0 + j, sh, PAGE)
                            x = x ^ _word_at(data32, c + 4 * j, mj)
                            nb = tl.where(mj, _equal_bytes(x), 0)
                            m += nb
                            alive = alive & (nb == 4)
                        key = tl.where(ok & (m >= MIN_MATCH - 4), (widx << 21) | (m << 16) | c,
                                       _NOKEY)
                        pos, anchor, out = _parse_window(
                            dst, data, key, idx, w0, wend, pos, anchor, out, PAGE, KNOWN_WORDS,
                            MATCH_STEP, LEN_STEP, LAZY, BACK)
                w0 += WINDOW
                if pos > w0:  # the match ran past this window: resume at its end
                    w0 = pos & ~3
                if ACCEL > 0:  # after m windows of a plane without a sequence, skip m // ACCEL
                    if out == out0:
                        misses += 1
                    else:
                        misses = 0
                    if (w0 >> PLANE_LOG2) == (wprev >> PLANE_LOG2):  # no skip crosses a plane
                        plane_end = ((w0 >> PLANE_LOG2) + 1) * PLANE
                        w0 += tl.minimum(WINDOW * (misses // ACCEL), plane_end - w0)
                    if (w0 >> PLANE_LOG2) != (wprev >> PLANE_LOG2):  # a new plane starts afresh
                        misses = 0
                if out > LIMIT:
                    w0 = PAGE
                if ELEMENT_SIZE > 1:  # at a plane's start: still planes are passed over
                    w0 = _skip_still_planes(w0, live_planes, PAGE, PLANE, PLANE_LOG2)
                tl.debug_barrier()
            lit = PAGE - anchor
            final = out + 1 + _ext_len(lit) + lit
            if final <= LIMIT:
                _emit(dst, data, out, anchor, lit, 0, 0, False, PAGE, LEN_STEP)
                size = final
                kind = KIND_LZ4
                keep = final
            else:
                size = PAGE
                kind = 0
        tl.debug_barrier()
        keep4 = (keep + 3) // 4  # words from here on are stored whole
        for q in range(0, PAGE // 4, WORD_STEP):
            o = q + tl.arange(0, WORD_STEP)
            kind_o = o * 0 + kind  # a vector: the interpreter mishandles scalar & vector masks
            v = tl.load(src32 + o, mask=(o < PAGE // 4) & (kind_o == 0), other=0)
            v = tl.where((o == 0) & (kind_o == 2), first.to(tl.uint32), v)
            tl.store(dst32 + o, v, mask=o >= keep4)
        b = keep + tl.arange(0, 4)
        tl.store(dst + b, tl.zeros([4], tl.uint8), mask=b < keep4 * 4)  # the word keep is in
        tl.store(sizes_ptr + page, size)
        tl.store(kinds_ptr + page, kind)


@dataclass(frozen=True)
class CompressConfig:
    """Compile-time settings of ``_lz4_compress_kernel`` for one page size and element size:
    each upper-case field is one of its constexprs; ``num_warps`` is a launch option and
    ``programs_per_sm`` sizes the persistent grid. The constexpr ``WIDE_SHUFFLE`` comes from the
    pages' alignment at each launch."""

    PAGE: int  # bytes per page
    PAGE_LOG2: int
    ELEMENT_SIZE: int  # 1: plain bytes; 2, 4: the page is bit-shuffled first
    KIND_LZ4: int  # the kind byte of this launch's LZ4 pages
    HASH_BITS: int  # log2 entries of the hash table (plain bytes)
    WINDOW: int  # positions whose candidates are found at once
    KNOWN_WORDS: int  # words after a candidate's first compared for all positions at once
    MIN_MATCH: int  # shorter matches stay literals
    NEAR: int  # how many of the distances 1, 2, 4, 8, 16 are checked directly
    LAZY: bool  # a match one byte later wins when it is known to be longer
    BACK: bool  # a match grows backwards into its literals
    ACCEL: int  # bit planes: after m windows without a sequence, m // ACCEL skipped; 0: off
    MATCH_STEP: int  # bytes compared per step when extending a long match
    LEN_STEP: int  # length-extension bytes written per step
    WORD_STEP: int  # 32-bit words per step of the fill check, table clear and final pass
    num_warps: int
    programs_per_sm: int

    def __post_init__(self):
        if not fmt.valid_page_size(self.PAGE) or self.ELEMENT_SIZE not in fmt.ELEMENT_SIZES:
            raise ValueError(f"bad page: PAGE={self.PAGE}, ELEMENT_SIZE={self.ELEMENT_SIZE}")
        if self.WINDOW not in (64, 128, 256, 512, 1024) or not 0 <= self.KNOWN_WORDS <= 6:
            raise ValueError(f"bad tuning: WINDOW={self.WINDOW}, KNOWN_WORDS={self.KNOWN_WORDS}")
        if self.ELEMENT_SIZE > 1 and self.WINDOW > self.PAGE // (8 * self.ELEMENT_SIZE):
            raise ValueError(f"bad tuning: WINDOW={self.WINDOW} is longer than a bit plane")
        if not 4 <= self.MIN_MATCH <= 4 + 4 * self.KNOWN_WORDS:
            raise ValueError(f"bad tuning: MIN_MATCH={self.MIN_MATCH} "
                             f"(4..{4 + 4 * self.KNOWN_WORDS})")
        if not 0 <= self.NEAR <= 5 or not 8 <= self.HASH_BITS <= 16:
            raise ValueError(f"bad tuning: NEAR={self.NEAR}, HASH_BITS={self.HASH_BITS}")
        if not 0 <= self.ACCEL <= 8 or (self.ACCEL and self.ELEMENT_SIZE == 1):
            raise ValueError(f"bad tuning: ACCEL={self.ACCEL} (0..8; bit planes only)")

    def meta(self, wide_shuffle: bool, rows: bool = False) -> dict:
        """The keyword arguments of the launch (``rows``: pages by a table of addresses)."""
        return config_meta(self, ("programs_per_sm",),
                           (("WIDE_SHUFFLE", wide_shuffle), ("ROWS", rows)))


@functools.cache
def compress_config(page_size: int, element_size: int) -> CompressConfig:
    """The compressor's settings for ``page_size`` and ``element_size``: each trades ratio
    against speed as follows.

    Plain bytes: 128-position windows, 2 known words, a hash table of ``min(log2 P, 14) - 1``
    bits (2048 entries for 4 KiB pages), the lazy step and the backward extension (which win
    back the ratio ``MIN_MATCH`` 5 costs, at fewer sequences: faster decoding).
    Bit-shuffled pages: 64-position windows and ``ACCEL`` 1 (the noisy mantissa planes are
    passed over), one known word for 2-byte elements (two for 4-byte ones), no lazy step and
    no backward extension (the candidates are exact distances, so a match is found where it
    starts; each would cost a warp reduction per sequence for almost no ratio). Their hash
    table bits are unused (no hash table).
    """
    shuffled = element_size > 1
    return CompressConfig(
        PAGE=page_size, PAGE_LOG2=page_size.bit_length() - 1, ELEMENT_SIZE=element_size,
        KIND_LZ4=fmt.KIND_LZ4 | (fmt.element_shift(element_size) << 4),
        HASH_BITS=min(page_size.bit_length() - 1, 14) - (2 if shuffled else 1),
        WINDOW=64 if shuffled else 128, KNOWN_WORDS=1 if element_size == 2 else 2,
        MIN_MATCH=5, NEAR=5 if shuffled else 4, LAZY=not shuffled, BACK=not shuffled,
        ACCEL=1 if shuffled else 0, MATCH_STEP=128, LEN_STEP=64, WORD_STEP=128, num_warps=1,
        programs_per_sm=16)


def max_programs(device: torch.device, cfg: CompressConfig) -> int:
    """The most programs a compress launch of ``cfg`` on ``device`` uses (scratch is sized
    for these)."""
    return _sm_programs(device, cfg.programs_per_sm)


def _sm_programs(device: torch.device, programs_per_sm: int) -> int:
    if device.type != "cuda" or interpreting():
        return 3
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index) * programs_per_sm


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def known_settings(device: torch.device, cfg: CompressConfig) -> tuple[int, tuple]:
    """``(programs, (settings of narrow rows, of 8-byte aligned rows))``: the most programs
    and the launch settings :func:`compress_pages` uses for ``cfg`` on ``device``, by the pages'
    storage offset modulo 8, for :func:`compress_at` (the activation store keeps them beside
    its scratch)."""
    return _sm_programs(device, cfg.programs_per_sm), (cfg.meta(False), cfg.meta(True))


def compress_at(index: int, programs: int, n: int, meta, addrs: tuple, args,
                rows: bool = False) -> None:
    """:func:`compress_pages` (``traced=False``) of ``n`` pages (storage offset a multiple of
    4) given the addresses ``addrs`` of ``(pages, payload, sizes, kinds, hash tables, shuffle
    rows)`` on CUDA device ``index``, without its checks: ``programs`` programs and ``meta``
    as :func:`known_settings` gives them, for the activation store, which cuts a slice's
    metadata by address; ``args`` (the tensors and ``n``, or a function that makes them) as
    for ``launch.launch_known``."""
    pages, payload, sizes, kinds, tabs, shuf = addrs
    classes = (ptr_class(torch.int64 if rows else torch.uint8, pages),
               ptr_class(torch.uint8, payload),
               ptr_class(torch.int32, sizes), ptr_class(torch.uint8, kinds),
               ptr_class(torch.int32, tabs), ptr_class(torch.uint8, shuf), int_class(n))
    launch_known(_lz4_compress_kernel, (programs,), index, meta, classes, (*addrs, n), args)


def compress_rows(rows: torch.Tensor, element_size: int, page_size: int,
                  out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """:func:`compress_pages` with each page read from its address: the pages of many tensors
    compressed by one launch without joining them first (the activation store's batches).

    Args:
        rows: ``int64 [N]`` on the GPU, the address of page ``i`` (``page_size`` bytes inside
            a live tensor the caller keeps until the kernel has run), each a multiple of 8.
        element_size: 1, or 2 / 4: bit-shuffle each page first.
        page_size: a power of two from 4096 to 65536.
        out: ``(payload uint8 [N, page_size], sizes int32 [N], kinds uint8 [N])``, written as
            :func:`compress_pages` writes them (the same bytes for the same pages).
        scratch: as for :func:`compress_pages`.

    Launches directly (callers outside the ops only: the addresses are not traceable)."""
    n = check_rows(rows, page_size)
    cfg = compress_config(page_size, element_size)
    if n == 0:
        return
    dev = rows.device
    grid = min(n, _sm_programs(dev, cfg.programs_per_sm))
    if scratch is None:
        scratch = compress_scratch(dev, cfg, grid, kept_unused=True)
    elif not _scratch_fits(scratch, cfg, grid):
        raise ValueError(f"scratch of shapes {[tuple(t.shape) for t in scratch]} is too small "
                         f"for {grid} programs of these settings")
    launch(_lz4_compress_kernel, (grid,), dev, (rows, *out, *scratch, n),
           cfg.meta(True, rows=True), traced=False)


def compress_rows_at(index: int, programs: int, n: int, cfg: CompressConfig, addrs: tuple,
                     args) -> None:
    """:func:`compress_rows` given addresses, as :func:`compress_at` (``addrs``: ``(row table,
    payload, sizes, kinds, hash tables, shuffle rows)``), without its checks."""
    compress_at(index, programs, n, _rows_meta(cfg), addrs, args, rows=True)


@functools.cache
def _rows_meta(cfg: CompressConfig):
    return cfg.meta(True, rows=True)


def compress_launch(cfg: CompressConfig, wide: bool) -> tuple:
    """``(kernel, settings)`` of :func:`compress_pages`' launch for ``cfg``, its pages 8-byte
    aligned (``wide``) or not, for a caller that keeps its compiled entry
    (``launch.kept_entry``)."""
    return _lz4_compress_kernel, cfg.meta(wide)


def compress_scratch(device: torch.device, cfg: CompressConfig, programs: int,
                     kept_unused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's working memory for up to ``programs`` programs of ``cfg``: ``(hash
    tables int32 [programs, 2^HASH_BITS] or [1, 1], shuffle rows uint8 [programs, P] or
    [1, P])`` (the hash tables serve plain bytes, the shuffle rows bit-shuffled pages; each
    kind uses one). ``kept_unused`` (eager callers only: never while tracing, whose tensors
    are fake): the one the kernel does not use is a kept one-element tensor of the device
    (:func:`_unused`), not a new one."""
    shuffled = cfg.ELEMENT_SIZE > 1
    if shuffled:
        tabs = (_unused(device, torch.int32) if kept_unused
                else torch.empty((1, 1), dtype=torch.int32, device=device))
        shuf = torch.empty((programs, cfg.PAGE), dtype=torch.uint8, device=device)
    else:
        tabs = torch.empty((programs, 1 << cfg.HASH_BITS), dtype=torch.int32, device=device)
        shuf = (_unused(device, torch.uint8) if kept_unused
                else torch.empty((1, cfg.PAGE), dtype=torch.uint8, device=device))
    return tabs, shuf


def scratch_need(device: torch.device, cfg: CompressConfig, programs: int) -> tuple:
    """``(bytes, position, other)``: the working memory :func:`compress_scratch` (``kept_unused``)
    gives ``programs`` programs of ``cfg``: the bytes of the one the kernel uses and its
    position among the kernel's arguments (4: the hash tables, 5: the shuffle rows), and the
    address of the kept tensor passed for the other (never touched), for a caller that
    allocates the scratch its own way (one small call's plans, #26)."""
    if cfg.ELEMENT_SIZE > 1:
        return programs * cfg.PAGE, 5, _unused(device, torch.int32).data_ptr()
    return programs * (4 << cfg.HASH_BITS), 4, _unused(device, torch.uint8).data_ptr()


_UNUSED: dict[tuple, torch.Tensor] = {}


def _unused(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A kept one-element tensor of ``dtype`` on ``device``: the scratch pointer a launch's
    settings never touch (the hash tables of bit-shuffled pages, the shuffle rows of plain
    bytes; see the kernel). Never read or written, so every call and stream may share it,
    and a small call allocates one tensor fewer (#26)."""
    t = _UNUSED.get((device, dtype))
    if t is None:
        t = _UNUSED.setdefault((device, dtype), torch.empty((1, 1), dtype=dtype, device=device))
    return t


def _scratch_fits(scratch: tuple[torch.Tensor, torch.Tensor], cfg: CompressConfig,
                  programs: int) -> bool:
    tabs, shuf = scratch
    if cfg.ELEMENT_SIZE > 1:
        return shuf.shape[0] >= programs and shuf.shape[1] == cfg.PAGE
    return tabs.shape[0] >= programs and tabs.shape[1] == 1 << cfg.HASH_BITS


def compress_pages(pages: torch.Tensor, element_size: int = 1, *,
                   config: CompressConfig | None = None, traced: bool = True,
                   out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compress pages on their device and current stream; never synchronises with the host.

    Args:
        pages: ``uint8 [N, P]``, rows contiguous, ``P`` a power of two from 4096 to 65536. A
            view that does not start 4-byte aligned is copied once; one 8-byte aligned is
            bit-shuffled from 64-bit loads (same bytes either way).
        element_size: 1, or 2 / 4: bit-shuffle each page (``E``-byte elements) before LZ4.
        config: the kernel's settings; ``None``: :func:`compress_config` of ``(P,
            element_size)``. Every setting writes valid blocks; the blocks depend on it.
        traced: ``False`` launches directly (eager callers outside the ops: see
            ``torch_pagecomp.kernels.launch``).
        out: the outputs, given by a caller that allocates them its own way (the offload
            store: one block of metadata per slice); shapes and dtypes as returned.
        scratch: :func:`compress_scratch` of this device and settings, for at least
            :func:`max_programs` programs, reused by a caller that compresses on one stream
            (its launches run in order); ``None``: allocated per call.
    Returns:
        The fixed-stride ``(payload uint8 [N, P], sizes int32 [N], kinds uint8 [N])`` of
        ``torch_pagecomp.format``.
    """
    n, page_size = pages.shape
    cfg = compress_config(page_size, element_size) if config is None else config
    if (cfg.PAGE, cfg.ELEMENT_SIZE) != (page_size, element_size):
        raise ValueError(f"config is for {cfg.PAGE}-byte pages of element size "
                         f"{cfg.ELEMENT_SIZE}, not {page_size} / {element_size}")
    dev = pages.device
    # the kernel reads pages as 32-bit (and, for the bit-shuffle, 64-bit) words: alignment from
    # the storage offset (storage bases from PyTorch's allocators are aligned; data_ptr() is
    # not readable under torch.compile's fake tensors). A view not 4-aligned is copied once.
    if pages.storage_offset() % 4:
        pages = pages.clone()
    wide = pages.storage_offset() % 8 == 0
    if out is None:
        payload = torch.empty((n, page_size), dtype=torch.uint8, device=dev)
        sizes = torch.empty((n,), dtype=torch.int32, device=dev)
        kinds = torch.empty((n,), dtype=torch.uint8, device=dev)
    else:
        payload, sizes, kinds = out
    if n == 0:
        return payload, sizes, kinds
    grid = min(n, _sm_programs(dev, cfg.programs_per_sm))
    # bit-shuffled pages use no hash table: the kernel never touches ``tabs`` then
    if scratch is None:
        scratch = compress_scratch(dev, cfg, grid, kept_unused=not traced)
    elif not _scratch_fits(scratch, cfg, grid):  # the kernel would write past it
        raise ValueError(f"scratch of shapes {[tuple(t.shape) for t in scratch]} is too small "
                         f"for {grid} programs of these settings")
    tabs, shuf = scratch
    args = (pages, payload, sizes, kinds, tabs, shuf, n)
    launch(_lz4_compress_kernel, (grid,), dev, args, cfg.meta(wide), traced)
    return payload, sizes, kinds
