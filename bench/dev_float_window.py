"""Dev probe (issue #23): the exponent page codec with a *window* instead of a table.

``bench/dev_float_codec.py`` stores a page's 7 most frequent exponents in a table; its encoder
runs at ~220 GB/s on an H200 whatever the data and however many warps a page gets
(``bench/results/h200x2_21c4d88/``): the histogram and seven arg-max passes that pick the table
bound it. On bf16 model data the frequent exponents are consecutive, just below the page's
largest, plus zero (ReLU outputs, padding). So this layout names a window of consecutive
exponents by its top (``base``) and a flag:

* ``header``, 2 bytes: ``base`` and ``mode``. Mode 0: codes 0..6 are the exponents
  ``base - code``. Mode 1: codes 0..5 are ``base - code`` and code 6 is exponent 0.
  Code 7 escapes in both modes.
* ``codes``, ``sign + mantissa`` and ``escapes``: as in the table layout. The codes are 3 bits
  a value, 8 values to a 3-byte little-endian group. The sign and mantissa take one byte a
  value, ``(v >> 8 & 0x80) | (v & 0x7f)``. The escapes hold the exponent byte of each escaped
  value, in value order.

Choosing the window:
- ``m`` is the largest non-zero exponent of the page (0 if there is none).
- One 32-bin histogram of ``d = m - e`` over the non-zero exponents covers it: bins 0..15 hold
  ``d``, bin 16 holds ``d >= 16`` and bin 17 the zero exponents. That is 32 bins instead of
  the table's 256, and there are no arg-max passes over them.
- The candidates are ``base = m - o`` for ``o`` in 0..9 (and ``o <= m``), each in both modes.
  The window with mode 0 covers ``d`` in ``o .. o + 6``, plus the zeros if ``base <= 6``. The
  window with mode 1 covers ``d`` in ``o .. o + 5``, plus the zeros.
- The encoder keeps the candidate covering the most values; on a tie, the smaller ``o``, then
  mode 0.
- An outlier up to 2^9 times the page's bulk therefore costs only its own escape. A page whose
  values spread wider is stored RAW, as one with random bits is.
- The decoder needs no table lookup. It computes ``(base - code) & 255``, so a hostile page
  decodes to some bytes, the same on both paths.

Measured on the CPU on 16 MiB of each bf16 corpus (2 header bytes counted), this window stores
the same as the table or slightly more:

| corpus | table | window |
|---|---|---|
| bf16-randn | 1.425 | 1.428 |
| bf16-relu | 1.425 | 1.428 |
| gpt-act | 1.419 | 1.422 |
| gpt-kv | 1.423 | 1.425 |
| gpt-weights | 1.427 | 1.429 |
| encoder-act | 1.428 | 1.431 |

Whether the window is faster needs a GPU.

Stored size ``2 + 3n / 8 + n + escapes``. Over ``P - P / 32`` the page is stored RAW, with the
same limit and RAW fallback as the table layout. A decoder accepts exactly the size its codes
imply, and at most the limit.

    python -m bench.dev_float_window [--mib 128] [--warps 2,4] (GPU): both layouts side by side
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from bench.dev_float_codec import (  # STATUS_BAD_SIZE, limit: this layout's as well
    STATUS_BAD_SIZE,  # noqa: F401
    launch_decode,
    launch_encode,
    limit,  # noqa: F401
    read_pages_ref,
    store_page,
    stored_bytes,
    write_pages_ref,
)
from bench.dev_float_codec import layout as table_layout

HEADER = 2
ESC = 7


def layout(page_size: int) -> tuple[int, int, int]:
    """``(values, offset of the sign + mantissa bytes, offset of the escapes)`` of a page."""
    return table_layout(page_size, HEADER)


OFFSETS = 10  # window tops m - 0 .. m - 9
BINS = 32  # d = 0..15, then "d >= 16" (16) and "zero exponent" (17)


def _window_tables() -> tuple[np.ndarray, np.ndarray]:
    """``int64 [2 * OFFSETS, BINS]``: which bins candidate ``2 * o + mode`` covers (zeros
    apart), and ``[2 * OFFSETS]``: the largest ``base`` at which its window holds exponent 0
    (mode 0: ``base <= 6``; mode 1: always)."""
    cover = np.zeros((2 * OFFSETS, BINS), dtype=np.int64)
    for o in range(OFFSETS):
        cover[2 * o, o:o + 7] = 1
        cover[2 * o + 1, o:o + 6] = 1
    return cover, np.tile(np.array([6, 255]), OFFSETS)


def choose_window(hist: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(base, mode)`` per page from its ``int64 [N, BINS]`` histogram and largest non-zero
    exponent ``m``: the candidate covering the most values, the first of equals."""
    cover, zero_up_to = _window_tables()
    o = np.arange(2 * OFFSETS) // 2
    base = m[:, None] - o[None, :]
    score = hist @ cover.T + np.where(base <= zero_up_to[None, :], hist[:, 17:18], 0)
    score = np.where(base >= 0, score, -1)
    best = score.argmax(axis=1)  # the first of equal scores
    return m - best // 2, best & 1


def _codes(e: np.ndarray, base: np.ndarray, mode: np.ndarray) -> np.ndarray:
    d = base[:, None] - e
    code0 = np.where((d >= 0) & (d <= 6), d, ESC)
    code1 = np.where(e == 0, 6, np.where((d >= 0) & (d <= 5), d, ESC))
    return np.where(mode[:, None] == 1, code1, code0)


# ---------------------------------------------------------------------------- reference
def encode_ref(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``uint8 [N, P]`` bf16 pages -> ``(payload uint8 [N, P], sizes int32 [N])``; bytes past
    a page's size are zero."""
    n_pages = pages.shape[0]
    v = pages.view("<u2").astype(np.int64)
    e = (v >> 7) & 255
    nz = e != 0
    m = np.where(nz, e, 0).max(axis=1)
    d = m[:, None] - e
    idx = np.where(nz, np.minimum(d, 16), 17)
    hist = np.zeros((n_pages, BINS), dtype=np.int64)
    np.add.at(hist, (np.arange(n_pages)[:, None], idx), 1)
    base, mode = choose_window(hist, m)
    return write_pages_ref(np.stack([base, mode], axis=1), _codes(e, base, mode), v)


def decode_ref(payload: np.ndarray, sizes: np.ndarray, page_size: int):
    """Inverse of :func:`encode_ref`: ``(pages uint8 [N, P], status int32 [N])``; a page of
    another size than its codes imply is ``STATUS_BAD_SIZE`` and comes back zero."""
    return read_pages_ref(payload, sizes, page_size, HEADER, lambda row, code: np.where(
        ((row[1] & 1) == 1) & (code == 6), 0, (row[0] - code) & 255))


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _encode_kernel(pages_ptr, out_ptr, sizes_ptr, P: tl.constexpr, BINS: tl.constexpr,
                   OFFSETS: tl.constexpr, OFFSETS_P2: tl.constexpr):
    page = tl.program_id(0).to(tl.int64)
    N: tl.constexpr = P // 2
    SM: tl.constexpr = 2 + 3 * N // 8
    src = (pages_ptr + page * P).to(tl.pointer_type(tl.uint16))
    dst = out_ptr + page * P
    i = tl.arange(0, N)
    v = tl.load(src + i).to(tl.int32)
    e = (v >> 7) & 255
    nz = e != 0
    m = tl.max(tl.where(nz, e, 0), axis=0)
    hist = tl.histogram(tl.where(nz, tl.minimum(m - e, 16), 17), BINS)
    # candidate c = 2 * o + mode covers bins o .. o + 6 - mode (and the zeros, bin 17, at
    # mode 1 or where its base m - o <= 6); the best score, first of equals: one max of
    # score * 64 + (63 - c)
    c = tl.arange(0, 2 * OFFSETS_P2)
    o = c // 2
    b = tl.arange(0, BINS)
    cover = (b[None, :] >= o[:, None]) & (b[None, :] <= (o + 6 - (c & 1))[:, None])
    zero = ((c & 1) == 1) | (m - o <= 6)
    h17 = tl.sum(tl.where(b == 17, hist, 0), axis=0)
    score = tl.sum(tl.where(cover, hist[None, :], 0), axis=1) + tl.where(zero, h17, 0)
    score = tl.where((o <= m) & (o < OFFSETS), score, -1)
    best = 63 - (tl.max(score * 64 + (63 - c), axis=0) & 63)
    base = m - best // 2
    mode = best & 1
    dd = base - e
    code = tl.where(mode == 1,
                    tl.where(nz, tl.where((dd >= 0) & (dd <= 5), dd, 7), 6),
                    tl.where((dd >= 0) & (dd <= 6), dd, 7))
    tl.store(dst, base.to(tl.uint8))
    tl.store(dst + 1, mode.to(tl.uint8))
    word = tl.sum(tl.reshape(code, (N // 8, 8)) << (3 * tl.arange(0, 8))[None, :], axis=1)
    g = tl.arange(0, N // 8)
    tl.store(dst + 2 + 3 * g, (word & 255).to(tl.uint8))
    tl.store(dst + 2 + 3 * g + 1, ((word >> 8) & 255).to(tl.uint8))
    tl.store(dst + 2 + 3 * g + 2, ((word >> 16) & 255).to(tl.uint8))
    tl.store(dst + SM + i, (((v >> 8) & 0x80) | (v & 0x7F)).to(tl.uint8))
    escaped = (code == 7).to(tl.int32)
    count = tl.sum(escaped, axis=0)
    if count > 0:  # most pages of model data have a few dozen; the scan only where needed
        at = tl.cumsum(escaped, axis=0) - escaped
        tl.store(dst + SM + N + at, e.to(tl.uint8), mask=(escaped != 0) & (SM + N + at < P))
    tl.store(sizes_ptr + page, SM + N + count)


@triton.jit
def _decode_kernel(payload_ptr, sizes_ptr, out_ptr, status_ptr, P: tl.constexpr):
    page = tl.program_id(0).to(tl.int64)
    N: tl.constexpr = P // 2
    SM: tl.constexpr = 2 + 3 * N // 8
    src = payload_ptr + page * P
    g = tl.arange(0, N // 8)
    word = (tl.load(src + 2 + 3 * g).to(tl.int32)
            | (tl.load(src + 2 + 3 * g + 1).to(tl.int32) << 8)
            | (tl.load(src + 2 + 3 * g + 2).to(tl.int32) << 16))
    code = tl.reshape((word[:, None] >> (3 * tl.arange(0, 8))[None, :]) & 7, (N,))
    escaped = (code == 7).to(tl.int32)
    count = tl.sum(escaped, axis=0)
    size = tl.load(sizes_ptr + page)
    ok = (size == SM + N + count) & (size <= P - P // 32)
    base = tl.load(src).to(tl.int32)
    mode = tl.load(src + 1).to(tl.int32) & 1
    e = tl.where((mode == 1) & (code == 6), 0, (base - code) & 255)
    if ok & (count > 0):
        at = tl.cumsum(escaped, axis=0) - escaped
        e = tl.where(escaped != 0,
                     tl.load(src + SM + N + at, mask=escaped != 0, other=0).to(tl.int32), e)
    okv = (tl.zeros((N,), tl.int32) + ok.to(tl.int32)) != 0  # the page's verdict, per value
    store_page(src, e, ok, okv, out_ptr, status_ptr, page, P, SM)


def encode(pages: torch.Tensor, payload: torch.Tensor | None = None, warps: int = 4
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton encoder: ``uint8 [N, P]`` (4-byte aligned rows) -> ``(payload, sizes int32)``,
    into ``payload`` if given; bytes past a page's size are not written."""
    return launch_encode(_encode_kernel, pages, payload, warps, BINS=BINS, OFFSETS=OFFSETS,
                         OFFSETS_P2=triton.next_power_of_2(OFFSETS))


def decode(payload: torch.Tensor, sizes: torch.Tensor, out: torch.Tensor | None = None,
           warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton decoder: ``(pages uint8 [N, P], status int32 [N])``, into ``out`` if given."""
    return launch_decode(_decode_kernel, payload, sizes, out, warps)


# --------------------------------------------------------------------------------- bench
def measure(x: torch.Tensor, reps: int, warps: list[int]) -> str:
    """Ratio, then encode / decode GB/s at each warp count, of both layouts on the pages
    ``x`` (``uint8 [N, 4096]`` on the GPU); every round trip checked exact."""
    from bench import dev_float_codec as table

    cells = []
    for name, enc_fn, dec_fn in (("table", table.encode, table.decode),
                                 ("window", encode, decode)):
        _, sizes = enc_fn(x)
        ratio = x.numel() / stored_bytes(sizes.cpu().numpy(), x.shape[1])
        cells.append(f"{name} {ratio:.3f}  {table.sweep_warps(x, reps, warps, enc_fn, dec_fn)}")
    return "  |  ".join(cells)


def main(argv: list[str] | None = None) -> int:
    from bench.dev_float_codec import run_corpora

    return run_corpora(argv, __doc__.splitlines()[0],
                       "per layout: ratio, then encode / decode GB/s (uncompressed bytes / "
                       "time) at each --warps per page",
                       lambda x, a: measure(x, a.reps, [int(w) for w in a.warps.split(",")]),
                       warps="2,4")


if __name__ == "__main__":
    raise SystemExit(main())
