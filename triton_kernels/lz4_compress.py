"""Triton LZ4 page compression: ``compress_pages`` (the launcher behind ``pagecomp::compress``).

Output: the fixed-stride container of ``torch_pagecomp.format`` (``payload uint8 [N, P]`` with a
zero tail, ``sizes int32 [N]``, ``kinds uint8 [N]``), the same kind rules as
``cpu_codec.compress_cpu``; every LZ4 page is a standard LZ4 block.

Design: one warp owns one page at a time (``num_warps=1``: warp-wide reductions are single
``redux.sync`` instructions and 32 programs fit an SM); a persistent grid of
``programs_per_sm x SMs`` programs loops over the pages.

1. Same-filled check: one pass over the page as 32-bit words. Filled pages skip to step 5.
2. ``element_size`` 2/4: the program bit-shuffles its page (read as 64-bit words; 8x8 bit
   transposes on 64-bit words, ``bitshuffle.py``) into a private P-byte scratch row that stays
   in cache; all LZ4 work reads that row. No separate pass over memory.
3. Match candidates for a window of ``W`` positions at once (default 128): the 4-byte word at
   every position (a row of 4 positions from 2 aligned loads) and its multiplicative hash. Two
   hash tables per program in global scratch, int32 entries ``tag << log2(P) | position``
   (tagged, so they are cleared once per launch, never per page): ``last`` (``atomic_max``, tag =
   page counter, 2048 entries for 4 KiB pages) holds the most recent occurrence in an earlier
   window; ``first`` (``atomic_min``, a tag that decreases per window) the first occurrence inside
   the window. The candidate (first-in-window if earlier, else last-before-window) must hold the
   same word (hash collisions lose matches, never correctness). For every candidate the next
   ``extra_words`` words are compared at once too, so most match lengths are known before the
   walk. This stands in for LZ4's "most recent occurrence" hash table: per page the blocks come
   within ~1% of python-lz4's size (text), equal or smaller on binaries.
   ``candidates="store"`` (``DEFAULT_CANDIDATES`` picks the default) replaces the two atomics
   and two ``.cg`` loads per position (L2-bound) with one table and plain (L1) accesses: per
   sub-chunk of 32 positions, load the entries, barrier, store the positions (lanes with one
   entry race: any wins), barrier. The sub-chunk's own earlier positions are invisible to it,
   so distances 1, 2, 4, 8 (``near``) are checked directly on 4 aligned words per row.
   ``candidates="store-max"`` (the default for bytes: fastest on an H200 and deterministic) is
   the same one-table scheme with ``.cg`` loads and ``atomic_max``: 2 L2 operations per position
   instead of 4. Measured (H200, 128 MiB, 4 KiB pages): text 33 -> 44 GB/s, mixed memory
   43 -> 52, random 36 -> 50, bf16 shuffled 35 -> 49, ratio within 0.5% of "atomic".
   ``candidates="planes"`` (the default for bit-shuffled pages) has no hash table at all: a
   shuffled page's matches are runs and repeated planes, so the candidates are distances 1, 2,
   4, 8, 16 and one and two planes back, read from the row in L1 (the parse model gives these
   the hash table's ratio or more). Its gate searches a window only if one of its aligned words
   repeats at 4, 8, 16 bytes or one or two planes; planes none of whose words repeat (the
   noisy mantissa planes) are found once per page and passed over whole.
4. Greedy parse, one short step per sequence: a warp min over packed keys ``(position, known
   length, candidate)`` finds the next match at or after the current position (a window without
   one costs one step, a window without a candidate none); only matches longer than the
   precomputed part are extended, 32 words per step. Each sequence is written at once: token and
   offset as scalar stores, literals as 32-bit word stores (bytes at the ends), length
   extensions as vectors of 255s. The LZ4 end rules
   hold by construction: matches start at most at ``P - 12`` and end at most at ``P - 5``;
   offsets are ``1..P - 12`` (so at most 65524 for 64 KiB pages).
   Lazy step (default on bytes, off on bit-shuffled pages): when the match found is short
   (known length < ``4 + 4 * XW``), the next position's candidate is taken instead if it is
   known to be longer. Matches shorter
   than ``min_match`` (default 5) stay literals: fewer sequences, faster decoding. A window
   that the last match ran past is not
   hashed at all: the next window starts at the match's end (4-aligned), as LZ4 skips the
   positions inside a match.
   With ``accel`` (off for bytes, 1 for shuffled pages) windows are skipped after windows
   without a sequence (within a bit plane on shuffled pages).
   A chosen match then grows backwards into its literals (up to 32 bytes; LZ4's "catch up"),
   which the hash candidates miss where a position's entry was older or overwritten.
5. The last literals are written only if the block fits ``lz4_keep_limit(P)``; otherwise (or as
   soon as the output passes the limit) the page goes RAW. A final pass over the row (32-bit
   words) writes the RAW copy, the FILL byte or the zero tail.

Barriers (``tl.debug_barrier``) separate table writes from other threads' reads, and the encoded
bytes from a RAW overwrite. Table reads are ``.cg`` loads: the atomics are performed in L2.
Resources (triton 3.6, sm_90): 96 registers (ncu, bit-shuffled pages), no spills.
Scratch: ``G x (2**hash_bits + 8 * window)`` int32 tables (bytes; none for "planes") and
``G x P`` bytes for the shuffle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import constants as fmt
from .bitshuffle import bitshuffle_page, bitshuffle_page_wide
from .launch import interpreting, launch


@triton.jit
def _word_at(ptr32, i, mask):
    """uint32 little-endian word of the 4 bytes at byte offset ``i`` (needs ``i + 8 <= P``)."""
    k = i >> 2
    lo = tl.load(ptr32 + k, mask=mask, other=0)
    hi = tl.load(ptr32 + k + 1, mask=mask, other=0)
    sh = ((i & 3) * 8).to(tl.uint32)
    return (lo >> sh) | ((hi << 1) << (31 - sh))  # two shifts: 0 when sh == 0


@triton.jit
def _fill_i32(ptr, N: tl.constexpr, value, CH: tl.constexpr):
    """``ptr[0:N] = value`` (int32)."""
    for q in range(0, N, CH):
        k = q + tl.arange(0, CH)
        tl.store(ptr + k, tl.full([CH], value, tl.int32), mask=k < N)


@triton.jit
def _ext_len(n):
    """Extension bytes after a 4-bit length field holding ``n``."""
    return tl.where(n >= 15, (n - 15) // 255 + 1, 0)


@triton.jit
def _row_words(ptr32, k, sh, P: tl.constexpr):
    """Words at bytes ``4k + sh / 8`` (``k`` [R, 1] word indices, ``sh`` [1, 4] shifts): [R, 4].

    Rows whose second word lies past the page read 0 (callers mask those positions)."""
    lo = tl.load(ptr32 + k, mask=k + 1 < P // 4, other=0)
    hi = tl.load(ptr32 + k + 1, mask=k + 1 < P // 4, other=0)
    return (lo >> sh) | ((hi << 1) << (31 - sh))


@triton.jit
def _equal_bytes(x):
    """Leading (little-endian) zero bytes of ``x = a ^ b``: bytes of ``a`` equal to ``b``, 0..4."""
    nb = tl.where((x & 0xFFFF) == 0, 2, ((x & 0xFF) == 0).to(tl.int32))
    nb = tl.where((x & 0xFFFFFF) == 0, 3, nb)
    return tl.where(x == 0, 4, nb)


@triton.jit
def _match_len(data, p, c, known, P: tl.constexpr, EXT: tl.constexpr):
    """Length of the match at ``p`` against ``c < p`` (``known`` bytes known equal), ending at
    most at ``P - 5``: ``EXT / 4`` words compared per step (``data`` 4-byte aligned)."""
    data32 = data.to(tl.pointer_type(tl.uint32))
    k = tl.arange(0, EXT // 4)
    n = p + known
    go = n < P - 5
    while go:
        i = n + 4 * k
        m = i < P - 5
        x = _word_at(data32, i, m) ^ _word_at(data32, i - (p - c), m)
        nb = tl.where(m, tl.minimum(_equal_bytes(x), P - 5 - i), 0)
        # the first word not wholly equal and its equal bytes, in one reduction
        f = tl.min(tl.where(nb < 4, 8 * k + nb, 8 * (EXT // 4)))
        d = 4 * (f >> 3) + (f & 7)
        n += d
        go = d == EXT
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
def _put_len_ext(dst, o, n, P: tl.constexpr, V: tl.constexpr):
    """Write the extension bytes of a length field holding ``n >= 15`` at ``dst + o``."""
    cnt = (n - 15) // 255 + 1
    rem = (n - 15) % 255
    for q in range(0, cnt, V):
        k = q + tl.arange(0, V)
        v = tl.where(k < cnt - 1, 255, rem)
        tl.store(dst + o + k, v.to(tl.uint8), mask=(k < cnt) & (o + k < P))
    return o + cnt


@triton.jit
def _copy_bytes(dst, o, src, a, n, P: tl.constexpr, V: tl.constexpr):
    """``dst[o:o + n] = src[a:a + n]`` (``dst``, ``src``: 4-byte aligned rows of ``P`` bytes;
    bytes at or past ``P`` are dropped): the whole 32-bit words of ``dst`` as word stores, ``V``
    per step, each from two aligned loads of ``src``; the up to 3 bytes before and after them
    as byte stores."""
    src32 = src.to(tl.pointer_type(tl.uint32))
    dst32 = dst.to(tl.pointer_type(tl.uint32))
    b = tl.arange(0, 4)
    head = tl.minimum((4 - (o & 3)) & 3, n)
    v = tl.load(src + a + b, mask=b < head, other=0)
    tl.store(dst + o + b, v, mask=(b < head) & (o + b < P))
    q0 = (o + head) >> 2  # the first whole word of dst
    nw = (n - head) >> 2
    s0 = a + head  # its source byte
    sh = ((s0 & 3) * 8).to(tl.uint32)
    for q in range(0, nw, V):
        j = q + tl.arange(0, V)
        k = (s0 >> 2) + j
        lo = tl.load(src32 + k, mask=j < nw, other=0)
        hi = tl.load(src32 + k + 1, mask=(j < nw) & (k + 1 < P // 4), other=0)
        w = (lo >> sh) | ((hi << 1) << (31 - sh))
        tl.store(dst32 + q0 + j, w, mask=(j < nw) & (q0 + j < P // 4))
    t = head + 4 * nw
    v = tl.load(src + a + t + b, mask=b < n - t, other=0)
    tl.store(dst + o + t + b, v, mask=(b < n - t) & (o + t + b < P))


@triton.jit
def _emit(
    dst, data, out, anchor, lit, off, ml, HAS_MATCH: tl.constexpr, P: tl.constexpr, V: tl.constexpr
):
    """Write one sequence at ``dst + out`` (stores past the row end are dropped); returns the new
    output position. ``lit`` literals from ``data + anchor``; then, if ``HAS_MATCH``, offset
    ``off`` and match length ``ml + 4``.
    """
    if HAS_MATCH:
        token = (tl.minimum(lit, 15) << 4) | tl.minimum(ml, 15)
    else:
        token = tl.minimum(lit, 15) << 4
    tl.store(dst + out, token.to(tl.uint8), mask=out < P)
    o = out + 1
    if lit >= 15:
        o = _put_len_ext(dst, o, lit, P, V)
    if lit > 0:  # (matches right after matches: none)
        _copy_bytes(dst, o, data, anchor, lit, P, 32)  # a word per lane and step
    o += lit
    if HAS_MATCH:
        tl.store(dst + o, (off & 255).to(tl.uint8), mask=o < P)
        tl.store(dst + o + 1, (off >> 8).to(tl.uint8), mask=o + 1 < P)
        o += 2
        if ml >= 15:
            o = _put_len_ext(dst, o, ml, P, V)
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
def _word_back(data32, k0, sh, D4: tl.constexpr, P: tl.constexpr):
    """Words ``4 * D4`` bytes before positions ``4 * k0 + lane`` (``k0`` [R, 1], ``sh`` [1, 4]
    lane shifts): [R, 4]. Rows before the page start or past its end read 0 (callers check the
    distance against the position)."""
    k = k0 - D4
    m = (k >= 0) & (k + 1 < P // 4)
    lo = tl.load(data32 + k, mask=m, other=0)
    hi = tl.load(data32 + k + 1, mask=m, other=0)
    return (lo >> sh) | ((hi << 1) << (31 - sh))


@triton.jit
def _near_candidates(data32, c, idx, k0, lane, word, valid, P: tl.constexpr, NEAR: tl.constexpr):
    """Positions of ``c`` that are -1 take the nearest of distances 1, 2, 4, 8, 16 (``NEAR`` of
    them) that holds the same ``word`` (positions ``idx = 4 * k0 + lane`` [R, 4])."""
    if NEAR > 0:
        # rows past the page end (a window that starts late, after a skip) read nothing
        m2 = tl.load(data32 + k0 - 2, mask=(k0 >= 2) & (k0 - 2 < P // 4), other=0)
        m1 = tl.load(data32 + k0 - 1, mask=(k0 >= 1) & (k0 - 1 < P // 4), other=0)
        l0 = tl.load(data32 + k0, mask=k0 + 1 < P // 4, other=0)
        l1 = tl.load(data32 + k0 + 1, mask=k0 + 1 < P // 4, other=0)
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
            okd = valid & (c < 0) & (idx >= 16) & (_word_back(data32, k0, sh, 4, P) == word)
            c = tl.where(okd, idx - 16, c)
    return c


@triton.jit
def _plane_candidates(
    data32, idx, k0, lane, word, valid, P: tl.constexpr, PL: tl.constexpr, NEAR: tl.constexpr,
):
    """Candidates of a bit-shuffled page without a hash table (-1: none) for positions
    ``idx = 4 * k0 + lane`` [R, 4]: the nearest of distances 1, 2, 4, 8, 16 (``NEAR`` of them),
    then one and two bit planes back (``PL`` bytes per plane), that holds the same ``word``.
    A plane equal to the one before it (exponent bits that rarely change) is one match."""
    c = _near_candidates(data32, tl.zeros_like(idx) - 1, idx, k0, lane, word, valid, P, NEAR)
    sh = (lane * 8).to(tl.uint32)
    for j in tl.static_range(1, 3):
        okd = valid & (c < 0) & (idx >= j * PL)
        okd = okd & (_word_back(data32, k0, sh, j * PL // 4, P) == word)
        c = tl.where(okd, idx - j * PL, c)
    return c


@triton.jit
def _same_word_back(data32, k, w, D: tl.constexpr, m):
    """``data32[k - D] == w`` where ``m`` and ``k >= D`` (else False)."""
    m = m & (k >= D)
    return m & (tl.load(data32 + k - D, mask=m, other=0) == w)


@triton.jit
def _repeats(data32, k, m, PL: tl.constexpr):
    """Whether each aligned word ``k`` (where ``m``) equals the word 4, 8 or 16 bytes, or one or
    two bit planes (``PL`` bytes), before it."""
    w = tl.load(data32 + k, mask=m, other=0)
    h = _same_word_back(data32, k, w, 1, m) | _same_word_back(data32, k, w, 2, m)
    h = h | _same_word_back(data32, k, w, 4, m) | _same_word_back(data32, k, w, PL // 4, m)
    return h | _same_word_back(data32, k, w, PL // 2, m)


@triton.jit
def _window_has_repeats(data32, w0, W: tl.constexpr, P: tl.constexpr, PL: tl.constexpr):
    """1 if one of the aligned words of the window at ``w0`` (those that start at most at
    ``P - 12``) :func:`_repeats`, else 0: the window gate of ``"planes"``."""
    k = (w0 >> 2) + tl.arange(0, W // 4)
    return tl.max(_repeats(data32, k, 4 * k <= P - 12, PL).to(tl.int32))


@triton.jit
def _repeats_pairs(data64, j, P: tl.constexpr, PL: tl.constexpr):
    """:func:`_repeats` of the two aligned 32-bit words of each 64-bit word ``j`` (words ``2j``,
    ``2j + 1``), ORed: the same test with 5 loads per two words instead of 12 (each 64-bit
    load brings two words, and the words one, two and four back come from the loads one and
    two 64-bit words back). Words past ``P - 12`` count as not repeating, as there."""
    LO: tl.constexpr = 0xFFFFFFFF
    m = j < P // 8
    cur = tl.load(data64 + j, mask=m, other=0)
    b1 = tl.load(data64 + j - 1, mask=m & (j >= 1), other=0)  # words 2j - 2, 2j - 1
    b2 = tl.load(data64 + j - 2, mask=m & (j >= 2), other=0)  # words 2j - 4, 2j - 3
    p1 = tl.load(data64 + j - PL // 8, mask=m & (j >= PL // 8), other=0)  # one plane back
    p2 = tl.load(data64 + j - PL // 4, mask=m & (j >= PL // 4), other=0)  # two planes back
    x1, x2, x3, x4 = cur ^ b1, cur ^ b2, cur ^ p1, cur ^ p2
    lo = ((cur ^ (b1 >> 32)) & LO) == 0  # word 2j against 4, 8, 16 bytes, 1, 2 planes back
    lo = (lo | ((x1 & LO) == 0)) & (j >= 1)
    lo = lo | (((x2 & LO) == 0) & (j >= 2))
    lo = lo | (((x3 & LO) == 0) & (j >= PL // 8)) | (((x4 & LO) == 0) & (j >= PL // 4))
    hi = (((cur >> 32) ^ cur) & LO) == 0  # word 2j + 1
    hi = hi | (((x1 >> 32) == 0) & (j >= 1)) | (((x2 >> 32) == 0) & (j >= 2))
    hi = hi | (((x3 >> 32) == 0) & (j >= PL // 8)) | (((x4 >> 32) == 0) & (j >= PL // 4))
    return (lo & (8 * j <= P - 12)) | (hi & (8 * j + 4 <= P - 12))


@triton.jit
def _live_planes(data32, P: tl.constexpr, PL: tl.constexpr, PAIRS: tl.constexpr):
    """int64 with bit ``p`` set for every bit plane ``p`` (``PL`` bytes each) that holds an
    aligned word (one that starts at most at ``P - 12``) equal to the word 4, 8 or 16 bytes, or
    one or two planes, before it (:func:`_repeats`). Every window of the other, still,
    planes fails the window gate. 128 words per step: whole planes, or one plane's part; with
    ``PAIRS`` (``data32`` 8-byte aligned) read as 64-bit words (:func:`_repeats_pairs`)."""
    U: tl.constexpr = 8 if PAIRS else 4  # bytes per element read
    EPP: tl.constexpr = PL // U  # elements per plane
    STEP: tl.constexpr = 512 // U  # elements per step: 128 words
    R: tl.constexpr = EPP if EPP < STEP else STEP
    NR: tl.constexpr = STEP // R
    data64 = data32.to(tl.pointer_type(tl.uint64))
    bits = tl.sum(tl.zeros([NR], tl.int64))
    for s in range(0, P // U, STEP):
        j = s + tl.arange(0, NR)[:, None] * R + tl.arange(0, R)[None, :]
        if PAIRS:
            rep = _repeats_pairs(data64, j, P, PL)
        else:
            rep = _repeats(data32, j, 4 * j <= P - 12, PL)
        row = tl.max(rep.to(tl.int64), axis=1)
        plane = ((s + tl.arange(0, NR) * R) // EPP).to(tl.int64)
        bits = bits | tl.sum(row << plane)
    return bits


@triton.jit
def _skip_still_planes(w0, live, P: tl.constexpr, PL: tl.constexpr, PLB: tl.constexpr):
    """From a bit plane's start ``w0``, pass over the still planes (bits of ``live`` clear);
    returns the next position to search. The blocks are the same as gating each window."""
    go = ((w0 & (PL - 1)) == 0) & (w0 <= P - 12)
    while go:
        still = ((live >> (w0 >> PLB)) & 1) == 0
        if still:
            w0 += PL
        go = still & (w0 <= P - 12)
    return w0


@triton.jit
def _store_candidates(
    tlast, data32, h, idx, widx, k0, lane, word, valid, pc, PB: tl.constexpr, P: tl.constexpr,
    W: tl.constexpr, NEAR: tl.constexpr, AMAX: tl.constexpr,
):
    """Verified candidates (-1: none) of a window's positions ``idx = 4 * k0 + lane`` [W / 4, 4]
    (``h`` hashes, ``word`` words, ``widx`` offsets in the window) from one plain ``last``
    table, updated in sub-chunks of 32 positions: load, barrier, store (conflicts: any lane may
    win), barrier. Positions whose table entry fails fall back to the nearest of distances 1, 2,
    4, 8, 16 (``NEAR`` of them) that holds the same word. ``AMAX``: ``.cg`` loads and
    ``atomic_max`` stores instead (the latest position wins: deterministic)."""
    PMASK: tl.constexpr = (1 << PB) - 1
    sub = widx >> 5
    ent = tl.zeros_like(idx)
    for s in tl.static_range(W // 32):
        m = valid & (sub == s)
        if AMAX:
            e = tl.load(tlast + h, mask=m, other=0, cache_modifier=".cg")
        else:
            e = tl.load(tlast + h, mask=m, other=0)
        ent = tl.where(sub == s, e, ent)
        tl.debug_barrier()
        if AMAX:
            tl.atomic_max(tlast + h, (pc << PB) | idx, mask=m, sem="relaxed")
        else:
            tl.store(tlast + h, (pc << PB) | idx, mask=m)
        tl.debug_barrier()
    ct = tl.where((ent >> PB) == pc, ent & PMASK, -1)
    ok = valid & (ct >= 0) & (ct < idx)
    ok = ok & (_word_at(data32, ct, ok) == word)
    c = tl.where(ok, ct, -1)
    return _near_candidates(data32, c, idx, k0, lane, word, valid, P, NEAR)


@triton.jit
def _lz4_compress_kernel(
    pages_ptr,
    payload_ptr,
    sizes_ptr,
    kinds_ptr,
    tab_ptr,
    shuf_ptr,
    n_pages,
    P: tl.constexpr,
    PB: tl.constexpr,
    E: tl.constexpr,
    KIND_LZ4: tl.constexpr,
    HB: tl.constexpr,
    FB: tl.constexpr,
    W: tl.constexpr,
    XW: tl.constexpr,
    EXT: tl.constexpr,
    V: tl.constexpr,
    CH: tl.constexpr,
    STORE: tl.constexpr,
    NEAR: tl.constexpr,
    AMAX: tl.constexpr,
    PLANES: tl.constexpr,
    GATE: tl.constexpr,
    GROUP_PLANES: tl.constexpr,
    PAIRS: tl.constexpr,
    MINML: tl.constexpr,
    LAZY: tl.constexpr,
    SKIP: tl.constexpr,
    BACK: tl.constexpr,
    ACC: tl.constexpr,
    PROBE: tl.constexpr,
    SW: tl.constexpr,
):
    """Grid ``(G,)``; program ``pid`` compresses pages ``pid, pid + G, ...``.

    pages/payload ``uint8 [N, P]``, sizes ``int32 [N]``, kinds ``uint8 [N]``, tab ``int32
    [G, 2**HB + 2**FB]`` (uninitialised), shuf ``uint8 [G, P]`` (E > 1).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    H: tl.constexpr = 1 << HB
    F: tl.constexpr = 1 << FB
    TMAX: tl.constexpr = 0x7FFFFFFF >> PB
    PMASK: tl.constexpr = (1 << PB) - 1
    NWIN: tl.constexpr = (P - 12 + W) // W
    LIMIT: tl.constexpr = P - P // 32
    MAXS: tl.constexpr = P - 12
    EMPTY_FIRST: tl.constexpr = 0x7FFFFFFF
    NOKEY: tl.constexpr = 0x7FFFFFFF
    PL: tl.constexpr = P // (8 * E)  # bytes per bit plane of a shuffled page (E > 1)
    PLB: tl.constexpr = PB - 3 - (E // 2)  # log2(PL): E // 2 is log2(E) for E in 1, 2, 4
    # still planes found once per page and passed over: the same blocks as gating every window
    # while windows never cross a plane (W <= PL) and no probe counts windows
    GROUP: tl.constexpr = GATE and GROUP_PLANES and (W <= PL) and (PROBE == 0)
    tlast = tab_ptr + pid.to(tl.int64) * (H + F)
    tfirst = tlast + H
    if not PLANES:
        _fill_i32(tlast, H, 0, CH)
        if not STORE:
            _fill_i32(tfirst, F, EMPTY_FIRST, CH)
        tl.debug_barrier()
    pc = 0
    wc = 0
    for it in range(0, tl.cdiv(n_pages - pid, nprog)):
        page = pid + it * nprog
        base = page.to(tl.int64) * P
        src = pages_ptr + base
        dst = payload_ptr + base
        src32 = src.to(tl.pointer_type(tl.uint32))
        dst32 = dst.to(tl.pointer_type(tl.uint32))
        first = tl.load(src)
        first4 = first.to(tl.uint32) * 0x01010101
        differs = tl.zeros([CH], tl.int32)
        for q in range(0, P // 4, CH):
            differs = differs | (tl.load(src32 + q + tl.arange(0, CH)) != first4).to(tl.int32)
        diff = tl.max(differs)
        size = page * 0 + 1
        kind = page * 0 + 2
        keep = page * 0
        if diff != 0:
            if E > 1:
                data = shuf_ptr + pid.to(tl.int64) * P
                if SW:
                    bitshuffle_page_wide(src, data, P, E, 64)
                else:
                    bitshuffle_page(src, data, P, E, 64)
                tl.debug_barrier()
            else:
                data = src
            data32 = data.to(tl.pointer_type(tl.uint32))
            if not PLANES:  # the hash tables' tags
                pc += 1
                if pc > TMAX:
                    _fill_i32(tlast, H, 0, CH)
                    tl.debug_barrier()
                    pc = 1
                if not STORE:
                    if wc + NWIN >= TMAX:
                        _fill_i32(tfirst, F, EMPTY_FIRST, CH)
                        tl.debug_barrier()
                        wc = 0
            pos = 0
            anchor = 0
            out = 0
            w0 = 0
            misses = 0
            dead = 0  # windows in a row without a sequence (PROBE; across bit planes)
            if GROUP:
                live_planes = _live_planes(data32, P, PL, PAIRS)
                w0 = _skip_still_planes(w0, live_planes, P, PL, PLB)
            while w0 <= MAXS:
                wc += 1
                out0 = out
                wprev = w0
                wend = tl.minimum(w0 + W, MAXS + 1)
                live = 1
                if GATE:  # a window without a repeated aligned word is not searched
                    live = _window_has_repeats(data32, w0, W, P, PL)
                if live == 0:
                    pos = tl.maximum(pos, wend)
                else:
                    # positions as [W / 4, 4]: a row's 4 words come from 2 aligned loads
                    row = tl.arange(0, W // 4)[:, None]
                    lane = tl.arange(0, 4)[None, :]
                    widx = row * 4 + lane
                    idx = w0 + widx
                    valid = idx <= MAXS
                    if PROBE > 0:  # after a window without a sequence: its first PROBE positions
                        valid = valid & ((widx < PROBE) | ((widx * 0 + dead) == 0))
                    k0 = (w0 >> 2) + row
                    sh = (lane * 8).to(tl.uint32)
                    word = _row_words(data32, k0, sh, P)
                    prod = word * 2654435761  # the hash tables' (unused by PLANES)
                    h = (prod >> (32 - HB)).to(tl.int32)
                    if PLANES:
                        c = _plane_candidates(data32, idx, k0, lane, word, valid, P, PL, NEAR)
                        ok = c >= 0
                    elif STORE:
                        c = _store_candidates(
                            tlast, data32, h, idx, widx, k0, lane, word, valid, pc, PB, P, W, NEAR,
                            AMAX,
                        )
                        ok = c >= 0
                    else:
                        tag_f = TMAX - wc
                        hf = (prod >> (32 - FB)).to(tl.int32)
                        tl.atomic_min(tfirst + hf, (tag_f << PB) | idx, mask=valid, sem="relaxed")
                        last = tl.load(tlast + h, mask=valid, other=0, cache_modifier=".cg")
                        tl.debug_barrier()
                        fv = tl.load(
                            tfirst + hf, mask=valid, other=EMPTY_FIRST, cache_modifier=".cg"
                        )
                        tl.atomic_max(tlast + h, (pc << PB) | idx, mask=valid, sem="relaxed")
                        cf = tl.where((fv >> PB) == tag_f, fv & PMASK, idx)
                        cl = tl.where((last >> PB) == pc, last & PMASK, -1)
                        c = tl.where(cf < idx, cf, cl)
                        ok = valid & (c >= 0)
                        ok = ok & (_word_at(data32, c, ok) == word)
                    if tl.max(ok.to(tl.int32)) == 0:  # no candidate (a noisy plane): no walk
                        pos = tl.maximum(pos, wend)
                    else:
                        m = tl.zeros([W // 4, 4], tl.int32)
                        alive = ok
                        for j in tl.static_range(1, 1 + XW):  # the next XW words of every match
                            mj = alive & (idx + 4 * j < P - 4)
                            x = _row_words(data32, k0 + j, sh, P) ^ _word_at(data32, c + 4 * j, mj)
                            nb = tl.where(mj, _equal_bytes(x), 0)
                            m += nb
                            alive = alive & (nb == 4)
                        key = tl.where(ok & (m >= MINML - 4), (widx << 21) | (m << 16) | c, NOKEY)
                        while pos < wend:
                            k = tl.min(tl.where(idx >= pos, key, NOKEY))
                            if LAZY:
                                if (k != NOKEY) & (((k >> 16) & 31) < 4 * XW):
                                    # lazy step: a longer match starting one byte later wins
                                    k1 = tl.min(tl.where(idx > w0 + (k >> 21), key, NOKEY))
                                    better = (k1 >> 21) == (k >> 21) + 1
                                    better = better & (((k1 >> 16) & 31) > ((k >> 16) & 31))
                                    if (k1 != NOKEY) & better:
                                        k = k1
                            if k != NOKEY:
                                p = w0 + (k >> 21)
                                src_pos = k & 0xFFFF
                                mx = (k >> 16) & 31
                                mlen = tl.minimum(4 + mx, P - 5 - p)
                                if (mx == 4 * XW) & (mlen == 4 + mx):
                                    mlen = _match_len(data, p, src_pos, mlen, P, EXT)
                                if BACK:  # the match also grows backwards into its literals
                                    if p > anchor:
                                        back_n = _back_len(data, p, src_pos, p - anchor)
                                        p -= back_n
                                        src_pos -= back_n
                                        mlen += back_n
                                off = p - src_pos
                                out = _emit(
                                    dst, data, out, anchor, p - anchor, off, mlen - 4, True, P, V
                                )
                                pos = p + mlen
                                anchor = pos
                            else:
                                pos = wend
                w0 += W
                if SKIP:
                    if pos > w0:  # the match ran past this window: resume at its end
                        w0 = pos & ~3
                if PROBE > 0:
                    if out == out0:
                        dead += 1
                    else:
                        dead = 0
                if ACC > 0:  # after m windows without a sequence, m // ACC are not hashed
                    if out == out0:
                        misses += 1
                    else:
                        misses = 0
                    if E > 1:  # bit planes: no skip crosses one, a new one starts afresh
                        if (w0 >> PLB) == (wprev >> PLB):
                            w0 += tl.minimum(W * (misses // ACC), ((w0 >> PLB) + 1) * PL - w0)
                        if (w0 >> PLB) != (wprev >> PLB):
                            misses = 0
                    else:
                        w0 += W * (misses // ACC)
                if out > LIMIT:
                    w0 = P
                if GROUP:  # at a plane's start: still planes are passed over
                    w0 = _skip_still_planes(w0, live_planes, P, PL, PLB)
                tl.debug_barrier()
            lit = P - anchor
            final = out + 1 + _ext_len(lit) + lit
            if final <= LIMIT:
                _emit(dst, data, out, anchor, lit, 0, 0, False, P, V)
                size = final
                kind = KIND_LZ4
                keep = final
            else:
                size = P
                kind = 0
        tl.debug_barrier()
        keep4 = (keep + 3) // 4  # words from here on are stored whole
        for q in range(0, P // 4, CH):
            o = q + tl.arange(0, CH)
            kind_o = o * 0 + kind  # a vector: the interpreter mishandles scalar & vector masks
            v = tl.load(src32 + o, mask=(o < P // 4) & (kind_o == 0), other=0)
            v = tl.where((o == 0) & (kind_o == 2), first.to(tl.uint32), v)
            tl.store(dst32 + o, v, mask=o >= keep4)
        b = keep + tl.arange(0, 4)
        tl.store(dst + b, tl.zeros([4], tl.uint8), mask=b < keep4 * 4)  # the word keep is in
        tl.store(sizes_ptr + page, size)
        tl.store(kinds_ptr + page, kind)


DEFAULT_WINDOW = 128
DEFAULT_EXTRA_WORDS = 2
DEFAULT_HASH_BITS_DELTA = -1  # 2048 entries for 4 KiB pages: 8 KiB of table per program
DEFAULT_PROGRAMS_PER_SM = 16  # faster than 32 on every H200 corpus
CANDIDATE_MODES = ("atomic", "store", "store-max", "planes")
DEFAULT_CANDIDATES = "store-max"  # H200 sweep: 1.3-1.4x "atomic", deterministic
# Bit-shuffled pages: no hash table. Their matches are runs (distances 1-16) and whole planes
# repeated (exponent bits that rarely change: distance one plane); the parse model
# (bench.dev_accel_model --candidates) gives these candidates the hash table's ratio or more.
TYPED_CANDIDATES = "planes"
TYPED_NEAR = 5  # distances 1-16 (16 adds 0.05-0.1% of ratio in the model)
DEFAULT_NEAR = 4  # "store" mode: distances 1, 2, 4, 8 checked directly
# Parse (H200, 128 MiB, bench/results/h200_parse_*): the lazy step and the window skip raise
# the ratio and compress faster; min_match 5 cuts sequences by a quarter (decode +10-17%) and
# costs 1-3% of ratio, which the backward extension wins back (text: python-lz4's ratio at
# about python-lz4's sequence count).
DEFAULT_LAZY = True
DEFAULT_SKIP = True
DEFAULT_BACK = True
DEFAULT_MIN_MATCH = 5
DEFAULT_ACCEL = 0  # plain bytes: no faster on text / mixed, 1-2% less ratio (H200 probe)
# Bit-shuffled pages (element size 2 or 4): 64-position windows. Their noisy mantissa planes
# are passed over by the window gate of "planes" mode (``gate``: a window is searched only if
# one of its aligned words repeats 4, 8, 16 bytes or one or two planes back), which the parse
# model finds within 0.2% of searching every window (bench.dev_accel_model --gate), and by
# ``accel`` 1 on top (windows after windows without a sequence are not even gated). H200,
# 64 MiB per corpus (bench/results/h200_b050f33/): gate + accel 1 against accel 1 alone,
# compress bf16 randn 142 -> 171 GB/s, K/V 205 -> 238, fp32 155 -> 219, at 0-0.4% of ratio.
# ``probe`` 32 on fp32 (h200_dcba96e/probe.txt) is off since the gate.
TYPED_WINDOW = 64
TYPED_ACCEL = 1
# Match bytes compared for all positions at once: one word on bf16 pages (H200, 64 MiB per corpus,
# four probe runs in bench/results/h200_b050f33/: +2-7% on every bf16 corpus, 0-0.1% of ratio;
# fp32 2-5% slower with one word).
TYPED_EXTRA_WORDS = {2: 1, 4: 2}
# No backward extension on bit-shuffled pages: their candidates are exact distances, so a match
# is found where it starts; the parse model gives the same ratio without it (0-0.02% less on
# every typed corpus), and it costs a 32-byte compare and a reduction per sequence.
TYPED_BACK = False
# No lazy step on bit-shuffled pages: it costs a second warp reduction per short match; the parse
# model gives 0.03-0.4% less ratio without it (bf16 ReLU 1.3697 -> 1.3647, K/V 1.3847 -> 1.3792,
# against nvCOMP + bitshuffle's 1.332 / 1.315). H200, 64 MiB (bench/results/h200_c6517cc/):
# compress bf16 ReLU and random-normal +5%, the other typed corpora within the probe's spread;
# decode 1-3% slower (relu: 35 -> 38 sequences per page).
TYPED_LAZY = False
TYPED_PROBE = {2: 0, 4: 0}
# The bit-shuffle of a typed page read as 64-bit words (bitshuffle_page_wide) instead of bytes:
# H200, 64 MiB per corpus (bench/results/h200_1a67841/wide_probe.txt), same blocks, compress
# bf16 K/V 113.5 -> 128.2 GB/s, activations 111.7 -> 128.2, ReLU 98.3 -> 113.0, randn 92.5 ->
# 103.6, fp32 82.4 -> 112.9 (again at e44ec50: +11-34%, wide2_probe_e44ec50.txt).
SHUFFLE_WIDE = True
# The hash table of bit-shuffled pages: 1024 entries for 4 KiB pages (4 KiB per program, half the
# byte pages' table). Their matches sit in a few exponent and sign planes, at short distances;
# the compressor is bound by L2 traffic (ncu, bench/results/h200_d2b7f7b/), and the smaller
# table gave the same blocks' ratio at +3-20% speed (H200, 64 MiB per corpus, same file).
TYPED_HASH_BITS_DELTA = -2


def parse_defaults(element_size: int) -> dict:
    """The default ``window``, ``accel``, ``probe``, ``candidates``, ``near``, ``extra_words``,
    ``back`` and ``lazy`` of :func:`compress_pages` for ``element_size``."""
    if element_size > 1:
        return {"window": TYPED_WINDOW, "accel": TYPED_ACCEL,
                "probe": TYPED_PROBE.get(element_size, 0), "candidates": TYPED_CANDIDATES,
                "near": TYPED_NEAR, "extra_words": TYPED_EXTRA_WORDS.get(element_size, 2),
                "back": TYPED_BACK, "lazy": TYPED_LAZY}
    return {"window": DEFAULT_WINDOW, "accel": DEFAULT_ACCEL, "probe": 0,
            "candidates": DEFAULT_CANDIDATES, "near": DEFAULT_NEAR,
            "extra_words": DEFAULT_EXTRA_WORDS, "back": DEFAULT_BACK, "lazy": DEFAULT_LAZY}


def table_bits(page_size: int, window: int, hash_bits: int | None = None,
               element_size: int = 1) -> tuple[int, int]:
    """log2 sizes of the ``last`` (per page) and ``first`` (per window) hash tables; the default
    ``last`` table is smaller for bit-shuffled pages (``element_size`` 2 or 4)."""
    if hash_bits is None:
        delta = TYPED_HASH_BITS_DELTA if element_size > 1 else DEFAULT_HASH_BITS_DELTA
        hash_bits = min(page_size.bit_length() - 1, 14) + delta
    return hash_bits, window.bit_length() + 2


def _num_programs(pages: torch.Tensor, programs_per_sm: int) -> int:
    n = pages.shape[0]
    if pages.device.type != "cuda" or interpreting():
        return min(n, 3)
    sms = torch.cuda.get_device_properties(pages.device).multi_processor_count
    return min(n, sms * programs_per_sm)


def compress_pages(
    pages: torch.Tensor,
    element_size: int = 1,
    *,
    num_warps: int = 1,
    programs_per_sm: int = DEFAULT_PROGRAMS_PER_SM,
    window: int | None = None,
    extra_words: int | None = None,
    hash_bits: int | None = None,
    candidates: str | None = None,
    near: int | None = None,
    min_match: int | None = None,
    lazy: bool | None = None,
    skip: bool = DEFAULT_SKIP,
    back: bool | None = None,
    accel: int | None = None,
    probe: int | None = None,
    shuffle_wide: bool | None = None,
    gate: bool = True,
    group: bool = True,
    pairs: bool = True,
    maxnreg: int | None = None,
    traced: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compress ``uint8 [N, P]`` pages (contiguous, ``P`` a power of two in [4096, 65536]).

    Returns the fixed-stride ``(payload uint8 [N, P], sizes int32 [N], kinds uint8 [N])`` of
    ``torch_pagecomp.format``. ``element_size`` 2 or 4 bit-shuffles each page before LZ4.
    Launches on ``pages``' device and current stream; never synchronises with the host.
    ``num_warps``, ``programs_per_sm``, ``window`` (positions per candidate step, a power of
    two from 64 to 1024; default from :func:`parse_defaults`) and ``extra_words`` (0-6:
    match bytes compared for all positions at once; default from :func:`parse_defaults`) tune
    speed only; ``hash_bits`` (8-16, log2 entries of the per-page table; default
    ``min(log2 P, 14) - 1``, one less for bit-shuffled pages: :func:`table_bits`) trades ratio
    for cache footprint. The output
    depends on ``window`` and ``hash_bits`` but is always a valid block. ``candidates``:
    ``"atomic"`` (two tables, L2 atomics: exact and deterministic) or ``"store"`` (one table,
    plain loads and stores per 32 positions, plus the ``near`` (0-5) distances 1, 2, 4, ...;
    on the GPU, lanes that store the same entry race, so the parse may vary from run to run;
    every block is still valid) or ``"store-max"`` (the same with
    ``.cg`` loads and ``atomic_max``: half the L2 traffic of ``"atomic"``, deterministic; the
    default for bytes) or ``"planes"`` (bit-shuffled pages only, their default: no hash table;
    the ``near`` distances, then one and two bit planes back; deterministic; with ``gate``
    (default on), a window is searched only if one of its aligned 32-bit words equals the word
    4, 8 or 16 bytes, or one or two planes, before it: the noisy mantissa planes cost one
    check per window; with ``group`` (default on; same blocks), the planes all of whose
    words fail that check are found once per page and passed over whole, read as 64-bit words
    with ``pairs``, default on; same blocks).
    Parse: ``lazy`` (a match one byte later wins when it is known to be longer; default from
    :func:`parse_defaults`: on for bytes, off for bit-shuffled pages), ``skip`` (a
    window wholly inside a match is not hashed; the next one starts at the match's end),
    ``back`` (a match grows backwards into its literals, up to 32 bytes, as LZ4's does;
    default from :func:`parse_defaults`: on for bytes, off for bit-shuffled pages),
    ``min_match`` (4 to ``4 + 4 * extra_words``; default ``DEFAULT_MIN_MATCH``: shorter
    matches stay literals; fewer, longer sequences decode faster, at some ratio), ``accel``
    (0 = off; ``k`` in 1..8: after ``m`` consecutive windows without a sequence, the next
    ``m // k`` windows are neither hashed nor searched, as LZ4's acceleration steps faster
    through data without matches, so incompressible stretches cost fewer table operations
    and matches there are missed; on a bit-shuffled page the count restarts at every bit
    plane and no skip crosses into the next plane: the noisy mantissa planes are skipped,
    the structured ones are not; default from :func:`parse_defaults`: 1 on bit-shuffled
    pages, 0 on bytes). ``probe`` (0 = off; 16 or 32, below ``window``): a window that
    follows a window without a sequence (in any earlier bit plane too) hashes and searches
    only its first ``probe`` positions, so each noisy mantissa plane after the first costs
    ``probe`` positions instead of a window (``bench.dev_accel_model --probe``: positions
    hashed and ratio); matches later in such a window are missed. ``shuffle_wide`` (default
    ``SHUFFLE_WIDE``; same bytes either way): the bit-shuffle reads the page as 64-bit words
    instead of bytes, where ``pages`` starts 8-byte aligned (else bytes). ``maxnreg`` (GPU
    only): ptxas' register cap per thread, so that more one-warp programs fit an SM (with
    ``programs_per_sm``). ``traced=False`` launches directly (eager callers outside the ops:
    see ``torch_pagecomp.kernels.launch``).
    """
    defaults = parse_defaults(element_size)
    window = defaults["window"] if window is None else window
    accel = defaults["accel"] if accel is None else accel
    candidates = defaults["candidates"] if candidates is None else candidates
    near = defaults["near"] if near is None else near
    extra_words = defaults["extra_words"] if extra_words is None else extra_words
    back = defaults["back"] if back is None else back
    lazy = defaults["lazy"] if lazy is None else lazy
    probe = defaults["probe"] if probe is None else probe
    if probe not in (0, 16, 32) or (probe and probe >= window):
        raise ValueError(f"bad tuning: probe={probe} (0, 16 or 32, below window={window})")
    if window not in (64, 128, 256, 512, 1024) or not 0 <= extra_words <= 6:
        raise ValueError(f"bad tuning: window={window}, extra_words={extra_words}")
    if candidates not in CANDIDATE_MODES or not 0 <= near <= 5:
        raise ValueError(f"bad tuning: candidates={candidates!r}, near={near}")
    if candidates == "planes" and element_size == 1:
        raise ValueError("candidates='planes' needs bit planes: element_size 2 or 4")
    if min_match is None:  # the default, as far as extra_words lets the walk know lengths
        min_match = min(DEFAULT_MIN_MATCH, 4 + 4 * extra_words)
    if not 4 <= min_match <= 4 + 4 * extra_words:
        raise ValueError(f"bad tuning: min_match={min_match} (4..{4 + 4 * extra_words})")
    if not 0 <= accel <= 8:
        raise ValueError(f"bad tuning: accel={accel} (0..8)")
    if hash_bits is not None and not 8 <= hash_bits <= 16:
        raise ValueError(f"bad tuning: hash_bits={hash_bits}")
    n, page_size = pages.shape
    dev = pages.device
    # the kernel reads pages as 32-bit (and, for the bit-shuffle, 64-bit) words: alignment from
    # the storage offset (storage bases from PyTorch's allocators are aligned; data_ptr() is
    # not readable under torch.compile's fake tensors). A view not 4-aligned is copied once.
    if pages.storage_offset() % 4:
        pages = pages.clone()
    wide = bool(SHUFFLE_WIDE if shuffle_wide is None else shuffle_wide)
    wide = wide and pages.storage_offset() % 8 == 0
    payload = torch.empty((n, page_size), dtype=torch.uint8, device=dev)
    sizes = torch.empty((n,), dtype=torch.int32, device=dev)
    kinds = torch.empty((n,), dtype=torch.uint8, device=dev)
    if n == 0:
        return payload, sizes, kinds
    pb = page_size.bit_length() - 1
    hb, fb = table_bits(page_size, window, hash_bits, element_size)
    grid = _num_programs(pages, programs_per_sm)
    planes = candidates == "planes"  # no hash table: the kernel never touches ``tabs``
    tab_shape = (1, 1) if planes else (grid, (1 << hb) + (1 << fb))
    tabs = torch.empty(tab_shape, dtype=torch.int32, device=dev)
    shuf_rows = grid if element_size > 1 else 1
    shuf = torch.empty((shuf_rows, page_size), dtype=torch.uint8, device=dev)
    kind_lz4 = fmt.KIND_LZ4 | (fmt.element_shift(element_size) << 4)
    args = (pages, payload, sizes, kinds, tabs, shuf, n)
    meta = dict(
        P=page_size, PB=pb, E=element_size, KIND_LZ4=kind_lz4, HB=hb, FB=fb,
        W=window, XW=extra_words, EXT=128, V=64, CH=128, num_warps=num_warps,
        STORE=candidates != "atomic", NEAR=near if candidates != "atomic" else 0,
        AMAX=candidates == "store-max", PLANES=planes, GATE=planes and gate,
        GROUP_PLANES=group, PAIRS=pairs, MINML=min_match,
        LAZY=lazy, SKIP=skip, BACK=back, ACC=accel, PROBE=probe, SW=wide,
    )
    if maxnreg and not interpreting():
        meta["maxnreg"] = maxnreg
    launch(_lz4_compress_kernel, (grid,), dev, args, meta, traced)
    return payload, sizes, kinds
