"""Triton LZ4 page decompression: ``decompress_pages`` behind ``torch.ops.pagecomp.decompress``.

One program (one warp) per page. An LZ4 page is a sequential token walk: the token, the offset and
the first length-extension byte are scalar loads (broadcast, L1-resident); longer extensions are
read 32 bytes at a time. Literals and matches are copied 32 bytes per step (one byte per lane),
long runs ``BIG`` bytes per step. A match reads only bytes written before it: an overlapping match
(offset ``d`` < length) copies ``out[o] = out[start + (o - op) % d]``, so one barrier per sequence
(between the stores so far and the match's loads) orders everything.

Shuffled pages, with ``SPLIT`` (the default), go to a second launch
(``_decompress_shuffled_kernel``; each kernel leaves the other's pages alone), so the plain
kernel carries no shuffle code. There,
with ``TILE``, the block is decoded plainly (contiguous stores) and unshuffled in one whole-page
tile of 32-bit words (``bitunshuffle.unshuffle_page_words``); larger pages are decoded
transposed (byte ``g`` of bit plane ``b`` at ``g * 8E + b``) and unshuffled in place
``SHUFFLED_GROUPS`` groups per step. Without ``SPLIT`` one fused kernel does all (the code before
the knobs: transposed decode, two groups per step). ``LEAN`` swaps in ``_decode_lz4_lean`` for
plain decodes. ``PREFETCH`` asks for a block's lines before its walk starts. The knobs are
module defaults and keywords of :func:`decompress_into`; every setting gives the same bytes and
statuses.

Safety like ``LZ4_decompress_safe``: every load is masked to the page's ``[offset, offset + size)``
(after checking that range lies in the payload), every store to its output row, and every loop
consumes input. Statuses are those of ``torch_pagecomp.cpu_codec.decode_block``; a failed page's
row is zeroed. All positions inside a page are int32, relative to its block, whose size is at
most ``P - P/32`` (``_page_meta``: a larger LZ4 size is ``STATUS_BAD_SIZE`` before any walk), so
a position never passes ``end + VEC`` and cannot wrap (comparisons are also written as
``length > end - position``); the page base addresses (``off``, ``pid * P``) are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import constants as fmt
from .bitunshuffle import unshuffle_groups, unshuffle_groups64, unshuffle_page_words
from .launch import interpreting, launch

VEC = 32  # bytes per copy step of a short literal run or match (one per lane of the warp)
# bytes per step of the rest of a long run: 128 was up to 9% faster than 256 on an H200; the CPU
# interpreter pays per operation, not per byte, so it takes bigger steps (same code path).
BIG = 64  # H200: 64 beat 128, 256 (the interpreter takes 256: fewer steps)
EXT = 32  # bytes per step of a long length extension
RAW_BLOCK = 1024  # bytes per step of a RAW / FILL page
UNSHUFFLE_GROUPS = 2  # shuffle groups per step of the in-place unshuffle (fused / TILE off)
NUM_WARPS = 1
# Launcher defaults (best guesses until measured on a GPU; each is a keyword of decompress_into):
LEAN = 2  # 0: _decode_lz4, 1: _decode_lz4_lean, 2: lean with the fast loop (plain decodes)
SPLIT = True  # shuffled LZ4 pages in a second launch, _decompress_shuffled_kernel
TILE = True  # there: plain decode, then a whole-page unshuffle (pages up to TILE_MAX_PAGE)
TILE_MAX_PAGE = 4096
# 0: none; 1 / 2: prefetch an LZ4 block's lines into L1 / L2 before its walk. H200, 64 MiB per
# corpus: into L1 +3-11% on the typed corpora (bench/results/h200_300e11a/), +2% on text and
# mixed (h200_088227b/); into L2 less.
PREFETCH = 1
SHUFFLED_GROUPS = 8  # TILE off or P > TILE_MAX_PAGE: groups per step of unshuffle_groups64
SHUFFLED_NUM_WARPS = 1
SHUFFLED_BIG = 256  # bytes per long-run step in the shuffled kernel (H200: 256 beat 128, 64)
SHUFFLED_LEAN = 2  # shuffled pages: the fast loop too (H200 probe, bf16-relu: 294 vs 171 GB/s
# with the checked loop alone; the illegal address once blamed on it was the compressor's, 91da5de)
SHUFFLED_MAXNREG = 0  # 0: none; else ptxas' register cap for _decompress_shuffled_kernel

_RUN = tl.constexpr(255)  # a page still being decoded (never stored)
_INT32_MAX = tl.constexpr(2**31 - 1)
_OK = tl.constexpr(fmt.STATUS_OK)
_BAD_KIND = tl.constexpr(fmt.STATUS_BAD_KIND)
_BAD_SIZE = tl.constexpr(fmt.STATUS_BAD_SIZE)
_TRUNCATED = tl.constexpr(fmt.STATUS_TRUNCATED)
_BAD_OFFSET = tl.constexpr(fmt.STATUS_BAD_OFFSET)
_OVERFLOW = tl.constexpr(fmt.STATUS_OVERFLOW)
_SHORT = tl.constexpr(fmt.STATUS_SHORT)


@triton.jit
def _ext_long(src, p, end, acc, st, EXT: tl.constexpr):
    """Add the length extension bytes at ``src[p:end]`` to ``acc`` (saturating at int32 max).

    Returns ``(acc, p after the last extension byte, st)``, ``st`` TRUNCATED when the input ends
    inside the extension. Every step consumes ``EXT`` bytes or ends the loop.
    """
    ar = tl.arange(0, EXT)
    done = p < 0
    more = p < end
    while more:
        w = tl.load(src + p + ar, mask=ar < end - p, other=255).to(tl.int32)
        j = tl.min(tl.where(w != 255, ar, EXT), axis=0)
        part = tl.sum(tl.where(ar <= j, w, 0), axis=0)
        acc = tl.minimum(acc, _INT32_MAX - part) + part
        p += tl.minimum(j + 1, tl.minimum(end - p, EXT))
        done = j < EXT
        more = (~done) & (p < end)
    return acc, p, tl.where(done, st, _TRUNCATED)


@triton.jit
def _read_ext(src, p, end, n, st, EXT: tl.constexpr):
    """A length field's extension at ``src[p:end]`` added to ``n``: one scalar load when it is a
    single byte (most are), ``_ext_long`` otherwise. Returns ``(n, p after it, st)``."""
    b = tl.load(src + p, mask=p < end, other=255).to(tl.int32)
    if b == 255:
        n, p, st = _ext_long(src, p, end, n, st, EXT)
    else:
        n += b
        p += 1
    return n, p, st


@triton.jit
def _decode_lz4(src, end, row, P: tl.constexpr, SHUF: tl.constexpr, glog, gshift,
                VEC: tl.constexpr, BIG: tl.constexpr, EXT: tl.constexpr):
    """Decode the LZ4 block ``src[0:end]`` (``end >= 1``) into ``row`` (``P`` bytes); returns the
    int32 status (0 ok). With ``SHUF``, shuffled byte ``y`` goes to row position
    ``(y % G) << gshift | y // G`` (``G = 1 << glog`` bytes per bit plane, ``gshift = log2(8E)``),
    the layout ``bitunshuffle.unshuffle_groups`` expects; inlined because the interpreter pays
    ~0.4 ms per device-function call.

    Invariants at the top of the loop: ``0 <= ip < end`` and ``tok = src[ip]``; the status
    decides, in the reference's order, and later checks only apply while it is ``_RUN``.
    """
    ar = tl.arange(0, VEC)
    arb = tl.arange(0, BIG)
    gmask = (1 << glog) - 1
    ip = end * 0
    op = end * 0
    st = end * 0 + _RUN
    tok = tl.load(src).to(tl.int32)
    while st == _RUN:
        # ---- literals: p <= end throughout
        lit = tok >> 4
        p = ip + 1
        if lit == 15:
            lit, p, st = _read_ext(src, p, end, lit, st, EXT)
        st = tl.where(st == _RUN, tl.where(lit > end - p, _TRUNCATED,
                                           tl.where(lit > P - op, _OVERFLOW, _RUN)), st)
        ok = st == _RUN
        n = tl.where(ok, lit, 0)
        q = p + n
        has_off = ok & (end - q >= 2)
        # the offset is loaded before the literals are stored: both loads are in flight at once
        b0 = tl.load(src + q, mask=has_off, other=0).to(tl.int32)
        b1 = tl.load(src + q + 1, mask=has_off, other=0).to(tl.int32)
        v = tl.load(src + p + ar, mask=ar < n)
        dst = op + ar
        if SHUF:
            dst = ((dst & gmask) << gshift) | (dst >> glog)
        tl.store(row + dst, v, mask=ar < n)
        if n > VEC:
            for k in range(VEC, n, BIG):
                mb = arb < n - k
                vb = tl.load(src + p + k + arb, mask=mb)
                db = op + k + arb
                if SHUF:
                    db = ((db & gmask) << gshift) | (db >> glog)
                tl.store(row + db, vb, mask=mb)
        op += n
        # ---- the block ends after the literals, or a match follows
        d = b0 | (b1 << 8)
        st = tl.where(ok, tl.where(q == end, tl.where(op == P, _OK, _SHORT),
                                   tl.where(~has_off, _TRUNCATED,
                                            tl.where((d == 0) | (d > op), _BAD_OFFSET, _RUN))),
                      st)
        p = q + 2  # only used while st == _RUN, and then q + 2 <= end
        ml = tok & 15
        if (st == _RUN) & (ml == 15):
            ml, p, st = _read_ext(src, p, end, ml, st, EXT)
        ml += 4
        st = tl.where(st == _RUN, tl.where(ml > P - op, _OVERFLOW,
                                           tl.where(p >= end, _TRUNCATED, _RUN)), st)
        n = tl.where(st == _RUN, ml, 0)  # n > 0 exactly while running
        tok = tl.load(src + p, mask=n > 0, other=0).to(tl.int32)  # next token, early
        start = op - d
        tl.debug_barrier()  # the literals and earlier matches are visible to every lane
        if d >= tl.minimum(n, VEC):
            s = start + ar
        else:  # overlapping: repeat the d bytes before op
            s = start + ar % d
        dst = op + ar
        if SHUF:
            s = ((s & gmask) << gshift) | (s >> glog)
            dst = ((dst & gmask) << gshift) | (dst >> glog)
        v = tl.load(row + s, mask=ar < n)
        tl.store(row + dst, v, mask=ar < n)
        if n > VEC:
            overlap = d < n
            for k in range(VEC, n, BIG):
                o = k + arb
                sb = start + tl.where(overlap, o % tl.maximum(d, 1), o)
                db = op + o
                if SHUF:
                    sb = ((sb & gmask) << gshift) | (sb >> glog)
                    db = ((db & gmask) << gshift) | (db >> glog)
                vb = tl.load(row + sb, mask=o < n)
                tl.store(row + db, vb, mask=o < n)
        op += n
        ip = p
    return st


@triton.jit
def _fast_next(src, end, tok, ip, op, P: tl.constexpr):
    """Parse of the sequence at ``ip`` (token ``tok``) for ``_decode_lz4_lean``'s fast loop:
    ``(lit, ml, q, d, fast)``; ``fast`` when no length has an extension, the offset and a next
    token lie inside the block (``q + 2 < end``), the sequence fits the page and its offset
    ``d`` reaches neither before the page start nor is 0. The offset loads are issued here,
    one sequence ahead of the copies."""
    lit = tok >> 4
    ml = (tok & 15) + 4
    q = ip + 1 + lit
    has = q + 1 < end
    b0 = tl.load(src + q, mask=has, other=0).to(tl.int32)
    b1 = tl.load(src + q + 1, mask=has, other=0).to(tl.int32)
    d = b0 | (b1 << 8)
    room = tl.minimum(end - 3 - q, P - op - lit - ml)  # >= 0: offset, next token, page fit
    fast = (tok < 0xF0) & (ml < 19) & (room >= 0)
    fast = fast & ((d - 1).to(tl.uint32) < (op + lit).to(tl.uint32))  # 1 <= d <= op + lit
    return lit, ml, q, d, fast


@triton.jit
def _decode_lz4_lean(src, end, row, P: tl.constexpr, VEC: tl.constexpr, BIG: tl.constexpr,
                     EXT: tl.constexpr, FAST: tl.constexpr):
    """``_decode_lz4`` without the shuffle layout and with fewer instructions per sequence: the
    checks of a sequence are a few compares, and the status is worked out only in rarely taken
    branches, each of which also makes the next one taken (``p = end``: no offset; ``ml = P``:
    overflow) so that a failed or finished page copies nothing more. Same statuses and bytes.

    With ``FAST``, sequences that ``_fast_next`` vouches for (short lengths, everything in
    bounds: most of them) go through an inner loop with no status work and one vector copy
    each for the literals and the match; any other sequence (extensions, the last literals, a
    bad offset) takes one step of the checked loop below, which then hands back.
    """
    ar = tl.arange(0, VEC)
    arb = tl.arange(0, BIG)
    ip = end * 0
    op = end * 0
    st = end * 0 + _RUN
    tok = tl.load(src).to(tl.int32)
    if FAST:
        lit, ml, q, d, fast = _fast_next(src, end, tok, ip, op, P)
    while st == _RUN:
        if FAST:
            while fast:  # VEC >= 32 > lit, ml
                lm = ar < lit
                tl.store(row + (op + ar), tl.load(src + (ip + 1 + ar), mask=lm), mask=lm)
                op += lit
                ip = q + 2
                tok = tl.load(src + ip).to(tl.int32)
                mm = ar < ml
                tl.debug_barrier()  # the literals and earlier matches are visible to every lane
                if d >= ml:
                    v = tl.load(row + (op - d + ar), mask=mm)
                else:  # overlapping: ar % d by a float quotient (exact for ar, d < 2**10)
                    qd = ((ar.to(tl.float32) + 0.5) * (1.0 / d.to(tl.float32))).to(tl.int32)
                    v = tl.load(row + (op - d + ar - qd * d), mask=mm)
                tl.store(row + (op + ar), v, mask=mm)
                op += ml
                lit, ml, q, d, fast = _fast_next(src, end, tok, ip, op, P)
        lit = tok >> 4
        p = ip + 1
        if lit == 15:
            lit, p, st = _read_ext(src, p, end, lit, st, EXT)  # TRUNCATED: p == end
        if (lit > end - p) | (lit > P - op):  # also taken after a truncated extension
            st = tl.where(st != _RUN, st, tl.where(lit > end - p, _TRUNCATED, _OVERFLOW))
            lit = 0
            p = end  # no offset: the next rare branch is taken too
        q = p + lit
        has_off = end - q >= 2
        b0 = tl.load(src + q, mask=has_off).to(tl.int32)
        b1 = tl.load(src + q + 1, mask=has_off).to(tl.int32)
        lm = ar < lit
        tl.store(row + (op + ar), tl.load(src + (p + ar), mask=lm), mask=lm)
        if lit > VEC:
            for k in range(VEC, lit, BIG):
                mb = arb < lit - k
                tl.store(row + (op + k + arb), tl.load(src + (p + k + arb), mask=mb), mask=mb)
        op += lit
        d = b0 | (b1 << 8)  # garbage unless has_off; then only the rare branch looks at it
        p = q + 2
        ml = tok & 15
        # no offset (block end, cut, or failed above), offset 0 or before the page start
        if (~has_off) | ((d - 1).to(tl.uint32) >= op.to(tl.uint32)):
            st = tl.where(st != _RUN, st,
                          tl.where(q == end, tl.where(op == P, _OK, _SHORT),
                                   tl.where(~has_off, _TRUNCATED, _BAD_OFFSET)))
            ml = P  # the next rare branch is taken too (ml + 4 > P - op)
        if ml == 15:
            ml, p, st = _read_ext(src, p, end, ml, st, EXT)  # TRUNCATED: p == end
        ml += 4
        if (ml > P - op) | (p >= end):  # also taken by every failed or finished page
            st = tl.where(st != _RUN, st, tl.where(ml > P - op, _OVERFLOW, _TRUNCATED))
            ml = 0
        tok = tl.load(src + p, mask=p < end).to(tl.int32)  # next token, early
        start = op - d
        mm = ar < ml
        tl.debug_barrier()  # the literals and earlier matches are visible to every lane
        if d >= tl.minimum(ml, VEC):
            v = tl.load(row + (start + ar), mask=mm)
        else:  # overlapping, d < VEC: ar % d by a float quotient (exact for ar, d < 2**10)
            qd = ((ar.to(tl.float32) + 0.5) * (1.0 / d.to(tl.float32))).to(tl.int32)
            v = tl.load(row + (start + ar - qd * d), mask=mm)
        tl.store(row + (op + ar), v, mask=mm)
        if ml > VEC:
            if d >= ml:
                for k in range(VEC, ml, BIG):
                    mb = arb < ml - k
                    tl.store(row + (op + k + arb), tl.load(row + (start + k + arb), mask=mb),
                             mask=mb)
            else:  # overlapping: r = (k + arb) % d, kept up to date with one compare per step
                r = (VEC + arb) % d
                step = BIG % d
                for k in range(VEC, ml, BIG):
                    mb = arb < ml - k
                    tl.store(row + (op + k + arb), tl.load(row + (start + r), mask=mb), mask=mb)
                    r += step
                    r = tl.where(r >= d, r - d, r)
        op += ml
        ip = p
        if FAST:
            lit, ml, q, d, fast = _fast_next(src, end, tok, ip, op, P)
            fast = fast & (st == _RUN)
    return st


@triton.jit
def _decode_plain(src, end, row, P: tl.constexpr, VEC: tl.constexpr, BIG: tl.constexpr,
                  EXT: tl.constexpr, LEAN: tl.constexpr):
    """Contiguous decode of one block: ``LEAN`` 0 ``_decode_lz4``, 1 ``_decode_lz4_lean``, 2 the
    lean decoder with its fast loop."""
    if LEAN != 0:
        st = _decode_lz4_lean(src, end, row, P, VEC, BIG, EXT, LEAN == 2)
    else:
        st = _decode_lz4(src, end, row, P, False, 0, 0, VEC, BIG, EXT)
    return st


@triton.jit
def _decode_transposed(src, end, row, shift, P: tl.constexpr, PLOG: tl.constexpr,
                       VEC: tl.constexpr, BIG: tl.constexpr, EXT: tl.constexpr):
    """Decode of a shuffled block straight into the transposed layout the group unshuffles
    expect (byte ``g`` of bit plane ``b`` at ``g * 8E + b``; ``E = 1 << shift``)."""
    glog = PLOG - 3 - shift
    return _decode_lz4(src, end, row, P, True, glog, 3 + shift, VEC, BIG, EXT)


@triton.jit
def _unshuffle_e(row, P: tl.constexpr, E: tl.constexpr, T: tl.constexpr, HOW: tl.constexpr):
    if HOW == 0:
        unshuffle_groups(row, P, E, T)
    elif HOW == 1:
        unshuffle_groups64(row, P, E, T)
    else:
        unshuffle_page_words(row, P, E)


@triton.jit
def _unshuffle_row(row, P: tl.constexpr, shift, T: tl.constexpr, HOW: tl.constexpr):
    """Unshuffle a decoded row in place (element size ``1 << shift``, 2 or 4), after a barrier
    for the decode's stores. ``HOW``: 0 ``unshuffle_groups`` and 1 ``unshuffle_groups64``
    (transposed decode, ``T`` groups per step), 2 ``unshuffle_page_words`` (plain decode)."""
    tl.debug_barrier()
    if shift == 1:
        _unshuffle_e(row, P, 2, T, HOW)
    else:
        _unshuffle_e(row, P, 4, T, HOW)


@triton.jit
def _page_meta(offsets_ptr, sizes_ptr, kinds_ptr, pid, total, P: tl.constexpr):
    """``(off int64, size int32, kind int32, status)`` of page ``pid``: BAD_KIND / BAD_SIZE / OK.

    OK means: ``[off, off + size)`` lies inside the payload (``total`` bytes; ``total - off``
    is int64 as ``off`` is, so no offset or size wraps) and ``size`` is what the kind allows:
    ``P`` (RAW), ``1`` (FILL), ``1..P - P/32`` (LZ4, ``format.lz4_keep_limit``). So every walk
    runs over at most ``P - P/32 < 2**16`` bytes: positions relative to the block fit int32
    with room to spare, and the block's base is the int64 ``off``. Scalar work per page."""
    off = tl.load(offsets_ptr + pid).to(tl.int64)
    size = tl.load(sizes_ptr + pid).to(tl.int32)
    kind = tl.load(kinds_ptr + pid).to(tl.int32)
    codec = kind & 15
    shift = kind >> 4
    bad_kind = (codec > 2) | (shift > 2) | ((shift != 0) & (codec != 1))
    bad_size = (off < 0) | (size < 1) | (size.to(tl.int64) > total - off)
    bad_size |= ((codec == 0) & (size != P)) | ((codec == 2) & (size != 1))
    bad_size |= (codec == 1) & (size > P - P // 32)
    st = tl.where(bad_kind, _BAD_KIND, tl.where(bad_size, _BAD_SIZE, _OK))
    return off, size, kind, st


@triton.jit
def _zero_row(row, P: tl.constexpr, RAW_BLOCK: tl.constexpr):
    ar = tl.arange(0, RAW_BLOCK)
    tl.debug_barrier()  # after every partial store of the page
    for k in range(0, P, RAW_BLOCK):
        tl.store(row + k + ar, tl.zeros([RAW_BLOCK], tl.uint8))


@triton.jit
def _prefetch_block(src, size, P: tl.constexpr, PF: tl.constexpr):
    """Ask for the lines of the block ``src[0:size]`` (its first 4 KiB at most) at once, one
    prefetch per 128-byte line (``PF`` 1: into L1, 2: into L2), so that the token walk's loads,
    each of which the next depends on, find their bytes on chip instead of waiting on DRAM one
    after another. Addresses stay inside the block (clamped to its last byte)."""
    N: tl.constexpr = min(P, 4096) // 128
    p = src + tl.minimum(tl.arange(0, N) * 128, size - 1)
    if PF == 1:
        tl.inline_asm_elementwise("mov.u32 $0, 0; prefetch.global.L1 [$1];", "=r,l", [p],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("mov.u32 $0, 0; prefetch.global.L2 [$1];", "=r,l", [p],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _decompress_kernel(payload_ptr, offsets_ptr, sizes_ptr, kinds_ptr, pages_ptr, status_ptr,
                       total, P: tl.constexpr, PLOG: tl.constexpr, VEC: tl.constexpr,
                       BIG: tl.constexpr, EXT: tl.constexpr, RAW_BLOCK: tl.constexpr,
                       GT: tl.constexpr, LEAN: tl.constexpr, SPLIT: tl.constexpr,
                       PF: tl.constexpr):
    """Program ``i`` decodes page ``i`` into ``pages[i]`` (``uint8 [P]``) and sets ``status[i]``.
    With ``SPLIT`` it leaves shuffled LZ4 pages (kinds ``0x11``, ``0x21``) alone, row and status,
    to ``_decompress_shuffled_kernel``; ``LEAN`` picks ``_decode_lz4_lean`` for plain LZ4."""
    pid = tl.program_id(0)
    off, size, kind, st = _page_meta(offsets_ptr, sizes_ptr, kinds_ptr, pid, total, P)
    codec = kind & 15
    shift = kind >> 4
    mine = (kind != 0x11) & (kind != 0x21)
    if not SPLIT:
        mine = mine | True
    if mine:
        src = payload_ptr + tl.where(st == 0, off, 0)
        row = pages_ptr + pid.to(tl.int64) * P
        ar = tl.arange(0, RAW_BLOCK)
        if st == 0:
            if codec == 1:
                if PF != 0:
                    _prefetch_block(src, size, P, PF)
                if shift == 0:
                    st = _decode_plain(src, size, row, P, VEC, BIG, EXT, LEAN)
                elif not SPLIT:
                    st = _decode_transposed(src, size, row, shift, P, PLOG, VEC, BIG, EXT)
                    if st == 0:
                        _unshuffle_row(row, P, shift, GT, 0)
            elif codec == 0:
                if (off & 15) == 0:  # 16-byte loads (a fixed-stride payload's pages all are)
                    a16 = payload_ptr + tl.multiple_of(off, 16)
                    for k in range(0, P, RAW_BLOCK):
                        tl.store(row + k + ar, tl.load(a16 + k + ar))
                else:
                    for k in range(0, P, RAW_BLOCK):
                        tl.store(row + k + ar, tl.load(src + k + ar))
            else:
                b = tl.load(src)
                for k in range(0, P, RAW_BLOCK):
                    tl.store(row + k + ar, tl.zeros([RAW_BLOCK], tl.uint8) + b)
        if st != 0:
            _zero_row(row, P, RAW_BLOCK)
        tl.store(status_ptr + pid, st)


@triton.jit
def _decompress_shuffled_kernel(payload_ptr, offsets_ptr, sizes_ptr, kinds_ptr, pages_ptr,
                                status_ptr, total, P: tl.constexpr, PLOG: tl.constexpr,
                                VEC: tl.constexpr, BIG: tl.constexpr, EXT: tl.constexpr,
                                RAW_BLOCK: tl.constexpr, GT: tl.constexpr, TILE: tl.constexpr,
                                LEAN: tl.constexpr, PF: tl.constexpr):
    """The other half of a ``SPLIT`` launch: program ``i`` decodes page ``i`` only if it is a
    shuffled LZ4 page (kind ``0x11`` or ``0x21``). With ``TILE``, where the rows are 4-byte
    aligned (checked here: the tile reads and writes 32-bit words), the block is decoded plainly
    (contiguous stores; ``LEAN`` as in ``_decompress_kernel``) and unshuffled in one whole-page
    tile; otherwise decoded transposed and unshuffled group by group as in the fused kernel."""
    pid = tl.program_id(0)
    off, size, kind, st = _page_meta(offsets_ptr, sizes_ptr, kinds_ptr, pid, total, P)
    if (kind == 0x11) | (kind == 0x21):
        shift = kind >> 4
        src = payload_ptr + tl.where(st == 0, off, 0)
        row = pages_ptr + pid.to(tl.int64) * P
        # rows are P apart, so all are aligned as the first (folded away for 16-aligned outputs)
        tile = ((pages_ptr.to(tl.int64, bitcast=True) & 3) == 0) & TILE
        if st == 0:
            if PF != 0:
                _prefetch_block(src, size, P, PF)
            if tile:
                st = _decode_plain(src, size, row, P, VEC, BIG, EXT, LEAN)
                if st == 0:
                    _unshuffle_row(row, P, shift, 0, 2)
            else:
                st = _decode_transposed(src, size, row, shift, P, PLOG, VEC, BIG, EXT)
                if st == 0:
                    _unshuffle_row(row, P, shift, GT, 1)
        if st != 0:
            _zero_row(row, P, RAW_BLOCK)
        tl.store(status_ptr + pid, st)


def launch_constants(page_size: int, lean: bool | None = None, split: bool | None = None,
                     prefetch: int | None = None) -> dict:
    """Compile-time arguments and ``num_warps`` of ``_decompress_kernel`` for ``page_size``."""
    pf = PREFETCH if prefetch is None else prefetch
    if interpreting():
        pf = 0  # the interpreter runs no inline PTX (and has no caches to fill)
    big = 256 if interpreting() else BIG
    return dict(P=page_size, PLOG=page_size.bit_length() - 1, VEC=VEC, BIG=big, EXT=EXT,
                RAW_BLOCK=RAW_BLOCK, GT=UNSHUFFLE_GROUPS, LEAN=LEAN if lean is None else lean,
                SPLIT=SPLIT if split is None else split, PF=pf, num_warps=NUM_WARPS)


def shuffled_constants(page_size: int, tile: bool | None = None,
                       lean: bool | None = None, prefetch: int | None = None) -> dict:
    """Compile-time arguments and ``num_warps`` of ``_decompress_shuffled_kernel``."""
    tile = (TILE if tile is None else tile) and page_size <= TILE_MAX_PAGE
    c = launch_constants(page_size, SHUFFLED_LEAN if lean is None else lean, prefetch=prefetch)
    del c["SPLIT"]
    c = dict(c, GT=SHUFFLED_GROUPS, TILE=tile, num_warps=SHUFFLED_NUM_WARPS)
    if not interpreting():
        c["BIG"] = SHUFFLED_BIG
    if SHUFFLED_MAXNREG:
        c["maxnreg"] = SHUFFLED_MAXNREG
    return c


def decompress_into(payload: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor,
                    kinds: torch.Tensor, pages: torch.Tensor, status: torch.Tensor, *,
                    lean: bool | None = None, split: bool | None = None,
                    tile: bool | None = None, prefetch: int | None = None,
                    traced: bool = True) -> None:
    """Decode into caller-provided outputs: ``pages`` ``uint8 [N, P]`` (contiguous),
    ``status`` ``int32 [N]``; other arguments as :func:`decompress_pages`. The knobs (module
    defaults ``LEAN``, ``SPLIT``, ``TILE``, ``PREFETCH`` when ``None``): ``lean`` decodes plain
    LZ4 pages with ``_decode_lz4_lean``; ``split`` decodes shuffled pages in a second launch,
    where ``tile`` unshuffles whole pages (``P <= TILE_MAX_PAGE``; rows 4-byte aligned, else
    the transposed path) after a plain decode; ``prefetch`` (0 off, 1 into L1, 2 into L2; off
    under the interpreter) asks for each LZ4 block's lines before its walk. Every combination
    gives the same bytes and statuses. ``traced=False``: launch directly (eager callers outside
    the ops; see ``torch_pagecomp.kernels.launch``)."""
    n, page_size = pages.shape
    if not fmt.valid_page_size(page_size):
        raise ValueError(f"page size must be a power of two from 4096 to 65536, got {page_size}")
    if n == 0:
        return
    split = SPLIT if split is None else split
    args = (payload, offsets, sizes, kinds, pages, status, payload.numel())
    launches = [(_decompress_kernel, launch_constants(page_size, lean, split, prefetch))]
    if split:
        consts = shuffled_constants(page_size, tile, lean, prefetch)
        launches.append((_decompress_shuffled_kernel, consts))
    for kernel, consts in launches:
        launch(kernel, (n,), payload.device, args, consts, traced)


def decompress_pages(payload: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor,
                     kinds: torch.Tensor, page_size: int,
                     traced: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``N`` stored pages.

    Args:
        payload: ``uint8 [T]``, a fixed-stride payload viewed flat or a packed one.
        offsets: ``int64 [N]``, start of page ``i`` in ``payload``.
        sizes: ``int32 [N]``, stored bytes; kinds: ``uint8 [N]`` (see ``torch_pagecomp.format``).
        page_size: ``P``, a power of two from 4096 to 65536.
        traced: ``False`` launches directly (see ``torch_pagecomp.kernels.launch``).
    Returns:
        ``(pages uint8 [N, P], status int32 [N])``; a failed page (status != 0) is all zeros.
    """
    n = sizes.shape[0]
    pages = torch.empty((n, page_size), dtype=torch.uint8, device=payload.device)
    status = torch.empty((n,), dtype=torch.int32, device=payload.device)
    decompress_into(payload, offsets, sizes, kinds, pages, status, traced=traced)
    return pages, status
