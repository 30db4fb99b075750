"""The Triton LZ4 page decoder against the CPU reference (``cpu_codec.decode_block``).

Without CUDA the kernels run on the interpreter (CPU tensors, small cases); with CUDA the same
tests run on the GPU, plus GPU-only ones: a million-page mutation fuzz (``-m fuzz``), round trips
of every kind and page size, CUDA graphs, ``torch.compile`` and side streams.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import random  # noqa: E402

import lz4.block  # noqa: E402
import pytest  # noqa: E402
from pages import (  # noqa: E402
    encode,
    file_pages,
    long_overlap_blocks,
    mixed_pages,
    periodic_pages,
    run_pages,
)

from torch_pagecomp import format as fmt  # noqa: E402
from torch_pagecomp.cpu_codec import (  # noqa: E402
    compress_cpu,
    decode_block,
    decompress_cpu,
    pack_cpu,
)
from torch_pagecomp.kernels.lz4_decompress import (  # noqa: E402
    decompress_into,
    decompress_pages,
    decompress_rows,
)
from torch_pagecomp.shuffle import bitunshuffle  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
P = 4096
POISON = 0xA5
# Odd, so the output rows also start misaligned: bit-shuffled pages then take the transposed
# decode; with 4096 (aligned rows) 4 KiB ones take the plain decode and the word-tile unshuffle.
GUARD = 4099


def device_for_kernels() -> str:
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    return DEV


# ------------------------------------------------------------------ building blocks
def random_block(page_size: int, nseq: int, rng: random.Random, few: bool = False) -> bytes:
    """A compliant block of roughly ``nseq`` sequences (exactly few of them, long ones, with
    ``few``) that a greedy encoder would not write: overlapping matches (offset < length),
    offsets up to 65535, long literal runs and long matches."""
    seqs, op, step = [], 0, max(8, page_size // nseq)
    while len(seqs) < (nseq if few else page_size):
        if few:
            lit, ml = rng.randrange(0, 24), rng.randrange(4, 2 * step)
        else:
            lit = rng.choice([0, 0, 1, 3, rng.randrange(4, 40), rng.randrange(step)])
            ml = rng.choice([4, 5, rng.randrange(4, 40), rng.randrange(4, 2 * step)])
        if op + lit + ml > page_size - 12:  # the last match starts 12 bytes before the end
            break
        hi = min(op + lit, 65535)
        if hi == 0:
            lit = hi = 1
        d = rng.choice([1, 2, rng.randrange(1, 20), rng.randrange(1, hi + 1), hi])
        seqs.append((rng.randbytes(lit), min(d, hi), ml))
        op += lit + ml
    return encode(seqs, rng.randbytes(page_size - op))


def ref(block: bytes, page_size: int = P) -> tuple[bytes | None, int]:
    return decode_block(block, page_size)


def ref_page(read, total: int, off: int, size: int, kind: int, page_size: int = P):
    """``(page or None, status)`` of one page by the rules of ``torch_pagecomp.format`` with
    ``decode_block`` deciding LZ4 blocks; ``read(off, size)`` returns payload bytes. An LZ4
    size past ``lz4_bound`` (``LZ4_compressBound(P)``) is ``STATUS_BAD_SIZE``."""
    codec, shift = kind & 15, kind >> 4
    if codec > 2 or shift > 2 or (shift and codec != fmt.KIND_LZ4):
        return None, fmt.STATUS_BAD_KIND
    if off < 0 or size < 1 or off + size > total:
        return None, fmt.STATUS_BAD_SIZE
    if codec == fmt.KIND_LZ4 and size > fmt.lz4_bound(page_size):
        return None, fmt.STATUS_BAD_SIZE
    if codec == fmt.KIND_FILL:
        return (read(off, 1) * page_size, 0) if size == 1 else (None, fmt.STATUS_BAD_SIZE)
    if codec == fmt.KIND_RAW:
        return (read(off, size), 0) if size == page_size else (None, fmt.STATUS_BAD_SIZE)
    data, st = decode_block(read(off, size), page_size)
    if data is not None and shift:
        y = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(1, -1)
        data = bytes(bitunshuffle(y, 1 << shift)[0].numpy())
    return data, st


def run_blocks(blocks, kinds=None, page_size=P, sizes=None, offsets=None, payload=None,
               guard=GUARD):
    """Pack ``blocks`` back to back, decode them into outputs that sit inside poisoned guard
    bytes (``guard`` of them: odd by default, so rows start misaligned), check the guards, and
    return ``(pages, status)`` on the CPU."""
    dev = device_for_kernels()
    n = len(blocks)
    if payload is None:
        payload = torch.frombuffer(bytearray(b"".join(blocks)) or bytearray(1), dtype=torch.uint8)
    if sizes is None:
        sizes = torch.tensor([len(b) for b in blocks], dtype=torch.int32)
    if offsets is None:
        offsets = torch.cumsum(sizes.to(torch.int64), 0) - sizes.to(torch.int64)
    if kinds is None:
        kinds = torch.full((n,), fmt.KIND_LZ4, dtype=torch.uint8)
    elif not isinstance(kinds, torch.Tensor):
        kinds = torch.tensor(kinds, dtype=torch.uint8)
    buf = torch.full((2 * guard + n * page_size,), POISON, dtype=torch.uint8, device=dev)
    sbuf = torch.full((2 * guard + n,), -0x5A5A5A5B, dtype=torch.int32, device=dev)
    pages = buf[guard : guard + n * page_size].view(n, page_size)
    status = sbuf[guard : guard + n]
    args = [t.to(dev) for t in (payload, offsets, sizes, kinds)]
    decompress_into(*args, pages, status)
    buf, sbuf = buf.cpu(), sbuf.cpu()
    assert (buf[:guard] == POISON).all() and (buf[guard + n * page_size :] == POISON).all()
    assert (sbuf[:guard] == -0x5A5A5A5B).all() and (sbuf[guard + n :] == -0x5A5A5A5B).all()
    return pages.cpu(), status.cpu()


def check_against_reference(blocks, pages, status, page_size=P, seed=None, kinds=None):
    for i, blk in enumerate(blocks):
        kind = fmt.KIND_LZ4 if kinds is None else int(kinds[i])
        data, st = ref_page(lambda o, s, b=blk: b[o : o + s], len(blk), 0, len(blk), kind,
                            page_size)
        where = f"block {i} (seed {seed}): {blk[:48].hex()}..."
        assert int(status[i]) == st, f"{where} status {int(status[i])} != reference {st}"
        if data is None:
            assert not pages[i].any(), f"{where} failed row is not zero"
        else:
            assert bytes(pages[i].numpy()) == data, f"{where} decoded wrong"


def test_length_extensions_at_the_fast_loop_edges(gen):
    """Literal runs of 14, 15, 16, 31-33, 269 (one extension byte, 254) and 270 (two: 255, 0)
    bytes and matches of 18-20, 50, 273 and 274 bytes, offsets 1, 3, 17 (overlapping) and
    longer (the fast loop's edge: one extension byte sends a sequence to the checked loop):
    the decoder gives the reference's bytes."""
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    lits = [14, 15, 16, 31, 32, 33, 269, 270, 0, 1]
    mls = [18, 19, 20, 50, 273, 274, 4, 33]
    blocks = []
    for _ in range(12):
        seqs, op = [], 0
        while True:
            lit, ml = rng.choice(lits), rng.choice(mls)
            if op + lit + ml > P - 12:
                break
            hi = op + lit
            if hi == 0:
                lit = hi = 1
            d = min(rng.choice([1, 3, 17, 300, hi]), hi)
            seqs.append((rng.randbytes(lit), d, ml))
            op += lit + ml
        blocks.append(encode(seqs, rng.randbytes(P - op)))
    out, status = run_blocks(blocks)
    check_against_reference(blocks, out, status)
    assert not status.any()


def test_long_overlapping_matches_of_every_period(gen):
    """Long matches whose offset is shorter than their length (a repeated pattern), at periods
    around every copy step's width (32, 64, 256 bytes: each side of the path that stores the
    pattern from registers and of the path that reloads it), at odd positions and with a
    length that is no multiple of the period: the decoder gives the reference's bytes."""
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    blocks = long_overlap_blocks(P, rng)
    out, status = run_blocks(blocks)
    check_against_reference(blocks, out, status)
    assert not status.any()


# --------------------------------------------------------------- valid pages, every kind
@pytest.mark.parametrize("mode", ["default", "fast", "high_compression"])
def test_lz4_modes_decode_bit_exact(mode, gen):
    pages = torch.cat([periodic_pages(int(torch.randint(1, 40, (1,), generator=gen)), 1, P, gen),
                       run_pages(1, P, gen),
                       torch.zeros((1, P), dtype=torch.uint8)])
    if CUDA:
        pages = torch.cat([pages, file_pages("text", 8, P, gen), file_pages("binary", 8, P, gen)])
    kw = {"fast": dict(mode="fast", acceleration=int(torch.randint(2, 60, (1,)))),
          "high_compression": dict(mode="high_compression", compression=12)}.get(mode, {})
    blocks = [lz4.block.compress(bytes(p.numpy()), store_size=False, **kw) for p in pages]
    out, status = run_blocks(blocks)
    check_against_reference(blocks, out, status)
    # binaries' incompressible pages give blocks past P - P/32 (up to 4114 bytes): read too
    assert not status.any() and torch.equal(out, pages)


def test_text_page_and_long_literal_run(gen):
    text = file_pages("text", 1, P, gen)
    noise = torch.randint(0, 256, (1, P), dtype=torch.uint8, generator=gen)
    noise[0, P - P // 32 - 80:] = 0  # one literal run of 3888 bytes (the block stays LZ4-sized)
    pages = torch.cat([text, noise])
    blocks = [lz4.block.compress(bytes(p.numpy()), store_size=False) for p in pages]
    assert max(len(b) for b in blocks) <= fmt.lz4_keep_limit(P)
    out, status = run_blocks(blocks)
    assert status.tolist() == [0, 0] and torch.equal(out, pages)


def test_lz4_blocks_up_to_the_bound_decode(gen):
    """Any LZ4 block of a page is read, up to ``LZ4_compressBound(P)`` bytes: what ``lz4.block``
    (and nvCOMP) write for incompressible data, 4114 bytes for ``P = 4096``, which the format's
    compressors would store RAW; one byte past the bound is ``STATUS_BAD_SIZE``, packed or
    where it runs into the next fixed-stride row."""
    bound, limit = fmt.lz4_bound(P), fmt.lz4_keep_limit(P)
    noise = torch.randint(0, 256, (3, P), dtype=torch.uint8, generator=gen)
    lit = limit - 33  # a block of exactly `limit` bytes: literals, one match, 12 literals
    noise[1, lit - 1:] = 0
    blocks = [lz4.block.compress(bytes(p.numpy()), store_size=False) for p in noise]
    blocks[1] = encode([(bytes(noise[1, :lit].numpy()), 1, P - 12 - lit)], bytes(12))
    assert len(blocks[0]) == P + 18 and len(blocks[1]) == limit
    # one literal run of the whole page (its length extension), then zeros up to the bound
    past = blocks[2] + bytes(bound + 1 - len(blocks[2]))
    out, status = run_blocks([blocks[0], blocks[1], past])
    assert status.tolist() == [0, 0, fmt.STATUS_BAD_SIZE]
    assert torch.equal(out[:2], noise[:2]) and not out[2].any()
    # fixed-stride rows: page 0's block runs into row 1, up to the bound and one byte past it
    rows = torch.zeros((2, P), dtype=torch.uint8)
    rows.view(-1)[: len(blocks[2])] = torch.frombuffer(bytearray(blocks[2]), dtype=torch.uint8)
    sizes = torch.tensor([len(blocks[2]), bound + 1], dtype=torch.int32)
    offsets = torch.tensor([0, 0], dtype=torch.int64)
    out, status = run_blocks([b""] * 2, [fmt.KIND_LZ4] * 2, sizes=sizes, offsets=offsets,
                             payload=rows.view(-1))
    assert status.tolist() == [0, fmt.STATUS_BAD_SIZE]
    assert torch.equal(out[0], noise[2]) and not out[1].any()


def test_any_compliant_parse(gen):
    """Overlapping matches, far offsets and long runs that python-lz4 never emits."""
    rng = random.Random(int(torch.randint(0, 2**62, (1,), generator=gen)))
    blocks = [random_block(P, rng.choice([3, 6, 12]), rng) for _ in range(6)]
    blocks.append(encode([(b"x", 1, P - 13)], b"abcdefghijkl"))  # offset 1, length 4083
    blocks.append(encode([(b"xyz", 3, P - 15)], b"abcdefghijkl"))  # offset 3 < length
    for b in blocks:  # the reference decoder takes them: they are valid LZ4
        assert lz4.block.decompress(b, uncompressed_size=P) == ref(b)[0]
    out, status = run_blocks(blocks)
    check_against_reference(blocks, out, status)


@pytest.mark.parametrize("misalign", [0, 1])  # output rows 4-byte aligned (word tile) or not
@pytest.mark.parametrize("element_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_shuffled_pages_unshuffle_in_kernel(element_size, misalign, gen):
    vals = torch.randn(2, P // 2, generator=gen).to(torch.bfloat16).relu().view(torch.uint8)
    pages = torch.cat([vals.view(-1, P), periodic_pages(element_size * 3, 1, P, gen)])
    payload, sizes, kinds = compress_cpu(pages, element_size)
    assert (kinds == (fmt.KIND_LZ4 | (fmt.element_shift(element_size) << 4))).all()
    dev = device_for_kernels()
    offsets = torch.arange(len(sizes), dtype=torch.int64) * P
    buf = torch.full((pages.numel() + misalign,), POISON, dtype=torch.uint8, device=dev)
    out = buf[misalign:].view_as(pages)
    status = torch.full((len(sizes),), -7, dtype=torch.int32, device=dev)
    decompress_into(*(t.to(dev) for t in (payload.view(-1), offsets, sizes, kinds)), out, status)
    assert status.tolist() == [0] * len(sizes)
    assert torch.equal(out.cpu(), pages)


def test_rows_by_address_decode_as_contiguous_output(gen):
    """``decompress_rows``: every kind (plain, both shuffled, RAW, FILL) and a corrupt page, each
    row at its own address of a poisoned buffer, in an order unlike the pages', aligned and not
    (misaligned shuffled rows take the transposed decode): the rows and statuses are the CPU
    path's, and no byte between rows is written."""
    dev = device_for_kernels()
    vals = torch.randn(1, P // 2, generator=gen).to(torch.bfloat16).relu().view(torch.uint8)
    rand = torch.randint(0, 256, (1, P), dtype=torch.uint8, generator=gen)
    parts = [compress_cpu(vals.view(-1, P), 2), compress_cpu(periodic_pages(12, 1, P, gen), 4),
             compress_cpu(file_pages("text", 1, P, gen)),
             compress_cpu(torch.cat([rand, torch.full((1, P), 7, dtype=torch.uint8), rand]))]
    payload = torch.cat([q[0] for q in parts])
    sizes, kinds = torch.cat([q[1] for q in parts]), torch.cat([q[2] for q in parts])
    n = len(sizes)
    sizes[n - 1] = P - 1  # corrupt: a RAW page of the wrong size (status, zeroed row)
    assert sorted({int(k) for k in kinds}) == sorted(
        {fmt.KIND_RAW, fmt.KIND_LZ4, fmt.KIND_FILL, fmt.KIND_LZ4_SHUFFLED_2,
         fmt.KIND_LZ4_SHUFFLED_4})
    offsets = torch.arange(n, dtype=torch.int64) * P
    want, want_status = decompress_cpu(payload.view(-1), offsets, sizes, kinds, P)
    gap = 4096 + 3
    buf = torch.full((n * (P + gap) + gap,), POISON, dtype=torch.uint8, device=dev)
    order = torch.randperm(n, generator=gen)
    starts = [gap + int(order[i]) * (P + gap) + (i % 4) for i in range(n)]  # some not 4-aligned
    rows = torch.tensor([buf.data_ptr() + a for a in starts], dtype=torch.int64, device=dev)
    status = torch.full((n,), -7, dtype=torch.int32, device=dev)
    meta = [t.to(dev) for t in (payload.view(-1), offsets, sizes, kinds)]
    decompress_rows(*meta, rows, P, status)
    assert status.tolist() == want_status.tolist() and want_status[n - 1] != 0
    mask = torch.ones(buf.numel(), dtype=torch.bool, device=dev)
    for i, a in enumerate(starts):
        assert torch.equal(buf[a:a + P].cpu(), want[i]), f"page {i}"
        mask[a:a + P] = False
    assert (buf[mask] == POISON).all(), "wrote between rows"
    with pytest.raises(ValueError, match="int64"):
        decompress_rows(*meta, rows.to(torch.int32), P, status)


@pytest.mark.parametrize("guard", [GUARD, 4096])  # rows misaligned (no word tile) / aligned
def test_unshuffle_matches_reference_on_random_bytes(guard, gen):
    """The in-kernel unshuffle is the reference ``bitunshuffle`` on arbitrary shuffled bytes;
    plain pages between shuffled ones (each of the two kernels leaves the other's alone);
    nothing written outside the rows."""
    y = torch.randint(0, 256, (4, P), dtype=torch.uint8, generator=gen)
    y[:, 3072 : P - 12] = y[:, : P - 12 - 3072]  # 3072 random bytes, then a repeat of them
    blocks = [encode([(bytes(r[:3072].numpy()), 3072, P - 12 - 3072)], bytes(r[P - 12 :].numpy()))
              for r in y]  # one literal run, one long match: within the LZ4 size limit
    kinds = [fmt.KIND_LZ4_SHUFFLED_2, fmt.KIND_LZ4, fmt.KIND_LZ4_SHUFFLED_4, fmt.KIND_LZ4]
    out, status = run_blocks(blocks, kinds, guard=guard)
    assert status.tolist() == [0] * 4
    assert torch.equal(out[0], bitunshuffle(y[:1], 2)[0])
    assert torch.equal(out[2], bitunshuffle(y[2:3], 4)[0])
    assert torch.equal(out[1::2], y[1::2])


@pytest.mark.parametrize("packed", [False, True])
def test_raw_fill_lz4_fixed_stride_and_packed(packed, gen):
    pages = torch.cat([
        torch.randint(0, 256, (2, P), dtype=torch.uint8, generator=gen),  # RAW
        torch.zeros((1, P), dtype=torch.uint8),  # FILL 0
        torch.full((1, P), int(torch.randint(1, 256, (1,), generator=gen)), dtype=torch.uint8),
        periodic_pages(7, 1, P, gen),  # LZ4
    ])
    payload, sizes, kinds = compress_cpu(pages)
    assert kinds.tolist() == [0, 0, 2, 2, 1]
    if packed:
        flat, offsets = pack_cpu(payload, sizes)
        flat, offsets = flat[: int(offsets[-1])], offsets[:-1]
    else:
        flat, offsets = payload.view(-1), torch.arange(len(sizes), dtype=torch.int64) * P
    dev = device_for_kernels()
    out, status = decompress_pages(*(t.to(dev) for t in (flat, offsets, sizes, kinds)), P)
    assert status.tolist() == [0] * 5 and torch.equal(out.cpu(), pages)


def test_no_pages():
    dev = device_for_kernels()
    e = torch.empty(0, dtype=torch.int64, device=dev)
    out, status = decompress_pages(torch.zeros(3, dtype=torch.uint8, device=dev), e,
                                   e.to(torch.int32), e.to(torch.uint8), P)
    assert out.shape == (0, P) and status.shape == (0,) and status.dtype == torch.int32


# ------------------------------------------------------------------ malformed input
def _blocks_and_status():
    lit = bytes(range(12))
    cases = {
        "match at the end, no token after": (encode([(b"a", 1, P - 1)], b"")[:-1], 3),
        "truncated literal run": (bytes([0x50]) + b"abc", 3),
        "truncated literal length ext": (bytes([0xF0, 255, 255]), 3),
        "truncated offset": (bytes([0x10]) + b"a" + bytes([1]), 3),
        "truncated match length ext": (bytes([0x1F]) + b"a" + bytes([1, 0, 255, 255]), 3),
        "zero offset": (encode([(b"a", 0, 4)], lit), 4),
        "offset before page start": (encode([(b"ab", 3, 4)], lit), 4),
        "literal overflow": (encode([(b"a", 1, P - 20)], bytes(30)), 5),
        "larger than P - P/32": (encode([], bytes(P)), 0),  # valid: read (ours store RAW)
        "larger than LZ4_compressBound(P)": (encode([], bytes(P)) + bytes(P // 255 + 3), 2),
        "match overflow": (encode([(b"a", 1, P)], lit), 5),
        "match overflow by one": (encode([(b"a", 1, P - 12)], lit), 5),
        "short output": (encode([(b"a", 1, 100)], lit), 6),
        "only literals, short": (b"\x30abc", 6),
        "exact fit": (encode([(b"a", 1, P - 13)], lit), 0),
        "offset to byte 0": (encode([(b"abcd", 4, P - 16)], lit), 0),
    }
    return cases


@pytest.mark.parametrize("guard", [GUARD, 4096])  # shuffled: transposed decode / word tile
@pytest.mark.parametrize("shift", [0, 1])
def test_malformed_blocks_give_their_status(shift, guard):
    cases = _blocks_and_status()
    blocks = [b for b, _ in cases.values()]
    expected = [s for _, s in cases.values()]
    assert [ref_page(lambda o, s, b=b: b[o : o + s], len(b), 0, len(b), fmt.KIND_LZ4)[1]
            for b in blocks] == expected  # the cases say what they claim
    kinds = [fmt.KIND_LZ4 | shift << 4] * len(blocks)
    out, status = run_blocks(blocks, kinds, guard=guard)
    assert dict(zip(cases, status.tolist())) == dict(zip(cases, expected))
    check_against_reference(blocks, out, status, kinds=kinds)


def test_bad_kind_and_bad_size():
    good = encode([(b"a", 1, P - 13)], bytes(12))
    payload = torch.frombuffer(bytearray(good + bytes(P) + b"\x07"), dtype=torch.uint8)
    t = payload.numel()
    n_lz4, raw_at, fill_at = len(good), len(good), len(good) + P
    rows = [  # (offset, size, kind, status)
        (0, n_lz4, fmt.KIND_LZ4, 0),
        (raw_at, P, fmt.KIND_RAW, 0),
        (fill_at, 1, fmt.KIND_FILL, 0),
        (0, n_lz4, 3, 1),  # unknown kind
        (0, n_lz4, 0x0F, 1),
        (0, n_lz4, fmt.KIND_LZ4 | 3 << 4, 1),  # shift > 2
        (raw_at, P, fmt.KIND_RAW | 1 << 4, 1),  # shuffle on RAW
        (fill_at, 1, fmt.KIND_FILL | 2 << 4, 1),  # shuffle on FILL
        (raw_at, P - 1, fmt.KIND_RAW, 2),  # RAW size != P
        (fill_at - 1, 2, fmt.KIND_FILL, 2),  # FILL size != 1
        (0, 0, fmt.KIND_LZ4, 2),  # size 0
        (0, -5, fmt.KIND_LZ4, 2),  # negative size
        (-1, 4, fmt.KIND_LZ4, 2),  # negative offset
        (t - 3, 4, fmt.KIND_LZ4, 2),  # past the payload
        (t, 1, fmt.KIND_FILL, 2),
        (2**62, 2**31 - 1, fmt.KIND_LZ4, 2),  # offset + size overflows nothing
        (0, 2**31 - 1, fmt.KIND_LZ4, 2),
        (t - 1, 1, fmt.KIND_FILL, 0),
        (0, 0, fmt.KIND_LZ4 | 1 << 4, 2),  # shuffled pages: the second kernel
        (-1, 4, fmt.KIND_LZ4 | 2 << 4, 2),
        (t - 3, 4, fmt.KIND_LZ4 | 1 << 4, 2),
        (0, 2**31 - 1, fmt.KIND_LZ4 | 2 << 4, 2),
        (0, fmt.lz4_bound(P) + 1, fmt.KIND_LZ4, 2),  # inside the payload, past the LZ4 bound
        (0, fmt.lz4_bound(P) + 1, fmt.KIND_LZ4 | 1 << 4, 2),
        (0, fmt.lz4_bound(P) + 1, fmt.KIND_LZ4 | 2 << 4, 2),
    ]
    assert fmt.lz4_bound(P) + 1 <= t
    offsets = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    sizes = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    kinds = torch.tensor([r[2] for r in rows], dtype=torch.uint8)
    out, status = run_blocks([b""] * len(rows), kinds, sizes=sizes, offsets=offsets,
                             payload=payload)
    assert status.tolist() == [r[3] for r in rows]
    assert not out[status != 0].any()
    assert out[0, -12:].eq(0).all() and out[0, :-12].eq(ord("a")).all()
    assert not out[1].any() and out[2].eq(7).all() and out[17].eq(7).all()


# ------------------------------------------------------------------ mutation fuzz
def mutate(block: bytes, donors: list[bytes], rng: random.Random) -> tuple[bytes, bytes]:
    """``(block, tail)``: a damaged block, and bytes laid after it in the payload (a cut-off
    block keeps its real continuation there, so reading past the end would show)."""
    b = bytearray(block)
    m = rng.randrange(6)
    if m == 0:
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif m == 1:
        cut = rng.randrange(1, len(b) + 1)
        return bytes(b[:cut]), bytes(b[cut:])
    elif m == 2:
        d = rng.choice(donors)
        i, j = rng.randrange(len(b) + 1), rng.randrange(len(d))
        b[i:i] = d[j : j + rng.randrange(1, 48)]
    elif m == 3:
        b[rng.randrange(len(b))] = rng.choice([0, 255, 15, 0xF0, 0xFF, rng.randrange(256)])
    elif m == 4:
        i = rng.randrange(len(b))
        del b[i : i + rng.randrange(1, 8)]
        if not b:
            b = bytearray(b"\x00")
    else:
        b += rng.randbytes(rng.randrange(1, 16))
    return bytes(b), b""


def fuzz_bases(rng: random.Random, gen: torch.Generator, count: int) -> list[bytes]:
    bases = [random_block(P, rng.choice([2, 4, 6]), rng, few=True) for _ in range(count)]
    for p in periodic_pages(rng.randrange(1, 24), 2, P, gen):
        bases.append(lz4.block.compress(bytes(p.numpy()), store_size=False))
    return bases


@pytest.mark.parametrize("guard", [GUARD, 4096])  # shuffled: transposed decode / word tile
def test_mutation_fuzz_matches_reference(guard, gen):
    """Mutated blocks, some marked shuffled (2- and 4-byte elements), in one packed payload."""
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    rng = random.Random(seed)
    bases = fuzz_bases(rng, gen, 12)
    n = 2000 if CUDA else (80 if guard == GUARD else 30)  # fresh blocks every run
    blocks, payload = [], bytearray()
    offsets = []
    for _ in range(n):
        blk, tail = mutate(rng.choice(bases), bases, rng)
        offsets.append(len(payload))
        blocks.append(blk)
        payload += blk + tail
    payload = torch.frombuffer(payload, dtype=torch.uint8)
    sizes = torch.tensor([len(b) for b in blocks], dtype=torch.int32)
    kinds = [rng.choice([fmt.KIND_LZ4] * 4 + [fmt.KIND_LZ4_SHUFFLED_2, fmt.KIND_LZ4_SHUFFLED_4])
             for _ in blocks]
    out, status = run_blocks(blocks, kinds, sizes=sizes, offsets=torch.tensor(offsets),
                             payload=payload, guard=guard)
    check_against_reference(blocks, out, status, seed=seed, kinds=kinds)
    assert (status == 0).any() and (status != 0).any()


# ------------------------------------------------------------------ GPU only
@needs_cuda
@pytest.mark.parametrize("misalign", [0, 1])  # output rows 4-byte aligned (word tile) or not
@pytest.mark.parametrize("page_size", [4096, 8192, 16384, 32768, 65536])
def test_gpu_roundtrip_every_kind_and_page_size(page_size, misalign, gen):
    """Every page kind and element size, fixed-stride and packed, decodes bit-exactly."""
    pages = mixed_pages(64, page_size, gen)
    for element_size in (1, 2, 4):
        payload, sizes, kinds = compress_cpu(pages, element_size)
        assert {int(k) & 15 for k in kinds} == {0, 1, 2}
        offsets = torch.arange(len(sizes), dtype=torch.int64) * page_size
        flat, offs = pack_cpu(payload, sizes)
        for args in ((payload.view(-1), offsets, sizes, kinds),
                     (flat[: int(offs[-1])], offs[:-1], sizes, kinds)):
            buf = torch.full((pages.numel() + misalign,), POISON, dtype=torch.uint8,
                             device="cuda")
            out = buf[misalign:].view(len(sizes), page_size)
            status = torch.full((len(sizes),), -7, dtype=torch.int32, device="cuda")
            decompress_into(*(t.cuda() for t in args), out, status)
            assert not status.any() and torch.equal(out.cpu(), pages)


@needs_cuda
@pytest.mark.parametrize("page_size", [4096, 65536])
def test_gpu_any_compliant_parse_and_lz4_modes(page_size, gen):
    rng = random.Random(int(torch.randint(0, 2**62, (1,), generator=gen)))
    blocks = [random_block(page_size, rng.choice([4, 30, 300, 3000]), rng) for _ in range(64)]
    pages = mixed_pages(28, page_size, gen)
    for kw in ({}, dict(mode="fast", acceleration=9), dict(mode="high_compression")):
        blocks += [lz4.block.compress(bytes(p.numpy()), store_size=False, **kw) for p in pages]
    out, status = run_blocks(blocks, page_size=page_size)
    check_against_reference(blocks, out, status, page_size)


def _gpu_fuzz_chunk(base, base_sizes, n, g):
    """``n`` mutated copies of rows of ``base`` (``uint8 [B, P]`` CUDA) as a fixed-stride
    payload: bit flips, cuts (the rest of the row stays), inserted slices of other blocks, byte
    overwrites, and a few garbage metadata rows; ``pure`` marks unmutated rows, ``pick`` bases."""
    dev = base.device
    b = base.shape[0]
    pick = torch.randint(0, b, (n,), device=dev, generator=g)
    rows = base[pick]
    sizes = base_sizes[pick].clone()
    kind = torch.randint(0, 16, (n,), device=dev, generator=g)
    idx = torch.arange(n, device=dev)
    u = lambda hi: (torch.rand(n, device=dev, generator=g) * hi).long()  # noqa: E731
    for _ in range(3):  # flips
        sel = kind < 5
        pos = u(1 << 20) % sizes.long()
        rows[idx[sel], pos[sel]] ^= (2 ** u(8)).to(torch.uint8)[sel]
    sel = kind == 5  # overwrite
    pos = u(1 << 20) % sizes.long()
    rows[idx[sel], pos[sel]] = u(256).to(torch.uint8)[sel]
    sel = (kind >= 6) & (kind < 9)  # cut
    sizes = torch.where(sel, 1 + u(1 << 20) % sizes.long(), sizes.long()).to(torch.int32)
    ins = ((kind == 9) | (kind == 10)).nonzero().squeeze(1)  # insert a slice of another block
    if ins.numel():
        m = ins.numel()
        col = torch.arange(P, device=dev)
        at = (torch.rand(m, device=dev, generator=g) * sizes[ins]).long()[:, None]
        length = 1 + (torch.rand(m, device=dev, generator=g) * 48).long()[:, None]
        donor = torch.randint(0, b, (m,), device=dev, generator=g)
        start = (torch.rand(m, device=dev, generator=g) * (base_sizes[donor] - 1)).long()[:, None]
        old = rows[ins]
        src_old = torch.where(col >= at + length, col - length, col).clamp(0, P - 1)
        merged = torch.where((col >= at) & (col < at + length),
                             base[donor][torch.arange(m, device=dev)[:, None],
                                         (start + col - at).clamp(0, P - 1)],
                             old.gather(1, src_old))
        rows[ins] = merged
        sizes[ins] = (sizes[ins] + length.squeeze(1).to(torch.int32)).clamp(max=P)
    kinds = torch.full((n,), fmt.KIND_LZ4, dtype=torch.uint8, device=dev)
    offsets = idx * P
    sel = kind == 11  # garbage metadata
    kinds = torch.where(sel & (u(4) == 0), u(256).to(torch.uint8), kinds)
    sizes = torch.where(sel & (u(4) == 1), (u(1 << 32) - (1 << 31)).to(torch.int32), sizes)
    offsets = torch.where(sel & (u(4) == 2), offsets + u(1 << 16) - (1 << 15), offsets)
    return rows, sizes, kinds, offsets, kind >= 12, pick


@needs_cuda
@pytest.mark.fuzz
def test_gpu_million_page_mutation_fuzz(gen):
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    rng = random.Random(seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    srcs = [bytes(p.numpy()) for p in mixed_pages(512, P, gen)]
    srcs += [bytes(p.numpy()) for p in file_pages("text", 512, P, gen)]
    bases = [lz4.block.compress(s, store_size=False) for s in srcs]
    bases += [random_block(P, rng.choice([3, 20, 200]), rng) for _ in range(512)]
    # each block in a row of P bytes (blocks up to LZ4_compressBound(P) are read too:
    # test_lz4_blocks_up_to_the_bound_decode)
    bases = [b for b in bases if len(b) <= P]
    base = torch.zeros((len(bases), P), dtype=torch.uint8)
    for i, blk in enumerate(bases):
        base[i, : len(blk)] = torch.frombuffer(bytearray(blk), dtype=torch.uint8)
    base = base.cuda()
    decoded = torch.stack([torch.frombuffer(bytearray(ref(b)[0]), dtype=torch.uint8)
                           for b in bases]).cuda()
    base_sizes = torch.tensor([len(b) for b in bases], dtype=torch.int32, device="cuda")
    chunk, total, checked = 1 << 16, 0, 0
    while total < 1_000_000:
        rows, sizes, kinds, offsets, pure, pick = _gpu_fuzz_chunk(base, base_sizes, chunk, g)
        flat = rows.view(-1)
        out, status = decompress_pages(flat, offsets, sizes, kinds, P)
        assert int(((status < 0) | (status > 6)).sum()) == 0, f"seed {seed}"
        # the fixed-stride specialisation (no offsets: page i at i * P) on the same pages:
        # equal wherever the offsets were not mutated
        out0, status0 = decompress_pages(flat, None, sizes, kinds, P, traced=False)
        same = offsets == torch.arange(chunk, device="cuda") * P
        assert torch.equal(status0[same], status[same]), f"seed {seed}: offsets=None statuses"
        assert torch.equal(out0[same], out[same]), f"seed {seed}: offsets=None bytes"
        assert not out[status != 0].any(), f"seed {seed}: a failed row is not zero"
        assert not status[pure].any(), f"seed {seed}: an unmutated block failed"
        assert torch.equal(out[pure], decoded[pick[pure]]), f"seed {seed}: unmutated, wrong"
        sub = torch.randperm(chunk, generator=gen)[:96].cuda()
        cpu = [t[sub].cpu().tolist() for t in (sizes, kinds, offsets, status)]
        read = lambda o, s, flat=flat: bytes(flat[o : o + s].cpu().numpy())  # noqa: E731
        for j, (s, k, o, st) in enumerate(zip(*cpu)):
            data, want = ref_page(read, flat.numel(), o, s, k)
            assert st == want, f"seed {seed}: kind {k} offset {o} size {s}"
            page = bytes(out[int(sub[j])].cpu().numpy())
            assert page == (data or bytes(P)), f"seed {seed}: kind {k} offset {o} size {s}"
            checked += 1
        total += chunk
    assert checked > 1000


@needs_cuda
def test_gpu_graph_capture_compile_and_side_stream(gen):
    pages = mixed_pages(256, P, gen)
    payload, sizes, kinds = (t.cuda() for t in compress_cpu(pages))
    offsets = torch.arange(256, dtype=torch.int64, device="cuda") * P
    flat = payload.view(-1)
    expect = pages.cuda()
    # CUDA graph
    decompress_pages(flat, offsets, sizes, kinds, P)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_status = decompress_pages(flat, offsets, sizes, kinds, P)
    g_out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, expect) and not g_status.any()
    # torch.compile, the launcher and the registered op
    fn = torch.compile(lambda *a: decompress_pages(*a, P), fullgraph=True)
    out, status = fn(flat, offsets, sizes, kinds)
    assert torch.equal(out, expect) and not status.any()
    import torch_pagecomp  # noqa: F401  (registers torch.ops.pagecomp)

    op = torch.compile(lambda *a: torch.ops.pagecomp.decompress(*a, P), fullgraph=True)
    out, status = op(flat, offsets, sizes, kinds)
    assert torch.equal(out, expect) and not status.any()
    # a side stream: the kernel must run after the producer on the current stream
    late = torch.zeros_like(flat)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        late.copy_(flat)
        out, status = decompress_pages(late, offsets, sizes, kinds, P)
    side.synchronize()
    assert torch.equal(out, expect) and not status.any()
    # control: the same on another stream reads the payload too early, so the test can fail
    late.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        late.copy_(flat)
    out, status = decompress_pages(late, offsets, sizes, kinds, P)  # default stream, no wait
    torch.cuda.synchronize()
    assert status.any()


@pytest.mark.parametrize("decoder", ["lz4", "exp"])
def test_fixed_stride_without_offsets_decodes_as_with_them(decoder, gen):
    """``offsets=None`` (page ``i`` at ``i * P``) gives the statuses and bytes that the same
    offsets given as a tensor give, hostile sizes and kinds included."""
    import torch_pagecomp as pc
    from torch_pagecomp.kernels.exp_codec import decompress_exp_into

    into = decompress_into if decoder == "lz4" else decompress_exp_into
    pages = mixed_pages(6, P, gen)[:6]
    c = (pc.compress(pages, element_size=2, backend="cpu") if decoder == "lz4"
         else pc.compress(pages, codec="exp-bf16", backend="cpu"))
    sizes, kinds = c.sizes.clone(), c.kinds.clone()
    hostile = torch.tensor([0, -1, P + 1, 2**31 - 1, 1, P], dtype=torch.int32)
    damaged = torch.randperm(6, generator=gen)[:3]
    for i in damaged.tolist():  # half the pages
        if torch.rand(1, generator=gen) < 0.5:
            sizes[i] = hostile[torch.randint(6, (1,), generator=gen)]
        else:
            kinds[i] = int(torch.randint(256, (1,), generator=gen))
    payload, sizes, kinds = (t.to(DEV) for t in (c.payload.view(-1), sizes, kinds))
    got = []
    for offsets in (None, torch.arange(0, 6 * P, P, dtype=torch.int64, device=DEV)):
        out = torch.full((6, P), POISON, dtype=torch.uint8, device=DEV)
        status = torch.full((6,), -7, dtype=torch.int32, device=DEV)
        into(payload, offsets, sizes, kinds, out, status, traced=False)
        got.append((out.cpu(), status.cpu()))
    assert torch.equal(got[0][1], got[1][1]) and torch.equal(got[0][0], got[1][0])
    assert not (got[0][1] == -7).any()  # every page got a status
    intact = torch.ones(6, dtype=torch.bool)
    intact[damaged] = False
    assert not got[0][1][intact].any() and torch.equal(got[0][0][intact], pages[intact])
