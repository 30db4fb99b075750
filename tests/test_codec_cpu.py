"""The CPU reference path: bit-exact round trips, lz4 interop, kinds and the packed form."""

import lz4.block
import pytest
import torch
from pages import file_pages, mixed_pages, periodic_pages, run_pages

import torch_pagecomp as pc
from torch_pagecomp import format as fmt
from torch_pagecomp.cpu_codec import decode_block

PAGE_SIZES = [4096, 8192, 16384, 32768, 65536]


def roundtrip(pages: torch.Tensor, element_size: int = 1) -> pc.CompressedPages:
    c = pc.compress(pages, element_size=element_size, backend="cpu")
    assert torch.equal(pc.decompress(c, backend="cpu"), pages)
    packed = pc.pack(c)
    assert packed.payload.numel() == int(c.sizes.sum())
    assert torch.equal(pc.decompress(packed, backend="cpu"), pages)
    return c


def check_blocks_readable_by_lz4(c: pc.CompressedPages, pages: torch.Tensor) -> None:
    shuffled = {1: pages}
    for i in range(c.num_pages):
        kind, shift = int(c.kinds[i]) & 15, int(c.kinds[i]) >> 4
        size = int(c.sizes[i])
        row = c.payload[i]
        assert not row[size:].any(), f"page {i}: tail after the stored bytes is not zero"
        if kind == fmt.KIND_LZ4:
            e = 1 << shift
            if e not in shuffled:
                shuffled[e] = pc.shuffle.bitshuffle(pages, e)
            out = lz4.block.decompress(row[:size].numpy().tobytes(), uncompressed_size=c.page_size)
            assert out == shuffled[e][i].numpy().tobytes(), f"page {i}"
        elif kind == fmt.KIND_FILL:
            assert size == 1 and (pages[i] == row[0]).all()
        else:
            assert kind == fmt.KIND_RAW and size == c.page_size and torch.equal(row, pages[i])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_roundtrip_mixed_every_page_size(page_size, gen):
    pages = mixed_pages(14, page_size, gen)
    c = roundtrip(pages)
    check_blocks_readable_by_lz4(c, pages)


def test_kinds_random_zero_fill_text(gen):
    random = torch.randint(0, 256, (3, 4096), dtype=torch.uint8, generator=gen)
    zero = torch.zeros((2, 4096), dtype=torch.uint8)
    fill = torch.full((2, 4096), int(torch.randint(1, 256, (1,), generator=gen)), dtype=torch.uint8)
    text = file_pages("text", 3, 4096, gen)
    c = roundtrip(torch.cat([random, zero, fill, text]))
    kinds = c.kinds.tolist()
    assert kinds[:3] == [fmt.KIND_RAW] * 3 and c.sizes[:3].tolist() == [4096] * 3
    assert kinds[3:7] == [fmt.KIND_FILL] * 4 and c.sizes[3:7].tolist() == [1] * 4
    assert kinds[7:] == [fmt.KIND_LZ4] * 3
    assert (c.sizes[7:] <= fmt.lz4_keep_limit(4096)).all()


@pytest.mark.parametrize("period", range(1, 18))
def test_periodic_patterns(period, gen):
    pages = periodic_pages(period, 3, 4096, gen)
    c = roundtrip(pages)
    check_blocks_readable_by_lz4(c, pages)


def test_long_runs_and_binaries(gen):
    pages = torch.cat([run_pages(4, 8192, gen), file_pages("binary", 4, 8192, gen)])
    check_blocks_readable_by_lz4(roundtrip(pages), pages)


@pytest.mark.parametrize("element_size", [1, 2, 4])
def test_element_sizes(element_size, gen):
    x = torch.randn(64 * 1024, generator=gen).to(torch.bfloat16)
    x = torch.relu(x).view(torch.uint8).view(-1, 4096)
    pages = torch.cat([x, mixed_pages(7, 4096, gen)])
    c = roundtrip(pages, element_size)
    lz4_pages = (c.kinds & 15) == fmt.KIND_LZ4
    assert ((c.kinds[lz4_pages] >> 4) == fmt.element_shift(element_size)).all()
    assert ((c.kinds[~lz4_pages] >> 4) == 0).all()
    check_blocks_readable_by_lz4(c, pages)


def test_shuffle_helps_bf16(gen):
    x = torch.randn(256 * 1024, generator=gen).to(torch.bfloat16)
    pages = x.view(torch.uint8).view(-1, 4096)
    plain = pc.compress(pages, backend="cpu").ratio()
    shuffled = pc.compress(pages, element_size=2, backend="cpu").ratio()
    assert shuffled > plain * 1.1, (plain, shuffled)


@pytest.mark.parametrize("n", [1, 3000])
def test_batch_sizes(n, gen):
    pages = mixed_pages(n, 4096, gen)[:n] if n > 1 else file_pages("text", 1, 4096, gen)
    roundtrip(pages)


def test_empty_batch():
    pages = torch.empty((0, 4096), dtype=torch.uint8)
    c = pc.compress(pages)
    assert c.payload.shape == (0, 4096) and c.sizes.shape == (0,)
    assert pc.decompress(c).shape == (0, 4096)
    assert pc.pack(c).offsets.tolist() == [0]


@pytest.mark.parametrize("mode", ["default", "fast", "high_compression"])
@pytest.mark.parametrize("page_size", [4096, 65536])
def test_reads_lz4_library_blocks(mode, page_size, gen):
    pages = mixed_pages(7, page_size, gen)
    blocks = [
        lz4.block.compress(p.numpy().tobytes(), mode=mode, store_size=False) for p in pages
    ]
    sizes = torch.tensor([len(b) for b in blocks], dtype=torch.int32)
    payload = torch.frombuffer(bytearray(b"".join(blocks)), dtype=torch.uint8)
    offsets = torch.zeros(len(blocks) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(sizes, 0)
    kinds = torch.full((len(blocks),), fmt.KIND_LZ4, dtype=torch.uint8)
    c = pc.CompressedPages(payload, sizes, kinds, page_size, offsets)
    assert torch.equal(pc.decompress(c), pages)
    for block, page in zip(blocks, pages):
        data, status = decode_block(block, page_size)
        assert status == fmt.STATUS_OK and data == page.numpy().tobytes()


def test_reference_decoder_agrees_with_lz4_on_mutations(gen):
    """decode_block accepts what lz4 accepts, with the same bytes, and never crashes.

    One exception: liblz4 does not reject a match offset of 0 (the format calls it invalid);
    decode_block does, with STATUS_BAD_OFFSET.
    """
    pages = mixed_pages(14, 4096, gen)
    for page in pages:
        block = bytearray(lz4.block.compress(page.numpy().tobytes(), store_size=False))
        for _ in range(30):
            b = bytearray(block)
            op = int(torch.randint(0, 3, (1,), generator=gen))
            pos = int(torch.randint(0, len(b), (1,), generator=gen))
            if op == 0:
                b[pos] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
            elif op == 1:
                b = b[:pos]
            else:
                b[pos:pos] = b[int(torch.randint(0, len(b), (1,), generator=gen)) :][:8]
            data, status = decode_block(bytes(b), 4096)
            try:
                ref = lz4.block.decompress(bytes(b), uncompressed_size=4096)
            except Exception:
                ref = None
            if ref is not None and len(ref) == 4096 and status != fmt.STATUS_BAD_OFFSET:
                assert status == fmt.STATUS_OK and data == ref
            if status == fmt.STATUS_OK:
                assert len(data) == 4096
            else:
                assert data is None and status in fmt.STATUS_NAMES
