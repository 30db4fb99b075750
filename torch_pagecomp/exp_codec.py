"""The exponent codec for pages of 16-bit floats: its numpy reference (the CPU path).

An exponent page (``KIND_EXP``, layouts bf16 and fp16; ``torch_pagecomp.format`` describes it
bit for bit) stores each value's exponent as a 3-bit index into a table of 7 exponents, the most
frequent among a quarter of the page's values (index 7 escapes to a byte of its own), and the
value's other bits as they are. Real bf16 tensors (activations, weights, KV caches) spend most
of a value's entropy in the sign and mantissa and little in the exponent (2.2-2.6 bits of 8:
``bench/results/cpu_exponent_probe.md``), so the fixed code stores 1.42-1.44x where LZ4 on
bit-shuffled pages stores 1.22-1.38x, and needs no match search (``triton_kernels/exp_codec.py``).

The Triton kernels (``torch_pagecomp.kernels.exp_codec``) write the same bytes, sizes, kinds
and statuses (``tests/test_exp_codec.py``). This module is the readable definition: whole
batches as numpy arrays, a few MiB of pages a step. Where the C extension is built
(``torch_pagecomp._native``: ``exp_encode_pages`` / ``exp_decode_pages``), :func:`compress_exp_cpu`
and :func:`decompress_exp_cpu` run its page loops instead (the GIL released, ranges of pages on
``cpu_codec``'s threads), bit for bit the numpy code's output (``tests/test_exp_codec_native.py``);
``native=False`` runs the numpy reference, which stays the fallback without a compiler.
"""

from __future__ import annotations

import numpy as np
import torch

from . import format as fmt
from .cpu_codec import (
    _SHARED_RANGES,
    _native,
    _run_ranges,
    compressed_empty,
    fill_rows,
    pages_empty,
    stride_offsets,
)

# The C page loops where the extension is built (else the numpy reference: the same bytes and
# statuses, 13-35x slower); an extension built before the exponent loops took their ranges from
# a shared counter is not used for them.
NATIVE = _native is not None and hasattr(_native, "exp_encode_pages") and _SHARED_RANGES
# ... whose loops take 16 values a step (SSE2, x86; other CPUs' loops are scalar): there the
# codec codes and decodes bf16 as fast as LZ4 + bit-shuffle on the host while storing 3-9%
# less (bench/results/cpu2_7081f35_auto), so a CPU ``PageCompressor(codec="auto")`` takes it
# for bf16. Not for fp16: on full fp16 mantissas it stores 1.13 where LZ4's near-raw pages
# store 1.06 and decode 1.6x faster (bench/results/cpu2_a0189a2_fp16)
FAST_BF16 = NATIVE and hasattr(_native, "exp_lookup")


def host_auto_format(float_format: str | None) -> str | None:
    """What ``codec="auto"`` codes host pages of ``float_format`` with (``"bf16"`` /
    ``"fp16"``: what they hold, or None): the exponent codec's layout for bf16 where the C
    loops are SIMD (:data:`FAST_BF16`), else None, LZ4 + bit-shuffle. The rule of a CPU
    ``PageCompressor`` and of a KV cache's CPU store."""
    return float_format if float_format == "bf16" and FAST_BF16 else None

# Where each layout's fields sit in a value ``v`` (``uint16``); see ``format``.
LAYOUTS = {"bf16": fmt.EXP_BF16, "fp16": fmt.EXP_FP16}
_BINS = {fmt.EXP_BF16: 256, fmt.EXP_FP16: 32}  # possible exponent values
_STEP_BYTES = 4 << 20  # pages per numpy step: bounds the temporaries (int64 per value)


def layout_code(float_format: str) -> int:
    """The high nibble of an exponent page's kind for ``"bf16"`` or ``"fp16"``."""
    if float_format not in LAYOUTS:
        raise fmt.PageCompError(
            f"the exponent codec codes 'bf16' or 'fp16' values, got {float_format!r}")
    return LAYOUTS[float_format]


def split_values(v: np.ndarray, layout: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``int [..., n]`` 16-bit values -> ``(exponent, rest byte, high 3 bits or None)``.

    bf16: exponent ``(v >> 7) & 255``, rest ``sign << 7 | mantissa`` (7 bits), no high bits.
    fp16: exponent ``(v >> 10) & 31``, rest the mantissa's low byte, high bits
    ``sign << 2 | mantissa bits 9..8``."""
    if layout == fmt.EXP_BF16:
        return (v >> 7) & 255, ((v >> 8) & 0x80) | (v & 0x7F), None
    return (v >> 10) & 31, v & 0xFF, ((v >> 13) & 4) | ((v >> 8) & 3)


def join_values(e: np.ndarray, rest: np.ndarray, high: np.ndarray | None,
                layout: int) -> np.ndarray:
    """Inverse of :func:`split_values` (``int64`` values)."""
    if layout == fmt.EXP_BF16:
        return ((rest & 0x80) << 8) | (e << 7) | (rest & 0x7F)
    return ((high & 4) << 13) | (e << 10) | ((high & 3) << 8) | rest


def pack3(x: np.ndarray) -> np.ndarray:
    """``int [k, n]`` 3-bit fields -> ``uint8 [k, 3n/8]``: 8 fields to a 3-byte little-endian
    group, field ``i`` at bits ``3i .. 3i + 2`` of the stream."""
    k, n = x.shape
    word = (x.reshape(k, n // 8, 8).astype(np.int64) << (3 * np.arange(8))).sum(axis=2)
    return np.stack([word & 255, (word >> 8) & 255, word >> 16], axis=2) \
        .reshape(k, 3 * n // 8).astype(np.uint8)


def unpack3(b: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack3`: ``uint8 [k, 3n/8]`` -> ``int64 [k, n]``."""
    k = b.shape[0]
    g = b.astype(np.int64).reshape(k, b.shape[1] // 3, 3)
    word = g[..., 0] | (g[..., 1] << 8) | (g[..., 2] << 16)
    return ((word[..., None] >> (3 * np.arange(8))) & 7).reshape(k, -1)


def sampled(e: np.ndarray) -> np.ndarray:
    """The values of ``e`` (``[k, n]``, a page a row) whose exponents the table counts: one
    row of 8 in ``format.EXP_SAMPLE``, values ``32j .. 32j + 7`` of each page."""
    k, n = e.shape
    return e.reshape(k, n // (8 * fmt.EXP_SAMPLE), 8 * fmt.EXP_SAMPLE)[:, :, :8].reshape(k, -1)


def _table_and_codes(e: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Per page (row of ``e``): the table (``int64 [k, 7]``: exponents by count among the
    sampled values (:func:`sampled`) descending, then by value ascending) and each value's
    code (``int64 [k, n]``, 7 = escape)."""
    k = e.shape[0]
    counts = np.bincount((np.arange(k)[:, None] * bins + sampled(e)).ravel(),
                         minlength=k * bins)
    # a stable sort of -count keeps equal counts in exponent order
    table = np.argsort(-counts.reshape(k, bins), axis=1, kind="stable")[:, :fmt.EXP_TABLE]
    code = np.full(e.shape, fmt.EXP_TABLE, dtype=np.int64)
    for t in range(fmt.EXP_TABLE):  # table entries differ: each value matches one at most
        code[e == table[:, t:t + 1]] = t
    return table, code


def compress_exp_cpu(pages: torch.Tensor, layout: int, native: bool = True,
                     out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exponent-code pages of 16-bit floats.

    Args:
        pages: ``uint8 [N, P]`` on the CPU, each row ``P / 2`` little-endian values.
        layout: ``format.EXP_BF16`` or ``format.EXP_FP16``.
        native: use the C loops (``_native.exp_encode_pages``) where built and ``P`` is a
            valid page size; ``False``: the numpy reference (the same output).
        out: ``(payload, sizes, kinds)``, contiguous CPU tensors of the shapes returned, to
            write the outputs into (the C loops write them in place), or None.
    Returns:
        Fixed-stride ``(payload uint8 [N, P], sizes int32 [N], kinds uint8 [N])`` (``out``'s
        tensors when given): FILL for an all-equal page, RAW where the exponent page would
        exceed ``P - P/32`` bytes, else ``KIND_EXP | layout << 4``; bytes past a page's size
        are zero.
    """
    n_pages, page_size = pages.shape
    if native and NATIVE and pages.dtype == torch.uint8 and fmt.valid_page_size(page_size):
        return _compress_exp_native(pages, layout, out)
    if out is not None:  # the numpy reference builds its own arrays
        return tuple(o.copy_(t) for o, t in zip(out, compress_exp_cpu(pages, layout, False)))
    n = page_size // 2
    fixed = fmt.exp_fixed_bytes(page_size, layout)
    limit = fmt.lz4_keep_limit(page_size)
    raw = np.ascontiguousarray(pages.detach().numpy())
    out = np.zeros((n_pages, page_size), dtype=np.uint8)
    sizes = np.empty(n_pages, dtype=np.int32)
    kinds = np.empty(n_pages, dtype=np.uint8)
    step = max(1, _STEP_BYTES // page_size)
    for s in range(0, n_pages, step):
        rows = raw[s:s + step]
        o = out[s:s + step]
        e, rest, high = split_values(rows.view("<u2").astype(np.int64), layout)
        table, code = _table_and_codes(e, _BINS[layout])
        escaped = code == fmt.EXP_TABLE
        size = fixed + escaped.sum(axis=1)
        fill = fill_rows(rows)
        keep = ~fill & (size <= limit)
        stored_raw = ~fill & ~keep
        at = fmt.EXP_TABLE
        o[keep, :at] = table[keep]
        o[keep, at:at + 3 * n // 8] = pack3(code[keep])
        at += 3 * n // 8
        if high is not None:
            o[keep, at:at + 3 * n // 8] = pack3(high[keep])
            at += 3 * n // 8
        o[keep, at:at + n] = rest[keep]
        # escapes: the exponent of each escaped value, in value order, after the fixed part
        r, c = np.nonzero(escaped & keep[:, None])
        o[r, fixed + (np.cumsum(escaped, axis=1) - escaped)[r, c]] = e[r, c]
        o[stored_raw] = rows[stored_raw]
        o[fill, 0] = rows[fill, 0]
        sizes[s:s + step] = np.where(fill, 1, np.where(keep, size, page_size))
        kinds[s:s + step] = np.where(fill, fmt.KIND_FILL,
                                     np.where(keep, fmt.KIND_EXP | layout << 4, fmt.KIND_RAW))
    return torch.from_numpy(out), torch.from_numpy(sizes), torch.from_numpy(kinds)


def page_checks(off: np.ndarray, size: np.ndarray, kinds: np.ndarray, page_size: int,
                total: int) -> np.ndarray:
    """``int32 [N]`` statuses that a page's metadata alone decides for the exponent decoder:
    BAD_KIND (not RAW, FILL or an exponent page of a known layout; so every LZ4 page), then
    BAD_SIZE (``[off, off + size)`` outside the payload of ``total`` bytes; RAW not ``P``,
    FILL not 1, an exponent page under its fixed part or over ``P - P/32``), else 0."""
    codec, high = kinds & 15, kinds >> 4
    plain = ((codec == fmt.KIND_RAW) | (codec == fmt.KIND_FILL)) & (high == 0)
    exp = (codec == fmt.KIND_EXP) & ((high == fmt.EXP_BF16) | (high == fmt.EXP_FP16))
    bad_size = (off < 0) | (size < 1) | (size > total - off)
    bad_size |= (codec == fmt.KIND_RAW) & (size != page_size)
    bad_size |= (codec == fmt.KIND_FILL) & (size != 1)
    least = np.where(high == fmt.EXP_FP16, fmt.exp_fixed_bytes(page_size, fmt.EXP_FP16),
                     fmt.exp_fixed_bytes(page_size, fmt.EXP_BF16))
    bad_size |= exp & ((size < least) | (size > fmt.lz4_keep_limit(page_size)))
    status = np.where(~(plain | exp), fmt.STATUS_BAD_KIND,
                      np.where(bad_size, fmt.STATUS_BAD_SIZE, fmt.STATUS_OK))
    return status.astype(np.int32)


def _decode_exp_rows(buf: np.ndarray, off: np.ndarray, size: np.ndarray, page_size: int,
                     layout: int) -> tuple[np.ndarray, np.ndarray]:
    """Decode exponent pages whose metadata passed :func:`page_checks` (each
    ``buf[off:off + size]`` lies in ``buf``, ``size >= fixed``): ``(uint8 [k, P], ok bool
    [k])``; a page whose size is not its fixed part plus its escapes is not ok (row zero)."""
    n = page_size // 2
    fixed = fmt.exp_fixed_bytes(page_size, layout)
    head = buf[off[:, None] + np.arange(fixed)].astype(np.int64)  # inside: size >= fixed
    table, at = head[:, :fmt.EXP_TABLE], fmt.EXP_TABLE
    code = unpack3(head[:, at:at + 3 * n // 8])
    at += 3 * n // 8
    high = None
    if layout == fmt.EXP_FP16:
        high = unpack3(head[:, at:at + 3 * n // 8])
        at += 3 * n // 8
    rest = head[:, at:at + n]
    escaped = code == fmt.EXP_TABLE
    ok = size == fixed + escaped.sum(axis=1)
    e = np.take_along_axis(table, np.minimum(code, fmt.EXP_TABLE - 1), axis=1)
    r, c = np.nonzero(escaped & ok[:, None])  # an ok page's escapes end at its size
    e[r, c] = buf[off[r] + fixed + (np.cumsum(escaped, axis=1) - escaped)[r, c]]
    if layout == fmt.EXP_FP16:
        e &= 31  # fp16 exponents are 5 bits: a decoder reads the low 5 of their bytes
    v = join_values(e, rest, high, layout).astype("<u2")
    v[~ok] = 0
    return v.view(np.uint8), ok


def decompress_exp_cpu(payload: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor,
                       kinds: torch.Tensor, page_size: int, native: bool = True,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode RAW, FILL and exponent pages (any other kind is ``STATUS_BAD_KIND``).

    Args:
        payload: ``uint8 [T]`` on the CPU (a fixed-stride payload viewed flat, or a packed one).
        offsets: ``int64 [N]`` or ``[N + 1]`` (the first ``N`` used), start of page ``i``; or
            None, a fixed-stride payload (page ``i`` at ``i * P``);
            sizes: ``int32 [N]``; kinds: ``uint8 [N]``.
        page_size: ``P``.
        native: use the C loops (``_native.exp_decode_pages``) where built and ``P`` is a
            valid page size; ``False``: the numpy reference (the same pages and statuses).
        out: ``uint8 [N, P]`` (contiguous, CPU, overlapping no input) to decode into, or None.
    Returns:
        ``(pages uint8 [N, P], status int32 [N])``, ``pages`` being ``out`` when given; a
        failed page's row is zero. Reads nothing outside
        ``payload[offsets[i]:offsets[i] + sizes[i]]`` for page ``i``.
    """
    n_pages = sizes.shape[0]
    if offsets is None:
        offsets = stride_offsets(n_pages, page_size)
    if (native and NATIVE and fmt.valid_page_size(page_size) and payload.dtype == torch.uint8
            and sizes.dtype == torch.int32 and kinds.dtype == torch.uint8
            and not offsets.is_floating_point() and offsets.shape[0] >= n_pages):
        return _decompress_exp_native(payload, offsets, sizes, kinds, page_size, out)
    if out is not None:  # the numpy reference builds its own array
        pages, status = decompress_exp_cpu(payload, offsets, sizes, kinds, page_size, False)
        return out.copy_(pages), status
    buf = np.ascontiguousarray(payload.detach().numpy()).reshape(-1)
    off = offsets.numpy().astype(np.int64)[:n_pages]
    size = sizes.numpy().astype(np.int64)
    kind = kinds.numpy().astype(np.int64)
    status = page_checks(off, size, kind, page_size, buf.shape[0])
    out = np.zeros((n_pages, page_size), dtype=np.uint8)
    ok = status == 0
    codec = kind & 15
    for i in np.flatnonzero(ok & (codec == fmt.KIND_RAW)).tolist():
        out[i] = buf[off[i]:off[i] + page_size]
    fill = np.flatnonzero(ok & (codec == fmt.KIND_FILL))
    out[fill] = buf[off[fill]][:, None]
    step = max(1, _STEP_BYTES // page_size)
    for layout in (fmt.EXP_BF16, fmt.EXP_FP16):
        rows = np.flatnonzero(ok & (kind == (fmt.KIND_EXP | layout << 4)))
        for s in range(0, rows.shape[0], step):
            r = rows[s:s + step]
            out[r], good = _decode_exp_rows(buf, off[r], size[r], page_size, layout)
            status[r[~good]] = fmt.STATUS_BAD_SIZE
    return torch.from_numpy(out), torch.from_numpy(status)


def _compress_exp_native(pages: torch.Tensor, layout: int, out: tuple | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`compress_exp_cpu` through ``_native.exp_encode_pages``, ranges of pages on the
    CPU codec's threads (``cpu_codec.set_cpu_threads``); every byte of the outputs (``out``'s
    tensors, or new ones: pooled memory) written."""
    n_pages, page_size = pages.shape
    raw = np.ascontiguousarray(pages.detach().numpy())
    payload, sizes, kinds = out if out is not None else compressed_empty(n_pages, page_size)
    out, size_np, kind_np = payload.numpy(), sizes.numpy(), kinds.numpy()

    def c_loop(counter: np.ndarray, parts: int, threads: int) -> None:  # in C, no GIL
        _native.exp_encode_pages(raw.reshape(-1), out.reshape(-1), size_np, kind_np, page_size,
                                 layout, counter, parts, threads)

    if n_pages:
        _run_ranges(None, n_pages, page_size, c_loop)
    return payload, sizes, kinds


def _decompress_exp_native(payload: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor,
                           kinds: torch.Tensor, page_size: int, out: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decompress_exp_cpu` through ``_native.exp_decode_pages`` (every row and status
    written there: failed rows zeroed), ranges of pages on the CPU codec's threads."""
    n_pages = sizes.shape[0]
    buf = np.ascontiguousarray(payload.detach().numpy()).reshape(-1)
    off = np.ascontiguousarray(offsets.detach().numpy()[:n_pages], dtype=np.int64)
    size = np.ascontiguousarray(sizes.detach().numpy())
    kind = np.ascontiguousarray(kinds.detach().numpy())
    pages = pages_empty(n_pages, page_size, out)  # every row written there, failed ones zero
    status = torch.empty(n_pages, dtype=torch.int32)
    out, st = pages.numpy(), status.numpy()

    def c_loop(counter: np.ndarray, parts: int, threads: int) -> None:  # in C, no GIL
        _native.exp_decode_pages(buf, off, size, kind, out.reshape(-1), st, page_size, counter,
                                 parts, threads)

    if n_pages:
        _run_ranges(None, n_pages, page_size, c_loop)
    return pages, status
