"""PageCompressor: API, bit-exact round trips of any dtype/shape, KV blocks, memory held, stats.

CPU tests run the lz4 reference through the same pipeline (threads, slots, pools); the GPU
tests at the end skip themselves without CUDA.
"""

import gc

import pytest
import torch
from pages import file_pages

import torch_pagecomp  # noqa: F401  (registers torch.ops.pagecomp)
from torch_pagecomp import KIND_RAW, PageCompError
from torch_pagecomp.api import decompress
from torch_pagecomp.format import CorruptPageError
from torch_pagecomp.module import OffloadHandle, PageCompressor, dtype_element_size

DTYPES = [
    torch.uint8, torch.int8, torch.bool, torch.bfloat16, torch.float16, torch.float32,
    torch.int32, torch.int64, torch.float64, torch.complex64,
]
SHAPES = [(), (0,), (3, 0, 5), (1,), (4097,), (7, 1031), (2, 3, 4099)]


def make(shape, dtype, gen, device="cpu"):
    """Fresh values: half the tensor small integers (compressible), half random bits."""
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        t = torch.rand(shape, generator=gen) > 0.5
    elif dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        flat = t.view(-1)
        flat[: n // 2] = torch.randint(-3, 3, (n // 2,), generator=gen).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -(1 << 30)), min(info.max, 1 << 30), shape,
                          generator=gen, dtype=torch.int64).to(dtype)
        t.view(-1)[: n // 2] = 0
    return t.to(device)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8).cpu(),
                       b.contiguous().reshape(-1).view(torch.uint8).cpu())


@pytest.fixture(scope="module")
def pc():
    return PageCompressor(device="cpu", batch_pages=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_dtypes_shapes(pc, dtype, gen):
    handles = [(make(s, dtype, gen), None) for s in SHAPES]
    handles = [(x, pc.offload(x)) for x, _ in handles]  # all in flight together
    for x, h in handles:
        y = pc.restore(h)
        assert y.device.type == "cpu" and h.state == "ready"
        assert same_bits(x, y), (x.shape, dtype)
        assert h.nbytes == x.numel() * x.element_size()
        h.free()


@pytest.mark.parametrize("page_size", [4096, 8192, 65536])
def test_page_sizes_odd_lengths(page_size, gen):
    pc = PageCompressor(device="cpu", page_size=page_size, batch_pages=2)
    for n in (1, page_size - 1, page_size, page_size + 1, 5 * page_size + 7):
        x = torch.randint(0, 4, (n,), dtype=torch.uint8, generator=gen)
        assert same_bits(x, pc.restore(pc.offload(x)))


def test_non_contiguous_and_out(pc, gen):
    x = make((33, 257), torch.float32, gen).t()
    h = pc.offload(x)
    out = torch.full((257, 33), float("nan"))
    y = pc.restore(h, out=out)
    assert y is out and torch.equal(y, x)
    with pytest.raises(PageCompError, match="out must be"):
        pc.restore(h, out=torch.empty(3))
    with pytest.raises(PageCompError):
        pc.restore("not a handle")
    with pytest.raises(PageCompError):
        pc.offload([1, 2, 3])


def test_incompressible_stored_raw(gen):
    pc = PageCompressor(device="cpu", batch_pages=4)
    nbytes = 9 * 4096 + 123
    x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    h = pc.offload(x)
    h.wait()
    pages = -(-nbytes // 4096)
    batches = -(-pages // 4)
    meta = 13 * pages + 23 * batches
    assert nbytes - 123 <= h.stored_nbytes <= nbytes + meta  # padding compresses away
    c = h.compressed()
    assert bool((c.kinds[:-1] & 15 == KIND_RAW).all())
    assert same_bits(x, pc.restore(h))
    assert pc.stats()["bytes_held_host"] <= h.stored_nbytes + 256 * batches


def test_compressible_host_memory_shrinks(gen):
    pc = PageCompressor(device="cpu", batch_pages=8)
    text = file_pages("text", 32, 4096, gen)
    zeros = torch.zeros(64 * 4096, dtype=torch.uint8)
    ht, hz = pc.offload(text), pc.offload(zeros)
    assert hz.wait() is None and hz.stored_nbytes < 64 * 4096 // 100
    ht.wait()
    assert ht.stored_nbytes < text.numel() * 0.8, ht.ratio
    s = pc.stats()
    assert s["bytes_held_host"] < (text.numel() + zeros.numel()) // 2
    assert s["ratio"] > 2
    assert same_bits(text, pc.restore(ht)) and same_bits(zeros, pc.restore(hz))


def test_free_and_gc_release_memory(gen):
    pc = PageCompressor(device="cpu", batch_pages=4)
    x = make((40000,), torch.float32, gen)
    h = pc.offload(x)
    h.wait()
    held = pc.stats()["bytes_held_host"]
    assert held >= h.stored_nbytes > 0
    h.free()
    assert h.state == "freed" and pc.stats()["bytes_held_host"] == 0
    with pytest.raises(PageCompError, match="freed"):
        pc.restore(h)
    h.free()  # idempotent
    h2 = pc.offload(x)
    h2.wait()
    assert pc.stats()["bytes_held_host"] == held
    del h2
    gc.collect()
    assert pc.stats()["bytes_held_host"] == 0
    h3 = pc.offload(x)  # freed while in flight: released when its batches land
    h3.free()
    pc.synchronize()
    assert pc.stats()["bytes_held_host"] == 0


def test_kv_blocks_gather_scatter(pc, gen):
    cache = make((64, 2, 16, 40), torch.bfloat16, gen)
    ref = cache.clone()
    ids = torch.randperm(64, generator=gen)[:23]
    h = pc.offload_blocks(cache, ids)
    assert tuple(h.shape) == (23, 2, 16, 40)
    cache[ids] = 0  # overwritten at once: the gather was a snapshot
    pc.restore_blocks(h, cache, ids)
    assert same_bits(cache, ref)
    with pytest.raises(PageCompError):
        pc.restore_blocks(h, cache, ids[:5])
    with pytest.raises(PageCompError):
        pc.offload_blocks(cache, ids.float())


def test_kv_blocks_along_another_dim(pc, gen):
    """A ``[layers, blocks, ...]`` cache: blocks along dim 1; ids past the block count (but
    below the layer count's neighbourhood) are errors naming the id and the bound."""
    cache = make((4, 32, 2, 8, 16), torch.bfloat16, gen)
    ref = cache.clone()
    ids = torch.randperm(32, generator=gen)[:9]
    h = pc.offload_blocks(cache, ids, dim=1)
    assert tuple(h.shape) == (4, 9, 2, 8, 16)
    cache[:, ids] = 0
    pc.restore_blocks(h, cache, ids, dim=-4)
    assert same_bits(cache, ref)
    with pytest.raises(PageCompError, match="block id 32 is out of range for a cache of 32"):
        pc.offload_blocks(cache, torch.tensor([3, 32]), dim=1)
    with pytest.raises(PageCompError, match="dim 5 is out of range"):
        pc.offload_blocks(cache, ids, dim=5)
    with pytest.raises(PageCompError, match="along dim 1"):
        pc.restore_blocks(h, cache, ids[:4], dim=1)


def test_element_size_and_compressed_container(pc, gen):
    dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64,
              torch.float64, torch.uint8, torch.bool)
    assert [dtype_element_size(d) for d in dtypes] == [2, 2, 4, 4, 4, 4, 1, 1]
    x = torch.randn(8192, generator=gen).to(torch.bfloat16)
    h = pc.offload(x)
    assert h.element_size == 2
    c = h.compressed()
    assert c.is_packed and c.num_pages == 4
    lz4 = (c.kinds & 15) == 1
    assert bool(((c.kinds[lz4] >> 4) == 1).all())
    assert torch.equal(decompress(c).view(-1)[: h.nbytes], x.view(torch.uint8))
    h2 = pc.offload(x, element_size=1)
    assert bool((h2.compressed().kinds >> 4 == 0).all())
    with pytest.raises(PageCompError):
        pc.offload(x, element_size=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_exp_codec_for_16_bit_floats(dtype, gen):
    """``codec="exp"``: 16-bit float tensors take the exponent codec through the same ring
    (several batches, a partial last page), restore bit-exactly, and store less than LZ4 +
    bit-shuffle on Gaussian bf16 values; other dtypes and an explicit element size keep
    LZ4."""
    exp = PageCompressor(device="cpu", batch_pages=3, codec="exp")
    lz4 = PageCompressor(device="cpu", batch_pages=3, codec="lz4")
    n = 7 * 2048 + int(torch.randint(1, 2047, (1,), generator=gen))  # 7 pages + a partial one
    x = (torch.randn(n, generator=gen) * 3).to(dtype)
    h, h_lz4 = exp.offload(x), lz4.offload(x)
    assert (h.codec, h_lz4.codec) == ("exp", "lz4")
    out = torch.full_like(x, 7.0)
    assert exp.restore(h, out=out) is out and same_bits(x, out)
    assert same_bits(x, lz4.restore(h_lz4))
    c = h.compressed()
    assert c.codec == "exp" and c.num_pages == 8
    exp_kind = (c.kinds & 15) == 3
    assert bool(exp_kind[:7].all()), c.kinds  # Gaussian pages: none stored raw
    assert torch.equal(decompress(c).view(-1)[: h.nbytes], x.view(torch.uint8))
    if dtype == torch.bfloat16:  # 8 exponent bits, where LZ4 stores least (fp16: 5, a tie)
        assert h.stored_nbytes < h_lz4.stored_nbytes, (h.stored_nbytes, h_lz4.stored_nbytes)
    assert exp.offload(x.float()).codec == "lz4"
    assert exp.offload(x, element_size=1).codec == "lz4"
    # a corrupt exponent-codec page is named by its index in the tensor
    sb = h._storage.batches[1]
    sb.layout.views(sb.block.tensor)[3][1] = 0x0F
    with pytest.raises(CorruptPageError) as err:
        exp.restore(h)
    assert err.value.pages == [sb.first_page + 1]
    exp.close()
    lz4.close()


def test_codec_setting(gen, monkeypatch):
    """``"auto"`` (the default) on a CPU compressor: the exponent codec for bf16 where the C
    loops are SIMD (``exp_codec.FAST_BF16``), else LZ4; fp16 and other dtypes LZ4; a bad
    codec is named."""
    from torch_pagecomp import exp_codec

    cpu = PageCompressor(device="cpu", batch_pages=3)
    assert cpu.codec == "auto" and "codec='auto'" in repr(cpu) and cpu.stats()["codec"] == "auto"
    bf16 = torch.randn(3000, generator=gen).to(torch.bfloat16)
    for fast in (True, False):
        monkeypatch.setattr(exp_codec, "FAST_BF16", fast)
        h = cpu.offload(bf16)
        assert h.codec == ("exp" if fast else "lz4")
        assert same_bits(cpu.restore(h), bf16)
    assert cpu.offload(bf16.to(torch.float16)).codec == "lz4"
    assert cpu.offload(bf16.float()).codec == "lz4"
    assert type(cpu).__reduce_ex__(cpu, 2)[1][0]["codec"] == "auto"
    cpu.close()
    with pytest.raises(PageCompError, match="codec must be one of"):
        PageCompressor(device="cpu", codec="zstd")


def test_compress_host_flow(pc, gen):
    pages = file_pages("binary", 10, 4096, gen)
    h = pc.compress_host(pages)
    c = h.compressed()
    assert torch.equal(decompress(c), pages)
    assert same_bits(pages, pc.restore(h, device="cpu"))


def test_stats_and_counts(gen):
    pc = PageCompressor(device="cpu", batch_pages=2)
    x = make((5 * 4096,), torch.uint8, gen)
    h = pc.offload(x)
    pc.restore(h)
    s = pc.stats()
    for key in ("bytes_in", "bytes_held_host", "ratio", "pinned_bytes_held", "pool_hits",
                "pool_misses", "upload_ms", "kernel_ms", "download_ms", "total_ms",
                "offloads", "restores", "bound_stage", "slot_states", "backpressure_waits"):
        assert key in s, key
    assert (s["offloads"], s["restores"], s["bytes_in"]) == (1, 1, x.numel())
    assert s["batches"] == 3 and s["restore_batches"] == 3
    assert s["pinned_bytes_held"] == 0  # no CUDA: plain (unregistered) host memory
    assert s["kernel_ms"] > 0 and sum(s["bound_stage"].values()) == 3
    assert isinstance(h, OffloadHandle) and "ready" in repr(h)
    assert "batch_pages=2" in repr(pc)


def test_small_host_tensors_are_stored_during_offload(gen, monkeypatch):
    """Without a GPU a tensor of at most ``INLINE_HOST_BYTES`` is compressed on the calling
    thread, batch by batch: its handle is ready when ``offload`` returns and no worker got it;
    its bytes come back; its batches are in the stats and the timeline (slot -1). A larger one
    goes through the workers, as before."""
    from torch_pagecomp import module

    pc = PageCompressor(device="cpu", batch_pages=2)
    submitted = []
    real = pc.pipeline.submit_compress
    monkeypatch.setattr(pc.pipeline, "submit_compress",
                        lambda *a, **k: submitted.append(1) or real(*a, **k))
    x = make((5 * 4096 + 7,), torch.uint8, gen)  # three batches, the last one short
    h = pc.offload(x)
    assert h.ready() and not submitted
    assert same_bits(x, pc.restore(h))
    assert pc.stats()["batches"] == 3
    assert [t["slot"] for t in pc.timeline() if t["kind"] == "offload"] == [-1, -1, -1]
    monkeypatch.setattr(module, "INLINE_HOST_BYTES", x.numel() - 1)
    h2 = pc.offload(x)
    assert submitted
    assert same_bits(x, pc.restore(h2))
    pc.close()


def test_a_failed_inline_offload_raises_and_the_compressor_goes_on(gen, monkeypatch):
    """A batch that fails while stored on the calling thread (here the second: no host
    memory) raises from ``offload`` itself, naming the cause, and leaves nothing held (the
    first batch's blob given back); the next offload works."""
    pc = PageCompressor(device="cpu", batch_pages=2)
    x = make((3 * 4096,), torch.uint8, gen)
    real, calls = pc.pipeline.arena.alloc, []

    def second_fails(nbytes):
        calls.append(nbytes)
        if len(calls) == 2:
            raise MemoryError(f"no host memory for {nbytes} bytes")
        return real(nbytes)

    with monkeypatch.context() as m:
        m.setattr(pc.pipeline.arena, "alloc", second_fails)
        with pytest.raises(MemoryError, match="no host memory"):
            pc.offload(x)
    gc.collect()
    assert len(calls) == 2 and pc.stats()["bytes_held_host"] == 0
    assert same_bits(x, pc.restore(pc.offload(x)))
    pc.close()


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "workers"])
def test_a_batch_failing_after_its_blob_was_carved_gives_the_blob_back(inline, gen,
                                                                       monkeypatch):
    """A batch that fails once its blob is carved from the arena but before the storage
    holds it (here a ``KeyboardInterrupt`` while its pages are packed into the blob: on the
    calling thread for a small host tensor, on the issuer otherwise) gives the blob back:
    no host bytes stay held once the handle is gone, and the next offload works."""
    from torch_pagecomp import cpu_codec, module

    if not inline:
        monkeypatch.setattr(module, "INLINE_HOST_BYTES", 0)
    pc = PageCompressor(device="cpu", batch_pages=2)
    x = make((3 * 4096,), torch.uint8, gen)
    real, calls = cpu_codec.pack_into, []

    def second_interrupted(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    with monkeypatch.context() as m:
        m.setattr(cpu_codec, "pack_into", second_interrupted)
        if inline:
            with pytest.raises(KeyboardInterrupt):
                pc.offload(x)
        else:
            h = pc.offload(x)
            with pytest.raises(RuntimeError, match="offload failed"):
                h.wait()
            assert isinstance(h._storage.error, KeyboardInterrupt)
            del h
    pc.synchronize()
    gc.collect()
    assert len(calls) == 2 and pc.stats()["bytes_held_host"] == 0
    assert same_bits(x, pc.restore(pc.offload(x)))
    pc.close()


def test_close_stops_workers(gen):
    pc = PageCompressor(device="cpu", batch_pages=2)
    x = make((3 * 4096 + 1,), torch.uint8, gen)
    h = pc.offload(x)
    pc.close()
    assert h.ready() and same_bits(x, pc.restore(h))  # stored data stays readable
    with pytest.raises(RuntimeError, match="closed"):
        pc.offload(x)
    assert not any(t.is_alive() for t in pc.pipeline._threads if t.join(2) or True)


def test_constructor_validation():
    with pytest.raises(PageCompError):
        PageCompressor(device="cpu", page_size=1000)
    with pytest.raises(PageCompError):
        PageCompressor(device="cpu", element_size=8)
    with pytest.raises(PageCompError):
        PageCompressor(device="cpu", max_pinned_bytes=100)
    pc = PageCompressor(device="cpu")
    assert pc.batch_pages >= 1 and isinstance(pc, torch.nn.Module)


def test_handle_carries_page_size_and_restore_checks_it(gen):
    pc4 = PageCompressor(device="cpu", batch_pages=2)
    pc8 = PageCompressor(device="cpu", page_size=8192, batch_pages=2)
    x = torch.zeros(3 * 8192 + 5, dtype=torch.uint8)  # FILL pages: wrong silently before
    x[-1] = 7
    h = pc4.offload(x)
    assert (h.page_size, h.element_size) == (4096, 1)
    with pytest.raises(PageCompError, match="page_size=4096.*page_size=8192"):
        pc8.restore(h)
    other = PageCompressor(device="cpu", batch_pages=5)  # same page size: fine
    assert same_bits(x, other.restore(h)) and same_bits(x, pc4.restore(h))


UNSUPPORTED = {
    "quantized": (lambda: torch.quantize_per_tensor(torch.randn(64), 0.1, 0, torch.quint8),
                  "quantized tensor"),
    "meta": (lambda: torch.empty(4096, device="meta"), "meta tensor"),
    "sparse_coo": (lambda: torch.randn(64, 64).to_sparse(), "torch.sparse_coo"),
    "sparse_csr": (lambda: torch.randn(64, 64).to_sparse_csr(), "torch.sparse_csr"),
    "nested": (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
               "nested tensor"),
    "jagged": (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)],
                                                  layout=torch.jagged), "nested tensor"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # deprecated, beta or prototype layouts
@pytest.mark.parametrize("kind", UNSUPPORTED)
def test_unsupported_tensors_refused_up_front(pc, kind):
    make_tensor, named = UNSUPPORTED[kind]
    x = make_tensor()
    before = pc.stats()["offloads"]
    with pytest.raises(PageCompError, match=named):
        pc.offload(x)
    assert pc.stats()["offloads"] == before  # refused before any work was queued


def test_conjugate_negative_and_grad_views_offload_their_values(pc):
    z = torch.randn(300, dtype=torch.complex64).conj()
    assert z.is_conj()
    assert same_bits(z.resolve_conj(), pc.restore(pc.offload(z)))
    n = torch.randn(300, dtype=torch.complex64).conj().imag  # a negative view
    assert same_bits(n.resolve_neg(), pc.restore(pc.offload(n)))
    w = torch.randn(300, requires_grad=True)
    assert same_bits(w.detach(), pc.restore(pc.offload(w)))


@pytest.mark.parametrize("bad", [2.0, 0, True, 3, "2"])
def test_element_size_must_be_a_valid_int(pc, bad):
    x = torch.randn(100)
    with pytest.raises(PageCompError, match="element_size"):
        pc.offload(x, element_size=bad)
    with pytest.raises(PageCompError, match="element_size"):
        PageCompressor(device="cpu", element_size=bad)


def test_integer_settings_reject_floats():
    for kwargs in ({"page_size": 4096.0}, {"batch_pages": 2.0}, {"slots": 3.0}):
        with pytest.raises(PageCompError, match=next(iter(kwargs))):
            PageCompressor(device="cpu", **kwargs)


def test_block_ids_out_of_range_named_before_any_work(pc):
    cache = torch.randn(8, 2, 512)
    before = pc.stats()["offloads"]
    cases = [([0, 8], 8), (torch.tensor([3, -1]), -1), (torch.tensor([9, 2], dtype=torch.int32), 9)]
    for ids, bad in cases:
        with pytest.raises(PageCompError, match=f"block id {bad} is out of range for a cache of 8"):
            pc.offload_blocks(cache, ids)
    assert pc.stats()["offloads"] == before
    h = pc.offload_blocks(cache, [1, 2])
    with pytest.raises(PageCompError, match="block id 8"):
        pc.restore_blocks(h, cache, [1, 8])
    with pytest.raises(PageCompError, match="block id 0 is out of range for a cache of 0"):
        pc.offload_blocks(cache[:0], [0])


# ---------------------------------------------------------------------------- GPU
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_roundtrip_dtypes_shapes(dtype, gen):
    pc = PageCompressor(batch_pages=2)
    xs = [make(s, dtype, gen, "cuda") for s in SHAPES]
    hs = [pc.offload(x) for x in xs]
    for x, h in zip(xs, hs):
        y = pc.restore(h, check=True)
        assert y.is_cuda and same_bits(x, y)
        assert same_bits(x, pc.restore(h, device="cpu"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_auto_codec_is_the_exponent_codec(dtype, gen):
    """On a GPU ``codec="auto"`` stores 16-bit floats with the exponent codec: bit-exact back
    on the GPU and on the CPU, in a container the API decodes (bf16: smaller than LZ4's)."""
    auto, lz4 = PageCompressor(batch_pages=4), PageCompressor(batch_pages=4, codec="lz4")
    x = (torch.randn(9 * 2048 + 5, generator=gen) * 2).to(dtype).cuda()
    h, h_lz4 = auto.offload(x), lz4.offload(x)
    assert (h.codec, h_lz4.codec) == ("exp", "lz4")
    assert same_bits(x, auto.restore(h, check=True))
    assert same_bits(x, auto.restore(h, device="cpu"))
    c = h.compressed()
    assert c.codec == "exp"
    assert torch.equal(decompress(c).view(-1)[: h.nbytes], x.view(torch.uint8).cpu())
    h_lz4.wait()
    if dtype == torch.bfloat16:  # (fp16 Gaussians: about a tie, either way)
        assert h.stored_nbytes < h_lz4.stored_nbytes
    auto.close()
    lz4.close()


@gpu
@pytest.mark.gpu
def test_gpu_kv_blocks_overwritten_at_once(gen):
    pc = PageCompressor(batch_pages=4)
    cache = make((128, 2, 8, 64), torch.bfloat16, gen, "cuda")
    ref = cache.clone()
    ids = torch.randperm(128, generator=gen)[:50].cuda()
    torch.cuda._sleep(50_000_000)
    h = pc.offload_blocks(cache, ids)
    cache[ids] = 0
    h.wait()
    torch.cuda._sleep(50_000_000)
    pc.restore_blocks(h, cache, ids)
    assert torch.equal(cache, ref)


@gpu
@pytest.mark.gpu
def test_gpu_host_flow_and_pinned_exact(gen):
    pc = PageCompressor(batch_pages=64)
    pages = file_pages("text", 300, 4096, gen)
    h = pc.compress_host(pages)
    assert torch.equal(decompress(h.compressed()), pages)
    assert same_bits(pages, pc.restore(h, device="cpu"))
    s = pc.stats()
    arena = s["pools"]["arena"]
    assert arena["pinned_bytes"] == arena["held_bytes"] and arena["held_bytes"] % 4096 == 0
    assert s["pinned_bytes_held"] > 0


@gpu
@pytest.mark.gpu
def test_gpu_raw_bypass_incompressible_bit_exact(gen):
    pc = PageCompressor(batch_pages=8)
    xs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).cuda()
          for n in (100 * 4096 + 5, 64 * 4096, 3)]
    for _ in range(3):
        hs = [pc.offload(x) for x in xs]
        for x, h in zip(xs, hs):
            torch.cuda._sleep(20_000_000)
            y = pc.restore(h, check=True)
            assert torch.equal(y, x)
            assert h.stored_nbytes <= x.numel() + 4096 + 13 * (x.numel() // 4096 + 1) + 23 * 20
    s = pc.stats()
    assert s["raw_bypass_batches"] > 0, s
    z = torch.zeros(50 * 4096, dtype=torch.uint8, device="cuda")  # same stream key, compressible
    for _ in range(6):  # a probe within 16 batches; then whole offloads compress again
        h = pc.offload(z)
        assert torch.equal(pc.restore(h), z)
    assert h.stored_nbytes < z.numel() // 10, "the probe did not notice compressible data"


@gpu
@pytest.mark.gpu
def test_gpu_raw_share_split_bit_exact(gen):
    pc = PageCompressor(batch_pages=512, max_raw_share=1.0)
    text = file_pages("text", 4096, 4096, gen).cuda()  # 16 MiB, compressible
    for _ in range(4):
        h = pc.offload(text)
        torch.cuda._sleep(20_000_000)
        assert torch.equal(pc.restore(h, check=True), text)
    s = pc.stats()
    print({k: s[k] for k in ("raw_split_batches", "raw_bypass_batches", "ratio", "batches")})
    assert h.stored_nbytes <= text.numel() + 13 * 4096 + 23 * 64


@gpu
@pytest.mark.gpu
def test_gpu_raw_share_split_waits_for_producer(gen):
    """Raw batches of a split (own slot ring, own download stream, chunked copies) still read
    the source only after its producer: the source is written behind a long sleep."""
    pc = PageCompressor(batch_pages=512, max_raw_share=1.0)
    text = file_pages("text", 4096, 4096, gen).cuda()  # 16 MiB, compressible
    rates, key = pc.pipeline.bypass._rates, (text.dtype, dtype_element_size(text.dtype))
    for _ in range(4):  # a slow kernel (1 GB/s, in bytes per ms): most batches go raw
        rates[key] = {"kernel": 1e6, "link": 5e7, "ratio": 3.0}
        src = torch.zeros_like(text)
        torch.cuda._sleep(50_000_000)
        src.copy_(text)
        h = pc.offload(src)
        del src  # freed while its downloads may still be queued
        assert torch.equal(pc.restore(h, check=True), text)
    s = pc.stats()
    assert s["raw_split_batches"] > 0, s
    n = len(pc.pipeline.slots)
    assert any(t["slot"] >= n for t in pc.timeline()), "raw batches use their own slots"


def _tagged_batches(gen, page_size: int, kinds: list[str]) -> torch.Tensor:
    """One batch of pages per entry of ``kinds`` ("text", "random", "fill"), every page
    stamped with its global index in its first 8 bytes (a misplaced page shows)."""
    parts = []
    for kind in kinds:
        n = int(torch.randint(1, 6, (1,), generator=gen))
        if kind == "text":
            part = file_pages("text", n, page_size, gen)
        elif kind == "random":
            part = torch.randint(0, 256, (n, page_size), generator=gen, dtype=torch.uint8)
        else:
            part = torch.full((n, page_size), int(torch.randint(0, 256, (1,), generator=gen)),
                              dtype=torch.uint8)
        parts.append(part)
    pages = torch.cat(parts)
    pages[:, :8] = torch.arange(pages.shape[0], dtype=torch.int64).view(-1, 1).view(torch.uint8)
    return pages


def test_multi_batch_mixed_kinds_restore_into_right_slices(gen):
    """A tensor of many batches (compressible, incompressible and fill batches mixed, a
    partial last batch): every batch's metadata goes with its payload and lands in its own
    slice of a poisoned ``out``; the packed container pairs them the same way."""
    p, bp = 4096, 5
    pc = PageCompressor(device="cpu", page_size=p, batch_pages=bp)
    kinds = [["text", "random", "fill"][int(i)] for i in torch.randint(0, 3, (9,), generator=gen)]
    pages = _tagged_batches(gen, p, kinds)
    tail = int(torch.randint(1, p, (1,), generator=gen))
    x = pages.view(-1)[: pages.numel() - tail].clone()  # partial last page
    h = pc.offload(x)
    out = torch.full_like(x, 0xA5)
    assert pc.restore(h, out=out) is out and torch.equal(out, x)
    batches = h._storage.batches
    assert [b.first_page for b in batches] == list(range(0, pages.shape[0], bp))
    assert sum(b.layout.n_pages for b in batches) == pages.shape[0]
    got = decompress(h.compressed()).reshape(-1)[: x.numel()]
    assert torch.equal(got, x)
    for h2, x2 in [(pc.offload(x), x) for _ in range(3)]:  # in flight together
        assert torch.equal(pc.restore(h2), x2)


def test_corrupt_page_reported_by_global_index(gen):
    """A bad page in a later batch is named by its index in the tensor, not in its batch."""
    p, bp = 4096, 4
    pc = PageCompressor(device="cpu", page_size=p, batch_pages=bp)
    x = file_pages("text", 11, p, gen).view(-1)
    h = pc.offload(x)
    h.wait()
    b = int(torch.randint(1, len(h._storage.batches), (1,), generator=gen))
    sb = h._storage.batches[b]
    j = int(torch.randint(0, sb.layout.n_pages, (1,), generator=gen))
    sb.layout.views(sb.block.tensor)[3][j] = 0x0F  # unknown kind
    with pytest.raises(CorruptPageError) as err:
        pc.restore(h)
    assert err.value.pages == [sb.first_page + j]


@gpu
@pytest.mark.gpu
def test_gpu_failed_restores_counted_without_sync(gen):
    """A restore without check=True never syncs, but a corrupt page still gets counted."""
    pc = PageCompressor(batch_pages=4)
    x = file_pages("text", 11, 4096, gen).cuda()
    h = pc.offload(x)
    h.wait()
    assert torch.equal(pc.restore(h), x) and pc.failed_restores(wait=True) == 0
    sb = h._storage.batches[1]
    sb.layout.views(sb.block.tensor)[3][0] = 0x0F  # unknown kind
    pc.restore(h)
    assert pc.failed_restores(wait=True) == 1
    pc.restore(h)
    torch.cuda.synchronize()
    pc.failed_restores()  # schedules a read; the next poll sees it
    torch.cuda.synchronize()
    assert pc.failed_restores() == 2 and pc.stats()["failed_restores"] == 2


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("raw_share", [0.0, 1.0])
def test_gpu_cold_device_pool_restore_behind_busy_consumer(gen, raw_share):
    """A fresh compressor (empty device pool, new streams) restores while the caller's stream is
    busy. Pages and device buffers share one allocator size class (11 MiB batches), so a buffer
    allocated where the previous batch's queued decompress output was freed gets that block:
    the next upload must not overwrite it (bad kinds / wrong slices otherwise)."""
    bp = 2816  # 11 MiB of 4 KiB pages: pages and the buffer both round to 12 MiB
    x = file_pages("text", bp * 3 + 5, 4096, gen).cuda()
    for _ in range(2):
        pc = PageCompressor(batch_pages=bp, max_raw_share=raw_share)
        for _ in range(3):
            h = pc.offload(x)
            h.wait()
            torch.cuda._sleep(50_000_000)
            out = torch.full_like(x, 0xA5)
            pc.restore(h, out=out, check=True)
            assert torch.equal(out, x)
        pc.close()


@gpu
@pytest.mark.gpu
def test_gpu_block_ids_on_the_device_out_of_range_is_an_error():
    pc = PageCompressor(device="cuda", batch_pages=4)
    cache = torch.randn(16, 1024, device="cuda")
    with pytest.raises(PageCompError, match="block id 16 is out of range for a cache of 16"):
        pc.offload_blocks(cache, torch.tensor([3, 16], device="cuda"))
    ids = torch.tensor([15, 0], device="cuda")
    h = pc.offload_blocks(cache, ids)  # the CUDA context is still usable
    assert torch.equal(pc.restore(h), cache[ids])
