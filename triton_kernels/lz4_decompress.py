"""Triton LZ4 page decompression: :func:`decompress_into` and :func:`decompress_pages`, the
launchers behind ``torch.ops.pagecomp.decompress``; the reference is
``torch_pagecomp.cpu_codec.decode_block``, the tests ``tests/test_triton_decompress.py``.

Two launches per call, one program (one warp) per page in each: ``_decompress_kernel`` decodes
RAW, FILL and plain LZ4 pages, ``_decompress_shuffled_kernel`` the bit-shuffled LZ4 pages; each
leaves the other's pages alone, so the plain kernel carries no shuffle code.

An LZ4 page is a sequential token walk (``_decode_lz4``): the token, the offset and the first
length-extension byte are scalar loads (broadcast, L1-resident); longer extensions are read
``EXT_BYTES`` at a time. Literals and matches are copied ``VEC_BYTES`` per step (one byte per
lane), long runs ``RUN_BYTES`` per step. A match reads only bytes written before it: an
overlapping match (offset ``d`` < length) copies ``out[o] = out[start + (o - op) % d]``, so one
barrier per sequence (between the stores so far and the match's loads) orders everything; a long
one of period ``d <= 256`` (a repeated pattern, a bit plane's run) loads its pattern once and
stores it from registers, ``256 - 256 % d`` bytes a step. On
the GPU each LZ4 block's lines are prefetched into L1 before its walk.

A bit-shuffled page up to ``WORD_TILE_MAX_PAGE`` bytes whose output rows are 4-byte aligned is
decoded plainly and unshuffled in one whole-page tile of 32-bit words
(``bitunshuffle.unshuffle_page_words``); a larger page (its tile would not fit in registers), or
one in misaligned rows, is decoded transposed (byte ``g`` of bit plane ``b`` at ``g * 8E + b``,
``_decode_lz4_transposed``) and unshuffled in place ``UNSHUFFLE_GROUPS`` groups per step.

Safety like ``LZ4_decompress_safe``: every load is masked to the page's ``[offset, offset + size)``
(after checking that range lies in the payload), every store to its output row, and every loop
consumes input. Statuses are those of ``torch_pagecomp.cpu_codec.decode_block``; a failed page's
row is zeroed. All positions inside a page are int32, relative to its block, whose size is at
most ``LZ4_compressBound(PAGE)`` (``_page_meta``: a larger LZ4 size is ``STATUS_BAD_SIZE``
before any walk), so a position never passes ``end + VEC_BYTES`` and cannot wrap (comparisons
are also written as ``length > end - position``); the page base addresses (``off``,
``pid * PAGE``) are int64.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import constants as fmt
from .bitunshuffle import unshuffle_groups64, unshuffle_page_words
from .launch import (
    config_meta,
    int_class,
    interpreting,
    known_args,
    launch,
    launch_known,
    ptr_class,
)

WORD_TILE_MAX_PAGE = 4096  # largest page whose whole-page unshuffle tile fits in registers


@dataclass(frozen=True)
class DecodeConfig:
    """Compile-time settings of ``_decompress_kernel``: each field is one of its constexprs, or
    the launch option ``num_warps``."""

    PAGE: int  # bytes per page
    VEC_BYTES: int  # bytes per copy step of a short literal run or match (one per lane)
    RUN_BYTES: int  # bytes per step of the rest of a long literal run or match
    EXT_BYTES: int  # bytes per step of a long length extension
    RAW_BYTES: int  # bytes per step of a RAW or FILL page, or of zeroing a failed row
    PREFETCH_L1: bool  # prefetch each LZ4 block's lines into L1 before its walk
    num_warps: int
    ROWS: bool = False  # ``pages`` is an ``int64 [N]`` table of row addresses (not ``[N, P]``)

    def meta(self) -> dict:
        """The keyword arguments of the launch."""
        return config_meta(self)


@dataclass(frozen=True)
class ShuffledDecodeConfig:
    """Compile-time settings of ``_decompress_shuffled_kernel`` (fields as in
    :class:`DecodeConfig`, plus the unshuffle's)."""

    PAGE: int
    PAGE_LOG2: int
    VEC_BYTES: int
    RUN_BYTES: int
    EXT_BYTES: int
    RAW_BYTES: int
    UNSHUFFLE_GROUPS: int  # groups per step of the in-place unshuffle after a transposed decode
    WORD_TILE: bool  # decode plainly and unshuffle the whole page as 32-bit words (aligned rows)
    PREFETCH_L1: bool
    num_warps: int
    ROWS: bool = False

    def meta(self) -> dict:
        """The keyword arguments of the launch."""
        return config_meta(self)




@functools.cache
def _configs(page_size: int, interpret: bool) -> tuple[DecodeConfig, ShuffledDecodeConfig]:
    # Shuffled pages take longer runs per step than plain ones: their planes hold long matches,
    # while a plain page's short ones would leave most of a long step idle.
    # The interpreter pays per operation, not per byte: long steps, and it runs no inline PTX.
    plain = DecodeConfig(PAGE=page_size, VEC_BYTES=32, RUN_BYTES=256 if interpret else 64,
                         EXT_BYTES=32, RAW_BYTES=1024, PREFETCH_L1=not interpret, num_warps=1)
    shuffled = ShuffledDecodeConfig(
        PAGE=page_size, PAGE_LOG2=page_size.bit_length() - 1, VEC_BYTES=32, RUN_BYTES=256,
        EXT_BYTES=32, RAW_BYTES=1024, UNSHUFFLE_GROUPS=8,
        WORD_TILE=page_size <= WORD_TILE_MAX_PAGE, PREFETCH_L1=not interpret, num_warps=1)
    return plain, shuffled


def decode_config(page_size: int) -> DecodeConfig:
    """The settings of ``_decompress_kernel`` for ``page_size`` (on the GPU, or the
    interpreter's when ``TRITON_INTERPRET=1``)."""
    return _configs(page_size, interpreting())[0]


def shuffled_decode_config(page_size: int) -> ShuffledDecodeConfig:
    """The settings of ``_decompress_shuffled_kernel`` for ``page_size``."""
    return _configs(page_size, interpreting())[1]


_RUN = tl.constexpr(255)  # a page still being decoded (never stored)
_PATTERN_BYTES = tl.constexpr(256)  # bytes per step of a long match repeating a short period
_INT32_MAX = tl.constexpr(2**31 - 1)
_OK = tl.constexpr(fmt.STATUS_OK)
_BAD_KIND = tl.constexpr(fmt.STATUS_BAD_KIND)
_BAD_SIZE = tl.constexpr(fmt.STATUS_BAD_SIZE)
_TRUNCATED = tl.constexpr(fmt.STATUS_TRUNCATED)
_BAD_OFFSET = tl.constexpr(fmt.STATUS_BAD_OFFSET)
_OVERFLOW = tl.constexpr(fmt.STATUS_OVERFLOW)
_SHORT = tl.constexpr(fmt.STATUS_SHORT)
_SHUFFLED_2 = tl.constexpr(fmt.KIND_LZ4_SHUFFLED_2)
_SHUFFLED_4 = tl.constexpr(fmt.KIND_LZ4_SHUFFLED_4)


@triton.jit
def _ext_long(src, p, end, acc, st, EXT_BYTES: tl.constexpr):
    """Add the length extension bytes at ``src[p:end]`` to ``acc`` (saturating at int32 max).

    Returns ``(acc, p after the last extension byte, st)``, ``st`` TRUNCATED when the input ends
    inside the extension. Every step consumes ``EXT_BYTES`` bytes or ends the loop.
    """
    ar = tl.arange(0, EXT_BYTES)
    done = p < 0
    more = p < end
    while more:
        w = tl.load(src + p + ar, mask=ar < end - p, other=255).to(tl.int32)
        j = tl.min(tl.where(w != 255, ar, EXT_BYTES), axis=0)
        part = tl.sum(tl.where(ar <= j, w, 0), axis=0)
        acc = tl.minimum(acc, _INT32_MAX - part) + part
        p += tl.minimum(j + 1, tl.minimum(end - p, EXT_BYTES))
        done = j < EXT_BYTES
        more = (~done) & (p < end)
    return acc, p, tl.where(done, st, _TRUNCATED)


@triton.jit
def _read_ext(src, p, end, n, st, EXT_BYTES: tl.constexpr):
    """A length field's extension at ``src[p:end]`` added to ``n``: one scalar load when it is a
    single byte (most are), ``_ext_long`` otherwise. Returns ``(n, p after it, st)``."""
    b = tl.load(src + p, mask=p < end, other=255).to(tl.int32)
    if b == 255:
        n, p, st = _ext_long(src, p, end, n, st, EXT_BYTES)
    else:
        n += b
        p += 1
    return n, p, st


@triton.jit
def _decode_lz4_transposed(src, end, row, PAGE: tl.constexpr, glog, gshift, VEC_BYTES: tl.constexpr,
                           RUN_BYTES: tl.constexpr, EXT_BYTES: tl.constexpr):
    """Decode the LZ4 block ``src[0:end]`` (``end >= 1``) of a bit-shuffled page into ``row``
    (``PAGE`` bytes) transposed: shuffled byte ``y`` goes to row position
    ``(y % G) << gshift | y // G`` (``G = 1 << glog`` bytes per bit plane, ``gshift = log2(8E)``),
    the layout ``bitunshuffle.unshuffle_groups64`` expects. Returns the int32 status (0 ok).
    The layout's index maps are inlined because the interpreter pays per device-function call.

    Invariants at the top of the loop: ``0 <= ip < end`` and ``tok = src[ip]``; the status
    decides, in the reference's order, and later checks only apply while it is ``_RUN``.
    """
    ar = tl.arange(0, VEC_BYTES)
    arb = tl.arange(0, RUN_BYTES)
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
            lit, p, st = _read_ext(src, p, end, lit, st, EXT_BYTES)
        st = tl.where(st == _RUN, tl.where(lit > end - p, _TRUNCATED,
                                           tl.where(lit > PAGE - op, _OVERFLOW, _RUN)), st)
        ok = st == _RUN
        n = tl.where(ok, lit, 0)
        q = p + n
        has_off = ok & (end - q >= 2)
        # the offset is loaded before the literals are stored: both loads are in flight at once
        b0 = tl.load(src + q, mask=has_off, other=0).to(tl.int32)
        b1 = tl.load(src + q + 1, mask=has_off, other=0).to(tl.int32)
        v = tl.load(src + p + ar, mask=ar < n)
        dst = op + ar
        dst = ((dst & gmask) << gshift) | (dst >> glog)
        tl.store(row + dst, v, mask=ar < n)
        if n > VEC_BYTES:
            for k in range(VEC_BYTES, n, RUN_BYTES):
                mb = arb < n - k
                vb = tl.load(src + p + k + arb, mask=mb)
                db = op + k + arb
                db = ((db & gmask) << gshift) | (db >> glog)
                tl.store(row + db, vb, mask=mb)
        op += n
        # ---- the block ends after the literals, or a match follows
        d = b0 | (b1 << 8)
        st = tl.where(ok, tl.where(q == end, tl.where(op == PAGE, _OK, _SHORT),
                                   tl.where(~has_off, _TRUNCATED,
                                            tl.where((d == 0) | (d > op), _BAD_OFFSET, _RUN))),
                      st)
        p = q + 2  # only used while st == _RUN, and then q + 2 <= end
        ml = tok & 15
        if (st == _RUN) & (ml == 15):
            ml, p, st = _read_ext(src, p, end, ml, st, EXT_BYTES)
        ml += 4
        st = tl.where(st == _RUN, tl.where(ml > PAGE - op, _OVERFLOW,
                                           tl.where(p >= end, _TRUNCATED, _RUN)), st)
        n = tl.where(st == _RUN, ml, 0)  # n > 0 exactly while running
        tok = tl.load(src + p, mask=n > 0, other=0).to(tl.int32)  # next token, early
        start = op - d
        tl.debug_barrier()  # the literals and earlier matches are visible to every lane
        if d >= tl.minimum(n, VEC_BYTES):
            s = start + ar
        else:  # overlapping: repeat the d bytes before op
            s = start + ar % d
        dst = op + ar
        s = ((s & gmask) << gshift) | (s >> glog)
        dst = ((dst & gmask) << gshift) | (dst >> glog)
        v = tl.load(row + s, mask=ar < n)
        tl.store(row + dst, v, mask=ar < n)
        if n > VEC_BYTES:
            overlap = d < n
            for k in range(VEC_BYTES, n, RUN_BYTES):
                o = k + arb
                sb = start + tl.where(overlap, o % tl.maximum(d, 1), o)
                db = op + o
                sb = ((sb & gmask) << gshift) | (sb >> glog)
                db = ((db & gmask) << gshift) | (db >> glog)
                vb = tl.load(row + sb, mask=o < n)
                tl.store(row + db, vb, mask=o < n)
        op += n
        ip = p
    return st


@triton.jit
def _fast_next(src, end, tok, ip, op, PAGE: tl.constexpr):
    """Parse of the sequence at ``ip`` (token ``tok``) for ``_decode_lz4``'s fast loop:
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
    room = tl.minimum(end - 3 - q, PAGE - op - lit - ml)  # >= 0: offset, next token, page fit
    fast = (tok < 0xF0) & (ml < 19) & (room >= 0)
    fast = fast & ((d - 1).to(tl.uint32) < (op + lit).to(tl.uint32))  # 1 <= d <= op + lit
    return lit, ml, q, d, fast


@triton.jit
def _decode_lz4(src, end, row, PAGE: tl.constexpr, VEC_BYTES: tl.constexpr, RUN_BYTES: tl.constexpr,
                EXT_BYTES: tl.constexpr):
    """Decode the LZ4 block ``src[0:end]`` (``end >= 1``) into ``row`` (``PAGE`` bytes, contiguous
    stores); returns the int32 status (0 ok).

    Sequences that ``_fast_next`` vouches for (short lengths, everything in bounds: most of
    them) go through an inner loop with no status work and one vector copy each for the
    literals and the match; any other sequence (extensions, the last literals, a bad offset)
    takes one step of the checked loop below, which then hands back. In the checked loop a
    sequence's checks are a few compares and the status is worked out only in rarely taken
    branches, each of which also makes the next one taken (``p = end``: no offset; ``ml = PAGE``:
    overflow), so that a failed or finished page copies nothing more.
    """
    ar = tl.arange(0, VEC_BYTES)
    arb = tl.arange(0, RUN_BYTES)
    ip = end * 0
    op = end * 0
    st = end * 0 + _RUN
    tok = tl.load(src).to(tl.int32)
    lit, ml, q, d, fast = _fast_next(src, end, tok, ip, op, PAGE)
    while st == _RUN:
        while fast:  # VEC_BYTES >= 32 > lit, ml
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
            lit, ml, q, d, fast = _fast_next(src, end, tok, ip, op, PAGE)
        lit = tok >> 4
        p = ip + 1
        if lit == 15:
            lit, p, st = _read_ext(src, p, end, lit, st, EXT_BYTES)  # TRUNCATED: p == end
        if (lit > end - p) | (lit > PAGE - op):  # also taken after a truncated extension
            st = tl.where(st != _RUN, st, tl.where(lit > end - p, _TRUNCATED, _OVERFLOW))
            lit = 0
            p = end  # no offset: the next rare branch is taken too
        q = p + lit
        has_off = end - q >= 2
        b0 = tl.load(src + q, mask=has_off).to(tl.int32)
        b1 = tl.load(src + q + 1, mask=has_off).to(tl.int32)
        lm = ar < lit
        tl.store(row + (op + ar), tl.load(src + (p + ar), mask=lm), mask=lm)
        if lit > VEC_BYTES:
            for k in range(VEC_BYTES, lit, RUN_BYTES):
                mb = arb < lit - k
                tl.store(row + (op + k + arb), tl.load(src + (p + k + arb), mask=mb), mask=mb)
        op += lit
        d = b0 | (b1 << 8)  # garbage unless has_off; then only the rare branch looks at it
        p = q + 2
        ml = tok & 15
        # no offset (block end, cut, or failed above), offset 0 or before the page start
        if (~has_off) | ((d - 1).to(tl.uint32) >= op.to(tl.uint32)):
            st = tl.where(st != _RUN, st,
                          tl.where(q == end, tl.where(op == PAGE, _OK, _SHORT),
                                   tl.where(~has_off, _TRUNCATED, _BAD_OFFSET)))
            ml = PAGE  # the next rare branch is taken too (ml + 4 > PAGE - op)
        if ml == 15:
            ml, p, st = _read_ext(src, p, end, ml, st, EXT_BYTES)  # TRUNCATED: p == end
        ml += 4
        if (ml > PAGE - op) | (p >= end):  # also taken by every failed or finished page
            st = tl.where(st != _RUN, st, tl.where(ml > PAGE - op, _OVERFLOW, _TRUNCATED))
            ml = 0
        tok = tl.load(src + p, mask=p < end).to(tl.int32)  # next token, early
        start = op - d
        mm = ar < ml
        tl.debug_barrier()  # the literals and earlier matches are visible to every lane
        if d >= tl.minimum(ml, VEC_BYTES):
            v = tl.load(row + (start + ar), mask=mm)
        else:  # overlapping, d < VEC_BYTES: ar % d by a float quotient (exact for ar, d < 2**10)
            qd = ((ar.to(tl.float32) + 0.5) * (1.0 / d.to(tl.float32))).to(tl.int32)
            v = tl.load(row + (start + ar - qd * d), mask=mm)
        tl.store(row + (op + ar), v, mask=mm)
        if ml > VEC_BYTES:
            if d >= ml:
                for k in range(VEC_BYTES, ml, RUN_BYTES):
                    mb = arb < ml - k
                    tl.store(row + (op + k + arb), tl.load(row + (start + k + arb), mask=mb),
                             mask=mb)
            elif d <= _PATTERN_BYTES:  # overlapping, a short period: out repeats every d
                # bytes, so steps of `span` bytes (a multiple of d) all store the same values:
                # loaded once (the d bytes before op), then stored from registers, with no load
                # (an L2 round trip: global stores leave L1) left in the loop
                arp = tl.arange(0, _PATTERN_BYTES)
                span = _PATTERN_BYTES - _PATTERN_BYTES % d
                pat = tl.load(row + (start + (VEC_BYTES + arp) % d))
                for k in range(VEC_BYTES, ml, span):
                    tl.store(row + (op + k + arp), pat, mask=arp < tl.minimum(span, ml - k))
            else:  # overlapping: r = (k + arb) % d, kept up to date with one compare per step
                r = (VEC_BYTES + arb) % d
                step = RUN_BYTES % d
                for k in range(VEC_BYTES, ml, RUN_BYTES):
                    mb = arb < ml - k
                    tl.store(row + (op + k + arb), tl.load(row + (start + r), mask=mb), mask=mb)
                    r += step
                    r = tl.where(r >= d, r - d, r)
        op += ml
        ip = p
        lit, ml, q, d, fast = _fast_next(src, end, tok, ip, op, PAGE)
        fast = fast & (st == _RUN)
    return st


@triton.jit
def _unshuffle_words(row, PAGE: tl.constexpr, shift):
    """Unshuffle a plainly decoded row in place (element size ``1 << shift``, 2 or 4) in one
    whole-page tile of 32-bit words, after a barrier for the decode's stores."""
    tl.debug_barrier()
    if shift == 1:
        unshuffle_page_words(row, PAGE, 2)
    else:
        unshuffle_page_words(row, PAGE, 4)


@triton.jit
def _unshuffle_transposed(row, PAGE: tl.constexpr, shift, GROUPS: tl.constexpr):
    """Unshuffle a transposed decode in place (element size ``1 << shift``, 2 or 4), ``GROUPS``
    groups per step, after a barrier for the decode's stores."""
    tl.debug_barrier()
    if shift == 1:
        unshuffle_groups64(row, PAGE, 2, GROUPS)
    else:
        unshuffle_groups64(row, PAGE, 4, GROUPS)


@triton.jit
def _page_meta(offsets_ptr, sizes_ptr, kinds_ptr, pid, total, PAGE: tl.constexpr):
    """``(off int64, size int32, kind int32, status)`` of page ``pid``: BAD_KIND / BAD_SIZE / OK.

    OK means: ``[off, off + size)`` lies inside the payload (``total`` bytes; ``total - off``
    is int64 as ``off`` is, so no offset or size wraps) and ``size`` is what the kind allows:
    ``PAGE`` (RAW), ``1`` (FILL), ``1..PAGE + PAGE/255 + 16`` (LZ4, ``format.lz4_bound``: any
    block of a page, as other LZ4 encoders write them). So every walk runs over at most
    ``PAGE + PAGE/255 + 16 < 2**17`` bytes: positions relative to the
    block fit int32 with room to spare, and the block's base is the int64 ``off``. Scalar work
    per page."""
    off, size, kind, bad_size = _plain_meta(offsets_ptr, sizes_ptr, kinds_ptr, pid, total, PAGE)
    codec = kind & 15
    shift = kind >> 4
    bad_kind = (codec > 2) | (shift > 2) | ((shift != 0) & (codec != 1))
    bad_size |= (codec == 1) & (size > PAGE + PAGE // 255 + 16)
    st = tl.where(bad_kind, _BAD_KIND, tl.where(bad_size, _BAD_SIZE, _OK))
    return off, size, kind, st


@triton.jit
def _plain_meta(offsets_ptr, sizes_ptr, kinds_ptr, pid, total, PAGE: tl.constexpr):
    """``(off int64, size int32, kind int32, bad_size)`` of page ``pid``, with the size rules
    every decoder shares: ``[off, off + size)`` non-empty and inside the payload (``total``
    bytes), a RAW page ``PAGE`` bytes, a FILL page 1 (each decoder adds its own kinds').
    ``offsets_ptr`` None: a fixed-stride payload, page ``pid`` at ``pid * PAGE``."""
    if offsets_ptr is None:
        off = pid.to(tl.int64) * PAGE
    else:
        off = tl.load(offsets_ptr + pid).to(tl.int64)
    size = tl.load(sizes_ptr + pid).to(tl.int32)
    kind = tl.load(kinds_ptr + pid).to(tl.int32)
    codec = kind & 15
    bad_size = (off < 0) | (size < 1) | (size.to(tl.int64) > total - off)
    bad_size |= ((codec == 0) & (size != PAGE)) | ((codec == 2) & (size != 1))
    return off, size, kind, bad_size


@triton.jit
def _store_plain_page(payload_ptr, off, raw, row, PAGE: tl.constexpr, RAW_BYTES: tl.constexpr):
    """A checked RAW page (``raw``) copied from ``payload[off:off + PAGE]`` into its row (16-byte
    loads where ``off`` allows: a fixed-stride payload's pages all do), else a FILL page: its
    byte at ``off`` repeated. Shared by the decoders."""
    ar = tl.arange(0, RAW_BYTES)
    if raw:
        if (off & 15) == 0:
            a16 = payload_ptr + tl.multiple_of(off, 16)
            for k in range(0, PAGE, RAW_BYTES):
                tl.store(row + k + ar, tl.load(a16 + k + ar))
        else:
            src = payload_ptr + off
            for k in range(0, PAGE, RAW_BYTES):
                tl.store(row + k + ar, tl.load(src + k + ar))
    else:
        b = tl.load(payload_ptr + off)
        for k in range(0, PAGE, RAW_BYTES):
            tl.store(row + k + ar, tl.zeros([RAW_BYTES], tl.uint8) + b)


@triton.jit
def _zero_row(row, PAGE: tl.constexpr, RAW_BYTES: tl.constexpr):
    ar = tl.arange(0, RAW_BYTES)
    tl.debug_barrier()  # after every partial store of the page
    for k in range(0, PAGE, RAW_BYTES):
        tl.store(row + k + ar, tl.zeros([RAW_BYTES], tl.uint8))


@triton.jit
def _prefetch_block(src, size, PAGE: tl.constexpr):
    """Ask for the lines of the block ``src[0:size]`` (its first 4 KiB at most) at once, one L1
    prefetch per 128-byte line, so that the token walk's loads, each of which the next depends
    on, find their bytes on chip instead of waiting on DRAM one after another. Addresses stay
    inside the block (clamped to its last byte)."""
    N: tl.constexpr = min(PAGE, 4096) // 128
    p = src + tl.minimum(tl.arange(0, N) * 128, size - 1)
    tl.inline_asm_elementwise("mov.u32 $0, 0; prefetch.global.L1 [$1];", "=r,l", [p],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _row(pages_ptr, pid, PAGE: tl.constexpr, ROWS: tl.constexpr):
    """Page ``pid``'s output row: ``PAGE`` bytes apart, or (``ROWS``) the address in entry
    ``pid`` of the ``int64`` table ``pages_ptr`` (tensors of different allocations)."""
    if ROWS:
        return tl.load(pages_ptr + pid).to(tl.pointer_type(tl.uint8))
    else:
        return pages_ptr + pid.to(tl.int64) * PAGE


@triton.jit
def _decompress_kernel(payload_ptr, offsets_ptr, sizes_ptr, kinds_ptr, pages_ptr, status_ptr,
                       total, PAGE: tl.constexpr, VEC_BYTES: tl.constexpr, RUN_BYTES: tl.constexpr,
                       EXT_BYTES: tl.constexpr, RAW_BYTES: tl.constexpr, PREFETCH_L1: tl.constexpr,
                       ROWS: tl.constexpr = False):
    """Program ``i`` decodes page ``i`` into ``pages[i]`` (``uint8 [PAGE]``; with ``ROWS``, the
    ``PAGE`` bytes at address ``pages[i]``) and sets ``status[i]``, except bit-shuffled LZ4
    pages, which it leaves alone, row and status, to ``_decompress_shuffled_kernel``."""
    pid = tl.program_id(0)
    off, size, kind, st = _page_meta(offsets_ptr, sizes_ptr, kinds_ptr, pid, total, PAGE)
    codec = kind & 15
    shift = kind >> 4
    if (kind != _SHUFFLED_2) & (kind != _SHUFFLED_4):
        src = payload_ptr + tl.where(st == 0, off, 0)
        row = _row(pages_ptr, pid, PAGE, ROWS)
        if st == 0:
            if codec == 1:
                if PREFETCH_L1:
                    _prefetch_block(src, size, PAGE)
                if shift == 0:
                    st = _decode_lz4(src, size, row, PAGE, VEC_BYTES, RUN_BYTES, EXT_BYTES)
            else:
                _store_plain_page(payload_ptr, off, codec == 0, row, PAGE, RAW_BYTES)
        if st != 0:
            _zero_row(row, PAGE, RAW_BYTES)
        tl.store(status_ptr + pid, st)


@triton.jit
def _decompress_shuffled_kernel(payload_ptr, offsets_ptr, sizes_ptr, kinds_ptr, pages_ptr,
                                status_ptr, total, PAGE: tl.constexpr,
                                PAGE_LOG2: tl.constexpr, VEC_BYTES: tl.constexpr,
                                RUN_BYTES: tl.constexpr, EXT_BYTES: tl.constexpr,
                                RAW_BYTES: tl.constexpr, UNSHUFFLE_GROUPS: tl.constexpr,
                                WORD_TILE: tl.constexpr, PREFETCH_L1: tl.constexpr,
                                ROWS: tl.constexpr = False):
    """Program ``i`` decodes page ``i`` only if it is a bit-shuffled LZ4 page (rows as in
    ``_decompress_kernel``). With
    ``WORD_TILE``, where the rows are 4-byte aligned (checked here: the tile reads and writes
    32-bit words), the block is decoded plainly (``_decode_lz4``) and unshuffled in one
    whole-page tile (``unshuffle_page_words``); otherwise it is decoded transposed and
    unshuffled ``UNSHUFFLE_GROUPS`` groups per step (``unshuffle_groups64``)."""
    pid = tl.program_id(0)
    off, size, kind, st = _page_meta(offsets_ptr, sizes_ptr, kinds_ptr, pid, total, PAGE)
    if (kind == _SHUFFLED_2) | (kind == _SHUFFLED_4):
        shift = kind >> 4
        src = payload_ptr + tl.where(st == 0, off, 0)
        row = _row(pages_ptr, pid, PAGE, ROWS)
        if ROWS:  # each row where its table entry says
            tile = ((row.to(tl.int64, bitcast=True) & 3) == 0) & WORD_TILE
        else:  # rows are PAGE apart, so aligned as the first (folded for 16-aligned outputs)
            tile = ((pages_ptr.to(tl.int64, bitcast=True) & 3) == 0) & WORD_TILE
        if st == 0:
            if PREFETCH_L1:
                _prefetch_block(src, size, PAGE)
            if tile:
                st = _decode_lz4(src, size, row, PAGE, VEC_BYTES, RUN_BYTES, EXT_BYTES)
                if st == 0:
                    _unshuffle_words(row, PAGE, shift)
            else:
                glog = PAGE_LOG2 - 3 - shift  # log2 of the bytes per bit plane
                st = _decode_lz4_transposed(src, size, row, PAGE, glog, 3 + shift, VEC_BYTES,
                                            RUN_BYTES, EXT_BYTES)
                if st == 0:
                    _unshuffle_transposed(row, PAGE, shift, UNSHUFFLE_GROUPS)
        if st != 0:
            _zero_row(row, PAGE, RAW_BYTES)
        tl.store(status_ptr + pid, st)


def decompress_into(payload: torch.Tensor, offsets: torch.Tensor | None, sizes: torch.Tensor,
                    kinds: torch.Tensor, pages: torch.Tensor, status: torch.Tensor, *,
                    traced: bool = True) -> None:
    """Decode ``N`` stored pages into caller-provided outputs, on ``payload``'s device and
    current stream (no host synchronisation).

    Args:
        payload: ``uint8 [T]``, a fixed-stride payload viewed flat or a packed one.
        offsets: ``int64 [N]``, start of page ``i`` in ``payload``; ``None`` for a
            fixed-stride payload (page ``i`` at ``i * P``: no offsets tensor to build).
        sizes: ``int32 [N]``, stored bytes of page ``i``.
        kinds: ``uint8 [N]``, page kinds (``torch_pagecomp.format``).
        pages: ``uint8 [N, P]`` output, rows contiguous; ``P`` a power of two from 4096 to
            65536. A failed page's row is zeroed.
        status: ``int32 [N]`` output, ``STATUS_OK`` (0) or the failure of page ``i``.
        traced: ``False`` launches directly (eager callers outside the ops; see
            ``torch_pagecomp.kernels.launch``).
    """
    n, page_size = pages.shape
    if not fmt.valid_page_size(page_size):
        raise ValueError(f"page size must be a power of two from 4096 to 65536, got {page_size}")
    if n == 0:
        return
    args = (payload, offsets, sizes, kinds, pages, status, payload.numel())
    launch(_decompress_kernel, (n,), payload.device, args, decode_config(page_size).meta(),
           traced)
    launch(_decompress_shuffled_kernel, (n,), payload.device, args,
           shuffled_decode_config(page_size).meta(), traced)


def decompress_rows(payload: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor,
                    kinds: torch.Tensor, rows: torch.Tensor, page_size: int,
                    status: torch.Tensor) -> None:
    """:func:`decompress_into` with each page's output row given by address: many tensors'
    pages decoded by one launch pair, each into its own allocation (no shared buffer, no copy).
    Launches directly (callers outside the ops only: the addresses are not traceable).

    Args:
        payload, offsets, sizes, kinds, status: as for :func:`decompress_into`.
        rows: ``int64 [N]`` on the payload's device: the address of page ``i``'s ``page_size``
            bytes of output, each inside a live ``uint8`` tensor of that device that the caller
            keeps alive until the decode has run; rows must not overlap.
        page_size: ``P``, a power of two from 4096 to 65536.
    """
    n = check_rows(rows, page_size)
    if n == 0:
        return
    plain, shuffled = _row_configs(page_size, interpreting())
    args = (payload, offsets, sizes, kinds, rows, status, payload.numel())
    launch(_decompress_kernel, (n,), payload.device, args, plain.meta(), traced=False)
    launch(_decompress_shuffled_kernel, (n,), payload.device, args, shuffled.meta(),
           traced=False)


def decompress_into_known(payload: torch.Tensor, offsets: torch.Tensor | None,
                          sizes: torch.Tensor, kinds: torch.Tensor, pages: torch.Tensor,
                          status: torch.Tensor) -> None:
    """:func:`decompress_into` (``traced=False``) for the activation store's hot path (``N >=
    1``, CUDA tensors on the current device), without its checks (``launch.launch_known``)."""
    _decode_pair_known(False, pages.shape[1], payload, offsets, sizes, kinds, pages, status)


def decompress_rows_known(payload: torch.Tensor, offsets: torch.Tensor | None,
                          sizes: torch.Tensor, kinds: torch.Tensor, rows: torch.Tensor,
                          page_size: int, status: torch.Tensor) -> None:
    """:func:`decompress_rows` for the activation store's hot path (``N >= 1``), without its
    checks (``launch.launch_known``)."""
    _decode_pair_known(True, page_size, payload, offsets, sizes, kinds, rows, status)


def _decode_pair_known(rows: bool, page_size: int, *args) -> None:
    """The plain then the shuffled decoder over ``args`` (:func:`decode_known`'s), output
    rows by address with ``rows``."""
    for kernel, meta in _pair(page_size, rows):
        decode_known(kernel, meta, *args)


def into_launches(page_size: int) -> tuple:
    """The ``(kernel, settings)`` of :func:`decompress_into`'s launches (the plain then the
    shuffled decoder), for callers that launch them by known classes or keep their compiled
    entries."""
    return _pair(page_size, False)


def _pair(page_size: int, rows: bool) -> tuple:
    plain, shuffled = _known_metas(page_size, rows, interpreting())
    return (_decompress_kernel, plain), (_decompress_shuffled_kernel, shuffled)


@functools.cache
def _known_metas(page_size: int, rows: bool, interpret: bool) -> tuple:
    # the settings the usual launchers pick (the interpreter's under TRITON_INTERPRET=1)
    configs = _row_configs(page_size, interpret) if rows else _configs(page_size, interpret)
    return tuple(c.meta() for c in configs)


def decompress_rows_at(index: int, page_size: int, n: int, addrs: tuple, total: int,
                       args) -> None:
    """:func:`decompress_rows_known` given addresses (:func:`decode_rows_at`)."""
    for kernel, meta in _pair(page_size, True):
        decode_rows_at(kernel, meta, index, n, addrs, total, args)


def decompress_into_at(index: int, page_size: int, n: int, addrs: tuple, total: int,
                       args) -> None:
    """:func:`decompress_into_known` given addresses: ``addrs`` as for
    :func:`decode_rows_at` with the address of the ``uint8 [n, page_size]`` output pages in
    place of the rows'."""
    for kernel, meta in _pair(page_size, False):
        decode_rows_at(kernel, meta, index, n, addrs, total, args, rows=False)


def decode_rows_at(kernel, meta, index: int, n: int, addrs: tuple, total: int, args,
                   rows: bool = True) -> None:
    """:func:`decode_known` of ``n`` pages into rows by address, given the addresses
    ``addrs`` of ``(payload, offsets, sizes, kinds, rows, status)`` on CUDA device ``index``
    (``payload`` of ``total`` bytes), for a caller that has them without the tensors (the
    activation store's restores cut their buffers by address); ``args`` (the tensors
    and ``total``, or a function that makes them) as for ``launch.launch_known``. Without
    ``rows`` (``meta`` of the kernel's contiguous-output settings), the fifth address is that
    of ``uint8 [n, P]`` output pages."""
    launch_known(kernel, (n,), index, meta, decode_classes(addrs, total, rows), (*addrs, total),
                 args)


def decode_classes(addrs: tuple, total: int, rows: bool = True) -> tuple:
    """The argument classes of :func:`decode_rows_at`'s launch (``launch.known_args``' rule)."""
    payload, offsets, sizes, kinds, out, status = addrs
    return (ptr_class(torch.uint8, payload), ptr_class(torch.int64, offsets),
            ptr_class(torch.int32, sizes), ptr_class(torch.uint8, kinds),
            ptr_class(torch.int64 if rows else torch.uint8, out),
            ptr_class(torch.int32, status), int_class(total))


def decode_known(kernel, meta, payload: torch.Tensor, offsets: torch.Tensor | None,
                 sizes: torch.Tensor, kinds: torch.Tensor, out: torch.Tensor,
                 status: torch.Tensor) -> None:
    """One launch of a decoder (this module's or the exponent codec's: they share the
    arguments ``payload, offsets, sizes, kinds, pages or rows, status, total``) over
    ``sizes.numel()`` pages through ``launch.launch_known``."""
    args = (payload, offsets, sizes, kinds, out, status, payload.numel())
    launch_known(kernel, (sizes.numel(),), payload.device.index, meta, *known_args(args), args)


def check_rows(rows: torch.Tensor, page_size: int) -> int:
    """The number of pages of a row table for ``page_size``-byte rows (the row-table
    launchers' shared checks); raises ``ValueError`` unless ``page_size`` is a power of two
    from 4096 to 65536 and ``rows`` a contiguous ``int64 [N]`` tensor."""
    if not fmt.valid_page_size(page_size):
        raise ValueError(f"page size must be a power of two from 4096 to 65536, got {page_size}")
    if rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous int64 [N] tensor, got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    return rows.numel()


@functools.cache
def _row_configs(page_size: int, interpret: bool):
    plain, shuffled = _configs(page_size, interpret)
    return dataclasses.replace(plain, ROWS=True), dataclasses.replace(shuffled, ROWS=True)


def decompress_pages(payload: torch.Tensor, offsets: torch.Tensor | None, sizes: torch.Tensor,
                     kinds: torch.Tensor, page_size: int,
                     traced: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``N`` stored pages into new outputs.

    Args:
        payload: ``uint8 [T]``, a fixed-stride payload viewed flat or a packed one.
        offsets: ``int64 [N]``, start of page ``i`` in ``payload``; ``None`` for a
            fixed-stride payload (page ``i`` at ``i * P``).
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
