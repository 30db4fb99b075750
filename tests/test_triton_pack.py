"""The Triton pack kernel equals the CPU reference (interpreter on CPU, GPU when present)."""

import pytest
import torch
from pages import kernel_device

from torch_pagecomp.cpu_codec import pack_cpu
from torch_pagecomp.kernels.pack import pack_pages, publish_to_host


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
