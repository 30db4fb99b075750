"""Dev probe (issue #23): how fast can the fixed-code exponent page codec run on a GPU?

The codec is now in the package (EXP pages, layout bf16: the same bytes as this probe's;
``torch_pagecomp/exp_codec.py``, ``triton_kernels/exp_codec.py``, ``compress(...,
codec="exp-bf16")``; ``python -m bench`` measures it as the ``pagecomp exp-bf16`` rows). This
probe stays as the measured baseline of its first GPU run (whole 4 KiB page a program, a
``--warps`` sweep) and as the base of ``bench/dev_float_window.py``; its numpy 3-bit packing
is the package's.

``bench/dev_exponent_probe.py`` measured the ratios of candidate bf16 page formats on the CPU
(``bench/results/cpu_exponent_probe.md``): a table of the page's 7 most frequent exponents
with 3-bit codes and an escape stores 1.42-1.44x on every corpus, about 8-11% more than LZ4 +
bit-shuffle. Whether to build it into the package depends on its speed, which only a GPU can
say. This probe holds the page layout, a numpy reference and a Triton encoder and decoder, one
program per page, bit-identical to the reference (``tests/test_dev_float_codec.py`` checks that
under the interpreter), and times them beside the package's typed LZ4 path in one run.

The page (bf16, ``P`` bytes = ``n = P / 2`` values ``v``; ``e = (v >> 7) & 255``):

* ``table``, 7 bytes: the page's exponents ordered by count (descending), then by value
  (ascending); the first 7 of all 256 (exponents of count 0 fill a table that has room);
* ``codes``, ``3n / 8`` bytes: per value the index of its exponent in the table, 7 (escape)
  for one not in it; 3 bits each, value ``i`` at bits ``3i .. 3i + 2`` of the little-endian
  bit stream (8 values a 3-byte group);
* ``sign + mantissa``, ``n`` bytes: ``(v >> 8 & 0x80) | (v & 0x7f)``;
* ``escapes``: the exponent byte of each escaped value, in value order.

Stored size ``7 + 3n / 8 + n + escapes``; over ``P - P / 32`` (the format's limit for a
compressed page) the page is stored RAW instead (the encoder writes nothing past its row and
reports the size it would need). A decoder accepts exactly that size (the escapes counted from
the codes) and at most the limit; anything else is a bad size, so no read leaves the page.

    python -m bench.dev_float_codec [--mib 128] [--corpora gpt-act,gpt-kv,...] (GPU)
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np
import torch
import triton
import triton.language as tl

from torch_pagecomp.exp_codec import pack3, unpack3

K = 7  # table entries; code K escapes
ESC = K
STATUS_OK, STATUS_BAD_SIZE = 0, 2
STATUS_OK_C = tl.constexpr(STATUS_OK)
STATUS_BAD_SIZE_C = tl.constexpr(STATUS_BAD_SIZE)


def limit(page_size: int) -> int:
    """The largest stored size of a compressed page (else RAW), as for LZ4 pages."""
    return page_size - page_size // 32


def stored_bytes(sizes: np.ndarray, page_size: int) -> int:
    """Bytes the pages take with the RAW fallback."""
    s = np.asarray(sizes, dtype=np.int64)
    return int(np.where(s > limit(page_size), page_size, s).sum())


def layout(page_size: int, header: int = K) -> tuple[int, int, int]:
    """``(values, offset of the sign + mantissa bytes, offset of the escapes)`` of a page whose
    ``header`` bytes (this layout's table: ``K``) precede its codes."""
    n = page_size // 2
    return n, header + 3 * n // 8, header + 3 * n // 8 + n


# ---------------------------------------------------------------------------- reference
pack_codes_np = pack3  # int [N, n] 3-bit codes -> uint8 [N, 3n / 8] (the package's packing)


def unpack_codes_np(packed: np.ndarray) -> np.ndarray:
    """One page's ``3n / 8`` code bytes (any integer dtype) -> ``int64 [n]`` codes."""
    return unpack3(np.asarray(packed).reshape(1, -1))[0]


def encode_ref(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``uint8 [N, P]`` bf16 pages -> ``(payload uint8 [N, P], sizes int32 [N])``; bytes past
    a page's size are zero."""
    n_pages = pages.shape[0]
    v = pages.view("<u2").astype(np.int64)
    e = (v >> 7) & 255
    counts = np.zeros((n_pages, 256), dtype=np.int64)
    np.add.at(counts, (np.arange(n_pages)[:, None], e), 1)
    # count descending, then exponent ascending: a stable sort of -count keeps exponent order
    table = np.argsort(-counts, axis=1, kind="stable")[:, :K]
    code = np.full(e.shape, ESC, dtype=np.int64)
    for k in range(K - 1, -1, -1):
        code[e == table[:, k:k + 1]] = k
    return write_pages_ref(table, code, v)


def write_pages_ref(header: np.ndarray, code: np.ndarray, v: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The payload and sizes of pages from their ``uint8 [N, H]`` header bytes, ``int [N, n]``
    3-bit codes (``ESC``: escaped) and ``int [N, n]`` bf16 values: header, codes, sign +
    mantissa, escaped exponents; bytes past a page's size (or its row: then RAW) are zero."""
    n_pages, n = v.shape
    page_size = 2 * n
    _, sm_at, esc_at = layout(page_size, header.shape[1])
    out = np.zeros((n_pages, page_size), dtype=np.uint8)
    out[:, :sm_at - 3 * n // 8] = header
    out[:, sm_at - 3 * n // 8:sm_at] = pack_codes_np(code)
    out[:, sm_at:esc_at] = ((v >> 8) & 0x80) | (v & 0x7F)
    escaped = code == ESC
    sizes = esc_at + escaped.sum(axis=1)
    e = (v >> 7) & 255
    for i in np.flatnonzero(escaped.any(axis=1)):
        k = min(int(sizes[i]), page_size) - esc_at  # nothing past the row (then RAW)
        out[i, esc_at:esc_at + k] = e[i][escaped[i]][:k]
    return out, sizes.astype(np.int32)


def decode_ref(payload: np.ndarray, sizes: np.ndarray, page_size: int):
    """Inverse of :func:`encode_ref`: ``(pages uint8 [N, P], status int32 [N])``; a page of
    another size than its codes say is ``STATUS_BAD_SIZE`` and comes back zero."""
    return read_pages_ref(payload, sizes, page_size, K,
                          lambda row, code: row[:K][np.minimum(code, K - 1)])


def read_pages_ref(payload: np.ndarray, sizes: np.ndarray, page_size: int, header: int,
                   exponents) -> tuple[np.ndarray, np.ndarray]:
    """Decode pages of ``header`` header bytes: ``exponents(row, codes)`` gives each value's
    exponent from the page's bytes (``int64``) and codes (escaped ones are replaced). A page of
    another size than its codes imply, or over the limit, is ``STATUS_BAD_SIZE`` and zero."""
    n_pages = payload.shape[0]
    _, sm_at, esc_at = layout(page_size, header)
    pages = np.zeros((n_pages, page_size), dtype=np.uint8)
    status = np.zeros(n_pages, dtype=np.int32)
    for i in range(n_pages):
        row = payload[i].astype(np.int64)
        code = unpack_codes_np(row[header:sm_at])
        escaped = code == ESC
        if int(sizes[i]) != esc_at + int(escaped.sum()) or int(sizes[i]) > limit(page_size):
            status[i] = STATUS_BAD_SIZE
            continue
        e = np.asarray(exponents(row, code), dtype=np.int64).copy()
        e[escaped] = row[esc_at:int(sizes[i])]
        sm = row[sm_at:esc_at]
        v = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
        pages[i] = v.astype("<u2").view(np.uint8)
    return pages, status


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _encode_kernel(pages_ptr, out_ptr, sizes_ptr, P: tl.constexpr, K: tl.constexpr):
    page = tl.program_id(0).to(tl.int64)
    N: tl.constexpr = P // 2
    SM: tl.constexpr = K + 3 * N // 8
    src = (pages_ptr + page * P).to(tl.pointer_type(tl.uint16))
    dst = out_ptr + page * P
    i = tl.arange(0, N)
    v = tl.load(src + i).to(tl.int32)
    e = (v >> 7) & 255
    counts = tl.histogram(e, 256)
    # count descending, then exponent ascending: one argmax per table entry over unique keys
    key = counts * 256 + (255 - tl.arange(0, 256))
    code = tl.full((N,), K, tl.int32)
    for k in tl.static_range(K):
        best = tl.argmax(key, axis=0)
        code = tl.where(e == best, k, code)
        tl.store(dst + k, best.to(tl.uint8))
        key = tl.where(tl.arange(0, 256) == best, -1, key)
    # codes: 8 values a 3-byte little-endian group
    word = tl.sum(tl.reshape(code, (N // 8, 8)) << (3 * tl.arange(0, 8))[None, :], axis=1)
    g = tl.arange(0, N // 8)
    tl.store(dst + K + 3 * g, (word & 255).to(tl.uint8))
    tl.store(dst + K + 3 * g + 1, ((word >> 8) & 255).to(tl.uint8))
    tl.store(dst + K + 3 * g + 2, ((word >> 16) & 255).to(tl.uint8))
    tl.store(dst + SM + i, (((v >> 8) & 0x80) | (v & 0x7F)).to(tl.uint8))
    escaped = (code == K).to(tl.int32)
    at = tl.cumsum(escaped, axis=0) - escaped
    tl.store(dst + SM + N + at, e.to(tl.uint8), mask=(escaped != 0) & (SM + N + at < P))
    tl.store(sizes_ptr + page, SM + N + tl.sum(escaped, axis=0))


@triton.jit
def _decode_kernel(payload_ptr, sizes_ptr, out_ptr, status_ptr, P: tl.constexpr,
                   K: tl.constexpr):
    page = tl.program_id(0).to(tl.int64)
    N: tl.constexpr = P // 2
    SM: tl.constexpr = K + 3 * N // 8
    src = payload_ptr + page * P
    g = tl.arange(0, N // 8)
    word = (tl.load(src + K + 3 * g).to(tl.int32)
            | (tl.load(src + K + 3 * g + 1).to(tl.int32) << 8)
            | (tl.load(src + K + 3 * g + 2).to(tl.int32) << 16))
    code = tl.reshape((word[:, None] >> (3 * tl.arange(0, 8))[None, :]) & 7, (N,))
    escaped = (code == K).to(tl.int32)
    size = tl.load(sizes_ptr + page)
    ok = (size == SM + N + tl.sum(escaped, axis=0)) & (size <= P - P // 32)
    at = tl.cumsum(escaped, axis=0) - escaped
    okv = (tl.zeros((N,), tl.int32) + ok.to(tl.int32)) != 0  # the page's verdict, per value
    e = tl.load(src + code, mask=okv & (escaped == 0), other=0).to(tl.int32)
    e = tl.where(escaped != 0, tl.load(src + SM + N + at, mask=okv & (escaped != 0), other=0)
                 .to(tl.int32), e)
    store_page(src, e, ok, okv, out_ptr, status_ptr, page, P, SM)


@triton.jit
def store_page(src, e, ok, okv, out_ptr, status_ptr, page, P: tl.constexpr, SM: tl.constexpr):
    """A decoder's last step: page ``page``'s values from its sign + mantissa bytes (at
    ``src + SM``) and exponents ``e``, zero where the page failed (``ok`` false; ``okv`` the
    same per value), and its status."""
    N: tl.constexpr = P // 2
    i = tl.arange(0, N)
    sm = tl.load(src + SM + i, mask=okv, other=0).to(tl.int32)
    v = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    dst = (out_ptr + page * P).to(tl.pointer_type(tl.uint16))
    tl.store(dst + i, tl.where(okv, v, 0).to(tl.uint16))
    tl.store(status_ptr + page, tl.where(ok, STATUS_OK_C, STATUS_BAD_SIZE_C))


def encode(pages: torch.Tensor, payload: torch.Tensor | None = None, warps: int = 4
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton encoder: ``uint8 [N, P]`` (4-byte aligned rows) -> ``(payload, sizes int32)``,
    into ``payload`` if given; bytes past a page's size are not written. ``warps``: per page
    (one program each)."""
    return launch_encode(_encode_kernel, pages, payload, warps, K=K)


def decode(payload: torch.Tensor, sizes: torch.Tensor, out: torch.Tensor | None = None,
           warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton decoder: ``(pages uint8 [N, P], status int32 [N])``, into ``out`` if given."""
    return launch_decode(_decode_kernel, payload, sizes, out, warps, K=K)


def launch_encode(kernel, pages, payload, warps: int, **meta):
    """One program per page of ``kernel(pages, payload, sizes, P=..., **meta)``."""
    n, page_size = pages.shape
    payload = torch.empty_like(pages) if payload is None else payload
    sizes = torch.empty(n, dtype=torch.int32, device=pages.device)
    if n:
        kernel[(n,)](pages, payload, sizes, P=page_size, num_warps=warps, **meta)
    return payload, sizes


def launch_decode(kernel, payload, sizes, out, warps: int, **meta):
    """One program per page of ``kernel(payload, sizes, out, status, P=..., **meta)``."""
    n, page_size = payload.shape
    out = torch.empty_like(payload) if out is None else out
    status = torch.empty(n, dtype=torch.int32, device=payload.device)
    if n:
        kernel[(n,)](payload, sizes, out, status, P=page_size, num_warps=warps, **meta)
    return out, status


# --------------------------------------------------------------------------------- bench
def _time(fn, reps: int) -> float:
    """Seconds per call: the best of 3 windows of ``reps`` back-to-back calls (CUDA events)."""
    from bench.timing import window_seconds

    fn()  # compiled and warm
    return min(window_seconds(fn, reps) for _ in range(3))


def measure(x: torch.Tensor, reps: int) -> str:
    """One table row for the pages ``x`` (``uint8 [N, 4096]`` on the GPU): this codec's ratio
    (RAW fallback counted), encode / decode GB/s and exactness; the package's typed LZ4 path's
    ratio and compress / decompress GB/s."""
    import torch_pagecomp as pc

    nbytes = x.numel()
    payload, sizes = encode(x)
    out, status = decode(payload, sizes)
    exact = bool(torch.equal(out, x)) and int(status.count_nonzero()) == 0
    ratio = nbytes / stored_bytes(sizes.cpu().numpy(), x.shape[1])
    enc = nbytes / _time(lambda: encode(x, payload), reps) / 1e9
    dec = nbytes / _time(lambda: decode(payload, sizes, out), reps) / 1e9
    c = pc.compress(x.reshape(-1), element_size=2)
    lz_ratio = nbytes / int(c.sizes.to(torch.int64).sum())
    cgb = nbytes / _time(lambda: pc.compress(x.reshape(-1), element_size=2), reps) / 1e9
    dgb = nbytes / _time(lambda: pc.decompress(c, return_status=True), reps) / 1e9
    return (f"{ratio:6.3f} {enc:9.0f} {dec:9.0f} {str(exact):>6s} {lz_ratio:14.3f} {cgb:7.0f} "
            f"{dgb:7.0f}")


def sweep_warps(x: torch.Tensor, reps: int, warps: list[int], enc_fn, dec_fn) -> str:
    """Encode / decode GB/s of the pages ``x`` at each number of warps per page by ``enc_fn``
    / ``dec_fn`` (a layout's ``encode`` / ``decode``; every setting checked exact)."""
    nbytes = x.numel()
    cells = []
    for w in warps:
        payload, sizes = enc_fn(x, warps=w)
        out, status = dec_fn(payload, sizes, warps=w)
        if not torch.equal(out, x) or int(status.count_nonzero()):
            raise AssertionError(f"num_warps={w}: the round trip is not exact")
        enc = nbytes / _time(functools.partial(enc_fn, x, payload, warps=w), reps) / 1e9
        dec = nbytes / _time(functools.partial(dec_fn, payload, sizes, out, warps=w), reps) / 1e9
        cells.append(f"{w}: {enc:4.0f} / {dec:4.0f}")
    return "  ".join(cells)


def run_corpora(argv: list[str] | None, description: str, legend: str, row, **extra) -> int:
    """The probes' command line: ``--mib`` of each of ``--corpora`` (4 KiB pages, on the GPU),
    one line ``row(pages, args)`` each after a header ending in ``legend``; ``extra``: more
    ``--name`` options (name -> default)."""
    from bench.corpora import build_corpus

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--corpora", default="bf16-randn,bf16-relu,gpt-act,gpt-kv,gpt-weights,"
                                          "encoder-act")
    ap.add_argument("--reps", type=int, default=10)
    for name, default in extra.items():
        ap.add_argument(f"--{name}", default=default)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
          f"{triton.__version__} | {a.mib} MiB per corpus, 4096-byte pages | {legend}",
          flush=True)
    for name in a.corpora.split(","):
        t0 = time.time()
        x = build_corpus(name, a.mib << 20, 4096, dev, seed=1).view(torch.uint8).reshape(-1, 4096)
        print(f"{name:12s} {row(x, a)}   ({time.time() - t0:.0f} s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    legend = (f"GB/s = uncompressed bytes / time\n{'corpus':12s} {'ratio':>6s} {'enc GB/s':>9s} "
              f"{'dec GB/s':>9s} {'exact':>6s} {'lz4+shuf ratio':>14s} {'c GB/s':>7s} "
              f"{'d GB/s':>7s}")
    return run_corpora(argv, __doc__.splitlines()[0], legend, lambda x, a: measure(x, a.reps))


if __name__ == "__main__":
    raise SystemExit(main())
