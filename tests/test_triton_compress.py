"""Tests of the Triton LZ4 compressor (``torch_pagecomp.kernels.lz4_compress.compress_pages``).

CPU tests run the kernel under ``TRITON_INTERPRET=1`` on a few 4 KiB pages and compare it
byte-for-byte with ``_model``, a plain-Python statement of the same parse (same hash tables,
windows and greedy choice); every LZ4 page must also decode with ``lz4.block.decompress`` and
``cpu_codec.decompress_cpu``, and honour the LZ4 end rules. GPU tests skip without CUDA.
"""

import os

import torch

# Before triton is imported (as in conftest.py): without CUDA the kernel runs in the CPU
# interpreter and the GPU tests skip; with CUDA it runs compiled and the CPU tests skip.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import random  # noqa: E402
from dataclasses import replace  # noqa: E402

import lz4.block  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from pages import length_extension  # noqa: E402

from torch_pagecomp import cpu_codec  # noqa: E402
from torch_pagecomp import format as fmt  # noqa: E402
from torch_pagecomp.kernels import lz4_compress as lc  # noqa: E402
from torch_pagecomp.shuffle import bitshuffle, bitunshuffle  # noqa: E402

P4K = 4096
needs_cuda = pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (and no TRITON_INTERPRET=1)"
)
interpret_only = pytest.mark.skipif(not INTERPRET, reason="CPU interpreter tests")


# ------------------------------------------------------------------------------ helpers
def _table_cands(span, words, h, last, near):
    """Plain bytes: per 32 positions, the table entries before the sub-chunk, then the entries
    of the sub-chunk (the latest position wins); a position whose entry fails takes the
    smallest of ``near`` distances 1, 2, 4, ... that holds the same word."""
    cand = {}
    for s0 in range(span.start, span.stop, 32):
        sub = range(s0, min(s0 + 32, span.stop))
        for i in sub:
            c = last.get(h[i], -1)
            if c >= 0 and words[c] == words[i]:
                cand[i] = c
                continue
            for d in (1 << j for j in range(near)):
                if i >= d and words[i - d] == words[i]:
                    cand[i] = i - d
                    break
        for i in sub:
            last[h[i]] = i
    return cand


def _plane_cands(span, words, near, plane):
    """Bit-shuffled pages: the smallest of ``near`` distances 1, 2, 4, ..., then one and two
    bit planes back (``plane`` bytes each), that holds the same word."""
    cand = {}
    for i in span:
        for d in [1 << j for j in range(near)] + [plane, 2 * plane]:
            if i >= d and words[i - d] == words[i]:
                cand[i] = i - d
                break
    return cand


def _window_has_repeats(page: bytes, span: range, plane: int) -> bool:
    """The window gate of bit-shuffled pages: an aligned word of the window (one that starts in
    ``span``) equals the word 4, 8, 16 bytes or one or two planes before it."""
    w = np.frombuffer(page, dtype=np.uint32)
    ks = np.arange(span.start // 4, (span.stop + 3) // 4)
    for d in (1, 2, 4, plane // 4, plane // 2):
        k = ks[ks >= d]
        if (w[k] == w[k - d]).any():
            return True
    return False


def _known(page: bytes, p: int, c: int, xw: int) -> int:
    """Match bytes after the first 4 that the kernel knows before its walk: up to ``xw`` more
    words, each counted while the previous ones matched whole and it starts before ``P - 4``."""
    m = 0
    for j in range(1, xw + 1):
        if p + 4 * j >= len(page) - 4:
            break
        a, b = page[p + 4 * j: p + 4 * j + 4], page[c + 4 * j: c + 4 * j + 4]
        nb = next((k for k in range(4) if a[k] != b[k]), 4)
        m += nb
        if nb < 4:
            break
    return m


def _model_block(page: bytes, cfg: lc.CompressConfig) -> bytes:
    """The kernel's parse in plain Python: the LZ4 block it must write (before the RAW rule)
    for one page (bit-shuffled already where ``cfg.ELEMENT_SIZE > 1``) under the settings
    ``cfg``."""
    size = len(page)
    plane = size // (8 * cfg.ELEMENT_SIZE) if cfg.ELEMENT_SIZE > 1 else 0
    window, near, xw, accel = cfg.WINDOW, cfg.NEAR, cfg.KNOWN_WORDS, cfg.ACCEL
    maxs, limit = size - 12, fmt.lz4_keep_limit(size)
    a = np.frombuffer(page, dtype=np.uint8).astype(np.uint64)
    words = (a[:-3] | (a[1:-2] << 8) | (a[2:-1] << 16) | (a[3:] << 24))[: maxs + 1]
    prod = (words * 2654435761) & 0xFFFFFFFF
    h = (prod >> (32 - cfg.HASH_BITS)).tolist()
    words = words.tolist()
    last: dict[int, int] = {}
    out = bytearray()
    pos = anchor = w0 = misses = 0
    while w0 <= maxs:
        emitted, w_prev = False, w0
        span = range(w0, min(w0 + window, maxs + 1))
        if plane:
            live = _window_has_repeats(page, span, plane)
            cand = _plane_cands(span, words, near, plane) if live else {}
        else:
            cand = _table_cands(span, words, h, last, near)
        known = {i: _known(page, i, c, xw) for i, c in cand.items()}
        usable = sorted(i for i in cand if known[i] >= cfg.MIN_MATCH - 4)
        for p in usable:
            if p < pos:
                continue
            if cfg.LAZY and known[p] < 4 * xw:  # a longer match one byte later wins
                nxt = next((i for i in usable if i > p), None)
                if nxt == p + 1 and known[nxt] > known[p]:
                    p = nxt
            c, n = cand[p], 4
            while p + n < size - 5 and page[p + n] == page[c + n]:
                n += 1
            k = 0  # backwards into the literals, at most 32 bytes
            while cfg.BACK and k < min(32, p - anchor, c) and page[p - k - 1] == page[c - k - 1]:
                k += 1
            p, c, n = p - k, c - k, n + k
            lit, ml = p - anchor, n - 4
            out += bytes([(min(lit, 15) << 4) | min(ml, 15)]) + length_extension(lit)
            out += page[anchor:p]
            out += (p - c).to_bytes(2, "little") + length_extension(ml)
            pos = anchor = p + n
            emitted = True
        if len(out) > limit:
            return bytes(out) + b"\x00" * size  # too long: RAW
        w0 += window
        if pos > w0:  # the match ran past this window: resume at its end
            w0 = pos & ~3
        if accel:  # after `misses` windows without a sequence, misses // accel are skipped
            misses = 0 if emitted else misses + 1
            extra = window * (misses // accel)
            if w0 // plane != w_prev // plane:  # no skip crosses into the next bit plane
                extra = 0
            extra = min(extra, (w0 // plane + 1) * plane - w0)
            w0 += extra
            if w0 // plane != w_prev // plane:  # a new plane starts afresh
                misses = 0
    lit = size - anchor
    return bytes(out) + bytes([min(lit, 15) << 4]) + length_extension(lit) + page[anchor:]


def _config(size: int = P4K, element_size: int = 1, **changes) -> lc.CompressConfig:
    """The kernel's settings for the page kind, with ``changes`` (field names) applied."""
    return replace(lc.compress_config(size, element_size), **changes)


def _model(pages: torch.Tensor, element_size: int = 1, **changes):
    """Expected ``(payload, sizes, kinds)`` of ``compress_pages`` under
    ``_config(P, element_size, **changes)``."""
    n, size = pages.shape
    cfg = _config(size, element_size, **changes)
    payload = torch.zeros((n, size), dtype=torch.uint8)
    sizes = torch.zeros(n, dtype=torch.int32)
    kinds = torch.zeros(n, dtype=torch.uint8)
    src = bitshuffle(pages, element_size) if element_size > 1 else pages
    for i in range(n):
        row = pages[i]
        if bool((row == row[0]).all()):
            payload[i, 0], sizes[i], kinds[i] = row[0], 1, fmt.KIND_FILL
            continue
        block = _model_block(src[i].numpy().tobytes(), cfg)
        if len(block) <= fmt.lz4_keep_limit(size):
            payload[i, : len(block)] = torch.frombuffer(bytearray(block), dtype=torch.uint8)
            sizes[i] = len(block)
            kinds[i] = fmt.KIND_LZ4 | (fmt.element_shift(element_size) << 4)
        else:
            payload[i], sizes[i], kinds[i] = row, size, fmt.KIND_RAW
    return payload, sizes, kinds


def _read_ext(block: bytes, ip: int, n: int) -> tuple[int, int]:
    """Add the length-extension bytes at ``block[ip:]`` to ``n``; returns ``(n, next ip)``."""
    while True:
        n += block[ip]
        ip += 1
        if block[ip - 1] != 255:
            return n, ip


def _sequences(block: bytes, size: int):
    """Parse an LZ4 block; assert the end rules. Returns ``[(lit_len, offset, match_len)]``."""
    seqs, ip, op = [], 0, 0
    while True:
        token = block[ip]
        ip += 1
        lit = token >> 4
        if lit == 15:
            lit, ip = _read_ext(block, ip, lit)
        ip += lit
        op += lit
        if ip == len(block):
            seqs.append((lit, 0, 0))
            break
        assert op <= size - 12, f"match starts at {op}, later than {size - 12}"
        off = block[ip] | (block[ip + 1] << 8)
        ip += 2
        assert 1 <= off <= op, f"bad offset {off} at {op}"
        ml = (token & 15) + 4
        if token & 15 == 15:
            ml, ip = _read_ext(block, ip, ml)
        op += ml
        assert op <= size - 5, f"match ends at {op}, inside the last 5 bytes"
        seqs.append((lit, off, ml))
    assert op == size and seqs[-1][0] >= 5
    return seqs


def _poisoned_empty(monkeypatch):
    """Make ``torch.empty`` return sentinel-filled tensors (unwritten outputs show)."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.dtype == torch.uint8:
            t.fill_(0xA5)
        elif not t.dtype.is_floating_point:
            t.fill_(-0x5A5A5A5B)
        return t

    monkeypatch.setattr(torch, "empty", empty)


def _check(pages: torch.Tensor, element_size: int = 1, **changes):
    """Run the kernel (settings: ``_config`` with ``changes``); compare with the model; decode
    every page. Returns the outputs."""
    n, size = pages.shape
    cfg = _config(size, element_size, **changes) if changes else None
    payload, sizes, kinds = lc.compress_pages(pages, element_size, config=cfg)
    assert payload.shape == (n, size) and payload.dtype == torch.uint8
    assert sizes.shape == (n,) and sizes.dtype == torch.int32
    assert kinds.shape == (n,) and kinds.dtype == torch.uint8
    exp = _model(pages, element_size, **changes)
    for i in range(n):
        assert int(sizes[i]) == int(exp[1][i]), f"page {i}: size {int(sizes[i])} != model"
        assert int(kinds[i]) == int(exp[2][i]), f"page {i}: kind {int(kinds[i])} != model"
        assert torch.equal(payload[i], exp[0][i]), f"page {i}: payload differs from the model"
        s = int(sizes[i])
        assert not payload[i, s:].any(), f"page {i}: non-zero tail"
    shuffled = bitshuffle(pages, element_size) if element_size > 1 else pages
    for i in range(n):
        if int(kinds[i]) & 15 == fmt.KIND_LZ4:
            assert int(kinds[i]) >> 4 == fmt.element_shift(element_size)
            block = payload[i, : int(sizes[i])].numpy().tobytes()
            data = lz4.block.decompress(block, uncompressed_size=size)
            assert data == shuffled[i].numpy().tobytes(), f"page {i}: lz4 decode differs"
            _sequences(block, size)
    offsets = torch.arange(n, dtype=torch.int64) * size
    dec, status = cpu_codec.decompress_cpu(payload.view(-1), offsets, sizes, kinds, size)
    assert not status.any() and torch.equal(dec, pages)
    return payload, sizes, kinds


def _rand(n: int) -> bytes:
    return bytes(random.getrandbits(8) for _ in range(n))


def _text_page(size: int = P4K) -> bytes:
    src = open(fmt.__file__, "rb").read()
    start = random.randrange(0, len(src) - size)
    return src[start : start + size]


def _rows(*rows: bytes) -> torch.Tensor:
    return torch.stack([torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in rows])


def _unaligned8(pages: torch.Tensor) -> torch.Tensor:
    """A copy of ``pages`` 4 bytes into its storage: 4-byte aligned, not 8 (the bit-shuffle
    then reads bytes, not 64-bit words)."""
    buf = torch.zeros(pages.numel() + 4, dtype=torch.uint8, device=pages.device)
    return buf[4:].view_as(pages).copy_(pages)


# -------------------------------------------------------------------------- CPU tests
@interpret_only
def test_all_kinds_poisoned(monkeypatch):
    _poisoned_empty(monkeypatch)
    period = _rand(41)
    pages = _rows(
        _rand(P4K),  # RAW
        bytes(P4K),  # FILL zero
        b"\x7f" * P4K,  # FILL non-zero
        (period * 100)[:P4K],  # LZ4: literals, one long match, last literals
        _text_page(),  # LZ4 text
        _rand(P4K - 100) + bytes(100),  # saves too little: RAW
        _rand(7) + b"\x7f" * (P4K - 7),  # almost filled
    )
    payload, sizes, kinds = _check(pages)
    assert kinds.tolist()[:7] == [0, 2, 2, 1, 1, 0, 1]
    assert sizes[0] == P4K and sizes[1] == 1 and payload[2, 0] == 0x7F
    assert sizes[3] < 100


@interpret_only
def test_empty_and_single():
    for n in (0, 1):
        pages = torch.empty((0, P4K), dtype=torch.uint8)
        if n:
            pages = _rows((_rand(97) * 50)[:P4K])
        payload, sizes, kinds = _check(pages)
        assert payload.shape == (n, P4K) and sizes.shape == (n,) and kinds.shape == (n,)


@pytest.mark.parametrize("element_size", [1, 2])  # hash tables / shuffle rows as scratch
@interpret_only
def test_caller_outputs_and_reused_scratch_match(element_size):
    # the offload store's way: outputs it allocated (poisoned here) and one scratch for every
    # launch; the same bytes as a call that allocates everything
    rows = [(_rand(11) * 400)[:P4K], _rand(P4K), bytes(P4K)]  # LZ4, RAW, FILL
    pages = _rows(*rows)
    want = lc.compress_pages(pages, element_size)
    dev = pages.device
    cfg = lc.compress_config(P4K, element_size)
    scratch = lc.compress_scratch(dev, cfg, lc.max_programs(dev, cfg))
    for _ in range(2):  # the scratch holds the previous launch's state: never read
        out = (torch.full((len(rows), P4K), 0xA5, dtype=torch.uint8),
               torch.full((len(rows),), -7, dtype=torch.int32),
               torch.full((len(rows),), 0xEE, dtype=torch.uint8))
        got = lc.compress_pages(pages, element_size, out=out, scratch=scratch)
        assert all(g is o for g, o in zip(got, out))
        assert torch.equal(out[1], want[1]) and torch.equal(out[2], want[2])
        for i, size in enumerate(want[1].tolist()):
            assert torch.equal(out[0][i, :size], want[0][i, :size]), f"page {i}"


@pytest.mark.parametrize("element_size", [1, 2, 4])
def test_rows_by_address_equal_contiguous(element_size):
    """``compress_rows``: pages read by address (a batch's members where they lie, in a random
    order of places in a poisoned buffer, 8-byte aligned at different residues mod 64) give
    the bytes, sizes and kinds ``compress_pages`` gives the same pages side by side, into
    poisoned outputs; the buffer the pages lie in is not written. More pages than the
    interpreter's programs (3): the persistent loop takes rows by address too."""
    from pages import kernel_device

    dev = kernel_device()
    rows = [(_rand(11) * 400)[:P4K], _rand(P4K), bytes(P4K), _text_page(), (_rand(5) * 900)[:P4K]]
    pages = _rows(*rows).to(dev)
    n = len(rows)
    gap = 64 + 8 * random.randrange(1, 8)
    buf = torch.full((n * (P4K + gap) + gap,), 0x5C, dtype=torch.uint8, device=dev)
    order = random.sample(range(n), n)
    starts = [gap + order[i] * (P4K + gap) + 8 * random.randrange(0, 8) for i in range(n)]
    for i, a in enumerate(starts):
        buf[a:a + P4K] = pages[i]
    before = buf.clone()
    table = torch.tensor([buf.data_ptr() + a for a in starts], dtype=torch.int64, device=dev)

    def poisoned():
        return (torch.full((n, P4K), 0xA5, dtype=torch.uint8, device=dev),
                torch.full((n,), -7, dtype=torch.int32, device=dev),
                torch.full((n,), 0xEE, dtype=torch.uint8, device=dev))

    want, got = poisoned(), poisoned()
    lc.compress_pages(pages, element_size, out=want)
    lc.compress_rows(table, element_size, P4K, got)
    for w, g in zip(want, got):
        assert torch.equal(w.cpu(), g.cpu())
    assert torch.equal(buf.cpu(), before.cpu()), "wrote into the pages' buffer"
    with pytest.raises(ValueError, match="int64"):
        lc.compress_rows(table.to(torch.int32), element_size, P4K, got)
    lc.compress_rows(table[:0], element_size, P4K, tuple(t[:0] for t in got))  # no pages


@pytest.mark.parametrize("element_size", [1, 2])  # hash table / bit-plane candidates
@interpret_only
def test_persistent_loop_many_pages(element_size):
    rows = []
    for i in range(4 if element_size == 1 else 5):  # more pages than programs (3)
        rows.append([bytes(P4K), _rand(P4K), (_rand(13 + i) * 400)[:P4K]][(i + 1) % 3])
    _check(_rows(*rows), element_size)


def _draw(make, want, tries: int = 300, **changes) -> bytes:
    """A page from ``make()`` whose model parse (plain bytes, ``_config(**changes)``)
    satisfies ``want(seqs)`` (hash collisions can move a match; such pages are drawn again).
    The kernel is then held to the model."""
    for _ in range(tries):
        page = make()
        block = _model_block(page, _config(len(page), 1, **changes))
        if len(block) <= fmt.lz4_keep_limit(len(page)) and want(_sequences(block, len(page))):
            return page
    raise AssertionError("could not draw a page with the wanted parse")


def _offsets(seqs):
    return {o for _, o, _ in seqs}


@interpret_only
def test_end_rules_and_offsets():
    size = P4K
    # a long offset-1 run that ends where the last possible match starts (offset P - 12)
    def edge():
        x = _rand(16)
        return x + b"z" * (size - 12 - 16) + x[:12]

    a = _draw(edge, lambda s: {1, size - 12} <= _offsets(s) and s[-2][2] == 7, 50)
    # the repeated pattern runs to the end: the match must stop 5 bytes before it
    b = _draw(lambda: (_rand(64) * 64)[:size], lambda s: s[-1][0] == 5 and 64 in _offsets(s),
              50)
    # a 4-byte repeat inside the last 11 bytes must stay literal (the period's 29 bytes
    # distinct: with two equal, 1 draw in 256 let the last match run on one byte into them,
    # legally, and left 10 literals)
    c = (bytes(random.sample(range(256), 29)) * 200)[: size - 11] + _rand(11)
    c = c[: size - 11] + c[100:104] + _rand(7)
    payload, sizes, kinds = _check(_rows(a, b, c))
    assert kinds.tolist() == [1, 1, 1]
    seqs = _sequences(payload[2, : int(sizes[2])].numpy().tobytes(), size)
    assert seqs[-1][0] >= 11


@pytest.mark.parametrize("lit_lens", [(14, 15, 16, 19), (269, 270, 271, 524, 525), (15, 270, 524)])
@interpret_only
def test_length_extension_boundaries(lit_lens):
    # literal runs of the given lengths, each followed by a copy of an earlier stretch whose
    # match length sits at a boundary of the 4-bit field and its extension bytes
    match_lens = [4 + m for m in (14, 15, 16, 19, 269, 270, 271)]

    def make():
        src = _rand(400)
        page = bytearray(src)
        for k, lit in enumerate((5,) + lit_lens):  # the byte after each copy is a literal too
            page += _rand(lit - (k > 0))
            ml = match_lens[(k * 3 + len(lit_lens)) % len(match_lens)]
            start = random.randrange(1, len(src) - ml)
            page += src[start : start + ml] + bytes([src[start + ml] ^ 0x55])
        return bytes(page + _rand(P4K - len(page)))[:P4K]

    def want(seqs):
        lits, mls = {s[0] for s in seqs}, {s[2] for s in seqs}
        return set(lit_lens) <= lits and len(mls & set(match_lens)) >= len(lit_lens)

    page = _draw(make, want)
    _check(_rows(page))


@pytest.mark.parametrize("element_size, wide", [  # wide: 64-bit loads (8-aligned pages)
    (2, True), (4, False), pytest.param(2, False, marks=pytest.mark.slow),
    pytest.param(4, True, marks=pytest.mark.slow)])
@interpret_only
def test_bitshuffle_fused(element_size, wide):
    x = torch.randn(P4K // 2, dtype=torch.bfloat16).view(torch.uint8)
    relu = torch.relu(torch.randn(P4K // 2, dtype=torch.bfloat16)).view(torch.uint8)
    ints = torch.randint(0, 1000, (P4K // 4,), dtype=torch.int32).view(torch.uint8)
    pages = torch.stack([relu, ints, torch.full((P4K,), 3, dtype=torch.uint8), x])
    payload, sizes, kinds = _check(pages if wide else _unaligned8(pages), element_size)
    assert kinds[0] == fmt.KIND_LZ4 | (fmt.element_shift(element_size) << 4)
    assert kinds[2] == fmt.KIND_FILL  # shuffle flag only on LZ4 pages


@interpret_only
@pytest.mark.parametrize("shift", [1, 4])
def test_unaligned_page_views(shift):
    """A page view that does not start on a 4-byte (8-byte) boundary compresses to the same
    blocks as an aligned copy."""
    relu = torch.relu(torch.randn(2 * P4K // 2, dtype=torch.bfloat16)).view(torch.uint8)
    buf = torch.zeros(2 * P4K + 8, dtype=torch.uint8)
    view = buf[shift:shift + 2 * P4K].view(2, P4K)
    view.copy_(relu.view(2, P4K))
    ref = lc.compress_pages(relu.view(2, P4K).clone(), 2)
    for a, b in zip(ref, lc.compress_pages(view, 2)):
        assert torch.equal(a, b)


@pytest.mark.slow  # non-default settings; the defaults are checked against the model above
@interpret_only
def test_config_variants_match_model():
    """Settings other than a page kind's own (``CompressConfig`` fields) still write the
    model's blocks, and bad ones are refused."""
    pages = _rows(_text_page()[: P4K // 2] + (_rand(50) * 50)[: P4K // 2])
    for window, known in ((64, 0), (512, 6)):  # known words: what the lazy step knows
        _check(pages, WINDOW=window, KNOWN_WORDS=known, MIN_MATCH=min(5, 4 + 4 * known))
    _check(pages, WINDOW=256, KNOWN_WORDS=0, MIN_MATCH=4, NEAR=5)
    # the parse options one at a time, and all of them off (the greedy parse before them)
    _check(pages, LAZY=False)
    _check(pages, MIN_MATCH=6)
    _check(pages, BACK=False)
    _check(pages, LAZY=False, MIN_MATCH=4, BACK=False)
    known = lc.compress_config(P4K, 1).KNOWN_WORDS
    with pytest.raises(ValueError, match="MIN_MATCH"):
        _config(MIN_MATCH=4 + 4 * known + 1)
    with pytest.raises(ValueError, match="ACCEL"):
        _config(ACCEL=1)  # window skipping is for bit planes only
    with pytest.raises(ValueError, match="ACCEL"):
        _config(P4K, 2, ACCEL=9)
    with pytest.raises(ValueError, match="config is for"):
        lc.compress_pages(pages, 2, config=_config())


@interpret_only
def test_planes_candidates_find_repeated_planes():
    """Bit-shuffled pages: a bit plane equal to the one before it, or to the one before that, is
    matched at one or two planes' distance with no hash table."""
    plane = P4K // 16
    planes = [_rand(plane) for _ in range(16)]
    planes[5] = planes[4]  # one plane back
    planes[9] = planes[7]  # two planes back
    shuffled = torch.frombuffer(bytearray(b"".join(planes)), dtype=torch.uint8)[None]
    page = bitunshuffle(shuffled, 2)  # the page whose bit-shuffle is `shuffled`
    payload, sizes, kinds = _check(page, 2)
    seqs = _sequences(payload[0, : int(sizes[0])].numpy().tobytes(), P4K)
    offsets = {off for _, off, ml in seqs if ml >= plane - 16}
    assert offsets == {plane, 2 * plane}, seqs


@pytest.mark.parametrize("element_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_still_plane_scan_finds_a_single_repeated_word(element_size):
    """The still-plane scan (64-bit loads) must mark live every plane that holds one repeated
    aligned word: pages of random (still) planes, one or two zero planes (so the pages store as
    LZ4), and one planted 5-byte repeat each (one aligned word), 4, 8, 16 bytes or one or two
    planes back, at the first words of the page and of a plane and at the last word that may
    start a match. The kernel writes the model's blocks, with a match there (interpreter and
    GPU)."""
    size, plane = P4K, P4K // (8 * element_size)
    wpp = plane // 4  # words per plane
    last = (size - 12) // 4  # the last word that may start a match
    cases = [(1, 1), (2, 1), (2, 2), (3, 2), (4, 4), (5, 4), (wpp, wpp), (wpp + 1, wpp),
             (2 * wpp, 2 * wpp), (3 * wpp - 1, 2 * wpp), (last, 1), (last - 1, 2), (last, wpp),
             (last, 2 * wpp)]
    rows = []
    for k, d in cases:
        page = bytearray(_rand(size))
        z = 8 * element_size - 4  # 256 zero bytes (whole planes) away from the planted words
        page[(z + 1) * plane - 256:(z + 1) * plane] = bytes(256)
        for b in range(4 * k, 4 * k + 5):  # word k alone repeats (forward: d 1 is a run)
            page[b] = page[b - 4 * d]
        rows.append(bitunshuffle(torch.frombuffer(page, dtype=torch.uint8)[None], element_size))
    pages = torch.cat(rows)
    if INTERPRET:
        got = _check(pages, element_size, ACCEL=0)  # ACCEL 0: every window of a live plane
    elif torch.cuda.is_available():  # the 64-bit loads where they run for real
        got = _gpu_check(pages, element_size, config=_config(P4K, element_size, ACCEL=0))
        exp = _model(pages, element_size, ACCEL=0)
        assert torch.equal(got[0], exp[0]) and torch.equal(got[1], exp[1])
    else:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    payload, sizes, kinds = got
    for i, (k, d) in enumerate(cases):
        assert int(kinds[i]) & 15 == fmt.KIND_LZ4, (k, d)
        op, covered = 0, False
        for lit, _, ml in _sequences(payload[i, : int(sizes[i])].numpy().tobytes(), size):
            op += lit
            covered |= ml > 0 and op <= 4 * k < op + ml
            op += ml
        assert covered, f"no match over the repeat at word {k}, {4 * d} bytes back"


@interpret_only
def test_planes_gate_passes_over_windows_without_repeated_words():
    """The gate searches a window only if one of its aligned words repeats (4, 8, 16 bytes or
    one or two planes back): a 7-byte run that covers no two equal aligned words (a match if
    its window were searched) stays literals."""
    plane = P4K // 16
    planes = [bytearray(_rand(plane)) for _ in range(16)]
    planes[5] = planes[4]
    planes[10][102:109] = b"\x07" * 7  # bytes 4k + 2 .. 4k + 8: no aligned word pair equal
    shuffled = torch.frombuffer(bytearray(b"".join(planes)), dtype=torch.uint8)[None]
    page = bitunshuffle(shuffled, 2)
    payload, sizes, _ = _check(page, 2, ACCEL=0)  # ACCEL 0: every window reaches the gate
    run = range(10 * plane + 102, 10 * plane + 109)
    op, covered = 0, set()
    for lit, _, ml in _sequences(payload[0, : int(sizes[0])].numpy().tobytes(), P4K):
        covered |= set(range(op + lit, op + lit + ml))
        op += lit + ml
    assert covered & set(range(5 * plane, 6 * plane)), "the repeated plane is a match"
    assert not covered & set(run), "the run in a still plane was searched"


@interpret_only
def test_table_near_distances():
    """Repeats closer than a sub-chunk of 32: only the direct distance checks find them."""
    runs = b"".join(_rand(d) * (40 // d) + _rand(9) for d in (1, 2, 3, 4, 8, 16))
    page = (runs * (P4K // len(runs) + 1))[:P4K]
    sizes = [int(_check(_rows(page), NEAR=n)[1][0]) for n in (0, 4)]
    assert sizes[1] <= sizes[0], sizes  # matches start earlier


@interpret_only
def test_64k_page_far_offset():
    size = 65536

    def edge():
        x = _rand(16)
        return x + b"q" * (size - 12 - 16) + x[:12]  # offset 65524: the largest a page allows

    page = _draw(edge, lambda s: size - 12 in _offsets(s), WINDOW=1024)
    _check(_rows(page), WINDOW=1024)  # big windows: fewer interpreter steps


# -------------------------------------------------------------------------- GPU tests
def _corpus_pages(n: int, size: int, seed: int) -> torch.Tensor:
    """Mixed pages on the CPU: text, random, zeros, patterns, bf16."""
    g = torch.Generator().manual_seed(seed)
    mods = (fmt, cpu_codec, lc, torch.nn.modules.conv)
    src = b"".join(open(m.__file__, "rb").read() for m in mods)
    text = np.frombuffer(src * (2 * size // len(src) + 2), dtype=np.uint8)
    out = torch.empty((n, size), dtype=torch.uint8)
    kinds = torch.randint(0, 5, (n,), generator=g)
    for i in range(n):
        k = int(kinds[i])
        if k == 0:
            start = int(torch.randint(0, len(text) - size, (1,), generator=g))
            out[i] = torch.from_numpy(text[start : start + size].copy())
        elif k == 1:
            out[i] = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
        elif k == 2:
            out[i] = int(torch.randint(0, 256, (1,), generator=g))
        elif k == 3:
            per = int(torch.randint(1, 300, (1,), generator=g))
            pat = torch.randint(0, 256, (per,), dtype=torch.uint8, generator=g)
            out[i] = pat.repeat(size // per + 1)[:size]
        else:
            out[i] = torch.randn(size // 2, generator=g).to(torch.bfloat16).view(torch.uint8)
    return out


def _gpu_check(pages_cpu: torch.Tensor, element_size: int = 1, config=None):
    pages = pages_cpu.cuda()
    payload, sizes, kinds = lc.compress_pages(pages, element_size, config=config)
    torch.cuda.synchronize()
    payload, sizes, kinds = payload.cpu(), sizes.cpu(), kinds.cpu()
    size = pages.shape[1]
    offsets = torch.arange(pages.shape[0], dtype=torch.int64) * size
    dec, status = cpu_codec.decompress_cpu(payload.view(-1), offsets, sizes, kinds, size)
    assert not status.any() and torch.equal(dec, pages_cpu)
    tail = torch.arange(size).unsqueeze(0) >= sizes.unsqueeze(1)
    assert not (payload * tail).any()
    return payload, sizes, kinds


@needs_cuda
@pytest.mark.parametrize("size", [4096, 8192, 16384, 32768, 65536])
@pytest.mark.parametrize("element_size", [1, 2, 4])
def test_gpu_round_trip_all_sizes(size, element_size):
    seed = random.getrandbits(31)
    n = max(8, (8 << 20) // size)
    _gpu_check(_corpus_pages(n, size, seed), element_size)


@needs_cuda
@pytest.mark.parametrize("element_size", [2, 4])
def test_gpu_shuffle_wide_same_bytes(element_size):
    """The bit-shuffle from 64-bit loads (8-byte aligned pages) gives the byte version's blocks
    (a page tensor 4-byte aligned only) exactly; one not 4-byte aligned is copied first."""
    seed = random.getrandbits(31)
    pages = _corpus_pages(2048, 4096, seed).cuda()
    ref = lc.compress_pages(_unaligned8(pages), element_size)
    buf = torch.empty(pages.numel() + 8, dtype=torch.uint8, device="cuda")
    for shift in (0, 8, 1, 3):  # 8-aligned (64-bit loads), misaligned (copied)
        src = buf[shift:shift + pages.numel()].view_as(pages)
        src.copy_(pages)
        got = lc.compress_pages(src, element_size)
        for a, b in zip(ref, got):
            assert torch.equal(a, b), f"offset {shift}"
    _gpu_check(pages.cpu(), element_size)


@needs_cuda
def test_gpu_matches_model_and_lz4_ratio():
    seed = random.getrandbits(31)
    text = np.frombuffer(open(fmt.__file__, "rb").read() * 64, dtype=np.uint8)
    n = 512
    starts = torch.randint(0, len(text) - P4K, (n,), generator=torch.Generator().manual_seed(seed))
    pages = torch.stack([torch.from_numpy(text[s : s + P4K].copy()) for s in starts.tolist()])
    payload, sizes, kinds = _gpu_check(pages)
    exp = _model(pages[:32])
    assert torch.equal(payload[:32], exp[0]) and torch.equal(sizes[:32], exp[1])
    ours = int(sizes.sum())
    ref = sum(
        min(len(lz4.block.compress(r.numpy().tobytes(), store_size=False)), P4K) for r in pages
    )
    assert ref / ours >= 0.98, f"ratio {ref / ours:.4f} of python-lz4 (seed {seed})"


@needs_cuda
@pytest.mark.parametrize("element_size", [2, 4])
def test_gpu_typed_default_matches_model(element_size):
    """Typed pages at the typed defaults (bit-plane candidates): the GPU writes the model's
    blocks (bf16 normal, ReLU and int32 pages)."""
    g = torch.Generator().manual_seed(random.getrandbits(31))
    rows = [torch.randn(P4K // 2, generator=g).to(torch.bfloat16).view(torch.uint8),
            torch.relu(torch.randn(P4K // 2, generator=g)).to(torch.bfloat16).view(torch.uint8),
            torch.randint(0, 5000, (P4K // 4,), generator=g, dtype=torch.int32).view(torch.uint8)]
    pages = torch.stack(rows * 8)
    payload, sizes, kinds = _gpu_check(pages, element_size)
    exp = _model(pages, element_size)
    assert torch.equal(payload, exp[0]) and torch.equal(sizes, exp[1])


@needs_cuda
def test_gpu_million_pages_bounded_memory():
    seed = random.getrandbits(31)
    n = 1 << 20  # 4 GiB of pages, compressed in slices of 128K pages
    base = _corpus_pages(4096, P4K, seed).cuda()
    total = 0
    for s in range(0, n, 1 << 17):
        idx = (torch.arange(s, s + (1 << 17), device="cuda") * 7919) % base.shape[0]
        pages = base[idx]
        payload, sizes, kinds = lc.compress_pages(pages)
        total += int(sizes.sum())
        if s == 0:
            sel = torch.randperm(1 << 17)[:256]
            _ = _gpu_check(pages[sel].cpu())
    assert total < n * P4K


@needs_cuda
def test_gpu_huge_batch_addressing():
    n = (1 << 31) // P4K + 1000  # past 2 GiB: int64 addressing
    pages = torch.zeros((n, P4K), dtype=torch.uint8, device="cuda")
    pages[-1] = torch.randint(0, 256, (P4K,), dtype=torch.uint8, device="cuda")
    pages[-2, ::3] = 7
    payload, sizes, kinds = lc.compress_pages(pages)
    assert kinds[-1] == fmt.KIND_RAW and torch.equal(payload[-1], pages[-1])
    assert kinds[-2] == fmt.KIND_LZ4 and kinds[0] == fmt.KIND_FILL
    last = payload[-2, : int(sizes[-2])].cpu().numpy().tobytes()
    assert lz4.block.decompress(last, uncompressed_size=P4K) == pages[-2].cpu().numpy().tobytes()


@needs_cuda
def test_gpu_graph_compile_and_stream():
    import torch_pagecomp  # noqa: F401  (registers torch.ops.pagecomp)

    pages = _corpus_pages(2048, P4K, random.getrandbits(31)).cuda()
    eager = lc.compress_pages(pages, 2)
    static = pages.clone()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lc.compress_pages(static, 2)  # warm up on a side stream before capture
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        captured = lc.compress_pages(static, 2)
    static.copy_(pages)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, captured))

    def f(x):
        return torch.ops.pagecomp.compress(x, 1)

    compiled = torch.compile(f, fullgraph=True)(pages)
    ref = lc.compress_pages(pages)
    assert all(torch.equal(a, b) for a, b in zip(compiled, ref))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000)
        out = lc.compress_pages(pages)
    side.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
