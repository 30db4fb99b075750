"""Triton kernels of the exponent codec for bf16 / fp16 pages: :func:`compress_exp_pages` and
:func:`decompress_exp_pages` / :func:`decompress_exp_into`, the launchers behind
``torch.ops.pagecomp.compress_exp`` / ``decompress_exp``, and :func:`decompress_exp_rows`
(output rows by address, for the activation store's batched restores). The format (``EXP``
pages, layouts bf16 and fp16) is in ``torch_pagecomp.format``; the reference, bit for bit the
same bytes, sizes, kinds and statuses, is ``torch_pagecomp.exp_codec``; the tests
``tests/test_exp_codec.py``.

One program per page each way, ``CHUNK`` values a step (a 64 KiB page's 32768 values would not
fit in registers at once):

* encode: the table first, from the exponents of a quarter of the page (``format``'s
  sample: one row of 8 values in 4, ``_sampled_rows``), counted by ``tl.histogram``; then
  every value's code, one lookup (``tl.gather``) in a table of codes by exponent
  (``_code_table``) in place of seven comparisons, and the escapes they count, so the page's
  size, and with it its kind (FILL, RAW or EXP), is known before anything is stored; then
  the codes, the rest bytes and the escapes (placed by a running ``tl.cumsum``) are written
  and the row past the size zeroed. No match search, no branch per value. A step is rows of
  8 consecutive values (``_rows``): a row is one 16-byte load, one 3-byte group of codes and
  one count of escapes, inside one thread (an fp16 page of one step counts a row's escapes
  from its 3-byte group by a multiply, as the decoder does: ``_row_escapes``; measured
  faster there and slower on bf16 pages). A 4 KiB page is one step, read once and kept in
  registers; its bf16 sample is counted in 32 bins (zero, the 30 exponents up to the
  sample's largest, the rest), exact unless the rest could reach the table, where all 256
  are counted (``_window_table``), and only a page whose sample is all one exponent is
  compared value by value for FILL. A longer page is read for the sample, then for FILL and
  the escapes, then for the stores. Integer operations bound it (ncu: the ALU pipe 89% busy)
  and Triton 3.6 counts a histogram by ballots, about 27 operations a value, half of the
  encoder's instructions when it counted every value: counting the sample made it 1.40x
  faster on 4 KiB bf16 pages (739 against 529 GB/s on six bf16 corpora, fp16 735 against
  444, 16 and 64 KiB pages 1.69-1.89x), for 0.06-0.13% of the ratio; with the launch's cap
  of 80 registers and 4 KiB pages' rest bytes and zeroed tail in fewer operations, 767-796
  GB/s on bf16 and 758-820 on fp16 in two calls (H200,
  ``bench/results/h200_session66/``).
* decode: the escapes in the codes are counted first (the size must equal the fixed part
  plus them: checked before an escape is read), then the values rebuilt, a row of 8 values
  a thread, held as 8 tensors of rows (``_value``): a ``[rows, 8]`` tensor grown from a load
  of the rows' code groups spread each row over 8 lanes, so that its sums were shuffles and
  its fields went through shared memory. A row's escapes are counted by one multiply
  (``_escape_counts``); an exponent is byte ``code`` of a 64-bit table in registers whose
  byte 7 is the row's first escape; where no row of the step has more than two (most pages:
  escapes are about 3% of real bf16 values) the second is also loaded once for the row, else
  each escape on its own. Integer operations bound the decoder before (ncu: the ALU the
  busiest pipe, 75%); after, 67%, with occupancy held to half by registers, hence the
  launch's cap of 48 a thread for pages of one step (``_decode_config``). 1.46-1.49x the
  speed of the decoder before on 4 KiB pages (1,304-1,350 against 896-905 GB/s on six bf16
  corpora, fp16 1.36-1.40x; H200, ``bench/results/h200_session65/``; larger pages not
  measured).

Decoding dispatch: this decoder handles RAW, FILL and EXP pages and gives LZ4 pages
``STATUS_BAD_KIND``; the LZ4 decoder (``lz4_decompress``) does the same to EXP pages. The
caller picks the decoder (``CompressedPages.codec``, or both with ``api.decompress(...,
codec="any")``). Handling EXP pages inside the LZ4 kernels would add a branch and registers to
their measured loops, or a third launch to every LZ4 decode (the activation hooks decode
thousands of small batches a step, host time per launch counts there): the LZ4 path stays as
it was, and only callers of the exponent codec pay for it.

Safety as the LZ4 decoder's: a page's metadata is checked first (``_exp_page_meta``: its
``[offset, offset + size)`` inside the payload, the size allowed for its kind, ``F <= size <=
P - P/32`` for EXP pages); an EXP page's codes lie inside its fixed part ``F``, and its escapes
are read only once their count matched the size, so every load stays inside the page's bytes;
every store stays in its output row. A failed page's row is zeroed.

Values are read and written as 16-bit words where a row is 2-byte aligned (checked on the
device: per row with a table of row addresses), else as byte pairs: ``uint8`` tensors may be
views at odd addresses, and a ragged group's later tensors start anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import constants as fmt
from .launch import config_meta, interpreting, launch, launch_known, ptr_class
from .lz4_decompress import (
    _plain_meta,
    _row,
    _store_plain_page,
    _zero_row,
    check_rows,
    decode_known,
    decode_rows_at,
)

_OK = tl.constexpr(fmt.STATUS_OK)
_BAD_KIND = tl.constexpr(fmt.STATUS_BAD_KIND)
_BAD_SIZE = tl.constexpr(fmt.STATUS_BAD_SIZE)
_RAW = tl.constexpr(fmt.KIND_RAW)
_FILL = tl.constexpr(fmt.KIND_FILL)
_EXP = tl.constexpr(fmt.KIND_EXP)
_BF16 = tl.constexpr(fmt.EXP_BF16)
_FP16 = tl.constexpr(fmt.EXP_FP16)
_TABLE = tl.constexpr(fmt.EXP_TABLE)  # table entries; code _TABLE escapes
_SAMPLE = tl.constexpr(fmt.EXP_SAMPLE)  # the table counts one row of 8 values in _SAMPLE
PLACE_ALIGN = 16  # bytes: where the placed encoder starts each page (the arena's alignment)
_PLACE_ALIGN = tl.constexpr(PLACE_ALIGN)


@dataclass(frozen=True)
class ExpEncodeConfig:
    """Compile-time settings of ``_exp_encode_kernel``: each field is one of its constexprs, or
    the launch option ``num_warps``."""

    PAGE: int  # bytes per page
    FP16: bool  # layout: fp16 (5-bit exponent, 3 high bits a value) or bf16
    CHUNK: int  # values per step (divides PAGE / 2)
    num_warps: int
    maxnreg: int | None  # the launch option: registers a thread at most (``_encode_config``)
    ROWS: bool = False  # ``pages`` is an ``int64 [N]`` table of row addresses (not ``[N, P]``)

    def meta(self) -> dict:
        """The keyword arguments of the launch."""
        return config_meta(self)


@dataclass(frozen=True)
class ExpDecodeConfig:
    """Compile-time settings of ``_exp_decode_kernel`` (fields as in :class:`ExpEncodeConfig`;
    the layout is read from each page's kind)."""

    PAGE: int
    CHUNK: int
    RAW_BYTES: int  # bytes per step of a RAW or FILL page, or of zeroing a failed row
    num_warps: int
    maxnreg: int | None  # the launch option: registers a thread at most (``_decode_config``)
    ROWS: bool = False  # ``pages`` is an ``int64 [N]`` table of row addresses (not ``[N, P]``)

    def meta(self) -> dict:
        """The keyword arguments of the launch."""
        return config_meta(self)


def _chunk(page_size: int, interpret: bool) -> int:
    # The interpreter pays per operation, not per byte: up to 8192 values a step. On the GPU
    # 2048 values a step are 16 a thread at 4 warps (a 4 KiB page in one step, as the probe
    # measured it: bench/dev_float_codec.py).
    return min(page_size // 2, 8192 if interpret else 2048)


@functools.cache
def _encode_config(page_size: int, fp16: bool, interpret: bool) -> ExpEncodeConfig:
    # Pages of one step (4 KiB on the GPU): 80 registers a thread. Uncapped the kernel took
    # 90 (5 blocks of 4 warps an SM); at 80 (6 blocks) bf16 pages encoded 1.06x and fp16
    # 1.11x faster; at 64 fp16 spilled and ran 0.98x; 8 warps ran 0.81x (H200, session 66).
    # Longer pages take 109-116 and are not capped (not measured).
    chunk = _chunk(page_size, interpret)
    return ExpEncodeConfig(PAGE=page_size, FP16=fp16, CHUNK=chunk, num_warps=4,
                           maxnreg=80 if chunk == page_size // 2 else None)


@functools.cache
def _decode_config(page_size: int, interpret: bool) -> ExpDecodeConfig:
    # Pages of one step (4 KiB on the GPU): 48 registers a thread. The bf16 path needs about
    # 32, but the fp16 and many-escapes paths raised the kernel to 57-64 and held occupancy to
    # half; capped, they spill a few values, and bf16 pages decode 1.07x and fp16 1.04-1.07x
    # faster (H200, bench/results/h200_session65). Pages of several steps take 96-115
    # uncapped (the decoder before took 108) and would spill 176-296 bytes a thread at 48
    # (``bench.dev_sass``): not measured on a GPU, so not capped.
    chunk = _chunk(page_size, interpret)
    return ExpDecodeConfig(PAGE=page_size, CHUNK=chunk, RAW_BYTES=1024, num_warps=4,
                           maxnreg=48 if chunk == page_size // 2 else None)


def encode_config(page_size: int, fp16: bool) -> ExpEncodeConfig:
    """The settings of ``_exp_encode_kernel`` for ``page_size`` and the layout (on the GPU, or
    the interpreter's when ``TRITON_INTERPRET=1``)."""
    return _encode_config(page_size, fp16, interpreting())


def decode_config(page_size: int) -> ExpDecodeConfig:
    """The settings of ``_exp_decode_kernel`` for ``page_size``."""
    return _decode_config(page_size, interpreting())


@functools.cache
def _row_config(page_size: int, interpret: bool) -> ExpDecodeConfig:
    return dataclasses.replace(_decode_config(page_size, interpret), ROWS=True)


# ------------------------------------------------------------------------------ helpers
@triton.jit
def _load_values(row, i, aligned):
    """Values ``i`` (``int32``, 0..65535) of the 16-bit little-endian row at ``row``."""
    if aligned:
        v = tl.load(row.to(tl.pointer_type(tl.uint16)) + i).to(tl.int32)
    else:
        v = tl.load(row + 2 * i).to(tl.int32) | (tl.load(row + 2 * i + 1).to(tl.int32) << 8)
    return v


@triton.jit
def _store_values(row, i, v, aligned):
    """Store the 16-bit values ``v`` (``int32``) at positions ``i`` of the row at ``row``."""
    if aligned:
        tl.store(row.to(tl.pointer_type(tl.uint16)) + i, v.to(tl.uint16))
    else:
        tl.store(row + 2 * i, (v & 255).to(tl.uint8))
        tl.store(row + 2 * i + 1, (v >> 8).to(tl.uint8))


@triton.jit
def _split(v, FP16: tl.constexpr):
    """``(exponent, rest byte, high 3 bits)`` of values ``v`` (``exp_codec.split_values``; the
    high bits are 0 for bf16, which has none)."""
    if FP16:
        return (v >> 10) & 31, v & 255, ((v >> 13) & 4) | ((v >> 8) & 3)
    else:
        return (v >> 7) & 255, ((v >> 8) & 0x80) | (v & 0x7F), v * 0


@triton.jit
def _join(e, rest, high, FP16: tl.constexpr):
    """Inverse of :func:`_split`."""
    if FP16:
        return ((high & 4) << 13) | (e << 10) | ((high & 3) << 8) | rest
    else:
        return ((rest & 0x80) << 8) | (e << 7) | (rest & 0x7F)


@triton.jit
def _pack3(x):
    """The 3-bit fields ``x`` (``int32 [R, 8]``: rows of 8 consecutive values) as one group a
    row (``int32 [R]``: field ``t`` in bits ``3t .. 3t + 2``), summed inside the thread that
    holds the row."""
    return tl.sum(x << (3 * tl.arange(0, 8))[None, :], axis=1)


@triton.jit
def _store_groups(dst, c, word, CHUNK: tl.constexpr):
    """Store the groups ``word`` (:func:`_pack3`) of values ``c .. c + CHUNK`` into the 3-bit
    stream at ``dst``: a little-endian 3-byte group a row."""
    at = dst + 3 * (c // 8 + tl.arange(0, CHUNK // 8))
    tl.store(at, (word & 255).to(tl.uint8))
    tl.store(at + 1, ((word >> 8) & 255).to(tl.uint8))
    tl.store(at + 2, (word >> 16).to(tl.uint8))


@triton.jit
def _store3(dst, c, x, CHUNK: tl.constexpr):
    """Store the 3-bit fields ``x`` (``int32 [CHUNK / 8, 8]``: rows of 8 consecutive values) of
    values ``c .. c + CHUNK`` into the 3-bit stream at ``dst`` (:func:`_pack3`,
    :func:`_store_groups`)."""
    _store_groups(dst, c, _pack3(x), CHUNK)


@triton.jit
def _groups(src, c, CHUNK: tl.constexpr):
    """The 3-byte groups of values ``c .. c + CHUNK`` of the 3-bit stream at ``src``, one a
    row of 8 values (``int32 [CHUNK / 8]``: field ``t`` of row ``g``, value ``c + 8g + t``,
    in bits ``3t .. 3t + 2``)."""
    at = src + 3 * (c // 8 + tl.arange(0, CHUNK // 8))
    return (tl.load(at).to(tl.int32) | (tl.load(at + 1).to(tl.int32) << 8)
            | (tl.load(at + 2).to(tl.int32) << 16))


@triton.jit
def _escape_bits(word):
    """Bit ``3t`` set where field ``t`` of the group ``word`` is 7 (an escape), the others 0."""
    return word & (word >> 1) & (word >> 2) & 0x249249


@triton.jit
def _sum_bits3(m):
    """The bits set in ``m`` (``uint32``, set bits only at ``3t``, fewer than 8 of them):
    multiplying by those 8 bits sums them into bits 21-23 (each lower partial sum fits 3
    bits, so none carries into them)."""
    return (((m * 0x249249) >> 21) & 7).to(tl.int32)


@triton.jit
def _escape_counts(word):
    """The escapes in each group ``word`` (:func:`_groups`): :func:`_sum_bits3` of
    :func:`_escape_bits`, but for a count of 8, which only a group of all escapes has."""
    m = _escape_bits(word).to(tl.uint32)
    return _sum_bits3(m) | tl.where(m == 0x249249, 8, 0)


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7):
    """``[R]`` tensors ``v0 .. v7`` as one ``[R, 8]`` (column ``t`` = ``vt``), each row inside
    the thread that holds it, for one 16-byte store a row (``bitunshuffle.join16``'s way)."""
    a0 = tl.join(v0, v4)  # the axis added first is the most significant bit of t
    a1 = tl.join(v1, v5)
    a2 = tl.join(v2, v6)
    a3 = tl.join(v3, v7)
    return tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), [v0.shape[0], 8])


# ------------------------------------------------------------------------------- encode
# A page's table is the 7 exponents most frequent among its sampled values (one row of 8 in
# EXP_SAMPLE: ``format``), by count descending, then by value ascending. Each candidate
# exponent ``x`` with ``c`` values gets the key ``c * 256 + 255 - x``: keys are distinct, and the
# largest key is the next entry, so one max reduction picks an entry and gives its count and
# exponent (an arg-max and a max, two reductions, took twice the barriers).
@triton.jit
def _take_max(key):
    """``(the largest key, key with it marked taken (-1))``."""
    k = tl.max(key, axis=0)
    return k, tl.where(key == k, -1, key)


@triton.jit
def _top7(key):
    """The 7 largest of the distinct keys ``key`` (``int32 [B]``, -1 for no candidate), as
    scalars, largest first."""
    k0, key = _take_max(key)
    k1, key = _take_max(key)
    k2, key = _take_max(key)
    k3, key = _take_max(key)
    k4, key = _take_max(key)
    k5, key = _take_max(key)
    k6, key = _take_max(key)
    return k0, k1, k2, k3, k4, k5, k6


@triton.jit
def _exponent(k):
    """The exponent a table key (:func:`_top7`) stands for."""
    return 255 - (k & 255)


@triton.jit
def _rows(CHUNK: tl.constexpr):
    """Value indices ``int32 [CHUNK / 8, 8]`` of one step: rows of 8 consecutive values. The
    encoder works on these rows: a row's 16 bytes are one load, its 3-bit codes one 3-byte
    group and its escapes one count, all inside the thread that holds it (a flat step needed a
    reshape through shared memory for the groups and a scan across the block for the escapes)."""
    return tl.arange(0, CHUNK // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]


@triton.jit
def _sampled_rows(CHUNK: tl.constexpr):
    """Value indices ``int32 [CHUNK / 32, 8]`` of the sampled rows of one step (values
    ``32j .. 32j + 7``): the values whose exponents the table counts."""
    ROW: tl.constexpr = 8 * _SAMPLE  # values from one sampled row to the next
    return tl.arange(0, CHUNK // ROW)[:, None] * ROW + tl.arange(0, 8)[None, :]


@triton.jit
def _full_table(src, aligned, PAGE: tl.constexpr, FP16: tl.constexpr, CHUNK: tl.constexpr):
    """The table's keys (:func:`_top7`) from a histogram of all possible exponents (256 for
    bf16, 32 for fp16) of the sampled values of the page at ``src``."""
    N: tl.constexpr = PAGE // 2
    BINS: tl.constexpr = 32 if FP16 else 256
    counts = tl.zeros([BINS], tl.int32)
    i = _sampled_rows(CHUNK)
    for c in range(0, N, CHUNK):
        e, _, _ = _split(_load_values(src, c + i, aligned), FP16)
        counts += tl.histogram(tl.reshape(e, (CHUNK // _SAMPLE,)), BINS)
    bins = tl.arange(0, BINS)
    return _top7(counts * 256 + (255 - bins))


@triton.jit
def _window_table(src, aligned, PAGE: tl.constexpr, CHUNK: tl.constexpr):
    """The table's keys for a bf16 page of one step (``CHUNK == PAGE / 2``): its sampled
    exponents counted in 32 bins (zero, the 30 exponents up to the sample's largest, the
    rest), where all 256 cost about 7x the work a value (Triton's histogram takes a ballot a
    bit of the bins). Exact whenever no exponent of the rest can reach the table (the rest's
    total is below the 7th entry's count, or every exponent has a bin); else the keys come
    from all 256 (:func:`_full_table`)."""
    e, _, _ = _split(_load_values(src, _sampled_rows(CHUNK), aligned), False)
    top = tl.max(tl.max(e, axis=1), axis=0)
    lo = tl.maximum(top - 29, 1)
    b = tl.where(e == 0, 0, tl.where(e >= lo, e - lo + 1, 31))
    counts = tl.histogram(tl.reshape(b, (CHUNK // _SAMPLE,)), 32)
    bins = tl.arange(0, 32)
    x = tl.where(bins == 0, 0, lo + bins - 1)
    key = tl.where(bins == 31, -1, counts * 256 + (255 - x))
    k0, k1, k2, k3, k4, k5, k6 = _top7(key)
    rest = tl.sum(tl.where(bins == 31, counts, 0), axis=0)
    # lo == 1: every exponent has a bin (and absent ones fill the table from 0 up, as all 256)
    if (lo > 1) & (rest >= (k6 >> 8)):
        k0, k1, k2, k3, k4, k5, k6 = _full_table(src, aligned, PAGE, False, CHUNK)
    return k0, k1, k2, k3, k4, k5, k6


@triton.jit
def _codes(x, t0, t1, t2, t3, t4, t5, t6):
    """Each ``x``'s code: the index of the table entry ``t*`` it equals, 7 if none (``x``
    exponents and ``t*`` the entries' exponents)."""
    code = tl.where(x == t6, 6, 7)
    code = tl.where(x == t5, 5, code)
    code = tl.where(x == t4, 4, code)
    code = tl.where(x == t3, 3, code)
    code = tl.where(x == t2, 2, code)
    code = tl.where(x == t1, 1, code)
    return tl.where(x == t0, 0, code)


@triton.jit
def _code_table(k0, k1, k2, k3, k4, k5, k6, FP16: tl.constexpr):
    """Every exponent's code (``int32 [256]`` bf16, ``[32]`` fp16) under the table of keys
    ``k*``: with it a value's code is one lookup (:func:`_code_of`) where comparing with the
    table takes 14 integer operations a value, and integer operations bound this kernel."""
    return _codes(tl.arange(0, 32 if FP16 else 256), _exponent(k0), _exponent(k1),
                  _exponent(k2), _exponent(k3), _exponent(k4), _exponent(k5), _exponent(k6))


@triton.jit
def _code_of(by_exp, e, CHUNK: tl.constexpr):
    """The codes of exponents ``e`` (``[CHUNK / 8, 8]``) under :func:`_code_table`."""
    return tl.reshape(tl.gather(by_exp, tl.reshape(e, (CHUNK,)), 0), (CHUNK // 8, 8))


@triton.jit
def _row_escapes(code, word, BY_GROUP: tl.constexpr):
    """The escapes (code 7) of each row of codes ``code`` (rows of 8): with ``BY_GROUP`` from
    the rows' 3-bit groups ``word`` (:func:`_pack3`) by a multiply (:func:`_escape_counts`, as
    the decoder counts them), else by a compare a value and their sum. By group is a few
    integer operations a row, but longer chains: fp16 pages of one step encode 1.03x faster
    that way, bf16 pages (their window table leaves the kernel at 80 registers) 0.96x (ncu:
    fewer warps eligible, H200, ``bench/results/h200_session67``), so only fp16 one-step pages
    take it."""
    if BY_GROUP:
        return _escape_counts(word)
    return tl.sum((code == 7).to(tl.int32), axis=1)


@triton.jit
def _write_codes(dst, c, v, code, escapes, PAGE: tl.constexpr, FP16: tl.constexpr,
                 CHUNK: tl.constexpr):
    """Store values ``c .. c + CHUNK`` (``v``, rows of 8: :func:`_rows`; ``code`` their codes)
    of an EXP page into the row at ``dst``: their codes, (fp16) high bits, rest bytes and
    escapes, the escapes after the ``escapes`` stored before them; returns the escapes stored
    so far."""
    N: tl.constexpr = PAGE // 2
    F: tl.constexpr = 7 + (1 + FP16) * (3 * N // 8) + N  # format.exp_fixed_bytes
    REST: tl.constexpr = F - N  # where the rest bytes start
    BY_GROUP: tl.constexpr = FP16 and CHUNK == N  # (_row_escapes)
    i = _rows(CHUNK)
    e, rest, high = _split(v, FP16)
    if (CHUNK == N) and not FP16:  # the rest byte as a low byte: a shift and an add, not three
        x = v & 0x807F  # operations (sign to bit 7 by an add that cannot carry); one-step pages
        rest = x + (x >> 8)  # only, as _zero_tail's words
    word = _pack3(code)  # the rows' code groups: stored, and (BY_GROUP) their escapes
    _store_groups(dst + 7, c, word, CHUNK)
    if FP16:
        _store3(dst + 7 + 3 * N // 8, c, high, CHUNK)
    tl.store(dst + REST + c + i, rest.to(tl.uint8))
    per_row = _row_escapes(code, word, BY_GROUP)
    n_esc = tl.sum(per_row, axis=0)
    if n_esc > 0:  # most pages have a few; the scan that places them is skipped without
        if BY_GROUP:  # value t's place in its row: the escapes of fields below t (at most
            # 7); one step, none before
            m = _escape_bits(word).to(tl.uint32)[:, None]
            t3 = 3 * tl.arange(0, 8)[None, :]
            ahead = _sum_bits3(m & ((1 << t3) - 1))
            before = tl.cumsum(per_row, axis=0) - per_row
            tl.store(dst + F + before[:, None] + ahead, e.to(tl.uint8),
                     mask=((m >> t3) & 1) != 0)
        else:
            before = escapes + tl.cumsum(per_row, axis=0) - per_row  # escapes of earlier rows
            escaped = (code == 7).to(tl.int32)
            at = before[:, None] + tl.cumsum(escaped, axis=1) - escaped
            tl.store(dst + F + at, e.to(tl.uint8), mask=escaped != 0)
    return escapes + n_esc


@triton.jit
def _zero_tail(dst, size, end, PAGE: tl.constexpr, F: tl.constexpr, CHUNK: tl.constexpr):
    """Zero bytes ``size .. end`` of the row at ``dst`` (``F <= size <= end <= PAGE``). A page
    of one step (4 KiB on the GPU) where ``dst`` is 8-aligned: the bytes to the next multiple
    of 8, then 8-byte words (a byte store a lane took a store and two compares a byte, on a
    kernel bound by integer operations); else bytes. Longer pages keep the byte loop: with
    the word path, the rest byte of :func:`_write_codes` and the escape sums regrouped, they
    ran 2-7% slower on Triton 3.6 (which of the three, not measured; the word path raised
    their registers from 109 to 128 as compiled here); without, their SASS is 04e4e2a's and
    they ran at its speed (H200, session 66)."""
    words = (size + 7) // 8  # the first word wholly past the size
    if CHUNK == PAGE // 2:
        aligned8 = (dst.to(tl.int64, bitcast=True) & 7) == 0
    else:
        aligned8 = False
    if aligned8:
        b = tl.arange(0, 8)
        tl.store(dst + size + b, tl.zeros([8], tl.uint8), mask=size + b < words * 8)
        W: tl.constexpr = 256  # words a step
        w = tl.arange(0, W)
        for k in range(F // 8, PAGE // 8, W):
            tl.store(dst.to(tl.pointer_type(tl.int64)) + k + w, tl.zeros([W], tl.int64),
                     mask=(k + w >= words) & (8 * (k + w) < end))
    else:
        j = tl.arange(0, CHUNK)
        for k in range(F, PAGE, CHUNK):
            tl.store(dst + k + j, tl.zeros([CHUNK], tl.uint8),
                     mask=(k + j >= size) & (k + j < end))


@triton.jit
def _exp_encode_kernel(pages_ptr, payload_ptr, sizes_ptr, kinds_ptr, PAGE: tl.constexpr,
                       FP16: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr = False):
    """Program ``i`` stores page ``i`` (``pages[i]``, ``PAGE / 2`` values; with ``ROWS``, the
    ``PAGE`` bytes at address ``pages[i]``) into ``payload[i]`` (the whole row: the bytes past
    its size zeroed) and sets ``sizes[i]`` and ``kinds[i]``: FILL for a page of equal bytes,
    RAW where the EXP page would pass ``PAGE - PAGE/32`` bytes, else EXP.

    A page of one step (``CHUNK == PAGE / 2``: 4 KiB pages on the GPU) is read once and kept
    in registers, and a bf16 page's table comes from 32 bins (:func:`_window_table`); a
    longer page is read three times (its sample, then its escapes, then its stores), its
    table from all 256 (32 for fp16) exponents of its sample."""
    _encode_page(pages_ptr, payload_ptr, sizes_ptr, kinds_ptr, sizes_ptr, sizes_ptr, PAGE, FP16,
                 CHUNK, ROWS, False)


@triton.jit
def _exp_encode_placed_kernel(pages_ptr, payload_ptr, sizes_ptr, kinds_ptr, rel_ptr, end_ptr,
                              PAGE: tl.constexpr, FP16: tl.constexpr, CHUNK: tl.constexpr,
                              ROWS: tl.constexpr = False):
    """:func:`_exp_encode_kernel` with the pages end to end: program ``i`` takes its page's
    stored bytes, padded to ``PLACE_ALIGN``, at ``payload`` byte ``end`` (an ``int64``
    counter, raised by that many with one atomic add), stores that offset in ``rel[i]`` and
    zeroes its padding. Pages land in the order their programs reach the add; the sum of the
    padded sizes, never more than ``N * PAGE``, is left in ``end``. For the copy engine: one
    copy of ``end`` bytes moves a slice's pages, with no kernel between the compress and the
    copy (``torch_pagecomp.offload._paged``)."""
    _encode_page(pages_ptr, payload_ptr, sizes_ptr, kinds_ptr, rel_ptr, end_ptr, PAGE, FP16,
                 CHUNK, ROWS, True)


@triton.jit
def _encode_page(pages_ptr, payload_ptr, sizes_ptr, kinds_ptr, rel_ptr, end_ptr,
                 PAGE: tl.constexpr, FP16: tl.constexpr, CHUNK: tl.constexpr,
                 ROWS: tl.constexpr, PLACED: tl.constexpr):
    """Both encoders' body: the page of program ``i`` at its fixed-stride row or, with
    ``PLACED``, where the atomic add on ``end`` puts it (it knows its size before it writes)."""
    pid = tl.program_id(0).to(tl.int64)
    N: tl.constexpr = PAGE // 2
    F: tl.constexpr = 7 + (1 + FP16) * (3 * N // 8) + N  # format.exp_fixed_bytes
    src = _row(pages_ptr, pid, PAGE, ROWS)
    if ROWS:  # each row where its table entry says
        src_aligned = (src.to(tl.int64, bitcast=True) & 1) == 0
    else:  # rows are PAGE apart, so aligned as the first (folded for 16-aligned tensors)
        src_aligned = (pages_ptr.to(tl.int64, bitcast=True) & 1) == 0
    dst_aligned = (payload_ptr.to(tl.int64, bitcast=True) & 1) == 0
    first = tl.load(src).to(tl.int32) * 257  # the value of a page of equal bytes
    i = _rows(CHUNK)
    if CHUNK == N:  # read once, kept in registers: the codes and escapes known before a store
        v = _load_values(src, i, src_aligned)
        if FP16:  # 32 exponents: all of them counted
            k0, k1, k2, k3, k4, k5, k6 = _full_table(src, src_aligned, PAGE, True, CHUNK)
        else:
            k0, k1, k2, k3, k4, k5, k6 = _window_table(src, src_aligned, PAGE, CHUNK)
        by_exp = _code_table(k0, k1, k2, k3, k4, k5, k6, FP16)
        e, _, _ = _split(v, FP16)
        code = _code_of(by_exp, e, CHUNK)
        # (the same sums _write_codes takes: computed once)
        n_esc = tl.sum(_row_escapes(code, _pack3(code), FP16), axis=0)
        # equal bytes share one exponent: only a page whose sample is all one exponent is
        # compared value by value (a compare a value on every page cost integer operations,
        # which bound this kernel)
        fill = False
        if (k0 >> 8) == N // _SAMPLE:
            fill = tl.max(tl.max((v != first).to(tl.int32), axis=1), axis=0) == 0
    else:  # the sample, then a pass for equal bytes and the escapes, then one that stores
        k0, k1, k2, k3, k4, k5, k6 = _full_table(src, src_aligned, PAGE, FP16, CHUNK)
        by_exp = _code_table(k0, k1, k2, k3, k4, k5, k6, FP16)
        differ = tl.zeros([CHUNK // 8, 8], tl.int32)
        escaped = tl.zeros([CHUNK // 8, 8], tl.int32)
        for c in range(0, N, CHUNK):
            v = _load_values(src, c + i, src_aligned)
            differ |= (v != first).to(tl.int32)
            e, _, _ = _split(v, FP16)
            escaped += (_code_of(by_exp, e, CHUNK) == 7).to(tl.int32)
        fill = tl.max(tl.max(differ, axis=1), axis=0) == 0
        n_esc = tl.sum(tl.sum(escaped, axis=1), axis=0)
    exp_size = F + n_esc  # the fixed part and one byte per escape
    raw = exp_size > PAGE - PAGE // 32
    EXP_KIND: tl.constexpr = _EXP | ((1 + FP16) << 4)  # layouts: bf16 1, fp16 2
    size = tl.where(fill, 1, tl.where(raw, PAGE, exp_size))
    kind = tl.where(fill, _FILL, tl.where(raw, _RAW, EXP_KIND))
    if PLACED:  # the padded size, then where it goes (payload is PLACE_ALIGN-aligned)
        end = (size + (_PLACE_ALIGN - 1)) // _PLACE_ALIGN * _PLACE_ALIGN
        at = tl.atomic_add(end_ptr, end.to(tl.int64))
        tl.store(rel_ptr + pid, at)
        dst = payload_ptr + at
    else:
        end = PAGE
        dst = payload_ptr + pid * PAGE
    if fill and PLACED:  # its padded size only: value b at byte 0, zeros after
        j = tl.arange(0, _PLACE_ALIGN)
        tl.store(dst + j, tl.where(j == 0, tl.load(src), 0).to(tl.uint8))
    elif fill:
        b = tl.load(src).to(tl.int32)  # value b at byte 0 (little-endian), zeros after
        for c in range(0, N, CHUNK):
            _store_values(dst, c + i, tl.where(c + i == 0, b, 0), dst_aligned)
    elif raw:
        for c in range(0, N, CHUNK):
            _store_values(dst, c + i, _load_values(src, c + i, src_aligned), dst_aligned)
    else:
        slots = tl.arange(0, 8)
        table = tl.where(slots == 0, k0, tl.where(slots == 1, k1, tl.where(
            slots == 2, k2, tl.where(slots == 3, k3, tl.where(slots == 4, k4, tl.where(
                slots == 5, k5, k6))))))
        tl.store(dst + slots, _exponent(table).to(tl.uint8), mask=slots < 7)
        if CHUNK == N:
            _write_codes(dst, 0, v, code, 0, PAGE, FP16, CHUNK)
        else:
            escapes = tl.zeros([], tl.int32)
            for c in range(0, N, CHUNK):
                v = _load_values(src, c + i, src_aligned)
                e, _, _ = _split(v, FP16)
                escapes = _write_codes(dst, c, v, _code_of(by_exp, e, CHUNK), escapes, PAGE,
                                       FP16, CHUNK)
        _zero_tail(dst, exp_size, end, PAGE, F, CHUNK)
    tl.store(sizes_ptr + pid, size)
    tl.store(kinds_ptr + pid, kind.to(tl.uint8))


def compress_exp_pages(pages: torch.Tensor, fp16: bool, traced: bool = True,
                       out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exponent-code pages of 16-bit floats on ``pages``' device (no host synchronisation).

    Args:
        pages: ``uint8 [N, P]``, contiguous, each row ``P / 2`` little-endian bf16 (``fp16``
            False) or fp16 values; ``P`` a power of two from 4096 to 65536.
        fp16: the layout: fp16 (True) or bf16 (False).
        traced: ``False`` launches directly (eager callers outside the ops; see
            ``torch_pagecomp.kernels.launch``).
        out: the three outputs to write (contiguous, shaped as returned), e.g. views of a
            caller's buffers; new tensors by default.
    Returns:
        Fixed-stride ``(payload uint8 [N, P], sizes int32 [N], kinds uint8 [N])``, bytes past
        each page's size zero.
    """
    n, page_size = pages.shape
    page_size = int(page_size)  # traced with dynamic shapes: specialised (compiled in anyway)
    if not fmt.valid_page_size(page_size):
        raise ValueError(f"page size must be a power of two from 4096 to 65536, got {page_size}")
    if out is None:
        out = (torch.empty_like(pages), torch.empty(n, dtype=torch.int32, device=pages.device),
               torch.empty(n, dtype=torch.uint8, device=pages.device))
    payload, sizes, kinds = out
    if n:
        launch(_exp_encode_kernel, (n,), pages.device, (pages, payload, sizes, kinds),
               encode_config(page_size, fp16).meta(), traced)
    return payload, sizes, kinds


def compress_exp_rows(rows: torch.Tensor, page_size: int, fp16: bool,
                      out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """:func:`compress_exp_pages` with each page read from its address: the pages of many
    tensors stored by one launch without joining them first (the activation store's batches).

    Args:
        rows: ``int64 [N]`` on the GPU, the address of page ``i`` (``page_size`` bytes of
            16-bit floats inside a live ``uint8`` tensor the caller keeps until the kernel has
            run); any alignment (an odd address takes the byte-pair path).
        page_size: a power of two from 4096 to 65536.
        fp16: the layout: fp16 (True) or bf16 (False).
        out: ``(payload uint8 [N, page_size], sizes int32 [N], kinds uint8 [N])``, written as
            :func:`compress_exp_pages` writes them.

    Launches directly (callers outside the ops only: the addresses are not traceable)."""
    n = check_rows(rows, page_size)
    if n:
        launch(_exp_encode_kernel, (n,), rows.device, (rows, *out),
               _encode_rows_meta(page_size, fp16, interpreting()), traced=False)


def compress_exp_placed(pages: torch.Tensor, fp16: bool, out: tuple[torch.Tensor, ...],
                        page_size: int | None = None) -> None:
    """Exponent-code pages end to end (``_exp_encode_placed_kernel``) on ``pages``' device.

    Args:
        pages: ``uint8 [N, P]`` contiguous rows of 16-bit floats, or an ``int64 [N]`` table
            of their addresses (as :func:`compress_exp_rows`; then ``page_size`` gives ``P``).
        fp16: the layout: fp16 (True) or bf16 (False).
        out: ``(payload uint8 [>= N * P], sizes int32 [N], kinds uint8 [N], rel int64 [N],
            end int64 [1])``: ``payload`` ``PLACE_ALIGN``-aligned; ``end`` holds the byte the
            first page goes to (0 for a fresh payload) and is raised past every page;
            page ``i`` lies at ``payload[rel[i]:rel[i] + sizes[i]]``, zeros to the next
            multiple of ``PLACE_ALIGN``. Bytes past the pages are not written.

    Launches directly (callers outside the ops only: the page order is not deterministic)."""
    rows = pages.dtype == torch.int64
    if rows:
        n = check_rows(pages, page_size)
    else:
        n, page_size = pages.shape
    payload = out[0]
    if not fmt.valid_page_size(page_size):
        raise ValueError(f"page size must be a power of two from 4096 to 65536, got {page_size}")
    if payload.numel() < n * page_size or payload.data_ptr() % PLACE_ALIGN:
        raise ValueError(f"the payload must hold {n * page_size} bytes from a "
                         f"{PLACE_ALIGN}-byte aligned address")
    if n:
        cfg = _encode_config(page_size, fp16, interpreting())
        meta = (dataclasses.replace(cfg, ROWS=True) if rows else cfg).meta()
        launch(_exp_encode_placed_kernel, (n,), payload.device, (pages, *out), meta,
               traced=False)


def compress_exp_placed_at(index: int, n: int, page_size: int, fp16: bool, rows: bool,
                           addrs: tuple, args) -> None:
    """:func:`compress_exp_placed` given the addresses of ``(pages, payload, sizes, kinds,
    rel, end)`` on CUDA device ``index``, without its checks (``rows``: ``pages`` is a row
    table): for the activation store, which cuts its metadata buffer by address; ``args``:
    the tensors (or a function that makes them), used only when the launch goes the usual
    way (``launch.launch_known``)."""
    classes = placed_encode_classes(addrs)
    if rows:
        classes = (ptr_class(torch.int64, addrs[0]),) + classes[1:]
    meta = (_encode_rows_meta(page_size, fp16, interpreting()) if rows
            else _frozen_encode_meta(page_size, fp16, interpreting()))
    launch_known(_exp_encode_placed_kernel, (n,), index, meta, classes, addrs, args)


@functools.cache
def _encode_rows_meta(page_size: int, fp16: bool, interpret: bool):
    return dataclasses.replace(_encode_config(page_size, fp16, interpret), ROWS=True).meta()


def placed_encode_launch(page_size: int, fp16: bool) -> tuple:
    """``(kernel, settings)`` of :func:`compress_exp_placed_at`'s launch (pages, not a row
    table), for a caller that keeps its compiled entry (``launch.launch_cached``)."""
    return _exp_encode_placed_kernel, _frozen_encode_meta(page_size, fp16, interpreting())


def placed_encode_classes(addrs: tuple) -> tuple:
    """The argument classes of :func:`compress_exp_placed_at`'s launch of pages at the
    addresses ``addrs`` (``launch.known_args``' rule)."""
    return (ptr_class(torch.uint8, addrs[0]), ptr_class(torch.uint8, addrs[1]),
            ptr_class(torch.int32, addrs[2]), ptr_class(torch.uint8, addrs[3]),
            ptr_class(torch.int64, addrs[4]), ptr_class(torch.int64, addrs[5]))


def encode_launch(page_size: int, fp16: bool) -> tuple:
    """``(kernel, settings)`` of :func:`compress_exp_pages`' launch, for a caller that keeps
    its compiled entry (``launch.kept_entry``)."""
    return _exp_encode_kernel, _frozen_encode_meta(page_size, fp16, interpreting())


@functools.cache
def _frozen_encode_meta(page_size: int, fp16: bool, interpret: bool):
    return _encode_config(page_size, fp16, interpret).meta()


# ------------------------------------------------------------------------------- decode
@triton.jit
def _exp_page_meta(offsets_ptr, sizes_ptr, kinds_ptr, pid, total, PAGE: tl.constexpr):
    """``(off int64, size int32, kind int32, status)`` of page ``pid`` for this decoder:
    BAD_KIND unless RAW / FILL (high nibble 0) or EXP of layout bf16 / fp16; BAD_SIZE where
    ``[off, off + size)`` leaves the payload (``total`` bytes) or the size is not one the kind
    allows (RAW ``PAGE``, FILL 1, EXP ``F .. PAGE - PAGE/32``); else OK."""
    off, size, kind, bad_size = _plain_meta(offsets_ptr, sizes_ptr, kinds_ptr, pid, total, PAGE)
    codec = kind & 15
    layout = kind >> 4
    plain = ((codec == _RAW) | (codec == _FILL)) & (layout == 0)
    exp = (codec == _EXP) & ((layout == _BF16) | (layout == _FP16))
    N: tl.constexpr = PAGE // 2
    least = tl.where(layout == _FP16, 7 + 6 * N // 8 + N, 7 + 3 * N // 8 + N)  # F
    bad_size |= exp & ((size < least) | (size > PAGE - PAGE // 32))
    st = tl.where(~(plain | exp), _BAD_KIND, tl.where(bad_size, _BAD_SIZE, _OK))
    return off, size, kind, st


@triton.jit
def _table(src):
    """The page's 7 table entries (its first 7 bytes) as one ``int64``, a byte an entry, byte
    7 zero (code 7, an escape: see :func:`_decode_step`). Scalar loads: every thread reads
    the same bytes, and no reduction crosses the threads."""
    lo = (tl.load(src).to(tl.int32) | (tl.load(src + 1).to(tl.int32) << 8)
          | (tl.load(src + 2).to(tl.int32) << 16) | (tl.load(src + 3).to(tl.int32) << 24))
    hi = (tl.load(src + 4).to(tl.int32) | (tl.load(src + 5).to(tl.int32) << 8)
          | (tl.load(src + 6).to(tl.int32) << 16))
    return (lo.to(tl.int64) & 0xFFFFFFFF) | (hi.to(tl.int64) << 32)


@triton.jit
def _value(rest_at, word8, high, t: tl.constexpr, table, m, second, at, FP16: tl.constexpr,
           FEW: tl.constexpr):
    """``(value t of each row, where the row's next escape is)``. Its code is field ``t`` of
    the row's group (``word8``: :func:`_groups` shifted left by 3, so a field is 8 times the
    code) and its exponent byte ``code`` of the row's ``table`` (:func:`_decode_step`), whose
    byte 7 is the row's first escape. With ``FEW`` (no row has more than two) an escape with
    one before it in the row (``m``: :func:`_escape_bits`) is the row's ``second``; else
    every escape is read at ``at``, which moves on by one. Its rest byte is at
    ``rest_at + t``; (fp16) its high bits are field ``t`` of ``high``."""
    at8 = (word8 >> (3 * t)) & 56  # 8 times the code: where its entry lies in ``table``
    e = ((table >> at8.to(tl.int64)) & 255).to(tl.int32)
    if FEW:
        if t > 0:
            e = tl.where((at8 == 56) & ((m & ((1 << (3 * t)) - 1)) != 0), second, e)
    else:
        esc = at8 == 56
        e = tl.where(esc, tl.load(at, mask=esc, other=0).to(tl.int32), e)
        at += esc.to(tl.int32)
    rest = tl.load(rest_at + t).to(tl.int32)
    if FP16:  # exponents are 5 bits: the low 5 of a table or escape byte
        return _join(e & 31, rest, (high >> (3 * t)) & 7, FP16), at
    return _join(e, rest, rest, FP16), at


@triton.jit
def _decode_step(src, c, row, aligned, word, cnt, first, table, PAGE: tl.constexpr,
                 FP16: tl.constexpr, CHUNK: tl.constexpr, FEW: tl.constexpr):
    """Rebuild values ``c .. c + CHUNK`` of an EXP page whose size was checked, a row of 8
    values a thread (``word``: their code groups, ``cnt``: each group's escapes, ``first``:
    where each row's escapes start). Escapes are about 3% of the values of real bf16 pages:
    with ``FEW`` (no row has more than two, most pages) a row's first and second escapes are
    loaded once for the row, the first looked up as code 7 in the row's copy of ``table``;
    else each escape is loaded on its own (an address, a load and a select a value: that
    path's block has about 1.7x the instructions of the other, ``bench.dev_sass``)."""
    N: tl.constexpr = PAGE // 2
    F: tl.constexpr = 7 + (1 + FP16) * (3 * N // 8) + N  # format.exp_fixed_bytes
    g = tl.arange(0, CHUNK // 8)
    rest_at = src + (F - N) + c + 8 * g
    high = word
    if FP16:
        high = _groups(src + 7 + 3 * N // 8, c, CHUNK)
    m = _escape_bits(word)
    second = tl.load(first + 1, mask=cnt > 1, other=0).to(tl.int32)
    table = table | (tl.load(first, mask=cnt > 0, other=0).to(tl.int64) << 56)
    at = first
    word8 = word << 3
    v0, at = _value(rest_at, word8, high, 0, table, m, second, at, FP16, FEW)
    v1, at = _value(rest_at, word8, high, 1, table, m, second, at, FP16, FEW)
    v2, at = _value(rest_at, word8, high, 2, table, m, second, at, FP16, FEW)
    v3, at = _value(rest_at, word8, high, 3, table, m, second, at, FP16, FEW)
    v4, at = _value(rest_at, word8, high, 4, table, m, second, at, FP16, FEW)
    v5, at = _value(rest_at, word8, high, 5, table, m, second, at, FP16, FEW)
    v6, at = _value(rest_at, word8, high, 6, table, m, second, at, FP16, FEW)
    v7, at = _value(rest_at, word8, high, 7, table, m, second, at, FP16, FEW)
    _store_values(row, c + 8 * g[:, None] + tl.arange(0, 8)[None, :],
                  _join8(v0, v1, v2, v3, v4, v5, v6, v7), aligned)


@triton.jit
def _escape_sums(word):
    """``(each group's escapes, their sum plus 65536 for each group of more than two)``:
    both from one reduction."""
    cnt = _escape_counts(word)
    return cnt, tl.sum(cnt + tl.where(cnt > 2, 65536, 0), axis=0)


@triton.jit
def _decode_groups(src, c, row, aligned, word, cnt, sums, table, done, PAGE: tl.constexpr,
                   FP16: tl.constexpr, CHUNK: tl.constexpr):
    """:func:`_decode_step` of values ``c .. c + CHUNK`` (``cnt``, ``sums``:
    :func:`_escape_sums`) after ``done`` escapes; returns the escapes read so far."""
    N: tl.constexpr = PAGE // 2
    F: tl.constexpr = 7 + (1 + FP16) * (3 * N // 8) + N  # format.exp_fixed_bytes
    first = src + F + done + tl.cumsum(cnt, axis=0) - cnt  # each row's first escape
    if sums < 65536:
        _decode_step(src, c, row, aligned, word, cnt, first, table, PAGE, FP16, CHUNK, True)
    else:
        _decode_step(src, c, row, aligned, word, cnt, first, table, PAGE, FP16, CHUNK, False)
    return done + (sums & 65535)


@triton.jit
def _decode_exp_page(src, size, row, aligned, PAGE: tl.constexpr, FP16: tl.constexpr,
                     CHUNK: tl.constexpr):
    """Decode the EXP page at ``src`` (``size`` bytes, ``F <= size <= PAGE - PAGE/32``, all
    inside the payload) into the row at ``row``; returns its status: BAD_SIZE (nothing
    stored) unless ``size`` is ``F`` plus the escapes its codes count. A page of one step
    (4 KiB on the GPU) loads its codes once, for the count and the values."""
    N: tl.constexpr = PAGE // 2
    F: tl.constexpr = 7 + (1 + FP16) * (3 * N // 8) + N  # format.exp_fixed_bytes
    table = _table(src)
    if CHUNK == N:
        word = _groups(src + 7, 0, CHUNK)  # the codes lie in the fixed part: inside the page
        cnt, sums = _escape_sums(word)
        st = tl.where(size == F + (sums & 65535), _OK, _BAD_SIZE)
        if st == 0:  # the escapes end at the page's size: every load below is inside it
            _decode_groups(src, 0, row, aligned, word, cnt, sums, table, 0, PAGE, FP16, CHUNK)
    else:
        escapes = tl.zeros([], tl.int32)
        for c in range(0, N, CHUNK):
            escapes += tl.sum(_escape_counts(_groups(src + 7, c, CHUNK)), axis=0)
        st = tl.where(size == F + escapes, _OK, _BAD_SIZE)
        if st == 0:
            done = tl.zeros([], tl.int32)  # escapes read so far
            for c in range(0, N, CHUNK):
                word = _groups(src + 7, c, CHUNK)
                cnt, sums = _escape_sums(word)
                done = _decode_groups(src, c, row, aligned, word, cnt, sums, table, done, PAGE,
                                      FP16, CHUNK)
    return st


@triton.jit
def _exp_decode_kernel(payload_ptr, offsets_ptr, sizes_ptr, kinds_ptr, pages_ptr, status_ptr,
                       total, PAGE: tl.constexpr, CHUNK: tl.constexpr,
                       RAW_BYTES: tl.constexpr, ROWS: tl.constexpr = False):
    """Program ``i`` decodes page ``i`` (RAW, FILL or EXP; anything else BAD_KIND) into
    ``pages[i]`` (``uint8 [PAGE]``; with ``ROWS``, the ``PAGE`` bytes at address ``pages[i]``,
    as the LZ4 decoder's ``_row``) and sets ``status[i]``; a failed page's row is zeroed."""
    pid = tl.program_id(0)
    off, size, kind, st = _exp_page_meta(offsets_ptr, sizes_ptr, kinds_ptr, pid, total, PAGE)
    codec = kind & 15
    src = payload_ptr + tl.where(st == 0, off, 0)
    row = _row(pages_ptr, pid, PAGE, ROWS)
    if ROWS:  # each row where its table entry says: 16-bit words only at an even address
        aligned = (row.to(tl.int64, bitcast=True) & 1) == 0
    else:  # rows are PAGE apart, so aligned as the first (folded for 16-aligned outputs)
        aligned = (pages_ptr.to(tl.int64, bitcast=True) & 1) == 0
    if st == 0:
        if codec == _EXP:
            if (kind >> 4) == _FP16:
                st = _decode_exp_page(src, size, row, aligned, PAGE, True, CHUNK)
            else:
                st = _decode_exp_page(src, size, row, aligned, PAGE, False, CHUNK)
        else:
            _store_plain_page(payload_ptr, off, codec == _RAW, row, PAGE, RAW_BYTES)
    if st != 0:
        _zero_row(row, PAGE, RAW_BYTES)  # the LZ4 decoder's: after any partial store
    tl.store(status_ptr + pid, st)


def decompress_exp_into(payload: torch.Tensor, offsets: torch.Tensor | None, sizes: torch.Tensor,
                        kinds: torch.Tensor, pages: torch.Tensor, status: torch.Tensor, *,
                        traced: bool = True) -> None:
    """Decode ``N`` stored RAW, FILL and EXP pages into caller-provided outputs, on
    ``payload``'s device and current stream (no host synchronisation).

    Args:
        payload: ``uint8 [T]``, a fixed-stride payload viewed flat or a packed one.
        offsets: ``int64 [N]``, start of page ``i`` in ``payload``; ``None`` for a
            fixed-stride payload (page ``i`` at ``i * P``).
        sizes: ``int32 [N]``, stored bytes of page ``i``.
        kinds: ``uint8 [N]``, page kinds (``torch_pagecomp.format``; LZ4 pages are BAD_KIND).
        pages: ``uint8 [N, P]`` output, rows contiguous; ``P`` a power of two from 4096 to
            65536. A failed page's row is zeroed.
        status: ``int32 [N]`` output, ``STATUS_OK`` (0) or the failure of page ``i``.
        traced: ``False`` launches directly (see ``torch_pagecomp.kernels.launch``).
    """
    n, page_size = pages.shape
    page_size = int(page_size)  # traced with dynamic shapes: specialised (compiled in anyway)
    if not fmt.valid_page_size(page_size):
        raise ValueError(f"page size must be a power of two from 4096 to 65536, got {page_size}")
    if n:
        launch(_exp_decode_kernel, (n,), payload.device,
               (payload, offsets, sizes, kinds, pages, status, payload.numel()),
               decode_config(page_size).meta(), traced)


def decompress_exp_rows(payload: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor,
                        kinds: torch.Tensor, rows: torch.Tensor, page_size: int,
                        status: torch.Tensor) -> None:
    """:func:`decompress_exp_into` with each page's output row given by address: many
    tensors' pages decoded by one launch, each into its own allocation. Arguments as for the
    LZ4 decoder's ``decompress_rows`` (``rows``: ``int64 [N]``, the address of page ``i``'s
    output row inside a live ``uint8`` tensor the caller keeps until the decode has run; rows
    must not overlap). A row may start at any address (an odd one takes the byte-pair path).
    Launches directly (callers outside the ops only: the addresses are not traceable)."""
    n = check_rows(rows, page_size)
    if n == 0:
        return
    launch(_exp_decode_kernel, (n,), payload.device,
           (payload, offsets, sizes, kinds, rows, status, payload.numel()),
           _row_config(page_size, interpreting()).meta(), traced=False)


def decompress_exp_into_known(payload: torch.Tensor, offsets: torch.Tensor | None,
                              sizes: torch.Tensor, kinds: torch.Tensor, pages: torch.Tensor,
                              status: torch.Tensor) -> None:
    """:func:`decompress_exp_into` (``traced=False``) for the activation store's hot path
    (``N >= 1``, CUDA tensors on the current device), without its checks
    (``launch.launch_known``)."""
    for kernel, meta in into_launches(pages.shape[1]):
        decode_known(kernel, meta, payload, offsets, sizes, kinds, pages, status)


def into_launches(page_size: int) -> tuple:
    """The ``(kernel, settings)`` of :func:`decompress_exp_into`'s launches (one), for
    callers that launch them by known classes or keep their compiled entries."""
    return ((_exp_decode_kernel, _known_meta(page_size, False, interpreting())),)


def decompress_exp_rows_known(payload: torch.Tensor, offsets: torch.Tensor | None,
                              sizes: torch.Tensor, kinds: torch.Tensor, rows: torch.Tensor,
                              page_size: int, status: torch.Tensor) -> None:
    """:func:`decompress_exp_rows` for the activation store's hot path (``N >= 1``), without
    its checks (``launch.launch_known``)."""
    decode_known(_exp_decode_kernel, _known_meta(page_size, True, interpreting()), payload,
                 offsets, sizes, kinds, rows, status)


def decompress_exp_rows_at(index: int, page_size: int, n: int, addrs: tuple, total: int,
                           args) -> None:
    """:func:`decompress_exp_rows_known` given addresses (``lz4_decompress.decode_rows_at``)."""
    decode_rows_at(_exp_decode_kernel, _known_meta(page_size, True, interpreting()), index, n,
                   addrs, total, args)


def decompress_exp_into_at(index: int, page_size: int, n: int, addrs: tuple, total: int,
                           args) -> None:
    """:func:`decompress_exp_into_known` given addresses
    (``lz4_decompress.decompress_into_at``)."""
    decode_rows_at(_exp_decode_kernel, _known_meta(page_size, False, interpreting()), index, n,
                   addrs, total, args, rows=False)


@functools.cache
def _known_meta(page_size: int, rows: bool, interpret: bool):
    # the settings the usual launchers pick (the interpreter's under TRITON_INTERPRET=1)
    return (_row_config if rows else _decode_config)(page_size, interpret).meta()


def decompress_exp_pages(payload: torch.Tensor, offsets: torch.Tensor | None, sizes: torch.Tensor,
                         kinds: torch.Tensor, page_size: int, traced: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decompress_exp_into` into new outputs: ``(pages uint8 [N, P], status int32
    [N])``; a failed page (status != 0) is all zeros."""
    n = sizes.shape[0]
    pages = torch.empty((n, page_size), dtype=torch.uint8, device=payload.device)
    status = torch.empty((n,), dtype=torch.int32, device=payload.device)
    decompress_exp_into(payload, offsets, sizes, kinds, pages, status, traced=traced)
    return pages, status
