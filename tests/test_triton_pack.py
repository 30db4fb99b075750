"""The Triton pack kernel equals the CPU reference (interpreter on CPU, GPU when present)."""

import pytest
import torch
from pages import kernel_device

from torch_pagecomp.cpu_codec import pack_cpu
from torch_pagecomp.kernels.pack import OFFSETS_BLOCK, pack_pages, page_offsets, publish_to_host


@pytest.mark.parametrize("page_size", [4096, 65536])
def test_pack_matches_reference(page_size, gen):
    n = 5
    payload = torch.randint(0, 256, (n, page_size), dtype=torch.uint8, generator=gen)
    sizes = torch.randint(1, page_size + 1, (n,), dtype=torch.int32, generator=gen)
    sizes[0], sizes[-1] = 1, page_size
    dev = kernel_device()
    packed, offsets = pack_pages(payload.to(dev), sizes.to(dev))
    ref_packed, ref_offsets = pack_cpu(payload, sizes)
    assert torch.equal(offsets.cpu(), ref_offsets)
    assert torch.equal(packed.cpu(), ref_packed)


def test_pack_clamps_garbage_sizes(gen):
    payload = torch.randint(0, 256, (4, 4096), dtype=torch.uint8, generator=gen)
    sizes = torch.tensor([-7, 5000, 12, 1 << 30], dtype=torch.int32)
    dev = kernel_device()
    packed, offsets = pack_pages(payload.to(dev), sizes.to(dev))
    assert offsets.tolist() == [0, 0, 4096, 4108, 8204]
    assert torch.equal(packed[:8204].cpu(), torch.cat([payload[1], payload[2, :12], payload[3]]))
    assert not packed[8204:].any()


@pytest.mark.parametrize("n, one_program", [(0, True), (1, True), (OFFSETS_BLOCK - 1, True),
                                            (OFFSETS_BLOCK, True), (2 * OFFSETS_BLOCK + 3, True),
                                            (2 * OFFSETS_BLOCK + 3, False)])
def test_page_offsets_over_several_steps(n, one_program, gen, monkeypatch):
    """The offsets' one program walks the sizes ``OFFSETS_BLOCK`` at a time, carrying the sum
    across steps: every entry of a poisoned output is written, each size clamped as the pack
    kernel reads it (garbage sizes in every step); past ``ONE_PROGRAM_PAGES`` (lowered here),
    PyTorch's scan gives the same."""
    from torch_pagecomp.kernels import pack

    real = torch.empty

    def poisoned(*args, **kwargs):
        return real(*args, **kwargs).fill_(-0x5A5A5A5A)

    if not one_program:
        monkeypatch.setattr(pack, "ONE_PROGRAM_PAGES", n - 1)

    page_size = 4096
    sizes = torch.randint(0, page_size + 1, (n,), dtype=torch.int32, generator=gen)
    bad = torch.randint(0, max(n, 1), (min(n, 8),), generator=gen)
    sizes[bad] = torch.tensor([-3, page_size + 1, 1 << 30, -(1 << 30)] * 2, dtype=torch.int32
                              )[:bad.numel()]
    monkeypatch.setattr(torch, "empty", poisoned)
    offsets = page_offsets(sizes.to(kernel_device()), page_size)
    monkeypatch.undo()
    want = torch.zeros(n + 1, dtype=torch.int64)
    want[1:] = torch.cumsum(sizes.clamp(0, page_size).to(torch.int64), dim=0)
    assert offsets.dtype == torch.int64 and torch.equal(offsets.cpu(), want)


def test_pack_without_zero_tail_writes_every_stored_byte(gen, monkeypatch):
    """``zero_tail=False`` (the pipeline's): the output comes uninitialised (poisoned here), and
    every byte up to ``offsets[N]`` is still written."""
    real = torch.empty

    def poisoned(*args, **kwargs):
        return real(*args, **kwargs).fill_(0xA5)

    n, page_size = 6, 4096
    payload = torch.randint(0, 256, (n, page_size), dtype=torch.uint8, generator=gen)
    sizes = torch.randint(1, page_size + 1, (n,), dtype=torch.int32, generator=gen)
    sizes[2] = 0  # an empty page between two others
    dev = kernel_device()
    payload, sizes = payload.to(dev), sizes.to(dev)
    monkeypatch.setattr(torch, "empty", poisoned)
    packed, offsets = pack_pages(payload, sizes, zero_tail=False)
    monkeypatch.undo()
    ref_packed, ref_offsets = pack_cpu(payload.cpu(), sizes.cpu())
    total = int(ref_offsets[-1])
    assert torch.equal(offsets.cpu(), ref_offsets)
    assert torch.equal(packed[:total].cpu(), ref_packed[:total])
    assert total < n * page_size and bool((packed[total:] == 0xA5).all())  # really unwritten


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pack_in_a_graph_and_compiled(gen):
    """The pack op (both its kernels) captured in a CUDA graph and traced by ``torch.compile``
    (fullgraph) gives the eager op's bytes and offsets, on a batch of one offsets step and on
    one of several (the page count a traced argument of the offsets program)."""
    import torch_pagecomp  # noqa: F401  (registers torch.ops.pagecomp)

    compiled = torch.compile(lambda p, s: torch.ops.pagecomp.pack(p, s), fullgraph=True)
    for n in (5, 2 * OFFSETS_BLOCK + 3):
        payload = torch.randint(0, 256, (n, 4096), dtype=torch.uint8, generator=gen).cuda()
        sizes = torch.randint(0, 4097, (n,), dtype=torch.int32, generator=gen).cuda()
        want = pack_cpu(payload.cpu(), sizes.cpu())
        got = compiled(payload, sizes)
        assert torch.equal(got[1].cpu(), want[1]) and torch.equal(got[0].cpu(), want[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pack_pages(payload, sizes)  # warm up on a side stream before capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = pack_pages(payload, sizes)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[1].cpu(), want[1]) and torch.equal(captured[0].cpu(), want[0])


def test_publish_to_host_stores_the_value_in_pinned_memory(gen):
    """The pipeline's packed size reaches the host by a kernel store (GPU: into pinned memory
    the kernel writes across the bus; interpreter: a CPU tensor). The target is poisoned first,
    and the value is fresh each run (any of the 64 bits wrong shows)."""
    dev = kernel_device()
    value = int(torch.randint(-(1 << 62), 1 << 62, (1,), dtype=torch.int64, generator=gen))
    src = torch.tensor([value, 7], dtype=torch.int64, device=dev)
    pinned = dev == "cuda"
    dst = torch.full((2,), -1, dtype=torch.int64, pin_memory=pinned)
    publish_to_host(src[:1], dst[:1], traced=False)
    if pinned:
        torch.cuda.current_stream().synchronize()
    assert dst.tolist() == [value, -1]  # one value, nothing past it


def test_publish_to_host_rejects_other_dtypes():
    with pytest.raises(ValueError, match="int64"):
        publish_to_host(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("pages, fits, moves", [(4000, True, False), (4900, True, True),
                                                (54052, False, True)])
def test_place_slice_reserves_pages_and_metadata_as_the_pack_plans(pages, fits, moves):
    """``place_slice`` (the plan alone, for pages the exponent encoder laid end to end):
    the slice's pages (the counter's bytes) at the arena's end, its metadata behind them
    in the same chunk or moved to the next where it would cross; both descriptors and the
    new end written, ``base = -1`` and the end unchanged where it passes the limit, the
    pages' bytes in the host descriptor, the counter set back to 0."""
    from torch_pagecomp.kernels.host_pack import place_slice

    dev = kernel_device()
    chunk, meta, start, parity = 1 << 14, 512, 3 * (1 << 14) + 16 * 700, 1
    limit = 8 * chunk if fits else start + 2 * chunk
    end = torch.tensor([pages], dtype=torch.int64, device=dev)
    ends = torch.tensor([-7, -7], dtype=torch.int64, device=dev)
    ends[parity] = start
    desc = torch.full((2,), -9, dtype=torch.int64, device=dev)
    host = torch.full((4,), -9, dtype=torch.int64, device=dev)
    place_slice(end, ends, parity, limit, desc, host, chunk, meta)
    meta_at = start + pages
    if meta_at % chunk + meta > chunk:
        meta_at = (meta_at // chunk + 1) * chunk
    assert (meta_at != start + pages) == moves
    total = meta_at + meta - start
    assert (start + total <= limit) == fits
    base = start if fits else -1
    assert desc.tolist() == [base, total] and host[:3].tolist() == [base, total, pages]
    assert ends.tolist()[1 - parity] == (start + total if fits else start)
    assert ends.tolist()[parity] == start and int(end) == 0
