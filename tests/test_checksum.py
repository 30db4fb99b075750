"""Page checksums (issue #20): the format's definition, the CPU reference and the Triton kernel
agree; every single-bit flip of a page is caught; a corrupted stored payload never decodes
silently to wrong bytes when checksums are on."""

import os

import pytest
import torch
from pages import kernel_device

import torch_pagecomp as pc
from torch_pagecomp import format as fmt
from torch_pagecomp.cpu_codec import page_checksums_cpu
from torch_pagecomp.kernels.checksum import page_checksums as kernel_checksums

M32 = 0xFFFFFFFF


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


def definition(page: bytes) -> int:
    """The format docstring's checksum, xxHash32 with seed 0, in plain Python (pages are whole
    16-byte stripes: no tail bytes)."""
    p1, p2, p3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
    v = [(p1 + p2) & M32, p2, 0, -p1 & M32]
    for s in range(0, len(page), 16):
        for k in range(4):
            w = int.from_bytes(page[s + 4 * k:s + 4 * k + 4], "little")
            v[k] = _rotl((v[k] + w * p2) & M32, 13) * p1 & M32
    h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18) + len(page)) & M32
    h ^= h >> 15
    h = h * p2 & M32
    h ^= h >> 13
    h = h * p3 & M32
    h ^= h >> 16
    return h - (1 << 32) if h >= 1 << 31 else h


def mixed_pages(gen: torch.Generator, n: int, page_size: int) -> torch.Tensor:
    """Random, low-entropy, zero and 0xFF pages (every stored kind)."""
    x = torch.randint(0, 256, (n, page_size), dtype=torch.uint8, generator=gen)
    x[1::4] = torch.randint(0, 3, (len(range(1, n, 4)), page_size), dtype=torch.uint8,
                            generator=gen)
    x[2::4] = 0
    x[3::4] = 255
    return x


def test_reference_follows_the_definition(gen):
    x = mixed_pages(gen, 6, 4096)
    x[5, :7] = torch.tensor([1, 2, 3, 4, 5, 6, 7], dtype=torch.uint8)  # odd bytes at the start
    want = [definition(bytes(row.tolist())) for row in x]
    assert page_checksums_cpu(x).tolist() == want


def test_definition_is_the_standard_xxhash32(gen):
    """The same values as an independent xxHash implementation (the ``xxhash`` package), the
    way a user checks a stored page without this package."""
    xxhash = pytest.importorskip("xxhash")
    x = mixed_pages(gen, 8, 4096)
    want = [xxhash.xxh32_intdigest(bytes(row.tolist())) for row in x]
    assert [v & M32 for v in page_checksums_cpu(x).tolist()] == want
    assert [definition(bytes(row.tolist())) & M32 for row in x[:2]] == want[:2]


# one chain per lane as long as the page: a 64 KiB page costs the interpreter ~13 s (slow
# there; on a GPU it runs with the rest)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("page_size", [
    4096, pytest.param(65536, marks=[pytest.mark.slow] if INTERPRETED else [])])
def test_kernel_equals_reference(page_size, gen):
    x = mixed_pages(gen, 5, page_size)
    dev = kernel_device()
    got = kernel_checksums(x.to(dev))
    assert got.dtype == torch.int32 and got.shape == (5,)
    assert torch.equal(got.cpu(), page_checksums_cpu(x))


def test_kernel_reads_a_view_that_is_not_word_aligned(gen):
    flat = torch.randint(0, 256, (3 * 4096 + 1,), dtype=torch.uint8, generator=gen)
    pages = flat[1:].view(3, 4096)
    dev = kernel_device()
    got = kernel_checksums(flat.to(dev)[1:].view(3, 4096))
    assert torch.equal(got.cpu(), page_checksums_cpu(pages))


def test_every_single_bit_flip_changes_the_checksum(gen):
    """10,000 flips at random bits of random pages: each one changes its page's checksum
    (guaranteed for xxHash32 when one word changes: each round is a bijection of its lane's
    state and of the word, the lanes merge by a sum and the avalanche is a bijection; and
    checked)."""
    flips, page_size = 10_000, 4096
    base = mixed_pages(gen, 8, page_size)
    which = torch.randint(0, 8, (flips,), generator=gen)
    byte = torch.randint(0, page_size, (flips,), generator=gen)
    bit = torch.randint(0, 8, (flips,), generator=gen)
    flipped = base[which].clone()
    rows = torch.arange(flips)
    flipped[rows, byte] ^= (1 << bit).to(torch.uint8)
    assert (page_checksums_cpu(flipped) != page_checksums_cpu(base)[which]).all()


@pytest.mark.parametrize("element_size", [1, 2])
def test_corrupted_payload_never_decodes_silently(element_size, gen):
    """Single-bit flips in a packed container's stored bytes: every page either decodes to
    the original bytes or fails (a decode status, or STATUS_CHECKSUM); none is wrong with
    status 0."""
    x = mixed_pages(gen, 8, 4096)
    c = pc.pack(pc.compress(x, element_size=element_size, checksum=True, backend="cpu"))
    total = c.payload.numel()
    caught_by_checksum = 0
    for _ in range(300):
        payload = c.payload.clone()
        at = int(torch.randint(0, total, (1,), generator=gen))
        payload[at] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
        bad = pc.CompressedPages(payload, c.sizes, c.kinds, c.page_size, c.offsets, c.checksums)
        pages, status = pc.decompress(bad, return_status=True, backend="cpu")
        ok = status == fmt.STATUS_OK
        assert torch.equal(pages[ok], x[ok]), "a page decoded to wrong bytes with status 0"
        caught_by_checksum += int((status == fmt.STATUS_CHECKSUM).sum())
    assert caught_by_checksum > 0  # flips in literals decode "fine": only the checksum sees them


def test_kernel_path_flags_a_wrong_page(gen):
    dev = kernel_device()
    x = mixed_pages(gen, 2, 4096)  # a random page (stored RAW) and a low-entropy one (LZ4)
    # compressed by the CPU path (the interpreter's compressor is slow; the same format), the
    # checksums and the decode by the kernels
    # (one decode: each costs the interpreter seconds; the kernel's checksums against the
    # reference are test_kernel_equals_reference's)
    c = pc.compress(x, checksum=True, backend="cpu").to(dev)
    raw = int(torch.nonzero((c.kinds.cpu() & 15) == fmt.KIND_RAW)[0])  # a stored-as-is page
    payload = c.payload.clone()
    payload[raw, 100] ^= 4
    bad = pc.CompressedPages(payload, c.sizes, c.kinds, c.page_size, checksums=c.checksums)
    # exactly the flipped page, by its checksum (the other decodes and checks OK)
    with pytest.raises(pc.CorruptPageError, match=rf"^1 corrupt page\(s\): {raw} \(checksum"):
        pc.decompress(bad, backend="triton")


def test_checksums_survive_pack_and_move(gen):
    x = mixed_pages(gen, 4, 4096)
    c = pc.compress(x, checksum=True, backend="cpu")
    p = pc.pack(c)
    assert p.checksums is c.checksums
    assert torch.equal(pc.decompress(p.to("cpu")), x)
    assert pc.compress(x, backend="cpu").checksums is None  # off unless asked


def test_bad_arguments_name_the_problem():
    with pytest.raises(pc.PageCompError, match="checksum.*uint8"):
        torch.ops.pagecomp.checksum(torch.zeros(2, 4096, dtype=torch.int32))
    with pytest.raises(pc.PageCompError, match="page size"):
        torch.ops.pagecomp.checksum(torch.zeros(2, 1000, dtype=torch.uint8))
    c = pc.compress(torch.zeros(2, 4096, dtype=torch.uint8), backend="cpu")
    bad = pc.CompressedPages(c.payload, c.sizes, c.kinds, c.page_size,
                             checksums=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(pc.PageCompError, match=r"checksums must be int32 \[2\]"):
        pc.decompress(bad)


# ------------------------------------------------------------------ PageCompressor(checksum=True)
def _flip_stored_bytes(handle, gen, flips: int):
    """Yield after flipping one random bit of the handle's stored payload bytes (put back
    after each yield)."""
    handle.wait()
    blocks = [(b.block.tensor, b.layout.payload_bytes) for b in handle._storage.batches
              if b is not None and b.layout.payload_bytes]  # (None: nothing stored)
    for _ in range(flips):
        t, n = blocks[int(torch.randint(0, len(blocks), (1,), generator=gen))]
        at = int(torch.randint(0, n, (1,), generator=gen))
        bit = 1 << int(torch.randint(0, 8, (1,), generator=gen))
        t[at] ^= bit
        yield
        t[at] ^= bit


def test_compressor_checksums_round_trip_odd_sizes(gen):
    with pc.PageCompressor(device="cpu", checksum=True, batch_pages=2) as comp:
        for nbytes in (1, 4095, 4096, 3 * 4096 + 7):
            x = torch.randint(0, 4, (nbytes,), dtype=torch.uint8, generator=gen)
            h = comp.offload(x)
            assert h.checksums.shape == (-(-nbytes // 4096),)
            assert torch.equal(comp.restore(h), x)


def test_compressor_checksums_catch_corrupted_host_bytes(gen):
    """Random bits flipped in the stored bytes (mostly RAW pages of random floats, which decode
    'fine' to the flipped bytes): every restore either is exact or raises naming the page;
    without checksums the same flips come back as wrong data."""
    x = torch.randn(6 * 1024, generator=gen)  # 6 pages, incompressible: stored as they are
    x[:1024] = 0  # and one FILL page
    caught = 0
    with pc.PageCompressor(device="cpu", checksum=True) as comp:
        h = comp.offload(x)
        for _ in _flip_stored_bytes(h, gen, 200):
            try:
                y = comp.restore(h)
            except pc.CorruptPageError as exc:
                caught += "checksum mismatch" in str(exc)
                continue
            assert torch.equal(y, x)
    assert caught > 100
    silent = 0
    with pc.PageCompressor(device="cpu") as comp:
        h = comp.offload(x)
        assert h.checksums is None
        for _ in _flip_stored_bytes(h, gen, 20):
            try:
                silent += not torch.equal(comp.restore(h), x)
            except pc.CorruptPageError:
                pass
    assert silent > 0  # what the checksums are for


def test_compressor_checksum_setting_is_copied_and_checked():
    import copy

    comp = pc.PageCompressor(device="cpu", checksum=True)
    try:
        assert copy.deepcopy(comp).checksum is True
    finally:
        comp.close()
    with pytest.raises(pc.PageCompError, match="checksum must be True or False"):
        pc.PageCompressor(device="cpu", checksum=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compressor_checksums_flag_a_corrupted_page(gen):
    # incompressible bytes: every page is stored RAW, so a flipped byte still decodes with status 0
    x = torch.randint(0, 256, (8 * 4096,), dtype=torch.uint8, device="cuda")
    with pc.PageCompressor(checksum=True, batch_pages=4) as comp:  # the ring: > one batch
        h = comp.offload(x)
        assert torch.equal(comp.restore(h, check=True), x)
        b = next(b for b in h._storage.batches if b is not None)
        b.block.tensor[5] ^= 1  # a RAW page's byte: decodes with status 0
        with pytest.raises(pc.CorruptPageError, match="checksum mismatch"):
            comp.restore(h, check=True)
        comp.restore(h)  # without check: counted on the device
        assert comp.failed_restores(wait=True) >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_restore_failures_are_read_after_the_stream_that_counted_them():
    """A restore stream's failure count, delayed behind a long kernel, is what the next poll
    reads once the device is idle: the host copy waits for that stream, not only for the
    caller's (a copy on the caller's stream alone read the count before it was added)."""
    from torch_pagecomp.handles import RestoreFailures

    dev = torch.device("cuda")
    failures = RestoreFailures(dev)
    side = torch.cuda.Stream()
    status = torch.ones(8, dtype=torch.int32, device=dev)  # eight failed pages
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # the restore stream is busy a while
    failures.add([status], side)
    assert failures.poll() == 0  # counted behind the sleep; the read is queued after it
    torch.cuda.synchronize()
    assert failures.poll() == 8
    assert failures.total() == 8


def test_restore_failures_adds_of_two_streams_are_queued_in_order(monkeypatch):
    """Every stream's adds write the one device count, so an add on another stream than the
    last one waits for it (a hand-off): two adds running at once could both read the old
    count and one stream's failures be lost. Adds on one stream need none. Run on the CPU
    with stand-in streams and a recording hand-off."""
    import threading

    from torch_pagecomp import handles

    waits = []
    monkeypatch.setattr(handles, "handoff", lambda before, after: waits.append((before, after)))
    first, a, b = object(), object(), object()
    failures = object.__new__(handles.RestoreFailures)  # (its __init__ pins host memory)
    failures.count = torch.zeros((), dtype=torch.int64)
    failures._counted, failures._last, failures._lock = set(), first, threading.Lock()
    failures.count_now(torch.tensor([0, 3, 0, 1], dtype=torch.int32), a)
    failures.count_now(torch.tensor([5], dtype=torch.int32), a)
    failures.count_now(torch.tensor([0, 0], dtype=torch.int32), b)
    assert waits == [(first, a), (a, b)]
    assert int(failures.count) == 3 and failures._counted == {a, b} and failures._last is b


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_restore_failures_add_on_another_stream_waits_for_the_last():
    """A count added on one stream while another stream's add is still queued behind a long
    kernel runs after it (its stream waits): the total has both, and the second stream's work
    after its add is not done while the first sleeps."""
    from torch_pagecomp.handles import RestoreFailures

    dev = torch.device("cuda")
    failures = RestoreFailures(dev)
    bad = torch.ones(8, dtype=torch.int32, device=dev)
    good = torch.zeros(8, dtype=torch.int32, device=dev)
    slow, fast = torch.cuda.Stream(), torch.cuda.Stream()
    for s in (slow, fast):  # after the statuses are written (the fast stream read garbage)
        s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(slow):
        torch.cuda._sleep(200_000_000)
        failures.count_now(bad, slow)
    with torch.cuda.stream(fast):
        failures.count_now(good, fast)
        after = fast.record_event()
    assert not after.query()  # the fast stream's add waits for the slow one's
    assert failures.total() == 8
