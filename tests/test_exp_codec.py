"""The exponent codec (EXP pages of bf16 / fp16 values, issue #23): the numpy reference
(``torch_pagecomp.exp_codec``) against a literal model of the format's text, the Triton kernels
(``torch_pagecomp.kernels.exp_codec``, under the interpreter here) bit-identical to the
reference, hostile pages, the ops and the API's ``codec=`` arguments.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import POISON
from pages import escape_rows_page, kernel_device, mixed_pages

import torch_pagecomp as pc
from torch_pagecomp import exp_codec as ec
from torch_pagecomp import format as fmt

CUDA = torch.cuda.is_available()
PAGE_SIZES = [4096, 8192, 16384, 32768, 65536]
LAYOUTS = {"bf16": (fmt.EXP_BF16, torch.bfloat16), "fp16": (fmt.EXP_FP16, torch.float16)}
STATUS_GUARD = -0x5A5A5A5B


def float_pages(gen: torch.Generator, page_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``uint8 [8, page_size]`` pages of ``dtype`` values of every exponent shape: normal,
    one value (one exponent), random bits (every exponent), NaN / Inf / denormals / -0, zeros
    (FILL), exponents spread far wider than 7 values, three exponents (a table with absent
    entries), and a normal page whose last value's exponent occurs once (one escape)."""
    n = page_size // 2
    bits = torch.randint(0, 1 << 16, (n,), generator=gen, dtype=torch.int32).to(torch.int16)
    tiny = 1e-40 if dtype == torch.bfloat16 else 1e-7  # a denormal of each
    few = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (n,), generator=gen)]
    mantissa = 1 + torch.rand(n, generator=gen) / 2  # [1, 1.5): never rounds up to 2
    escape = 2.0 ** torch.randint(-3, 4, (n,), generator=gen) * mantissa
    escape[-1] = 1e4  # 7 exponents, then one more
    rows = [
        torch.randn(n, generator=gen) * 0.02,
        torch.full((n,), 1.5),
        bits.view(dtype),
        torch.tensor([float("nan"), float("inf"), -float("inf"), tiny, -0.0] * (n // 5)
                     + [0.0] * (n % 5)),
        torch.zeros(n),
        torch.randn(n, generator=gen) * torch.logspace(-4, 4, n),
        few * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0),
        escape,
    ]
    return torch.stack([r.to(dtype).view(torch.uint8) for r in rows])


# ------------------------------------------------------------------------ the format
def model_encode_page(page: bytes, layout: int) -> bytes:
    """One page, written value by value from the words of ``format``'s docstring (an
    independent model of the reference; EXP bytes only, no RAW / FILL decision)."""
    v = np.frombuffer(page, dtype="<u2").astype(int).tolist()
    if layout == fmt.EXP_BF16:
        e = [(x >> 7) & 255 for x in v]
        r = [((x >> 8) & 0x80) | (x & 0x7F) for x in v]
        h = None
    else:
        e = [(x >> 10) & 31 for x in v]
        r = [x & 0xFF for x in v]
        h = [((x >> 13) & 4) | ((x >> 8) & 3) for x in v]
    bins = 256 if layout == fmt.EXP_BF16 else 32
    sample = [x for i, x in enumerate(e) if i % (8 * fmt.EXP_SAMPLE) < 8]  # rows 0, 4, 8 ..
    table = sorted(range(bins), key=lambda x: (-sample.count(x), x))[:7]
    c = [table.index(x) if x in table else 7 for x in e]

    def stream3(fields):
        out = bytearray()
        for g in range(0, len(fields), 8):
            w = sum(f << (3 * t) for t, f in enumerate(fields[g:g + 8]))
            out += w.to_bytes(3, "little")
        return bytes(out)

    out = bytes(table) + stream3(c) + (stream3(h) if h is not None else b"") + bytes(r)
    return out + bytes(x for x, k in zip(e, c) if k == 7)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_reference_writes_the_documented_bytes(name, gen):
    layout, dtype = LAYOUTS[name]
    pages = float_pages(gen, 4096, dtype)
    payload, sizes, kinds = ec.compress_exp_cpu(pages, layout)
    for i in range(pages.shape[0]):
        want = model_encode_page(bytes(pages[i].numpy()), layout)
        assert len(want) >= fmt.exp_fixed_bytes(4096, layout)
        if int(kinds[i]) == fmt.KIND_FILL:
            assert i == 4 and int(sizes[i]) == 1 and not payload[i].any()
        elif len(want) > fmt.lz4_keep_limit(4096):
            assert int(kinds[i]) == fmt.KIND_RAW and int(sizes[i]) == 4096
            assert torch.equal(payload[i], pages[i])
        else:
            assert int(kinds[i]) == fmt.KIND_EXP | layout << 4
            assert int(sizes[i]) == len(want)
            assert bytes(payload[i, :len(want)].numpy()) == want, i
            assert not payload[i, len(want):].any()  # the rest of the row is zero
    assert int(kinds[2]) == fmt.KIND_RAW  # random bits: more escapes than the limit allows
    f = fmt.exp_fixed_bytes(4096, layout)
    assert int(sizes[1]) == f and int(sizes[6]) == f and int(sizes[7]) == f + 1


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_reference_round_trip(name, page_size, gen):
    layout, dtype = LAYOUTS[name]
    pages = float_pages(gen, page_size, dtype)
    payload, sizes, kinds = ec.compress_exp_cpu(pages, layout)
    assert (sizes <= page_size).all()
    n = pages.shape[0]
    offsets = torch.arange(n, dtype=torch.int64) * page_size
    out, status = ec.decompress_exp_cpu(payload.view(-1), offsets, sizes, kinds, page_size)
    assert not status.any() and torch.equal(out, pages)
    packed = pc.pack(pc.CompressedPages(payload, sizes, kinds, page_size, codec="exp"))
    assert torch.equal(pc.decompress(packed, backend="cpu"), pages)


# ------------------------------------------------------------------------- kernels
def kernel_round_trip(pages: torch.Tensor, fp16: bool, shift: int = 0) -> None:
    """Kernel encode and decode of ``pages`` against the reference: payload, sizes and kinds
    bit-identical (outputs poisoned first, nothing written around them), then the decode of
    the kernel's payload bit-identical to the reference's, in rows ``shift`` bytes off
    alignment (an odd ``shift`` takes the byte-pair path)."""
    from torch_pagecomp.kernels import exp_codec as kx

    dev = kernel_device()
    n, p = pages.shape
    layout = fmt.EXP_FP16 if fp16 else fmt.EXP_BF16
    want = ec.compress_exp_cpu(pages, layout)
    src = torch.full((n * p + shift,), POISON, dtype=torch.uint8, device=dev)
    src[shift:].copy_(pages.view(-1))
    got = kx.compress_exp_pages(src[shift:].view(n, p), fp16)
    for a, b in zip(want, got):
        assert torch.equal(a, b.cpu())
    buf = torch.full((2 * 64 + shift + n * p,), POISON, dtype=torch.uint8, device=dev)
    sbuf = torch.full((n + 2,), STATUS_GUARD, dtype=torch.int32, device=dev)
    out, status = buf[64 + shift:64 + shift + n * p].view(n, p), sbuf[1:n + 1]
    offsets = torch.arange(n, dtype=torch.int64, device=dev) * p
    kx.decompress_exp_into(got[0].view(-1), offsets, got[1], got[2], out, status)
    assert not status.any() and torch.equal(out.cpu(), pages)
    assert (buf[:64 + shift] == POISON).all() and (buf[64 + shift + n * p:] == POISON).all()
    assert int(sbuf[0]) == STATUS_GUARD and int(sbuf[-1]) == STATUS_GUARD


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_kernels_equal_reference(name, gen):
    _, dtype = LAYOUTS[name]
    kernel_round_trip(float_pages(gen, 4096, dtype), name == "fp16")


def exponent_page(gen: torch.Generator, counts: dict[int, int], n: int = 2048) -> torch.Tensor:
    """``uint8 [2n]``: a bf16 page whose sampled values (``format.EXP_SAMPLE``: the ``n / 4``
    values the table counts) have ``counts[x]`` values of exponent ``x`` (at most ``n / 4`` in
    all; the rest of them
    exponent 0), at random places, the other values the same exponents three times over,
    with random signs and mantissas."""
    s = n // fmt.EXP_SAMPLE
    e_s = torch.zeros(s, dtype=torch.int32)
    at = 0
    for x, c in counts.items():
        e_s[at:at + c] = x
        at += c
    assert at <= s
    e_s = e_s[torch.randperm(s, generator=gen)]
    sampled = torch.arange(n) % (8 * fmt.EXP_SAMPLE) < 8
    e = torch.empty(n, dtype=torch.int32)
    e[sampled] = e_s
    e[~sampled] = e_s.repeat(fmt.EXP_SAMPLE - 1)[torch.randperm(n - s, generator=gen)]
    low = torch.randint(0, 1 << 7, (n,), generator=gen, dtype=torch.int32)
    sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int32) << 15
    return (sign | (e << 7) | low).to(torch.int16).view(torch.uint8)


def test_kernels_table_from_a_window_equals_all_exponents(gen):
    """The 4 KiB bf16 encoder counts the sampled exponents in 32 bins (zero, the 30 exponents
    up to the sample's largest, the rest) and falls back to all 256 where the rest could
    reach the table: pages on each side of that rule give the reference's bytes (the 7 most
    frequent of all 256 sampled)."""
    def r(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=gen))

    bulk = {x: r(25, 39) for x in range(100, 113)}  # 13 exponents, ~410 values
    pages = [
        {**bulk, 250: 1},  # the bulk far below the largest: all of it in the rest
        {**{x: r(15, 30) for x in range(120, 136)}, 150: 1},  # 120 in the rest
        # the rest (exponent 170) ties the 7th entry (194): the smaller exponent wins the tie
        {200: 100, 199: 75, 198: 75, 197: 50, 196: 50, 195: 40, 194: 25, 170: 25,
         **{x: 9 for x in range(186, 194)}},
        {0: 175, 120: 150, 121: 125},  # 3 exponents, the largest above 30: absent ones fill
        {0: 75, 5: 225, 20: 150},  # 3 exponents all below 30: the window holds them all
        {255: r(125, 225), 254: 100, 200: 75},  # Inf / NaN exponents
        {**{x: r(25, 38) for x in range(150, 161)}, 100: 1},  # a rest below the 7th
        {130: 125, 101: 75, 100: r(1, 100), 120: 50},  # the window's lowest exponent
        {x: r(1, 14) for x in range(0, 256, 7)},  # 37 exponents, spread
    ]
    kernel_round_trip(torch.stack([exponent_page(gen, c) for c in pages]), False)


@pytest.mark.parametrize("page_size", [4096, 32768])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_kernels_decode_rows_of_few_and_many_escapes(name, page_size, gen):
    """The decoder loads a row's first two escapes once for the row where no row of its step
    has more than two, and each escape on its own where one has three or more
    (``kernels.exp_codec._decode_step``): pages on each side of that rule, escapes at a row's
    first and last fields and side by side; at 32 KiB (two steps under the interpreter) one
    step on each side, both orders."""
    n = page_size // 2
    half = n // 16  # the first row of the second half (a step of 8192 values at 32 KiB)
    few = {0: [0, 7], 3: [3, 4], 9: [5], half - 1: [6, 7]}
    many = {2: [0, 1, 2], 5: [1, 4, 6, 7], 11: list(range(8))}
    later = {half + g: fields for g, fields in few.items()}
    layouts = [{}, few, many, {**few, **many}, {**few, 2: [0, 3, 7]},  # (three: the least)
               {g: [1, 2] for g in range(0, n // 8, 3)}]
    if page_size > 4096:  # the steps take different paths, each way round
        layouts += [{**few, **{half + g: f for g, f in many.items()}}, {**many, **later}]
    fp16 = name == "fp16"
    pages = torch.stack([escape_rows_page(gen, n, rows, fp16) for rows in layouts])
    kinds = ec.compress_exp_cpu(pages, LAYOUTS[name][0])[2]
    assert ((kinds & 15) == fmt.KIND_EXP).all()  # (every page through the EXP decode)
    kernel_round_trip(pages, fp16)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_kernels_fill_pages_and_pages_one_byte_from_it(name, gen):
    """A page of one repeated byte (any byte) is FILL; one differing byte anywhere makes it
    EXP or RAW. The encoder compares values only on pages whose exponents are all one, so
    both sides of that are checked against the reference."""
    n = 4096
    rows = []
    for byte in (0x00, 0x41, 0x80, 0xFF, int(torch.randint(0, 256, (1,), generator=gen))):
        page = torch.full((n,), byte, dtype=torch.uint8)
        rows.append(page.clone())
        at = int(torch.randint(0, n, (1,), generator=gen))
        page[at] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
        rows.append(page)
    kernel_round_trip(torch.stack(rows), name == "fp16")


@pytest.mark.parametrize("shift", [0, 1, 2, 4, 8])
def test_kernels_write_every_byte_of_a_poisoned_payload(shift, gen):
    """The encoder writes each payload row whole (its bytes past the page's size zero) into a
    poisoned ``out=`` payload at any alignment (the 8-byte word path and the byte path), and
    nothing around it."""
    from torch_pagecomp.kernels import exp_codec as kx

    dev = kernel_device()
    pages = torch.cat([float_pages(gen, 4096, dtype) for dtype in (torch.bfloat16, torch.float16)])
    p = pages.shape[1]
    for fp16, rows in ((False, pages[:8]), (True, pages[8:])):
        want = ec.compress_exp_cpu(rows, fmt.EXP_FP16 if fp16 else fmt.EXP_BF16)
        buf = torch.full((64 + shift + 8 * p + 64,), POISON, dtype=torch.uint8, device=dev)
        out = (buf[64 + shift:64 + shift + 8 * p].view(8, p),
               torch.empty(8, dtype=torch.int32, device=dev),
               torch.empty(8, dtype=torch.uint8, device=dev))
        kx.compress_exp_pages(rows.to(dev), fp16, out=out)
        for a, b in zip(want, out):
            assert torch.equal(a, b.cpu())
        assert (buf[:64 + shift] == POISON).all() and (buf[64 + shift + 8 * p:] == POISON).all()


@pytest.mark.parametrize("shift", [1, 2])
def test_kernels_misaligned_rows(shift, gen):
    """Rows at odd addresses (views of ``uint8`` tensors) go through byte pairs."""
    kernel_round_trip(float_pages(gen, 4096, torch.bfloat16)[[0, 2, 4, 7]], False, shift)


@pytest.mark.parametrize("page_size", [8192, 16384])
def test_kernels_larger_pages(page_size, gen):
    """Pages of several steps (the interpreter's step is 8192 values, a 16 KiB page)."""
    pages = torch.cat([float_pages(gen, page_size, torch.bfloat16)[[0, 5, 7]],
                       float_pages(gen, page_size, torch.float16)[[0, 3]]])
    kernel_round_trip(pages[:3], False)
    kernel_round_trip(pages[3:], True)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [32768, 65536])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_kernels_largest_pages(name, page_size, gen):
    _, dtype = LAYOUTS[name]
    kernel_round_trip(float_pages(gen, page_size, dtype), name == "fp16")


# -------------------------------------------------------------------- hostile pages
def hostile_batch(gen: torch.Generator, page_size: int = 4096):
    """A packed payload of valid pages of both layouts (and RAW, FILL) and mutated copies:
    sizes off by one, under the fixed part, over the limit, 0 and negative; offsets outside
    the payload; every kind byte that is not this decoder's; random code bytes; fp16 tables
    and escapes with high bits set; LZ4 pages. Returns ``(payload, offsets, sizes, kinds)``
    on the CPU."""
    p = page_size
    bf = float_pages(gen, p, torch.bfloat16)[[0, 2, 4, 7]]
    hf = float_pages(gen, p, torch.float16)[[0, 7]]
    a = ec.compress_exp_cpu(bf, fmt.EXP_BF16)
    b = ec.compress_exp_cpu(hf, fmt.EXP_FP16)
    lz = pc.compress(mixed_pages(3, p, gen), element_size=2, backend="cpu")
    payload = torch.cat([a[0], b[0], lz.payload])
    sizes = torch.cat([a[1], b[1], lz.sizes])
    kinds = torch.cat([a[2], b[2], lz.kinds])
    rows = list(range(payload.shape[0]))
    exp_rows = [i for i in rows if int(kinds[i]) & 15 == fmt.KIND_EXP]
    f = {r: fmt.exp_fixed_bytes(p, int(kinds[r]) >> 4) for r in exp_rows}
    entries = [(r, int(sizes[r]), int(kinds[r])) for r in rows]  # valid pages first
    for r in exp_rows:
        s, k = int(sizes[r]), int(kinds[r])
        entries += [(r, s + 1, k), (r, s - 1, k), (r, f[r] - 1, k), (r, p - p // 32 + 1, k),
                    (r, 0, k), (r, -7, k), (r, p, k)]
        entries += [(r, s, kk) for kk in (0x03, 0x33, 0xF3, 0x13 ^ 0x30, 0x01, 0x11, 0x04,
                                          0x10, 0x12)]
    rng = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    extra = []
    for r in exp_rows:  # random code bytes: the escapes they count disagree with the size
        row = payload[r].clone()
        row[7:7 + 64] = torch.randint(0, 256, (64,), generator=rng, dtype=torch.uint8)
        extra.append((row, int(sizes[r]), int(kinds[r])))
    r = next(r for r in exp_rows if int(kinds[r]) == fmt.KIND_EXP_FP16 and
             int(sizes[r]) > f[r])
    row = payload[r].clone()  # fp16: table and escape bytes with their high bits set
    row[:7] |= 0xE0
    row[f[r]:int(sizes[r])] |= 0x60
    extra.append((row, int(sizes[r]), int(kinds[r])))
    parts, offs, szs, kds, at = [], [], [], [], 0
    for r, s, k in entries:
        keep = max(0, min(s, p))
        parts.append(payload[r, :keep])
        offs.append(at)
        szs.append(s)
        kds.append(k)
        at += keep
    for row, s, k in extra:
        parts.append(row[:s])
        offs.append(at)
        szs.append(s)
        kds.append(k)
        at += s
    flat = torch.cat(parts)
    offs += [at - 10, at + 5, -3, 1 << 40]  # pages ending past, starting past, before, far
    szs += [int(sizes[exp_rows[0]])] * 4
    kds += [int(kinds[exp_rows[0]])] * 4
    return (flat, torch.tensor(offs, dtype=torch.int64), torch.tensor(szs, dtype=torch.int32),
            torch.tensor(kds, dtype=torch.uint8))


def test_hostile_pages_reference_statuses(gen):
    payload, offsets, sizes, kinds = hostile_batch(gen)
    out, status = ec.decompress_exp_cpu(payload, offsets, sizes, kinds, 4096)
    st = status.tolist()
    assert set(st) == {fmt.STATUS_OK, fmt.STATUS_BAD_KIND, fmt.STATUS_BAD_SIZE}
    assert not out[status != 0].any()  # failed pages zero-filled
    lz4 = ((kinds & 15) == fmt.KIND_LZ4)
    assert (status[lz4] == fmt.STATUS_BAD_KIND).all()
    assert (status[-4:] == fmt.STATUS_BAD_SIZE).all()
    # the LZ4 decoder: EXP pages are not its kind
    _, lz_status = pc.decompress(pc.CompressedPages(payload, sizes, kinds, 4096,
                                                    torch.cat([offsets, offsets[-1:]])),
                                 return_status=True, backend="cpu", codec="lz4")
    exp = (kinds & 15) == fmt.KIND_EXP
    assert (lz_status[exp] == fmt.STATUS_BAD_KIND).all()


def test_hostile_pages_kernel_equals_reference(gen):
    """Statuses and bytes of the kernel equal the reference's; outputs sit between poisoned
    guards (nothing written outside them; misaligned rows)."""
    from torch_pagecomp.kernels import exp_codec as kx

    dev = kernel_device()
    payload, offsets, sizes, kinds = hostile_batch(gen)
    want, want_status = ec.decompress_exp_cpu(payload, offsets, sizes, kinds, 4096)
    n = sizes.shape[0]
    guard = 33
    buf = torch.full((2 * guard + n * 4096,), POISON, dtype=torch.uint8, device=dev)
    sbuf = torch.full((n + 2,), STATUS_GUARD, dtype=torch.int32, device=dev)
    out, status = buf[guard:guard + n * 4096].view(n, 4096), sbuf[1:n + 1]
    kx.decompress_exp_into(*(t.to(dev) for t in (payload, offsets, sizes, kinds)), out, status)
    assert status.cpu().tolist() == want_status.tolist()
    assert torch.equal(out.cpu(), want)
    assert (buf[:guard] == POISON).all() and (buf[guard + n * 4096:] == POISON).all()
    assert int(sbuf[0]) == STATUS_GUARD and int(sbuf[-1]) == STATUS_GUARD


def scattered_rows(gen: torch.Generator, n: int, p: int, dev) -> tuple[torch.Tensor, list]:
    """A poisoned ``uint8`` buffer with room for ``n`` rows of ``p`` bytes apart, and the
    rows' byte offsets in it: a random order of places, at addresses of every residue mod 4
    (odd ones take the byte-pair path), gaps between them."""
    gap = 64 + 7
    buf = torch.full((n * (p + gap) + gap,), POISON, dtype=torch.uint8, device=dev)
    order = torch.randperm(n, generator=gen)
    shift = torch.randint(0, 8, (n,), generator=gen)
    shift[:4] = torch.tensor([0, 1, 2, 3])  # every residue mod 4, whatever the draw
    return buf, [gap + int(order[i]) * (p + gap) + int(shift[i]) for i in range(n)]


def test_rows_by_address_equal_reference(gen):
    """``decompress_exp_rows``: the hostile batch (valid pages of both layouts, RAW, FILL,
    and every failure) each into its own row of a poisoned buffer, in a random order of rows,
    at addresses of every residue mod 4 (odd ones take the byte-pair path): bytes and statuses
    are the reference's and ``decompress_exp_into``'s, and no byte between rows is written."""
    from torch_pagecomp.kernels import exp_codec as kx

    dev = kernel_device()
    p = 4096
    payload, offsets, sizes, kinds = hostile_batch(gen)
    want, want_status = ec.decompress_exp_cpu(payload, offsets, sizes, kinds, p)
    assert set(want_status.tolist()) == {fmt.STATUS_OK, fmt.STATUS_BAD_KIND, fmt.STATUS_BAD_SIZE}
    n = sizes.shape[0]
    meta = [t.to(dev) for t in (payload, offsets, sizes, kinds)]
    buf, starts = scattered_rows(gen, n, p, dev)
    rows = torch.tensor([buf.data_ptr() + a for a in starts], dtype=torch.int64, device=dev)
    sbuf = torch.full((n + 2,), STATUS_GUARD, dtype=torch.int32, device=dev)
    kx.decompress_exp_rows(*meta, rows, p, sbuf[1:n + 1])
    assert sbuf[1:n + 1].cpu().tolist() == want_status.tolist()
    assert int(sbuf[0]) == STATUS_GUARD and int(sbuf[-1]) == STATUS_GUARD
    mask = torch.ones(buf.numel(), dtype=torch.bool, device=dev)
    for i, a in enumerate(starts):
        assert torch.equal(buf[a:a + p].cpu(), want[i]), f"page {i} (row at +{a})"
        mask[a:a + p] = False
    assert (buf[mask] == POISON).all(), "wrote between rows"
    into = torch.full((n, p), POISON, dtype=torch.uint8, device=dev)
    into_status = torch.full((n,), STATUS_GUARD, dtype=torch.int32, device=dev)
    kx.decompress_exp_into(*meta, into, into_status)  # the contiguous launcher agrees
    assert into_status.cpu().tolist() == want_status.tolist()
    with pytest.raises(ValueError, match="int64"):
        kx.decompress_exp_rows(*meta, rows.to(torch.int32), p, sbuf[1:n + 1])
    with pytest.raises(ValueError, match="page size"):
        kx.decompress_exp_rows(*meta, rows, 3000, sbuf[1:n + 1])
    sbuf.fill_(STATUS_GUARD)
    kx.decompress_exp_rows(*meta, rows[:0], p, sbuf[1:1])  # no pages: nothing launched
    assert (sbuf == STATUS_GUARD).all()


def test_encode_rows_by_address_equal_reference(gen):
    """``compress_exp_rows``: pages of both layouts read by address (a batch's members where
    they lie), in a random order of places in a poisoned buffer at every residue mod 4 (odd
    ones take the byte-pair path), encode to the reference's bytes, sizes and kinds, into a
    poisoned payload written whole; the pages' buffer is not written."""
    from torch_pagecomp.kernels import exp_codec as kx

    dev = kernel_device()
    p = 4096
    for fp16, dtype in ((False, torch.bfloat16), (True, torch.float16)):
        pages = float_pages(gen, p, dtype)
        n = pages.shape[0]
        want = ec.compress_exp_cpu(pages, fmt.EXP_FP16 if fp16 else fmt.EXP_BF16)
        buf, starts = scattered_rows(gen, n, p, dev)
        for i, a in enumerate(starts):
            buf[a:a + p] = pages[i].to(dev)
        before = buf.clone()
        rows = torch.tensor([buf.data_ptr() + a for a in starts], dtype=torch.int64, device=dev)
        out = (torch.full((n, p), POISON, dtype=torch.uint8, device=dev),
               torch.full((n,), STATUS_GUARD, dtype=torch.int32, device=dev),
               torch.full((n,), 0xEE, dtype=torch.uint8, device=dev))
        kx.compress_exp_rows(rows, p, fp16, out)
        for a, b in zip(want, out):
            assert torch.equal(a, b.cpu())
        assert torch.equal(buf.cpu(), before.cpu()), "wrote into the pages' buffer"
    with pytest.raises(ValueError, match="page size"):
        kx.compress_exp_rows(rows, 3000, False, out)


@pytest.mark.parametrize("by_rows", [False, True])
def test_placed_encoder_lays_pages_end_to_end(gen, by_rows):
    """``compress_exp_placed`` (the activation store's encoder, whose pages the copy engine
    sends): every page of both layouts (fill, raw, escapes, NaN / Inf, ...), read in place or
    by address from scattered rows, lies at its ``rel`` with the reference's bytes, sizes and
    kinds, zeros up to the next 16 bytes; the pages tile ``[start, end)`` exactly, from a
    counter that did not start at 0, and the poisoned payload past ``end`` is not written."""
    from torch_pagecomp.kernels import exp_codec as kx

    dev = kernel_device()
    p = 4096
    for fp16, dtype in ((False, torch.bfloat16), (True, torch.float16)):
        pages = torch.cat([float_pages(gen, p, dtype)] * 2)
        pages = pages[torch.randperm(pages.shape[0], generator=gen)]
        n = pages.shape[0]
        want = ec.compress_exp_cpu(pages, fmt.EXP_FP16 if fp16 else fmt.EXP_BF16)
        if by_rows:
            buf, starts = scattered_rows(gen, n, p, dev)
            for i, a in enumerate(starts):
                buf[a:a + p] = pages[i].to(dev)
            src = torch.tensor([buf.data_ptr() + a for a in starts], dtype=torch.int64,
                               device=dev)
        else:
            src = pages.to(dev)
        start = 16 * int(torch.randint(0, 8, (), generator=gen))
        payload = torch.full((n * p + 4096,), POISON, dtype=torch.uint8, device=dev)
        out = (payload, torch.full((n,), STATUS_GUARD, dtype=torch.int32, device=dev),
               torch.full((n,), 0xEE, dtype=torch.uint8, device=dev),
               torch.full((n,), -1, dtype=torch.int64, device=dev),
               torch.tensor([start], dtype=torch.int64, device=dev))
        kx.compress_exp_placed(src, fp16, out, page_size=p)
        got, sizes, kinds, rel, end = (t.cpu() for t in out)
        assert torch.equal(sizes, want[1]) and torch.equal(kinds, want[2])
        padded = (sizes.to(torch.int64) + 15) // 16 * 16
        assert int(end) == start + int(padded.sum())
        order = torch.argsort(rel)  # the pages tile [start, end): each where the last ended
        assert torch.equal(rel[order], start + torch.cumsum(padded[order], 0) - padded[order])
        for i in range(n):
            a, k = int(rel[i]), int(sizes[i])
            assert torch.equal(got[a:a + k], want[0][i, :k]), f"page {i}"
            assert (got[a + k:a + int(padded[i])] == 0).all(), f"page {i}'s padding"
        assert (got[:start] == POISON).all() and (got[int(end):] == POISON).all()
    with pytest.raises(ValueError, match="16-byte aligned"):
        kx.compress_exp_placed(pages.to(dev), False, (payload[1:],) + out[1:])


# ------------------------------------------------------------------------- ops, API
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_api_round_trip_every_backend_and_container(name, gen):
    _, dtype = LAYOUTS[name]
    pages = float_pages(gen, 4096, dtype)
    backends = ["cpu"] + (["triton"] if CUDA or os.environ.get("TRITON_INTERPRET") == "1"
                          else [])
    results = []
    for be in backends:
        c = pc.compress(pages.view(-1), codec=f"exp-{name}", backend=be, checksum=True)
        assert c.codec == "exp"
        results.append(c)
        assert torch.equal(pc.decompress(c, backend=be), pages)
        assert torch.equal(pc.decompress(pc.pack(c), backend=be), pages)
        _, status = pc.decompress(c, backend=be, codec="lz4", return_status=True)
        assert (status[c.kinds == (fmt.KIND_EXP | LAYOUTS[name][0] << 4)] ==
                fmt.STATUS_BAD_KIND).all()
    for a, b in zip(results, results[1:]):
        for t, u in ((a.payload, b.payload), (a.sizes, b.sizes), (a.kinds, b.kinds)):
            assert torch.equal(t.cpu(), u.cpu())


def test_any_decodes_a_mix_of_both_codecs(gen):
    """A container that mixes LZ4 and EXP pages (packed from both codecs' outputs)."""
    lz_pages = mixed_pages(4, 4096, gen)
    fl_pages = float_pages(gen, 4096, torch.bfloat16)
    a = pc.pack(pc.compress(lz_pages, backend="cpu"))
    b = pc.pack(pc.compress(fl_pages, codec="exp-bf16", backend="cpu"))
    mixed = pc.CompressedPages(torch.cat([a.payload, b.payload]), torch.cat([a.sizes, b.sizes]),
                               torch.cat([a.kinds, b.kinds]), 4096,
                               torch.cat([a.offsets, b.offsets[1:] + a.offsets[-1]]))
    assert torch.equal(pc.decompress(mixed, codec="any"), torch.cat([lz_pages, fl_pages]))
    with pytest.raises(pc.CorruptPageError):
        pc.decompress(mixed)  # the container says lz4: the EXP pages are not its kind


def test_default_calls_unchanged(gen):
    pages = mixed_pages(7, 4096, gen)
    c = pc.compress(pages)
    ref = torch.ops.pagecomp.compress(pages, 1)
    assert c.codec == "lz4"
    assert all(torch.equal(x, y) for x, y in zip((c.payload, c.sizes, c.kinds), ref))
    c2 = pc.compress(pages, element_size=2, codec="lz4")
    ref2 = torch.ops.pagecomp.compress(pages, 2)
    assert all(torch.equal(x, y) for x, y in zip((c2.payload, c2.sizes, c2.kinds), ref2))
    assert not (c.kinds & 15 == fmt.KIND_EXP).any()


@pytest.mark.parametrize("kwargs, match", [
    (dict(codec="exp-bf16", element_size=4), "element_size must be 2"),
    (dict(codec="exp-fp16", element_size=1), "element_size must be 2"),
    (dict(codec="exp"), "codec must be one of"),
    (dict(codec="zstd"), "codec must be one of"),
    (dict(codec="lz4", element_size=3), "element_size must be one of"),
])
def test_bad_codec_arguments(kwargs, match):
    pages = torch.zeros((2, 4096), dtype=torch.uint8)
    with pytest.raises(pc.PageCompError, match=match):
        pc.compress(pages, **kwargs)


def test_bad_decoder_and_container_codec():
    c = pc.compress(torch.zeros((2, 4096), dtype=torch.uint8), codec="exp-bf16")
    with pytest.raises(pc.PageCompError, match="codec must be None or one of"):
        pc.decompress(c, codec="exp-bf16")
    with pytest.raises(pc.PageCompError, match="codec must be one of"):
        pc.decompress(pc.CompressedPages(c.payload, c.sizes, c.kinds, 4096, codec="zstd"))
    with pytest.raises(pc.PageCompError, match="float_format must be one of"):
        torch.ops.pagecomp.compress_exp(torch.zeros((2, 4096), dtype=torch.uint8), "fp32")
    with pytest.raises(pc.PageCompError, match="pagecomp.decompress_exp: .*kinds"):
        torch.ops.pagecomp.decompress_exp(c.payload.view(-1), torch.zeros(2, dtype=torch.int64),
                                          c.sizes, c.kinds.int(), 4096)


def test_fake_shapes_and_opcheck(gen):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.library import opcheck

    with FakeTensorMode():
        pages = torch.empty((10, 8192), dtype=torch.uint8)
        payload, sizes, kinds = torch.ops.pagecomp.compress_exp(pages, "fp16")
        assert payload.shape == (10, 8192) and sizes.dtype == torch.int32
        out, status = torch.ops.pagecomp.decompress_exp(
            payload.view(-1), torch.empty(10, dtype=torch.int64), sizes, kinds, 8192)
        assert out.shape == (10, 8192) and status.dtype == torch.int32
    pages = float_pages(gen, 4096, torch.bfloat16)[:3]
    c = pc.compress(pages, codec="exp-bf16", backend="cpu")
    opcheck(torch.ops.pagecomp.compress_exp.default, (pages, "bf16"))
    opcheck(torch.ops.pagecomp.decompress_exp.default,
            (c.payload.view(-1), c.page_offsets(), c.sizes, c.kinds, 4096))


# ------------------------------------------------------------------------ GPU only
@pytest.mark.skipif(not CUDA or os.environ.get("TRITON_INTERPRET") == "1", reason="needs CUDA")
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_gpu_round_trip_equals_reference(page_size, gen):
    """Every page size and layout on the GPU, 64 pages of each shape: bytes, sizes, kinds and
    pages equal the reference's; CUDA graphs and ``torch.compile`` give the same."""
    torch.compiler.reset()  # one lambda per layout, compiled anew for every page size
    for name, (layout, dtype) in LAYOUTS.items():
        pages = torch.cat([float_pages(gen, page_size, dtype)] * 8)
        want = ec.compress_exp_cpu(pages, layout)
        gpu = pages.cuda()
        c = pc.compress(gpu, codec=f"exp-{name}")
        for a, b in zip(want, (c.payload, c.sizes, c.kinds)):
            assert torch.equal(a, b.cpu())
        assert torch.equal(pc.decompress(c), gpu)
        assert torch.equal(pc.decompress(pc.pack(c)), gpu)
        compiled = torch.compile(lambda x, f=name: torch.ops.pagecomp.compress_exp(x, f),
                                 fullgraph=True)(gpu)
        assert all(torch.equal(a, b.cpu()) for a, b in zip(want, compiled))
        graph = torch.cuda.CUDAGraph()
        args = (c.payload.view(-1), c.page_offsets(), c.sizes, c.kinds, page_size)
        torch.ops.pagecomp.decompress_exp(*args)  # compiled before capture
        with torch.cuda.graph(graph):
            out, status = torch.ops.pagecomp.decompress_exp(*args)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gpu) and not status.any()


# --------------------------------------------------------------------- mutation fuzz (GPU)
def _exp_fuzz_chunk(base, base_sizes, base_kinds, n, g):
    """``n`` mutated copies of rows of ``base`` (EXP, RAW and FILL pages, ``uint8 [B, P]`` on
    the GPU) as a fixed-stride payload: bit flips anywhere in the stored bytes (codes, table,
    escapes, sign and mantissa), byte overwrites, sizes cut or grown, kind bytes changed (the
    other layout, any byte), offsets moved; ``pure`` marks unmutated rows, ``pick`` bases."""
    dev, (b, p) = base.device, base.shape
    pick = torch.randint(0, b, (n,), device=dev, generator=g)
    rows, sizes, kinds = base[pick], base_sizes[pick].clone(), base_kinds[pick].clone()
    what = torch.randint(0, 16, (n,), device=dev, generator=g)
    idx = torch.arange(n, device=dev)
    u = lambda hi: (torch.rand(n, device=dev, generator=g) * hi).long()  # noqa: E731
    for _ in range(3):  # flips
        sel = what < 5
        pos = u(1 << 20) % sizes.long()
        rows[idx[sel], pos[sel]] ^= (2 ** u(8)).to(torch.uint8)[sel]
    sel = what == 5  # overwrite a byte of the codes (escapes counted anew)
    pos = 7 + u(1 << 20) % (p // 4)
    rows[idx[sel], pos[sel]] = u(256).to(torch.uint8)[sel]
    sel = (what >= 6) & (what < 8)  # cut or grow the size
    sizes = torch.where(sel, (sizes.long() + u(65) - 32).clamp(-3, p + 3), sizes.long())
    sizes = sizes.to(torch.int32)
    sel = what == 8  # the other layout, or any kind byte
    kinds = torch.where(sel & (u(2) == 0), kinds ^ 0x30, kinds)
    kinds = torch.where(sel & (u(2) == 1), u(256).to(torch.uint8), kinds)
    offsets = idx * p
    sel = what == 9  # offsets moved (outside the payload at the ends)
    offsets = torch.where(sel, offsets + u(1 << 13) - (1 << 12), offsets)
    return rows, sizes, kinds, offsets, what >= 10, pick


@pytest.mark.fuzz
@pytest.mark.skipif(not CUDA or os.environ.get("TRITON_INTERPRET") == "1", reason="needs CUDA")
def test_gpu_million_page_mutation_fuzz(gen):
    """A million mutated pages through the GPU decoder: every status is OK, BAD_KIND or
    BAD_SIZE; failed rows are zero; unmutated pages decode to their source; nothing is written
    outside the output (poisoned guard rows); a sample of every chunk equals the reference
    decoder's statuses and bytes."""
    from torch_pagecomp.kernels import exp_codec as kx

    p = 4096
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    g = torch.Generator(device="cuda").manual_seed(seed)
    srcs = torch.cat([float_pages(gen, p, dtype) for dtype in (torch.bfloat16, torch.float16)
                      for _ in range(16)]).cuda()
    fp16 = torch.arange(srcs.shape[0], device="cuda") >= srcs.shape[0] // 2
    parts = [kx.compress_exp_pages(srcs[~fp16], False), kx.compress_exp_pages(srcs[fp16], True)]
    base, base_sizes, base_kinds = (torch.cat(t) for t in zip(*parts))
    srcs = torch.cat([srcs[~fp16], srcs[fp16]])
    assert {int(k) & 15 for k in base_kinds} >= {fmt.KIND_EXP, fmt.KIND_FILL}
    chunk, total, checked, guard = 1 << 16, 0, 0, 2
    buf = torch.empty((chunk + 2 * guard, p), dtype=torch.uint8, device="cuda")
    out, status = buf[guard:guard + chunk], torch.empty(chunk, dtype=torch.int32, device="cuda")
    while total < 1_000_000:
        rows, sizes, kinds, offsets, pure, pick = _exp_fuzz_chunk(base, base_sizes, base_kinds,
                                                                  chunk, g)
        buf.fill_(POISON)
        flat = rows.view(-1)
        kx.decompress_exp_into(flat, offsets, sizes, kinds, out, status)
        msg = f"seed {seed}"
        assert (buf[:guard] == POISON).all() and (buf[guard + chunk:] == POISON).all(), msg
        assert set(status.unique().tolist()) <= {fmt.STATUS_OK, fmt.STATUS_BAD_KIND,
                                                 fmt.STATUS_BAD_SIZE}, msg
        assert not out[status != 0].any(), f"{msg}: a failed row is not zero"
        assert not status[pure].any(), f"{msg}: an unmutated page failed"
        assert torch.equal(out[pure], srcs[pick[pure]]), f"{msg}: unmutated, wrong bytes"
        # the fixed-stride specialisation (no offsets: page i at i * P) on the same pages:
        # equal wherever the offsets were not mutated
        out0, status0 = kx.decompress_exp_pages(flat, None, sizes, kinds, p, traced=False)
        same = offsets == torch.arange(chunk, device="cuda") * p
        assert torch.equal(status0[same], status[same]), f"{msg}: offsets=None statuses"
        assert torch.equal(out0[same], out[same]), f"{msg}: offsets=None bytes"
        sub = torch.randperm(chunk, generator=gen)[:64].cuda()
        want, want_st = ec.decompress_exp_cpu(flat.cpu(), offsets[sub].cpu(), sizes[sub].cpu(),
                                              kinds[sub].cpu(), p)
        assert status[sub].cpu().tolist() == want_st.tolist(), msg
        assert torch.equal(out[sub].cpu(), want), msg
        checked += 64
        total += chunk
    assert checked > 900
