"""Bad arguments to the public entry points raise an error naming the argument, up front.

Each case here came out of an adversarial sweep of the API on the CPU (session 35). Before, it
raised something from deep inside torch, numpy or the package (an AttributeError on a list, a
TypeError comparing a str, torch's "Could not infer dtype"), was accepted and made every later
offload fail with a warning only, or lost data silently (``restore_blocks`` with a repeated
block id kept one of the two rows meant for that block).
"""

from __future__ import annotations

import math

import pytest
import torch

import torch_pagecomp as pc
from torch_pagecomp import offload_activations, offload_module
from torch_pagecomp.format import STATUS_CHECKSUM, PageCompError


@pytest.fixture
def comp():
    with pc.PageCompressor(device="cpu") as c:
        yield c


# ------------------------------------------------------------------ PageCompressor
@pytest.mark.parametrize("kwargs, match", [
    (dict(device="bogus"), "device must be"),
    (dict(device=torch.device("meta")), "cuda or cpu"),
    (dict(max_pinned_bytes="x"), "max_pinned_bytes must be an int"),
    (dict(max_raw_share=2.0), "max_raw_share must be a number in"),
    (dict(max_raw_share=math.nan), "max_raw_share must be a number in"),
    (dict(max_raw_share="x"), "max_raw_share must be a number in"),
    (dict(raw_bypass="x"), "raw_bypass must be True or False"),
    (dict(stream_priority="x"), "stream_priority must be an int"),
])
def test_compressor_settings_are_checked_by_name(kwargs, match):
    with pytest.raises(PageCompError, match=match):
        pc.PageCompressor(**{"device": "cpu", **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_a_cuda_device_without_cuda_says_so():
    with pytest.raises(PageCompError, match="CUDA is not available"):
        pc.PageCompressor(device="cuda")


def test_restore_checks_out_and_device(comp):
    h = comp.offload(torch.randn(100))
    with pytest.raises(PageCompError, match="out must be a torch.Tensor"):
        comp.restore(h, out=[0])
    with pytest.raises(PageCompError, match="cuda or cpu"):
        comp.restore(h, device="meta")
    with pytest.raises(PageCompError, match="out must be on a cpu or cuda device"):
        comp.restore(h, out=torch.empty(100, device="meta"))
    assert torch.equal(comp.restore(h, device="cpu"), comp.restore(h))


def test_a_handle_cannot_be_told_another_shape_or_dtype(comp):
    """A restore allocates and decodes by the handle's shape and dtype: set from outside, it
    handed back memory no page was decoded into."""
    h = comp.offload(torch.randn(5000))
    for name, value in (("shape", torch.Size([10000])), ("dtype", torch.float64),
                        ("nbytes", 1), ("page_size", 8192), ("element_size", 1)):
        with pytest.raises(AttributeError):
            setattr(h, name, value)
    assert h.shape == (5000,) and h.dtype == torch.float32 and h.nbytes == 20000


def test_restore_blocks_refuses_a_repeated_block(comp):
    """``index_copy_`` with a repeated id keeps one of the rows meant for that block and drops
    the other: before, ``restore_blocks(h, cache, [3, 3])`` lost block 1's data silently."""
    cache = torch.randn(8, 4, 256)
    ref = cache.clone()
    h = comp.offload_blocks(cache, torch.tensor([1, 2]))
    with pytest.raises(PageCompError, match="repeat block 3"):
        comp.restore_blocks(h, cache, torch.tensor([3, 3]))
    assert torch.equal(cache, ref)  # nothing written
    comp.restore_blocks(h, cache, torch.tensor([5, 3]))
    assert torch.equal(cache[5], ref[1]) and torch.equal(cache[3], ref[2])
    # gathering a block twice is fine: each row of the handle is read from it
    h2 = comp.offload_blocks(cache, [0, 0])
    assert torch.equal(comp.restore(h2), torch.stack([cache[0], cache[0]]))


@pytest.mark.parametrize("ids, match", [
    (None, "block_ids must be a 1-D int tensor or a sequence of ints"),
    ("12", "block_ids must be"),
    (torch.tensor([0.0, 1.0]), "block_ids must be 1-D int32/int64"),
    (torch.empty(2, dtype=torch.int64, device="meta"), "block_ids must be on a cpu or cuda"),
])
def test_block_ids_are_checked_by_name(comp, ids, match):
    with pytest.raises(PageCompError, match=match):
        comp.offload_blocks(torch.randn(8, 4), ids)


def test_caches_and_host_pages_must_be_tensors(comp):
    with pytest.raises(PageCompError, match="offload takes a torch.Tensor, got list"):
        comp.offload_blocks([[1.0]], [0])
    with pytest.raises(PageCompError, match="offload takes a torch.Tensor, got list"):
        comp.compress_host([1, 2])


# ------------------------------------------------------------------ compress / pack
def test_compress_arguments_are_checked_by_name():
    z = torch.zeros(2, 4096, dtype=torch.uint8)
    for es in (2.0, 4.0, "2"):
        with pytest.raises(PageCompError, match="element_size must be one of"):
            pc.compress(z, element_size=es, backend="cpu")
    for flag in ("yes", None, 1):
        with pytest.raises(PageCompError, match="checksum must be True or False"):
            pc.compress(z, checksum=flag, backend="cpu")
    with pytest.raises(PageCompError, match="meta device"):
        pc.compress(z.to("meta"))
    with pytest.raises(PageCompError, match="meta device"):
        pc.page_checksums(z.to("meta"))


def test_containers_must_hold_tensors():
    z = torch.zeros(2, 4096, dtype=torch.uint8)
    c = pc.compress(z, backend="cpu")
    bad = pc.CompressedPages(c.payload, c.sizes.tolist(), c.kinds, 4096)
    with pytest.raises(PageCompError, match="CompressedPages.sizes must be a torch.Tensor"):
        pc.decompress(bad)
    with pytest.raises(PageCompError, match="CompressedPages.payload is on the meta device"):
        pc.decompress(pc.CompressedPages(c.payload.to("meta"), c.sizes, c.kinds, 4096))
    for thing in (z, None):
        with pytest.raises(PageCompError, match="expected CompressedPages"):
            pc.pack(thing)


def test_a_page_failing_its_checksum_comes_back_zeroed():
    """Status 7 (decoded, but to other bytes than were compressed) zeroes the page as the
    decoders zero the pages they fail: with ``return_status=True`` no caller reads bytes known
    to be wrong."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 4, (3, 4096), dtype=torch.uint8, generator=g)
    c = pc.pack(pc.compress(data, checksum=True, backend="cpu"))
    payload = c.payload.clone()
    start, size = int(c.offsets[1]), int(c.sizes[1])
    assert size > 64
    payload[start + size - 8] ^= 1  # a literal of page 1: still decodes, to other bytes
    bad = pc.CompressedPages(payload, c.sizes, c.kinds, 4096, c.offsets, c.checksums)
    pages, status = pc.decompress(bad, return_status=True, backend="cpu")
    assert status.tolist() == [0, STATUS_CHECKSUM, 0]
    assert not pages[1].any()
    assert torch.equal(pages[0], data[0]) and torch.equal(pages[2], data[2])


# ------------------------------------------------------------------ activation offload
@pytest.mark.parametrize("kwargs, match", [
    (dict(min_ratio="x"), "min_ratio must be a finite number >= 0"),
    (dict(min_ratio=math.inf), "min_ratio must be a finite number >= 0"),
    (dict(min_ratio=-1.0), "min_ratio must be a finite number >= 0"),
    (dict(sample_tensors=0), "sample_tensors must be an int >= 1"),
    (dict(page_size=4095), "page size must be a power of two"),
    (dict(page_size="4096"), "page size must be a power of two"),
    (dict(min_offload_bytes=-1), "min_offload_bytes must be an int >= 0"),
    (dict(min_offload_bytes=1.5), "min_offload_bytes must be an int >= 0"),
    (dict(group_bytes=0), "group_bytes must be an int >= 1 or None"),
    (dict(max_pinned_bytes=-1), "max_pinned_bytes must be an int >= 0 or None"),
    (dict(max_in_flight_tensors=True), "max_in_flight_tensors must be an int >= 1 or None"),
    (dict(prefetch=-1), "prefetch must be an int >= 0"),
    (dict(stream_priority="x"), "stream_priority must be an int"),
    (dict(offload_cpu="yes"), "offload_cpu must be True or False"),
    (dict(keep_param_casts=None), "keep_param_casts must be True or False"),
])
def test_offloader_settings_are_checked_by_name(kwargs, match):
    """Left to the hooks, each of these failed every offload (kept in place, said in a
    warning only), so a step ran with nothing offloaded."""
    with pytest.raises(ValueError, match=match):
        offload_activations(**kwargs)


def test_offload_module_checks_what_it_is_given():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="takes a torch.nn.Module, got function"):
        offload_module(lambda x: x)
    with pytest.raises(ValueError, match="blocks must hold torch.nn.Modules, got int"):
        offload_module(m, blocks=[1])
    with pytest.raises(ValueError, match="keep must hold torch.nn.Modules, got NoneType"):
        offload_module(m, keep=[None])
    with pytest.raises(ValueError, match="offloader must be an ActivationOffloader"):
        offload_module(m, offloader="x")
    with pytest.raises(ValueError, match=r"settings \['prefer'\] go to the ActivationOffloader"):
        offload_module(m, offloader=offload_activations(), prefer="memory")
    off = offload_module(m, offload_cpu=True, min_offload_bytes=0)  # and the good case works
    m(torch.randn(2, 4)).sum().backward()
    assert off.stats()["packed"] > 0
    off.remove()


def test_the_helpers_name_their_arguments():
    with pytest.raises(PageCompError, match="dtype must be a torch.dtype, got str"):
        pc.dtype_element_size("float32")
    with pytest.raises(PageCompError, match="status must be a 1-D tensor"):
        pc.raise_for_status([0, 1])
    status = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(PageCompError, match=r"mismatch must be a tensor shaped as status \(2,\)"):
        pc.raise_for_status(status, torch.tensor([True]))
    with pytest.raises(pc.CorruptPageError):  # and the right arguments still work
        pc.raise_for_status(status, torch.tensor([False, True]))
    with pytest.raises(PageCompError, match="device must be a torch.device or its name"):
        pc.select_backend(4, None)
    with pytest.raises(PageCompError, match="num_pages must be an int >= 0"):
        pc.select_backend(-1, "cpu")
    assert pc.select_backend(4, "cpu") == "cpu"
