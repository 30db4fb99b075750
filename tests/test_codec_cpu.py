"""The CPU reference path: bit-exact round trips, lz4 interop, kinds and the packed form."""

import random

import lz4.block
import numpy as np
import pytest
import torch
from pages import file_pages, long_overlap_blocks, mixed_pages, periodic_pages, run_pages

import torch_pagecomp as pc
from torch_pagecomp import cpu_codec
from torch_pagecomp import format as fmt
from torch_pagecomp.cpu_codec import decode_block, decompress_cpu
from torch_pagecomp.shuffle import _bitshuffle_torch, _bitunshuffle_torch, bitshuffle, bitunshuffle

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
    out, status = pc.decompress(c, return_status=True, backend="cpu")
    # blocks that save less than P/32 (random pages: longer than P) decode too: any LZ4 block
    # of a page, up to LZ4_compressBound(P), is read
    assert (sizes > fmt.lz4_keep_limit(page_size)).any()
    assert (status == fmt.STATUS_OK).all() and torch.equal(out, pages)
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


# --------------------------------------------------------------------------- bit-shuffle
def reference_bitshuffle(pages: np.ndarray, e: int) -> np.ndarray:
    """The format's definition, one plane at a time: ``Y[b * (n/8) + g] = sum_t bit b of
    x[8g + t] << t`` with ``x`` the page's ``n = P / e`` little-endian ``e``-byte integers."""
    n_pages, page_size = pages.shape
    x = pages.reshape(n_pages, -1, e).astype(np.uint64)
    x = (x << (8 * np.arange(e, dtype=np.uint64))).sum(axis=2)  # [N, n] element values
    groups = x.shape[1] // 8
    out = np.zeros((n_pages, 8 * e, groups), dtype=np.uint64)
    for b in range(8 * e):
        bit = (x >> np.uint64(b)) & np.uint64(1)  # [N, n]
        for t in range(8):
            out[:, b] |= bit[:, t::8] << np.uint64(t)
    return out.astype(np.uint8).reshape(n_pages, page_size)


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_bitshuffle_matches_the_definition(element_size, page_size, gen):
    n = 3 if page_size > 8192 else 9
    pages = torch.randint(0, 256, (n, page_size), dtype=torch.uint8, generator=gen)
    want = reference_bitshuffle(pages.numpy(), element_size)
    got = bitshuffle(pages, element_size)
    assert np.array_equal(got.numpy(), want)
    assert torch.equal(bitunshuffle(got, element_size), pages)
    # the torch element-op version (other devices) gives the same bytes
    assert np.array_equal(_bitshuffle_torch(pages, element_size).numpy(), want)
    assert torch.equal(_bitunshuffle_torch(got, element_size), pages)


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("page_size", [4096, 65536])
def test_numpy_and_c_shuffles_give_the_definition(element_size, page_size, gen):
    """Both implementations (the C extension's SSE2 loops where built, numpy everywhere): the
    definition's bytes, the inverse, and the inverse in place."""
    pages = torch.randint(0, 256, (5, page_size), dtype=torch.uint8, generator=gen).numpy()
    want = reference_bitshuffle(pages, element_size)
    sh = pc.shuffle
    assert np.array_equal(sh._bitshuffle_numpy(pages, element_size, np.empty_like(pages)), want)
    assert np.array_equal(sh._bitunshuffle_numpy(want, element_size, np.empty_like(pages)), pages)
    if sh._native is None:
        pytest.skip("no C shuffle here (not built, or not x86-64): numpy only")
    got = np.full_like(pages, 0xA5)
    sh._native.bitshuffle(pages.reshape(-1), got.reshape(-1), page_size, element_size, False)
    assert np.array_equal(got, want)
    sh._native.bitshuffle(got.reshape(-1), got.reshape(-1), page_size, element_size, True)
    assert np.array_equal(got, pages)  # in place
    for bad in ((3, page_size), (element_size, 64 * element_size + 8)):
        with pytest.raises(ValueError, match="bitshuffle"):
            sh._native.bitshuffle(pages.reshape(-1), got.reshape(-1), bad[1], bad[0], False)
    with pytest.raises(ValueError, match="bitshuffle"):
        sh._native.bitshuffle(pages.reshape(-1), got.reshape(-1)[:-page_size], page_size,
                              element_size, False)


@pytest.mark.parametrize("element_size", [1, 2, 4])
def test_bitshuffle_batches_across_chunks(element_size, gen):
    """Batches larger than one numpy step (``CHUNK_BYTES``), a partial last step, views."""
    rows = pc.shuffle.CHUNK_BYTES // 4096
    pages = torch.randint(0, 256, (rows * 2 + 5, 4096), dtype=torch.uint8, generator=gen)
    got = bitshuffle(pages, element_size)
    if element_size > 1:
        sample = torch.randint(0, pages.shape[0], (6,), generator=gen)
        want = reference_bitshuffle(pages[sample].numpy(), element_size)
        assert np.array_equal(got[sample].numpy(), want)
    assert torch.equal(bitunshuffle(got, element_size), pages)
    y = got.numpy().copy()
    assert pc.shuffle.bitunshuffle_np(y, element_size, out=y) is y  # in place
    assert np.array_equal(y, pages.numpy())
    assert bitshuffle(pages[:0], element_size).shape == (0, 4096)


# ------------------------------------------------------------------- threads
def test_threads_give_the_same_bytes(gen):
    pages = torch.cat([mixed_pages(140, 4096, gen), run_pages(3, 4096, gen)])
    x = torch.relu(torch.randn(70 * 2048, generator=gen)).to(torch.bfloat16)
    typed = x.view(torch.uint8).view(-1, 4096)
    try:
        results = []
        for threads in (1, 2, 3, 7):
            cpu_codec.set_cpu_threads(threads)
            assert cpu_codec.cpu_threads() == threads
            results.append([cpu_codec.compress_cpu(pages), cpu_codec.compress_cpu(typed, 2)])
            c = roundtrip(pages)
            roundtrip(typed, 2)
            assert torch.equal(c.payload, results[0][0][0])
        for r in results[1:]:
            for a, b in zip(r, results[0]):
                assert all(torch.equal(u, v) for u, v in zip(a, b))
    finally:
        cpu_codec.set_cpu_threads(None)


@pytest.mark.parametrize("packed", [False, True])
def test_threads_give_the_same_statuses_on_hostile_metadata(gen, packed, cpu_loops):
    """Bad kinds and sizes spread over every range (and, packed, a first offset that is not 0)
    give the same statuses and zeroed rows with 1 and 3 threads as the checks of the whole
    batch (the C loops check each range's pages in its thread; python-lz4: the batch's, first)."""
    pages = mixed_pages(300, 4096, gen)
    c = pc.compress(pages, backend="cpu")
    payload, offsets = c.payload.reshape(-1), torch.arange(300, dtype=torch.int64) * 4096
    sizes, kinds = c.sizes.clone(), c.kinds.clone()
    if packed:
        payload, offsets = cpu_codec.pack_cpu(c.payload, c.sizes)
        offsets = offsets.clone()
    bad = torch.randperm(300, generator=gen)[:30]
    kinds[bad[:10]] = 0x0F
    sizes[bad[10:20]] = 0
    sizes[bad[20:]] = fmt.lz4_bound(4096) + 1  # BAD_SIZE whatever the kind
    if packed:
        offsets[0] = 3  # page 0 only: its offset and its size no longer agree
    want = cpu_codec._page_checks(offsets.numpy(), sizes.numpy(), kinds.numpy(), 4096,
                                  payload.numel(), 300)
    assert (want != 0).sum() >= 30
    try:
        for threads in (1, 3):
            cpu_codec.set_cpu_threads(threads)
            out, status = cpu_codec.decompress_cpu(payload, offsets, sizes, kinds, 4096)
            assert np.array_equal(status.numpy(), want), threads
            failed = torch.from_numpy(want != 0)
            assert not out[failed].any() and torch.equal(out[~failed], pages[~failed])
    finally:
        cpu_codec.set_cpu_threads(None)


def hostile_metadata(gen, packed: bool):
    """A valid batch (bytes pages and bit-shuffled bf16 ones, fixed-stride or packed) whose
    metadata is then broken on about a third of its pages, each page one way: ``(payload,
    offsets int64 [N] or [N + 1], sizes int32 [N], kinds uint8 [N])``."""
    x = torch.relu(torch.randn(100 * 2048, generator=gen)).to(torch.bfloat16)
    typed = pc.compress(x.view(torch.uint8).view(-1, 4096), element_size=2, backend="cpu")
    plain = pc.compress(mixed_pages(200, 4096, gen), backend="cpu")
    payload = torch.cat([plain.payload, typed.payload])
    sizes = torch.cat([plain.sizes, typed.sizes])
    kinds = torch.cat([plain.kinds, typed.kinds])
    n = sizes.shape[0]
    if packed:
        payload, offsets = cpu_codec.pack_cpu(payload, sizes)
    else:
        payload, offsets = payload.reshape(-1), torch.arange(n, dtype=torch.int64) * 4096
    rand = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=gen)))
    if packed and rand.integers(0, 2):  # every page where its offsets say, but offsets[0] != 0
        d = int(rand.integers(1, 9))
        payload, offsets = torch.cat([torch.zeros(d, dtype=torch.uint8), payload]), offsets + d
    total, bound = payload.numel(), fmt.lz4_bound(4096)
    off, size, kind = offsets.numpy(), sizes.numpy(), kinds.numpy()
    for i in rand.choice(n, n // 3, replace=False).tolist():
        way = int(rand.integers(0, 13))
        if way == 0:  # a negative offset
            off[i] = -int(rand.integers(1, 1 << 62))
        elif way == 1:  # an offset at or past the end, up to the int64 edge
            off[i] = total + int(rand.integers(0, 1 << 62)) * int(rand.integers(0, 2))
        elif way == 2:  # size 0, or negative down to the int32 edge
            size[i] = -int(rand.integers(0, 1 << 31))
        elif way == 3:  # one byte more than the payload holds after the offset
            size[i] = min(total - max(int(off[i]), 0) + 1, 2**31 - 1)
        elif way == 4:  # RAW of another size
            kind[i], size[i] = fmt.KIND_RAW, 4096 + int(rand.choice([-1, 1, -4095, 2**30]))
        elif way == 5:  # FILL of another size
            kind[i], size[i] = fmt.KIND_FILL, int(rand.choice([0, 2, 4096]))
        elif way == 6:  # LZ4 over LZ4_compressBound(P) (inside the payload where it fits)
            kind[i] = fmt.KIND_LZ4 | kind[i] & 0xF0
            size[i] = int(rand.integers(bound + 1, 8193))
        elif way == 7:  # an unknown codec, any shift nibble
            kind[i] = int(rand.integers(3, 16)) | int(rand.integers(0, 16)) << 4
        elif way == 8:  # a shift on RAW or FILL
            codec = int(rand.choice([fmt.KIND_RAW, fmt.KIND_FILL]))
            kind[i] = codec | int(rand.integers(1, 16)) << 4
        elif way == 9:  # LZ4 with a shift nibble above 2
            kind[i] = fmt.KIND_LZ4 | int(rand.integers(3, 16)) << 4
        elif way == 10:  # the offset moved by a little (packed: it disagrees with a size)
            off[i] += int(rand.choice([-2, -1, 1, 2]))
        elif way == 11 and packed:  # the end offset (i + 1) moved: page i disagrees
            off[i + 1] += int(rand.choice([-1, 1, 4096]))
        elif way == 12:  # the size moved by one
            size[i] += int(rand.choice([-1, 1]))
    if packed and rand.integers(0, 2):
        off[0] = int(rand.choice([1, -1, 4096]))
    return payload, offsets, sizes, kinds


@pytest.mark.parametrize("packed", [False, True])
def test_c_metadata_checks_are_page_checks(gen, packed, monkeypatch):
    """The C decoder's own metadata checks give, on fresh random hostile metadata, exactly
    ``_page_checks``' BAD_KIND and BAD_SIZE (every other page: OK or its block's status): on
    ranges cut anywhere (a packed page's check reads the offset one past its range), and through
    ``decompress_cpu`` at several thread counts, with the same statuses and pages as the
    python-lz4 path."""
    if cpu_codec._native is None:
        pytest.skip("torch_pagecomp._native is not built here")
    payload, offsets, sizes, kinds = hostile_metadata(gen, packed)
    n = sizes.shape[0]
    want = cpu_codec._page_checks(offsets.numpy(), sizes.numpy(), kinds.numpy(), 4096,
                                  payload.numel(), n)
    assert (want == fmt.STATUS_BAD_KIND).any() and (want == fmt.STATUS_BAD_SIZE).any()

    def metadata_part(status: np.ndarray) -> np.ndarray:
        bad = (status == fmt.STATUS_BAD_KIND) | (status == fmt.STATUS_BAD_SIZE)
        return np.where(bad, status, 0)

    cuts = torch.randperm(n - 1, generator=gen)[: int(torch.randint(1, 40, (1,), generator=gen))]
    bounds = [0, *sorted((cuts + 1).tolist()), n]
    out = np.full(n * 4096, 0xA5, np.uint8)
    st = np.full(n, -1, np.int32)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        cpu_codec._native.decode_pages(payload.numpy(), offsets.numpy(), sizes.numpy(),
                                       kinds.numpy(), out, st, 4096, start, stop)
    assert np.array_equal(metadata_part(st), want), bounds
    assert not out.reshape(n, 4096)[st != 0].any()
    with monkeypatch.context() as m:
        m.setattr(cpu_codec, "_native", None)
        ref_out, ref_status = cpu_codec.decompress_cpu(payload, offsets, sizes, kinds, 4096)
    assert np.array_equal(ref_status.numpy(), st)
    assert np.array_equal(ref_out.numpy().reshape(-1), out)
    try:
        for threads in (1, 2, 3, 8):
            cpu_codec.set_cpu_threads(threads)
            got_out, got_status = cpu_codec.decompress_cpu(payload, offsets, sizes, kinds, 4096)
            assert torch.equal(got_status, ref_status), threads
            assert torch.equal(got_out, ref_out), threads
    finally:
        cpu_codec.set_cpu_threads(None)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", [40, 1000, 5000])
def test_threads_take_ranges_as_they_finish(monkeypatch, threads, n):
    """A batch runs as bounded ranges, a few per thread when split, each taken once, covering
    every page."""
    import threading

    monkeypatch.setattr(cpu_codec, "cpu_threads", lambda: threads)
    seen, workers, lock = [], set(), threading.Lock()

    def fn(start, stop):
        with lock:
            seen.append((start, stop))
            workers.add(threading.get_ident())

    cpu_codec._run_ranges(fn, n, 4096)
    seen.sort()
    assert seen[0][0] == 0 and seen[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(seen, seen[1:]))  # no gap, no overlap
    assert all((b - a) * 4096 <= cpu_codec.MAX_RANGE_BYTES for a, b in seen)
    split = threads > 1 and n >= cpu_codec.MIN_THREADED_PAGES
    if split:
        assert len(seen) >= min(threads * cpu_codec.RANGES_PER_THREAD,
                                n // (cpu_codec.MIN_THREADED_PAGES // 2))
    else:
        assert workers == {threading.get_ident()}


def test_output_pool_reuses_only_dead_outputs():
    from torch_pagecomp.pools import CpuOutputPool

    pool = CpuOutputPool(max_idle_bytes=3 * (2 << 20))
    shape = (512, 4096)  # 2 MiB
    a = pool.empty(shape)
    assert a.shape == shape and a.dtype == torch.uint8
    ptr = a.data_ptr()
    view = a[3:]
    del a
    b = pool.empty(shape)  # the view keeps the first buffer alive: a new one
    assert b.data_ptr() != ptr
    del view
    c = pool.empty(shape)
    assert c.data_ptr() == ptr and pool.stats()["hits"] == 1
    assert pool.empty((511, 4096)).data_ptr() != b.data_ptr()  # exact sizes only
    del b, c
    held = [pool.empty(shape) for _ in range(5)]
    del held
    assert pool.stats()["idle_buffers"] == 3  # the cap: the oldest idle ones dropped
    pool.clear()
    assert pool.stats()["idle_bytes"] == 0
    small = pool.empty((16, 4096))  # below MIN_BYTES: plain torch memory, not counted
    assert pool.stats()["misses"] == 6 and pool.stats()["hits"] == 3
    assert small.numel() == 16 * 4096


@pytest.mark.parametrize("threads", [1, 2])
def test_reused_outputs_are_written_in_full(threads, gen):
    """The codec's outputs come back from the pool with the bytes of earlier calls: every byte
    must be written again. Poisoned outputs are handed back and must not show."""
    pages = torch.cat([mixed_pages(300, 4096, gen), run_pages(8, 4096, gen)])
    x = torch.relu(torch.randn(300 * 2048, generator=gen)).to(torch.bfloat16)
    typed = x.view(torch.uint8).view(-1, 4096)
    cpu_codec.empty_cpu_cache()
    try:
        cpu_codec.set_cpu_threads(threads)
        for batch, e in ((pages, 1), (typed, 2)):
            first = cpu_codec.compress_cpu(batch, e)
            want = [t.clone() for t in first]
            first[0].fill_(0xAB)  # poison, then hand the memory back
            del first
            hits = cpu_codec._outputs.stats()["hits"]
            again = cpu_codec.compress_cpu(batch, e)
            assert cpu_codec._outputs.stats()["hits"] == hits + 1
            assert all(torch.equal(u, v) for u, v in zip(again, want))
            out, status = decompress_cpu(again[0].view(-1), torch.arange(batch.shape[0]) * 4096,
                                         again[1], again[2], 4096)
            assert torch.equal(out, batch) and not status.any()
            out.fill_(0xCD)
            del out
            out, status = decompress_cpu(again[0].view(-1), torch.arange(batch.shape[0]) * 4096,
                                         again[1], again[2], 4096)
            assert torch.equal(out, batch) and not status.any()
    finally:
        cpu_codec.set_cpu_threads(None)


def test_thread_setting(monkeypatch):
    monkeypatch.delenv(cpu_codec.THREADS_ENV, raising=False)
    cpu_codec.set_cpu_threads(None)
    default = cpu_codec.cpu_threads()
    assert 1 <= default <= cpu_codec.MAX_DEFAULT_THREADS
    monkeypatch.setenv(cpu_codec.THREADS_ENV, "3")  # read at each call
    assert cpu_codec.cpu_threads() == 3
    cpu_codec.set_cpu_threads(5)
    assert cpu_codec.cpu_threads() == 5
    cpu_codec.set_cpu_threads(None)
    monkeypatch.setenv(cpu_codec.THREADS_ENV, "zero")
    with pytest.raises(pc.PageCompError, match=cpu_codec.THREADS_ENV):
        cpu_codec.cpu_threads()
    for bad in (0, -1, 2.0, True):
        with pytest.raises(pc.PageCompError):
            cpu_codec.set_cpu_threads(bad)


def test_default_threads_follow_the_cpus_the_process_may_use(monkeypatch):
    """The default thread count is bounded by the process's affinity mask (a container's
    cpuset, ``taskset``, a scheduler's allotment), not the host's core count, and falls back
    to ``os.cpu_count()`` where the OS has no mask."""
    import os

    monkeypatch.delenv(cpu_codec.THREADS_ENV, raising=False)
    cpu_codec.set_cpu_threads(None)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6}, raising=False)
    assert cpu_codec.usable_cpus() == 3 and cpu_codec.cpu_threads() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(40)), raising=False)
    assert cpu_codec.cpu_threads() == cpu_codec.MAX_DEFAULT_THREADS

    def no_mask(pid):
        raise OSError("no affinity here")

    monkeypatch.setattr(os, "sched_getaffinity", no_mask, raising=False)
    assert cpu_codec.usable_cpus() == 64
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert cpu_codec.usable_cpus() == 64


def test_pool_exits_cleanly(tmp_path):
    """A script that compresses on several threads exits 0 with nothing on stderr; a child
    forked after they ran (a DataLoader worker, say) compresses on threads of its own: the
    pool's (the parent's pool threads are not in the child: submitting to them would wait
    forever), or, where the C loops start their threads per call, new ones (none outlives a
    call, so there is no pool)."""
    import subprocess
    import sys

    script = tmp_path / "use_pool.py"
    script.write_text(
        "import os, time, torch\n"
        "from torch_pagecomp import cpu_codec\n"
        "cpu_codec.set_cpu_threads(4)\n"
        "x = torch.arange(4096 * 256, dtype=torch.int32).view(torch.uint8).view(-1, 4096)\n"
        "def round_trip():\n"
        "    p, s, k = cpu_codec.compress_cpu(x, 4)\n"
        "    offs = torch.arange(x.shape[0], dtype=torch.int64) * 4096\n"
        "    out, st = cpu_codec.decompress_cpu(p.view(-1), offs, s, k, 4096)\n"
        "    # numpy's compare: torch's own thread pool does not survive a fork (not ours)\n"
        "    return bool((out.numpy() == x.numpy()).all()) and not st.numpy().any()\n"
        "assert round_trip() and (cpu_codec._pool is not None) != cpu_codec._C_THREADS\n"
        "import warnings  # the fork of a process with threads (the pool's) is the point here:\n"
        "warnings.filterwarnings('ignore', 'This process .* is multi-threaded',\n"
        "                        DeprecationWarning)  # Python >= 3.12 warns on such a fork\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if round_trip() else 1)\n"
        "for _ in range(600):\n"
        "    done, status = os.waitpid(pid, os.WNOHANG)\n"
        "    if done:\n"
        "        break\n"
        "    time.sleep(0.1)\n"
        "else:\n"
        "    os.kill(pid, 9)\n"
        "    raise SystemExit('the forked child hung on the pool')\n"
        "assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done
    assert done.stderr == "", done.stderr


# ---------------------------------------------------------------- decode rules (#20)
def lz4_block(sequences, last: bytes) -> bytes:
    """A raw LZ4 block: ``sequences`` of ``(literals, offset, match_len)``, then ``last``."""
    def length(n):
        out = bytearray()
        while n >= 255:
            out.append(255)
            n -= 255
        out.append(n)
        return bytes(out)

    block = bytearray()
    for lits, offset, ml in sequences:
        lit_n, ml_n = len(lits), ml - 4
        block.append((min(lit_n, 15) << 4) | min(ml_n, 15))
        if lit_n >= 15:
            block += length(lit_n - 15)
        block += lits + offset.to_bytes(2, "little")
        if ml_n >= 15:
            block += length(ml_n - 15)
    block.append(min(len(last), 15) << 4)
    if len(last) >= 15:
        block += length(len(last) - 15)
    return bytes(block + last)


def decode(blocks, sizes=None, kinds=None, page_size=4096, packed=True):
    """``decompress_cpu`` over ``blocks`` packed back to back (``offsets [N + 1]``)."""
    sizes = torch.tensor([len(b) for b in blocks] if sizes is None else sizes, dtype=torch.int32)
    offsets = torch.zeros(len(blocks) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([len(b) for b in blocks]), 0)
    if kinds is None:
        kinds = [fmt.KIND_LZ4] * len(blocks)
    kinds = torch.tensor(kinds, dtype=torch.uint8)
    payload = torch.frombuffer(bytearray(b"".join(blocks) or b"\0"), dtype=torch.uint8)
    return decompress_cpu(payload, offsets if packed else offsets[:-1], sizes, kinds, page_size)


@pytest.mark.parametrize("page_size", [4096, 8192])
def test_long_overlapping_matches_decode_as_the_reference(page_size, gen, cpu_loops):
    """Matches longer than their offset at every period around the C decoder's 16-byte copies
    (it copies a repeated pattern 16 bytes at a time from inside the match's first bytes), ending
    anywhere near the page's end: the bytes are the reference's. Both decoders."""
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    blocks = long_overlap_blocks(page_size, rng)
    out, status = decode(blocks, page_size=page_size)
    for k, b in enumerate(blocks):
        data, want = decode_block(b, page_size)
        assert want == 0 and status[k] == 0, (k, status[k])
        assert out[k].numpy().tobytes() == data, f"block {k} decoded wrong"


def test_offset_zero_is_bad_offset(gen):
    """liblz4 decodes a match offset of 0; the format (and the GPU decoder) reject it."""
    text = file_pages("text", 1, 4096, gen)[0].numpy().tobytes()
    good_seq = [(text[:100], 100, 200)]
    ok = lz4_block(good_seq, text[300:4096])
    cases = [
        lz4_block([(text[:100], 0, 200)], text[300:4096]),  # the first match
        lz4_block(good_seq + [(b"", 0, 4)], text[304:4096]),  # a later one, no literals
        lz4_block(good_seq + [(text[300:320], 0, 300)], text[620:4096]),  # long match
        lz4_block(good_seq + [(text[300:3000], 0, 19)], text[3019:4096]),  # lit ext before
    ]
    for block in cases:
        assert lz4.block.decompress(block, uncompressed_size=4096)  # liblz4 lets it through
        assert decode_block(block, 4096) == (None, fmt.STATUS_BAD_OFFSET)
    out, status = decode([ok] + cases + [ok])
    assert status.tolist() == [0] + [fmt.STATUS_BAD_OFFSET] * len(cases) + [0]
    assert not out[1:-1].any()
    assert out[0].numpy().tobytes() == decode_block(ok, 4096)[0]


def test_overlong_lz4_raw_and_fill_sizes_are_bad_size(gen, cpu_loops):
    """An LZ4 block of any length up to ``LZ4_compressBound(P)`` is read (``lz4.block`` writes
    ~4114 bytes for a random 4 KiB page); one byte more is BAD_SIZE, as are RAW pages not of
    ``P`` bytes, FILL pages not of 1 and empty LZ4 pages."""
    page = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    overlong = lz4.block.compress(page, store_size=False)  # valid, ~4114 bytes
    bound = fmt.lz4_bound(4096)
    assert fmt.lz4_keep_limit(4096) < len(overlong) <= bound
    past = overlong + bytes(bound + 1 - len(overlong))  # the block, then zeros past the bound
    text = file_pages("text", 1, 4096, gen)[0].numpy().tobytes()
    good = lz4.block.compress(text, store_size=False)
    raw, fill = text, b"\x07"
    blocks = [overlong, good, raw[:4095], raw + b"x", raw, fill + b"\x07", fill, b"", past]
    sizes = [len(b) for b in blocks]
    sizes[-2] = 0  # an LZ4 page of size 0
    kinds = [1, 1, 0, 0, 0, 2, 2, 1, 1]
    for packed in (True, False):
        out, status = decode(blocks, sizes, kinds, packed=packed)
        assert status.tolist() == [0, 0, 2, 2, 0, 2, 0, 2, 2], packed
        assert not out[[2, 3, 5, 7, 8]].any()
        assert out[0].numpy().tobytes() == page and out[1].numpy().tobytes() == text
        assert out[4].numpy().tobytes() == raw and (out[6] == 7).all()
    # the bound itself is read: the block with zeros after it is decoded to its end, the zeros
    # being a token past the page's end (a block that does not end where it should)
    assert decode([past[:bound]], page_size=4096)[1].tolist() != [fmt.STATUS_BAD_SIZE]


def test_packed_offsets_must_agree_with_sizes(gen, cpu_loops):
    pages = torch.cat([file_pages("text", 4, 4096, gen), mixed_pages(7, 4096, gen)])
    c = pc.pack(pc.compress(pages, backend="cpu"))
    n = c.num_pages
    args = (c.payload, c.offsets, c.sizes, c.kinds, 4096)
    out, status = decompress_cpu(*args)
    assert not status.any() and torch.equal(out, pages)
    i = int(torch.randint(1, n - 1, (1,), generator=gen))
    cases = {
        "size one short": (lambda o, s: s.__setitem__(i, s[i] - 1), [i]),
        "offset moved": (lambda o, s: o.__setitem__(i, o[i] + 1), [i - 1, i]),
        "offsets[0] != 0": (lambda o, s: o.__setitem__(0, 1), [0]),
        "end past the payload": (lambda o, s: o.__setitem__(n, o[n] + 1), [n - 1]),
        "not monotonic": (lambda o, s: o.__setitem__(i, o[i + 1] + 5), [i - 1, i]),
    }
    for name, (mutate, bad) in cases.items():
        offsets, sizes = c.offsets.clone(), c.sizes.clone()
        mutate(offsets, sizes)
        out, status = decompress_cpu(c.payload, offsets, sizes, c.kinds, 4096)
        assert torch.nonzero(status).flatten().tolist() == bad, name
        assert (status[bad] == fmt.STATUS_BAD_SIZE).all(), name
        good = [k for k in range(n) if k not in bad]
        assert torch.equal(out[good], pages[good]) and not out[bad].any(), name
    # hostile offsets never read outside the payload
    for _ in range(20):
        offsets = torch.randint(-50, c.payload.numel() + 50, (n + 1,), generator=gen)
        sizes = torch.randint(-3, 5000, (n,), dtype=torch.int32, generator=gen)
        out, status = decompress_cpu(c.payload, offsets, sizes, c.kinds, 4096)
        assert set(status.tolist()) <= set(fmt.STATUS_NAMES)


@pytest.fixture(params=["native", "python-lz4"])
def cpu_loops(request, monkeypatch):
    """Each way the CPU path runs its LZ4 pages in turn: the C loops (``_native``, where
    built) and python-lz4 page by page, which they replace where no C compiler is found."""
    if request.param == "native" and cpu_codec._native is None:
        pytest.skip("torch_pagecomp._native is not built here")
    if request.param == "python-lz4":
        monkeypatch.setattr(cpu_codec, "_native", None)
    return request.param


def test_cpu_statuses_are_the_reference_rules(gen, cpu_loops):
    """Every mutated block: ``decompress_cpu``'s status is ``decode_block``'s (after the size
    rule), whether or not liblz4 takes the block; offsets of 0 planted among the mutations.
    Both decoders."""
    pages = torch.cat([mixed_pages(14, 4096, gen), file_pages("binary", 4, 4096, gen)])
    x = torch.relu(torch.randn(4 * 2048, generator=gen)).to(torch.bfloat16)
    shuffled = bitshuffle(x.view(torch.uint8).view(-1, 4096), 2)
    blocks = []
    for page in torch.cat([pages, shuffled]):
        block = bytearray(lz4.block.compress(page.numpy().tobytes(), store_size=False))
        for _ in range(12):
            b = bytearray(block)
            op = int(torch.randint(0, 4, (1,), generator=gen))
            pos = int(torch.randint(0, len(b), (1,), generator=gen))
            if op == 0:
                b[pos] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
            elif op == 1:
                b = b[:pos]
            elif op == 2:
                b[pos:pos + 2] = b"\0\0"  # an offset of 0 when pos is an offset
            else:
                b[pos:pos] = b[int(torch.randint(0, len(b), (1,), generator=gen)):][:8]
            blocks.append(bytes(b))
    out, status = decode(blocks)
    bound = fmt.lz4_bound(4096)
    for k, b in enumerate(blocks):
        data, want = decode_block(b, 4096) if 1 <= len(b) <= bound else (None, 2)
        assert status[k] == want, (k, status[k], want)
        if want == 0:
            assert out[k].numpy().tobytes() == data
        else:
            assert not out[k].any()
    assert (status == fmt.STATUS_BAD_OFFSET).any()  # the planted zeros did plant some


def test_the_c_decoder_is_built_where_a_compiler_is():
    """``make install`` builds ``torch_pagecomp._native`` when a C compiler is on the path (as
    on CI): the CPU path's speed and thread scaling depend on it."""
    import os
    import shutil
    import sysconfig

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: python-lz4 page by page")
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no Python headers here: python-lz4 page by page")
    assert cpu_codec._native is not None
    import platform

    if platform.machine().lower() in ("x86_64", "amd64"):  # SSE2: the bit-shuffle in C too
        assert pc.shuffle._native is not None


def test_c_loops_check_their_arguments(gen):
    """Buffers that do not describe one batch, or a range outside it, are a ValueError and
    buffers of another type a TypeError (before any page is written); only the range's rows and
    statuses are written, every one of them; a block outside the payload is BAD_SIZE and its row
    zeroed; a packed container's checks read the offset one past the range and know page 0;
    the compress loop refuses missing liblz4 calls and writes FILL, LZ4 and RAW pages with
    their kinds."""
    if cpu_codec._native is None:
        pytest.skip("torch_pagecomp._native is not built here")
    page = bytes(range(256)) * 16
    block = lz4.block.compress(page, store_size=False)
    payload = np.frombuffer(block, dtype=np.uint8)
    off, size = np.zeros(2, np.int64), np.full(2, len(block), np.int32)
    kinds = np.full(2, fmt.KIND_LZ4, np.uint8)
    out, st = np.full(2 * 4096, 0xA5, np.uint8), np.full(2, -1, np.int32)

    def dec(payload=payload, off=off, size=size, kinds=kinds, out=out, st=st, start=0, stop=2):
        cpu_codec._native.decode_pages(payload, off, size, kinds, out, st, 4096, start, stop)

    for bad in ({"out": out[:4096]}, {"off": off[:1]}, {"off": np.zeros(4, np.int64)},
                {"kinds": kinds[:1]}, {"st": st[:1]}, {"stop": 3}, {"start": 2, "stop": 1},
                {"start": -1}):
        with pytest.raises(ValueError, match="decode_pages: 2 pages"):
            dec(**bad)
    for bad in ({"size": size.astype(np.int64)}, {"off": off.astype(np.int32)},
                {"kinds": kinds.view(np.int8)}, {"out": out[::2]}, {"st": st.view(np.uint32)}):
        with pytest.raises(TypeError):
            dec(**bad)
    assert (out == 0xA5).all() and (st == -1).all()  # nothing written before the checks
    dec(start=1, stop=2)
    assert st.tolist() == [-1, fmt.STATUS_OK] and (out[:4096] == 0xA5).all()
    assert out[4096:].tobytes() == page
    size[1] = len(block) + 1  # one byte past the payload
    dec()
    assert st.tolist() == [fmt.STATUS_OK, fmt.STATUS_BAD_SIZE]
    assert out[:4096].tobytes() == page and not out[4096:].any()
    size[1] = len(block)
    kinds[1] = fmt.KIND_FILL  # a FILL page's size must be 1, a RAW page's the page size
    dec()
    assert st.tolist() == [fmt.STATUS_OK, fmt.STATUS_BAD_SIZE]
    kinds[1] = fmt.KIND_LZ4
    st[:] = [fmt.STATUS_BAD_KIND, fmt.STATUS_TRUNCATED]  # whatever was there is overwritten
    dec()
    assert st.tolist() == [fmt.STATUS_OK, fmt.STATUS_OK]
    # kinds the C checks refuse (never unshuffled as other sizes)
    for bad in (fmt.KIND_LZ4 | 3 << 4, 3, fmt.KIND_RAW | 1 << 4, fmt.KIND_FILL | 2 << 4):
        kinds[:] = [fmt.KIND_LZ4, bad]
        out[:] = 0xA5
        dec()
        assert st.tolist() == [fmt.STATUS_OK, fmt.STATUS_BAD_KIND] and not out[4096:].any()
    kinds[:] = fmt.KIND_LZ4
    # packed (N + 1 offsets): page 0 is checked against offsets[1], past a range [0, 1)
    two = np.frombuffer(block * 2, dtype=np.uint8)
    packed = np.array([0, len(block), 2 * len(block)], np.int64)
    dec(payload=two, off=packed, start=0, stop=1)
    assert st[0] == fmt.STATUS_OK and out[:4096].tobytes() == page
    packed[1] += 1
    dec(payload=two, off=packed, start=0, stop=1)
    assert st[0] == fmt.STATUS_BAD_SIZE and not out[:4096].any()
    # every page agrees with the next offset, but offsets[0] != 0: page 0 only
    shifted = np.frombuffer(b"\0" + block * 2, dtype=np.uint8)
    packed = np.array([1, 1 + len(block), 1 + 2 * len(block)], np.int64)
    dec(payload=shifted, off=packed, start=1, stop=2)
    assert st[1] == fmt.STATUS_OK and out[4096:].tobytes() == page
    dec(payload=shifted, off=packed)
    assert st.tolist() == [fmt.STATUS_BAD_SIZE, fmt.STATUS_OK]
    comp, calls = cpu_codec._native.compress_pages, cpu_codec._liblz4_calls()
    raw = np.frombuffer(page + bytes([9]) * 4096 + bytes(gen_bytes(gen, 4096)), dtype=np.uint8)
    sizes, kinds3 = np.zeros(3, np.int32), np.zeros(3, np.uint8)
    out3 = np.full(3 * 4096, 0xA5, np.uint8)
    with pytest.raises(ValueError, match="out holds"):
        comp(raw, raw, out3[:4096], sizes, kinds3, 4096, 3968, fmt.KIND_LZ4, 0, calls)
    with pytest.raises(ValueError, match="liblz4 calls are invalid"):
        comp(raw, raw, out3, sizes, kinds3, 4096, 3968, fmt.KIND_LZ4, 0, (0, 0, 0))
    with pytest.raises(ValueError, match="shuffle"):
        comp(raw, raw, out3, sizes, kinds3, 4096, 3968, fmt.KIND_LZ4, 8, calls)
    assert (out3 == 0xA5).all()
    comp(raw, raw, out3, sizes, kinds3, 4096, 3968, fmt.KIND_LZ4, 0, calls)
    assert sizes.tolist() == [len(block), 1, 4096]
    assert kinds3.tolist() == [fmt.KIND_LZ4, fmt.KIND_FILL, fmt.KIND_RAW]
    assert out3[:len(block)].tobytes() == block and not out3[len(block):4096].any()
    assert out3[4096] == 9 and not out3[4097:8192].any()
    assert out3[8192:].tobytes() == raw[8192:].tobytes()


def gen_bytes(gen: torch.Generator, n: int) -> bytes:
    return bytes(torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).numpy())


def test_c_compress_loop_writes_lz4_block_bytes(gen, monkeypatch):
    """The C loop compresses with python-lz4's own liblz4: payload, sizes and kinds equal the
    page-by-page python-lz4 path's on every kind of page (fill, RAW, bytes, bit-shuffled), and
    every block is ``lz4.block.compress``'s."""
    if cpu_codec._native is None or cpu_codec._liblz4_calls() is None:
        pytest.skip("torch_pagecomp._native is not built here")
    pages = torch.cat([mixed_pages(40, 4096, gen), file_pages("text", 8, 4096, gen),
                       torch.randint(0, 256, (4, 4096), generator=gen, dtype=torch.uint8)])
    pages[3] = 7  # a fill page
    for e in (1, 2, 4):
        native = cpu_codec.compress_cpu(pages, e)
        with monkeypatch.context() as m:
            m.setattr(cpu_codec, "_native", None)
            python = cpu_codec.compress_cpu(pages, e)
        for a, b in zip(native, python):
            assert torch.equal(a, b)
    payload, sizes, kinds = native  # element size 4
    src = bitshuffle(pages, 4)
    for i in torch.nonzero((kinds & 15) == fmt.KIND_LZ4).flatten().tolist():
        want = lz4.block.compress(src[i].numpy().tobytes(), store_size=False)
        assert payload[i, :int(sizes[i])].numpy().tobytes() == want


@pytest.mark.parametrize("page_size", [4096, 65536])
def test_the_c_pack_equals_the_python_loop_and_refuses_bad_offsets(page_size, gen, monkeypatch):
    """``pack_cpu`` through the C loop gives the Python loop's bytes (sizes 0, P, past P and
    negative clamped as before; the tail zeroed, though the output starts unwritten) and the
    loop itself refuses offsets that would copy outside its buffers."""
    if getattr(cpu_codec._native, "pack_pages", None) is None:
        pytest.skip("torch_pagecomp._native (with pack_pages) is not built here")
    n = int(torch.randint(1, 50, (1,), generator=gen))
    payload = torch.randint(0, 256, (n, page_size), dtype=torch.uint8, generator=gen)
    sizes = torch.randint(-5, page_size + 6, (n,), dtype=torch.int32, generator=gen)
    sizes[0], sizes[-1] = 0, page_size
    empty = cpu_codec._outputs.empty
    with monkeypatch.context() as m:  # outputs poisoned: what the loop leaves unwritten shows
        m.setattr(cpu_codec._outputs, "empty", lambda shape: empty(shape).fill_(0xAB))
        got = cpu_codec.pack_cpu(payload, sizes)
    with monkeypatch.context() as m:
        m.setattr(cpu_codec, "_native", None)
        want = cpu_codec.pack_cpu(payload, sizes)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    flat, out = payload.reshape(-1).numpy(), np.empty(n * page_size, dtype=np.uint8)
    good = want[1].numpy()
    for bad in (good[:-1] - 1, np.r_[good[:-1], good[-2] + page_size + 1],
                np.r_[1, good[1:]], np.r_[good[:1], good[2:], good[-1]][: n + 1]):
        bad = np.ascontiguousarray(bad, dtype=np.int64)
        if np.array_equal(bad, good):
            continue
        if (bad[0] == 0 and (np.diff(bad) >= 0).all() and (np.diff(bad) <= page_size).all()):
            continue  # a valid packing after all
        with pytest.raises(ValueError, match="offsets are invalid"):
            cpu_codec._native.pack_pages(flat, bad, out, page_size)
    with pytest.raises(ValueError, match="packed holds"):  # shorter than the pages packed
        cpu_codec._native.pack_pages(flat, good, out[:int(good[-1]) - 1], page_size)
    exact = np.full(int(good[-1]) + 3, 0xAB, dtype=np.uint8)  # packed to its exact size
    cpu_codec._native.pack_pages(flat, good, exact[:-3], page_size)
    assert np.array_equal(exact[:-3], got[0][:int(good[-1])].numpy())
    assert (exact[-3:] == 0xAB).all()  # nothing written past the buffer given
